"""Role flips: moving a worker between the prefill and the decode pool while it runs (`pdserve ctl
flip`, the Admin service's Flip), and the Admin service itself.

The router creates one Flips as it starts; it runs one flip at a time. Flip(worker, role):

 1. Refused, with nothing changed: an unknown worker (NOT_FOUND), a role that is not one
    (INVALID_ARGUMENT), the role it has, a worker configured by address, another flip under way,
    or a flip that would leave the worker's pool with no worker up and serving
    (FAILED_PRECONDITION).
 2. Draining: the pool stops picking it (WorkerPool.begin_drain) and the worker refuses new work
    of its role (WorkerControl.Drain); what it has goes on. The flip waits until no call of this
    router is open there and the worker holds nothing of its role (RoleStatus.remaining). At the
    drain bound (FlipRequest.drain_timeout_ms, else router.flip_drain_s) the calls still open
    move (OpenLegs.dropped): decode streams resume on another decode worker, by the path that
    resumes a dead worker's, as a move that costs no resume; prefills go to another prefill
    worker.
 3. Switching: WorkerControl.SwitchRole. The worker registers under the new role before it
    answers, so the pool holds it there, serving, when the call returns; the flip checks that.

The router's intent for the worker (router/reconcile.py) follows the flip: a flip is refused
while the reconciler is still bringing the worker to its intent; while it runs the flip alone
drives the worker; a flip done leaves the intent at the new role, serving. A failure after step 1
gives the flip up: the intent goes back to the old role, serving, and the reconciler drives the
worker there, retrying until the worker answers (a worker stopped or restarted in the middle of
the flip included), so that no worker stays draining or half-switched. Each transition is logged;
the states show in `pdserve ctl roles` and pdserve:worker_state, and the flips, their drain and
switch times and the streams they moved are counted (pdserve:role_flips, ...).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc
from prometheus_client import Counter, Histogram

from pdserve.protos.limits import check_id
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.router.metrics import STAGE_BUCKETS
from pdserve.router.pool import ROLES, WorkerPool
from pdserve.router.reconcile import SWITCHING, Reconciler

log = logging.getLogger(__name__)
MAX_DRAIN_S = 3600.0  # the longest drain bound a FlipRequest may ask for


class FlipRefused(Exception):
    """A flip refused or given up; `code` is the gRPC status the Admin service answers."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class FlipResult:
    worker_id: str
    from_role: str
    role: str
    drain_s: float  # the flip's start -> no work of the old role left
    switch_s: float  # then -> the router holds the worker in the new pool
    moved_streams: int  # decode streams moved at the drain bound


class Flips:
    """The flips of `pool`'s workers (the module docstring); open_legs: the router's OpenLegs;
    reconciler: the router's Reconciler (None: one of its own, with its defaults, not started:
    the caller starts and stops `self.reconciler`)."""

    POLL_S = 0.05

    def __init__(
        self,
        pool: WorkerPool,
        open_legs,
        *,
        drain_s: float = 5.0,
        settle_s: float = 30.0,
        rpc_timeout_s: float = 5.0,
        registry=None,
        model_name: str = "",
        reconciler: Reconciler | None = None,
    ):
        self.pool = pool
        self.reconciler = reconciler or Reconciler(
            pool, open_legs, drain_s=drain_s, registry=registry, model_name=model_name
        )
        self.open_legs = open_legs
        self.drain_s = drain_s
        self.settle_s = settle_s  # after the move, the longest wait for the rest to end
        self.rpc_timeout_s = rpc_timeout_s
        self._lock = threading.Lock()
        self._busy: str | None = None  # "worker -> role" of the flip under way
        labels = ["model_name", "from_role", "to_role"]
        self._flips = Counter(
            "pdserve:role_flips",
            "Role flips by outcome: done, refused (nothing changed) or failed (given up after "
            "the drain began; the worker serves its old role again).",
            labels + ["outcome"],
            registry=registry,
        )
        self._drain_hist = Histogram(
            "pdserve:role_flip_drain_seconds",
            "A done flip's drain: its start -> the worker holding no work of its old role.",
            labels,
            buckets=STAGE_BUCKETS,
            registry=registry,
        )
        self._switch_hist = Histogram(
            "pdserve:role_flip_switch_seconds",
            "A done flip's switch: the drain's end -> the router holding the worker in its new "
            "pool.",
            labels,
            buckets=STAGE_BUCKETS,
            registry=registry,
        )
        self._moved = Counter(
            "pdserve:role_flip_moved_streams",
            "Decode streams a flip moved to another decode worker at its drain bound.",
            labels,
            registry=registry,
        )
        self._model = model_name

    # ---- the flip -------------------------------------------------------------------------------
    def flip(self, worker_id: str, role: str, drain_s: float | None = None) -> FlipResult:
        """Flips `worker_id` to `role`; returns once it serves it. Raises FlipRefused."""
        worker = self.pool.registered(worker_id)
        from_role = worker.role if worker is not None else "none"
        try:
            if role not in ROLES:
                raise FlipRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"role must be one of {list(ROLES)}, got {role[:32]!r}",
                )
            if worker is None:
                raise FlipRefused(
                    grpc.StatusCode.NOT_FOUND,
                    f"no worker {worker_id!r} in the pools: `pdserve ctl roles` lists them",
                )
            self._check(worker, worker_id, role)
            with self._lock:
                if self._busy is not None:
                    raise FlipRefused(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"a flip is under way ({self._busy}): one at a time, try again after it",
                    )
                self._busy = f"{worker_id} -> {role}"
        except FlipRefused:
            # a role that is not one of ROLES is counted under one fixed label: a caller's
            # string must not mint a metric series of its own
            label = role if role in ROLES else "invalid"
            self._flips.labels(self._model, from_role, label, "refused").inc()
            raise
        try:
            result = self._flip(
                worker, worker_id, role, self.drain_s if drain_s is None else drain_s
            )
        finally:
            with self._lock:
                self._busy = None
        labels = (self._model, result.from_role, role)
        self._flips.labels(*labels, "done").inc()
        self._drain_hist.labels(*labels).observe(result.drain_s)
        self._switch_hist.labels(*labels).observe(result.switch_s)
        self._moved.labels(*labels).inc(result.moved_streams)
        return result

    def _check(self, worker, worker_id: str, role: str) -> None:
        if worker.role == role:
            raise FlipRefused(
                grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker_id} already serves {role}"
            )
        if worker.static:
            raise FlipRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {worker_id} is configured by address (router prefill_addresses/"
                f"decode_addresses), not registered: only workers that register can change role",
            )

    def _flip(self, worker, worker_id: str, role: str, drain_s: float) -> FlipResult:
        old, name = worker.role, self.pool.name(worker)
        why = self.reconciler.begin_flip(name, old)
        if why is None:
            why = self.pool.begin_drain(worker)
            if why is not None:
                self.reconciler.end_flip(name, old, began=False)
        if why is not None:
            self._flips.labels(self._model, worker.role, role, "refused").inc()
            raise FlipRefused(
                grpc.StatusCode.FAILED_PRECONDITION, f"cannot flip worker {worker_id}: {why}"
            )
        control = worker_pb2_grpc.WorkerControlStub(worker.channel)
        t0 = time.monotonic()
        log.info(
            "flip %s %s -> %s: draining (%d calls open on it, bound %.1f s)",
            worker_id,
            old,
            role,
            self.open_legs.count(worker),
            drain_s,
        )
        try:
            moved = self._drain(worker, worker_id, role, control, t0 + drain_s)
            t1 = time.monotonic()
            self.pool.set_state(worker, SWITCHING)
            self.reconciler.flip_state(name, role, SWITCHING)
            log.info(
                "flip %s %s -> %s: drained in %.2f s, switching", worker_id, old, role, t1 - t0
            )
            status = self._call(control.SwitchRole, worker_pb2.SwitchRoleRequest(role=role))
            now = self.pool.registered(worker_id)
            if status.role != role or now is None or now.role != role:
                raise FlipRefused(
                    grpc.StatusCode.INTERNAL,
                    f"worker {worker_id} answered the switch as {status.role or '?'} but the pool "
                    f"holds it as {now.role if now else 'nothing'}: see `pdserve ctl roles`",
                )
        except BaseException as e:
            self._give_up(worker_id, old, role, e)
            raise
        self.reconciler.end_flip(name, role, status)
        t2 = time.monotonic()
        log.info(
            "flip %s %s -> %s: done (drain %.2f s, switch %.2f s, %d streams moved)",
            worker_id,
            old,
            role,
            t1 - t0,
            t2 - t1,
            moved,
        )
        return FlipResult(worker_id, old, role, t1 - t0, t2 - t1, moved)

    def _drain(self, worker, worker_id: str, role: str, control, move_at: float) -> int:
        """Waits until `worker` holds no work of its role; moves what is open at `move_at`.
        Returns how many decode streams it moved."""
        moved = None
        give_up_at = move_at + self.settle_s
        while True:
            status = self._call(control.Drain, worker_pb2.DrainRequest(draining=True))
            open_here = self.open_legs.count(worker)
            if not open_here and not status.remaining:
                return moved or 0
            now = time.monotonic()
            if moved is None and now >= move_at:
                lost = self.open_legs.dropped(
                    worker, f"worker {worker_id} is flipping to {role}", None, moved=True
                )
                moved = sum(1 for leg in lost if leg.moved)
                log.info("flip %s: drain bound reached, moved %d calls", worker_id, len(lost))
            if now >= give_up_at:
                raise FlipRefused(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"worker {worker_id} still holds {status.remaining or 'work'} "
                    f"({open_here} calls of this router open on it) {self.settle_s:g} s after "
                    f"its calls were moved",
                )
            time.sleep(self.POLL_S)

    def _call(self, method, request):
        try:
            return method(request, timeout=self.rpc_timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise FlipRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "the worker cannot change role: it was started with one role only (a "
                    "colocated deployment's worker, or a PrefillWorker or DecodeWorker)",
                ) from None
            raise FlipRefused(
                e.code(), f"the worker answered {e.code().name}: {e.details()}"
            ) from None

    def _give_up(self, worker_id: str, old: str, role: str, error) -> None:
        """Gives up a flip that began draining: the router's intent for the worker goes back to
        `old`, serving, and the reconciler (router/reconcile.py) drives it there, retrying until
        the worker answers; the pool picks it again once it reports serving `old`."""
        self._flips.labels(self._model, old, role, "failed").inc()
        self.reconciler.end_flip(worker_id, old)
        log.warning(
            "flip %s %s -> %s given up (%s); the router brings it back to %s",
            worker_id,
            old,
            role,
            error,
            old,
        )


class AdminServicer(worker_pb2_grpc.AdminServicer):
    """The operators' door (`pdserve ctl`): the cluster secret guards it like every control-plane
    service (protos/security.py)."""

    def __init__(self, flips: Flips):
        self.flips = flips

    def ListWorkers(self, request, context):
        pool = self.flips.pool
        rows = []
        for w in pool.members():
            view = self.flips.reconciler.view(w)
            info = worker_pb2.WorkerInfo(
                worker_id=pool.name(w),
                role=w.role,
                state="down" if w.down else w.state,
                address=w.address,
                intended_role=view.intended_role,
                intended_state=view.intended_state,
                reported_role=view.reported_role,
                reported_state=view.reported_state,
                reported_age_ms=-1
                if view.reported_age_s is None
                else min(int(view.reported_age_s * 1000), 2**31 - 1),
                mismatch=view.mismatch,
                stuck=view.stuck,
            )
            if w.stats is not None:
                info.stats.CopyFrom(w.stats)
            rows.append(info)
        rows.sort(key=lambda r: r.worker_id)
        return worker_pb2.ListWorkersResponse(workers=rows)

    def Flip(self, request, context):
        refusal = check_id("worker_id", request.worker_id)
        if refusal:
            refusal.abort(context)
        drain_s = request.drain_timeout_ms / 1000 if request.drain_timeout_ms else None
        if drain_s is not None and drain_s > MAX_DRAIN_S:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"drain_timeout_ms must be at most {int(MAX_DRAIN_S * 1000)}, got "
                f"{request.drain_timeout_ms}",
            )
        try:
            r = self.flips.flip(request.worker_id, request.role, drain_s)
        except FlipRefused as e:
            context.abort(e.code, str(e))
        return worker_pb2.FlipResponse(
            worker_id=r.worker_id,
            from_role=r.from_role,
            role=r.role,
            drain_ms=int(r.drain_s * 1000),
            switch_ms=int(r.switch_s * 1000),
            moved_streams=r.moved_streams,
        )
