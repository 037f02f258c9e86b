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
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from pdserve.protos.limits import WEIGHT_UPDATE_TIMEOUT_S as UPDATE_TIMEOUT_S, check_weight_update
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router.catch_up import CatchUps

log = logging.getLogger(__name__)
# an UpdateWeights answer vouches for the worker this long: a few Stats polls, so that one asked
# before the update and answered after it cannot take the worker out
CONFIRM_GRACE_S = 3.0


class WeightsError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


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
                names = ", ".join(self.pool.name(w) for w in stuck)
                raise WeightsError(
                    500,
                    f"{why}; the workers that took the update could not load their old weights "
                    f"again ({names}): the pools serve different weights, and the router stays "
                    "paused until an update succeeds",
                )
            status = 409 if error.code() == grpc.StatusCode.FAILED_PRECONDITION else 400
            if error.code() not in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.FAILED_PRECONDITION,
            ):
                status = 503
            raise WeightsError(status, f"{why}; every worker serves the weights it did before")
        finally:
            self._admin.release()

    def _record(self, model_path: str, weight_version: str) -> None:
        with self._lock:
            self.version, self.wanted = weight_version, (model_path, weight_version)
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


def _live(pool) -> list:
    """Every member but the dead ones (the catch-up brings those up to date when they answer)."""
    return [w for w in pool.members() if not getattr(w, "dead", "")]


def _served(worker) -> tuple[str, str]:
    """(weights_path, weight_version) of the worker's last report."""
    stats = worker.stats
    return (stats.weights_path, stats.weight_version) if stats is not None else ("", "")
