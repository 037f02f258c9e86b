"""The base model's weights, updated across both pools at once: a reinforcement-learning
trainer's sync (SGLang's POST /update_weights_from_disk, router/openai/weights.py), and the one
version every worker the router sends a request to must serve.

A request's KV is computed by a prefill worker and extended by a decode worker; if the two held
different weights its tokens would come from neither model. So an update runs with the router
paused (router/pause.py: no request admitted, and none running once the pause answers): every
live worker of both pools is told UpdateWeights (worker_common/weights.py) at once, and only when
every one took it does the router record the new (path, version) and resume. If one refuses (a
path that is not a checkpoint of the served shapes, a quantized engine), the workers that took
it load the weights they served before again, and the router resumes on the old version; if
that fails too, the pools hold different weights and the router stays paused, saying so.

From the first update on, the pool sends requests only to workers that serve the recorded
(path, version) (router/pool.py `serves_weights`): their Stats say so, or, for CONFIRM_GRACE_S
after it, their answer to UpdateWeights did (a Stats poll asked before the update may answer
after it). A worker that was dead during the update, or joins later, is caught up from its
reports, as LoRA adapters are (router/lora.py): a catch-up thread asks its Stats afresh and, if
they differ, calls UpdateWeights on it (it gets no request meanwhile, so it is idle), and tries a
failed one again CATCH_UP_RETRY_S later (router/catch_up.py). Off unless the deployment sets
`router.weight_updates`. One RouterWeights per router; `update` blocks its caller (the HTTP
front runs it on a thread, once the pause has drained), one update at a time.

A trainer may instead send the weights itself, over a torch.distributed group (SGLang's
/init_weights_update_group and /update_weights_from_distributed; engine/weight_sync.py):
`init_group` has every live worker's engine ranks join it, the trainer rank 0 and the workers
ranked in (role, name) order from rank_offset on; `update_from_group` (paused, as `update`) has
every member receive and load one update, all or nothing (the ranks agree on receipt before any
loads), the version then recorded as the group's. A worker that joins after such an update cannot
be caught up (the tensors are gone): it gets no request until the trainer's next init and update
of a group it is in, and the router logs that once.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from pdserve.protos.limits import (
    WEIGHT_UPDATE_TIMEOUT_S as UPDATE_TIMEOUT_S,
    check_transfer_id,
    check_weight_tensors,
    check_weight_update,
    check_weights_group,
)
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router.catch_up import CatchUps

log = logging.getLogger(__name__)
# an UpdateWeights answer vouches for the worker this long: a few Stats polls, so that one asked
# before the update and answered after it cannot take the worker out
CONFIRM_GRACE_S = 3.0


class WeightsError(Exception):
    """`reinit`: the trainer's weight group no longer holds every live worker (one left, one
    joined since, or a failed transfer closed it): an init makes the next update work."""

    def __init__(self, status: int, message: str, reinit: bool = False):
        super().__init__(message)
        self.status, self.message, self.reinit = status, message, reinit


class RouterWeights:
    def __init__(self, pool, enabled: bool = False):
        self.pool, self.enabled = pool, enabled
        self.version = ""  # the recorded weight_version ("" until the first update)
        self.wanted: tuple[str, str] | None = None  # the recorded (path, version); None: none yet
        # id() of a worker -> ((path, version) its UpdateWeights answer said, when)
        self._confirmed: dict[int, tuple[tuple[str, str], float]] = {}
        self._lock = threading.Lock()
        self._admin = threading.Lock()  # one update or catch-up call at a time
        self._catch_ups = CatchUps("router-weights-catch-up")
        self.catch_ups = 0
        # an update left the pools serving different weights: its pause hold (router/pause.py)
        # stays until an update succeeds (router/openai/weights.py)
        self.held_apart = False
        # a trainer's group name -> _Group (its members and their first ranks)
        self.groups: dict[str, _Group] = {}
        self._updates_from_groups = 0
        self._uncaught: set[int] = set()  # id() of workers told they cannot be caught up
        if enabled and hasattr(pool, "on_report"):
            pool.on_report(self.on_report)

    def check(self, model_path: object, weight_version: object) -> tuple[str, str]:
        if not self.enabled:
            raise WeightsError(
                404, "weight updates are off here: the deployment needs router.weight_updates"
            )
        if not isinstance(model_path, str):
            raise WeightsError(400, "model_path must be a string: a checkpoint directory")
        if weight_version is None:
            weight_version = ""
        if not isinstance(weight_version, str):
            raise WeightsError(400, "weight_version must be a string")
        why = check_weight_update(model_path, weight_version)
        if why is not None:
            raise WeightsError(400, why)
        return model_path, weight_version

    def update(self, model_path: str, weight_version: str) -> str:
        """Every live worker of both pools loads `model_path`, or none keeps it (the module's
        docstring); the caller has paused the router and seen it drain. Returns the message;
        raises WeightsError (400 refused, 409 a worker's state, 500 pools left apart)."""
        if not self._admin.acquire(blocking=False):
            raise WeightsError(409, "another weight update is running; retry when it ends")
        try:
            workers = _live(self.pool)
            if not workers:
                raise WeightsError(503, "no live worker to update")
            before = {id(w): _served(w) for w in workers}
            failed = self._call_all(workers, model_path, weight_version)
            if not failed:
                self._record(model_path, weight_version)
                log.info(
                    "weight update: %d worker(s) serve %s (version %r)",
                    len(workers),
                    model_path,
                    weight_version,
                )
                return f"{len(workers)} worker(s) of both pools now serve {model_path!r}" + (
                    f" as version {weight_version!r}" if weight_version else ""
                )
            took = [w for w in workers if id(w) not in {id(f) for f, _ in failed}]
            # those that took it load their old weights again; `stuck`: those that could not
            stuck = [w for w in took if self._call_one(w, *before[id(w)]) is not None]
            worker, error = failed[0]
            why = f"worker {self.pool.name(worker)}: {error.code().name}: {error.details()}"
            log.warning("weight update to %s failed: %s", model_path, why)
            if stuck:
                raise self._apart(why, stuck)
            status = 409 if error.code() == grpc.StatusCode.FAILED_PRECONDITION else 400
            if error.code() not in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.FAILED_PRECONDITION,
            ):
                status = 503
            raise WeightsError(status, f"{why}; every worker serves the weights it did before")
        finally:
            self._admin.release()

    def _apart(self, why: str, stuck: list) -> WeightsError:
        """The 500 of an update whose workers that took it could not load their old weights."""
        names = ", ".join(self.pool.name(w) for w in stuck)
        return WeightsError(
            500,
            f"{why}; the workers that took the update could not load their old weights "
            f"again ({names}): the pools serve different weights, and the router stays "
            "paused until an update succeeds",
        )

    def _record(self, model_path: str, weight_version: str) -> None:
        with self._lock:
            self.version, self.wanted = weight_version, (model_path, weight_version)
            # the grace counts from now for every worker that said it took these weights: one
            # that answered early must not lose it to a slower one's load
            now = time.monotonic()
            for key, (said, _) in list(self._confirmed.items()):
                if said == self.wanted:
                    self._confirmed[key] = (said, now)
        self.pool.serves_weights = self.serves

    def serves(self, worker) -> bool:
        """Whether `worker` serves the recorded weights (the pool's filter; any thread)."""
        wanted, stats = self.wanted, worker.stats
        if stats is not None and (stats.weights_path, stats.weight_version) == wanted:
            return True
        said = self._confirmed.get(id(worker))
        return (
            said is not None and said[0] == wanted and time.monotonic() - said[1] < CONFIRM_GRACE_S
        )

    def _confirm(self, worker, reply) -> None:
        with self._lock:
            self._confirmed[id(worker)] = (
                (reply.model_path, reply.weight_version),
                time.monotonic(),
            )

    def _call_all(self, workers, model_path: str, weight_version: str) -> list:
        """UpdateWeights on every worker at once: [(worker, grpc.RpcError)] of those that failed."""
        request = worker_pb2.UpdateWeightsRequest(
            model_path=model_path, weight_version=weight_version
        )
        pending = [
            (w, w.stub.UpdateWeights.future(request, timeout=UPDATE_TIMEOUT_S + 30))
            for w in workers
        ]
        failed = []
        for worker, future in pending:
            try:
                self._confirm(worker, future.result())
            except grpc.RpcError as e:
                failed.append((worker, e))
        return failed

    def _call_one(self, worker, model_path: str, weight_version: str):
        """None when `worker` took the weights, else its grpc.RpcError."""
        try:
            reply = worker.stub.UpdateWeights(
                worker_pb2.UpdateWeightsRequest(
                    model_path=model_path, weight_version=weight_version
                ),
                timeout=UPDATE_TIMEOUT_S + 30,
            )
        except grpc.RpcError as e:
            return e
        self._confirm(worker, reply)
        return None

    # ---- catch-up of a worker that missed an update ---------------------------------------------
    def on_report(self, worker, stats) -> None:
        """A WorkerPool report listener (returns at once): starts a catch-up thread for a worker
        whose weights are not the recorded ones."""
        if self.wanted is None or not stats.worker_id or self.serves(worker):
            return
        if self.wanted[0].startswith(GROUP_SOURCE):
            said = self._confirmed.get(id(worker))
            if self._admin.locked() or (said is not None and said[0] == self.wanted):
                # an update under way, or it answered that it took these: a report taken before
                return
            if id(worker) not in self._uncaught:
                self._uncaught.add(id(worker))
                log.warning(
                    "worker %s does not serve weight version %r, which a trainer's group sent: "
                    "it gets no request until the trainer inits a group again and updates",
                    self.pool.name(worker),
                    self.wanted[1],
                )
            return
        self._catch_ups.start(worker, self._catch_up)

    def _catch_up(self, worker) -> None:
        with self._admin:  # after an update under way: its outcome is what we push
            wanted = self.wanted
            if not self.pool.is_member(worker) or self.serves(worker):
                return
            try:  # afresh: the report that started this may be older than an update
                stats = worker.stub.Stats(worker_pb2.StatsRequest(), timeout=10.0)
            except grpc.RpcError:
                stats = None
            if stats is not None and (stats.weights_path, stats.weight_version) == wanted:
                return
            error = self._call_one(worker, *wanted)
        if error is None:
            self._catch_ups.succeeded(worker)
            log.info("weights catch-up of worker %s: %s", self.pool.name(worker), wanted[0])
            self.catch_ups += 1
            return
        self._catch_ups.failed(worker)
        log.warning(
            "weights catch-up of worker %s failed: %s %s",
            self.pool.name(worker),
            error.code().name,
            error.details(),
        )

    # ---- a trainer's weight group (engine/weight_sync.py) ----------------------------------------
    def ranks(self) -> int:
        """The engine ranks of every live worker (as their last reports say): what a trainer's
        group holds besides the trainer."""
        return sum(max(1, w.stats.engine_ranks) for w in _live(self.pool) if w.stats is not None)

    def init_group(self, f: dict) -> str:
        """Every live worker joins the group `f` describes (the HTTP body's fields, checked
        here); raises WeightsError."""
        if not self.enabled:
            raise WeightsError(
                404, "weight updates are off here: the deployment needs router.weight_updates"
            )
        why = check_weights_group(
            f["group_name"],
            f["master_address"],
            f["master_port"],
            f["rank_offset"],
            f["world_size"],
            f["timeout_s"],
        )
        if why is not None:
            raise WeightsError(400, why)
        if not self._admin.acquire(blocking=False):
            raise WeightsError(409, "a weight update is running; retry when it ends")
        try:
            workers = sorted(_live(self.pool), key=lambda w: (w.role, self.pool.name(w)))
            if not workers:
                raise WeightsError(503, "no live worker to join the group")
            quiet = [self.pool.name(w) for w in workers if w.stats is None]
            if quiet:
                raise WeightsError(503, f"worker(s) {', '.join(quiet)} have not reported yet")
            counts = [max(1, w.stats.engine_ranks) for w in workers]
            offset, ranks = f["rank_offset"], sum(counts)
            if f["world_size"] != offset + ranks:
                raise WeightsError(
                    400,
                    f"this deployment has {ranks} engine rank(s) now: world_size must be "
                    f"rank_offset + {ranks} = {offset + ranks}",
                )
            old = self.groups.pop(f["group_name"], None)
            if old is not None:
                self._leave(old)
            members, failed = self._join_all(workers, counts, f)
            group = _Group(f["group_name"], members, f["world_size"], f["timeout_s"])
            if failed or any(n != c for (_, _, n), c in zip(members, counts, strict=False)):
                self._leave(group)
                if failed:
                    worker, e = failed[0]
                    why = f"worker {self.pool.name(worker)}: {e.code().name}: {e.details()}"
                else:
                    why = "a worker's ranks changed while it joined: init again"
                raise WeightsError(503 if not failed else _status(failed[0][1]), why)
            self.groups[group.name] = group
            self._uncaught.clear()
            log.info(
                "weight group %r: %d worker(s), ranks %d..%d of %d (rank 0: the trainer at %s:%d)",
                group.name,
                len(members),
                f["rank_offset"],
                f["rank_offset"] + ranks - 1,
                f["world_size"],
                f["master_address"],
                f["master_port"],
            )
            return (
                f"{len(members)} worker(s) of both pools, {ranks} engine rank(s), are joining "
                f"group {group.name!r} as ranks {f['rank_offset']}..{f['rank_offset'] + ranks - 1}"
            )
        finally:
            self._admin.release()

    def _join_all(self, workers, counts, f: dict) -> tuple[list, list]:
        """InitWeightsGroup on every worker at once, ranked from f's rank_offset on: the members
        that joined [(worker, first rank, ranks)] and [(worker, grpc.RpcError)] of those that
        failed."""
        offset, pending = f["rank_offset"], []
        for worker, count in zip(workers, counts, strict=True):
            request = worker_pb2.InitWeightsGroupRequest(
                group_name=f["group_name"],
                master_address=f["master_address"],
                master_port=f["master_port"],
                rank_offset=offset,
                world_size=f["world_size"],
                timeout_s=f["timeout_s"],
            )
            pending.append(
                (worker, offset, worker.stub.InitWeightsGroup.future(request, timeout=60))
            )
            offset += count
        members, failed = [], []
        for worker, first, future in pending:
            try:
                members.append((worker, first, future.result().ranks))
            except grpc.RpcError as e:
                failed.append((worker, e))
        return members, failed

    def check_group_update(self, f: dict) -> None:
        """Raises WeightsError (400, 404) for an update request's fields, before any pause."""
        if not self.enabled:
            raise WeightsError(
                404, "weight updates are off here: the deployment needs router.weight_updates"
            )
        why = check_transfer_id(f["transfer_id"]) or check_weight_tensors(
            f["names"], f["dtypes"], f["shapes"]
        )
        why = why or check_weight_update(GROUP_SOURCE, f["weight_version"])
        if why is not None:
            raise WeightsError(400, why)
        if f["group_name"] not in self.groups:
            raise WeightsError(
                400, f"no weight group {f['group_name'][:64]!r}: /init_weights_update_group first"
            )

    def update_from_group(self, f: dict) -> str:
        """Every member of the group receives and loads the trainer's tensors, or none keeps them
        (the module's docstring); the caller has paused the router and seen it drain."""
        if not self._admin.acquire(blocking=False):
            raise WeightsError(409, "another weight update is running; retry when it ends")
        try:
            group = self.groups.get(f["group_name"])
            if group is None:
                raise WeightsError(400, f"no weight group {f['group_name'][:64]!r}")
            live = {id(w) for w in _live(self.pool)}
            gone = [self.pool.name(w) for w, _, _ in group.members if id(w) not in live]
            if gone:
                raise WeightsError(
                    409,
                    f"worker(s) {', '.join(gone)} of group {group.name!r} left: the group cannot "
                    "complete an update; /init_weights_update_group again",
                    reinit=True,
                )
            self._updates_from_groups += 1
            source = f"{GROUP_SOURCE}{group.name}#{self._updates_from_groups}"
            dims = [d for shape in f["shapes"] for d in shape]
            request = worker_pb2.UpdateWeightsFromGroupRequest(
                group_name=group.name,
                names=f["names"],
                dtypes=f["dtypes"],
                dims=dims,
                ndims=[len(s) for s in f["shapes"]],
                weight_version=f["weight_version"],
                source=source,
                transfer_id=f["transfer_id"],
            )
            workers = [w for w, _, _ in group.members]
            before = {id(w): _served(w) for w in workers}
            timeout = 2 * group.timeout_s + 90
            pending = [
                (w, w.stub.UpdateWeightsFromGroup.future(request, timeout=timeout)) for w in workers
            ]
            failed = self._gather(pending)
            if not failed:
                self._record(source, f["weight_version"])
                log.info(
                    "weight update from group %r: %d worker(s) serve version %r",
                    group.name,
                    len(workers),
                    f["weight_version"],
                )
                return f"{len(workers)} worker(s) of both pools now serve the trainer's weights" + (
                    f" as version {f['weight_version']!r}" if f["weight_version"] else ""
                )
            worker, error = failed[0]
            why = f"worker {self.pool.name(worker)}: {error.code().name}: {error.details()}"
            log.warning("weight update from group %r failed: %s", group.name, why)
            took = [w for w in workers if id(w) not in {id(x) for x, _ in failed}]
            # those that took it load their old weights again where those came from a directory
            stuck = [
                w
                for w in took
                if before[id(w)][0].startswith(GROUP_SOURCE)
                or self._call_one(w, *before[id(w)]) is not None
            ]
            # a failed transfer closed the group; a worker in no group of that name was restarted
            reinit = error.code() == grpc.StatusCode.ABORTED or any(
                "in no weight group" in (e.details() or "") for _, e in failed
            )
            if error.code() == grpc.StatusCode.ABORTED:
                self.groups.pop(group.name, None)
                why += "; the group was closed: /init_weights_update_group again"
            if stuck:
                raise self._apart(why, stuck)
            raise WeightsError(
                _status(error), f"{why}; every worker serves the weights it did before", reinit
            )
        finally:
            self._admin.release()

    def _gather(self, pending: list) -> list:
        """Waits for every worker's UpdateWeightsFromGroup, confirming those that took it; once one
        fails, cancels the others, so that workers ready for a transfer that will never start
        call it off rather than wait out the group's timeout. [(worker, grpc.RpcError)] of those
        that failed (the cancelled ones included)."""
        failed, waiting = [], list(pending)
        while waiting:
            time.sleep(0.005)
            for item in [x for x in waiting if x[1].done()]:
                waiting.remove(item)
                worker, future = item
                try:
                    self._confirm(worker, future.result())
                except grpc.FutureCancelledError:
                    failed.append((worker, _CalledOff()))
                except grpc.RpcError as e:
                    if not failed and e.code() in _REFUSALS:  # refused before the transfer
                        for _, other in waiting:
                            other.cancel()
                    failed.append((worker, e))
        # the first refusal says why; a cancelled call only that it was called off
        failed.sort(key=lambda f: f[1].code() == grpc.StatusCode.CANCELLED)
        return failed

    def destroy_group(self, group_name: str) -> str:
        if not self.enabled:
            raise WeightsError(
                404, "weight updates are off here: the deployment needs router.weight_updates"
            )
        with self._admin:
            group = self.groups.pop(group_name, None)
            if group is None:
                raise WeightsError(400, f"no weight group {group_name[:64]!r}")
            self._leave(group)
        return f"group {group_name!r} destroyed"

    def _leave(self, group: _Group) -> None:
        """Every member that answers leaves the group (best effort: a dead one left already)."""
        request = worker_pb2.DestroyWeightsGroupRequest(group_name=group.name)
        futures = [
            w.stub.DestroyWeightsGroup.future(request, timeout=30) for w, _, _ in group.members
        ]
        for future in futures:
            try:
                future.result()
            except grpc.RpcError as e:
                log.info("leaving weight group %r: %s", group.name, e.code().name)


class _CalledOff:
    """A worker's update the router cancelled (another worker refused), as an RpcError reads."""

    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "called off: another worker refused the update"


# a worker's answers that mean it refused before any transfer started
_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
GROUP_SOURCE = "group:"  # weights_path of weights a trainer's group sent: group:<name>#<n>


class _Group:
    def __init__(self, name: str, members: list, world_size: int, timeout_s: float):
        self.name, self.members = name, members  # [(worker, first rank, ranks)]
        self.world_size, self.timeout_s = world_size, timeout_s


def _status(error) -> int:
    """The HTTP status of a worker's refusal."""
    code = error.code()
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return 409
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ABORTED):
        return 400
    return 503


def _live(pool) -> list:
    """Every member but the dead ones (the catch-up brings those up to date when they answer)."""
    return [w for w in pool.members() if not getattr(w, "dead", "")]


def _served(worker) -> tuple[str, str]:
    """(weights_path, weight_version) of the worker's last report."""
    stats = worker.stats
    return (stats.weights_path, stats.weight_version) if stats is not None else ("", "")
