"""What the router intends for each worker beside what the worker reports, and the thread that
drives every worker to its intent: Reconciler.

The router creates one Reconciler as it starts (router/server.py hands it to router/flips.py's
Flips, which uses it) and stops it before its pool. Per worker (by the pool's name for it: its
worker id, or its address where it is configured by address) it keeps:

  intent  the role the worker should serve and its state. A worker seen for the first time gets
          the role it joined the pool with, serving. A flip owns the worker while it runs
          (begin_flip: draining in the old role, then switching to the new one) and ends with the
          new role, serving (done), or the old one (given up: the flip's undo is only that). The
          intent outlives the worker's process: a worker the supervisor restarts
          (deploy/supervisor.py) comes back in the role it was launched with and is driven to the
          intended one, since the operators or the planner chose that split. It does not outlive
          the router: a restarted router takes each worker's role as it registers (the workers
          keep theirs, so the split stays).
  report  the role and role_state of the worker's last WorkerStats (a heartbeat's or a health
          sweep's: WorkerPool.on_report, or this thread's own Stats probe) or the RoleStatus of a
          control call the thread made, with when it came. A report belongs to one pool entry: a
          worker that registers again (a restart, a re-registration) starts without one. A
          report whose role_version (the worker's count of its role changes) is below one
          already heard from that entry left the worker before a change the router knows of
          (a Stats answer overtaken by the switch's own answer): it is ignored.

A worker has converged when a report newer than its intent says it serves the intended role, and
the pool holds it in that role's pool. Outside a flip, the thread (router-reconcile) wakes on
every report that differs and every POLL_S, and drives each worker that has not converged, with at
most one call in flight per worker:

  no report newer than the intent   Stats (a probe), for one
  reported "switching"              wait: a worker ends a switch by itself, serving or draining
  reported the intended role        Drain(false); where the pool holds it in the other role's pool
                                    (its switch's registration went through but the switch did
                                    not), the pool moves it back first
  reported the other role           the pool stops picking it (not while it is the last worker of
                                    that role: it waits, serving), Drain(true) until it holds
                                    nothing of that role (calls still open after drain_s move, as
                                    a flip's do), then SwitchRole(the intended role)

Meanwhile the pool does not pick it (state "reconciling", or "draining" on the way to a switch).
A failed call is tried again after a backoff that doubles from MIN_BACKOFF_S to MAX_BACKOFF_S. A
worker that has not converged bound_s (router.reconcile_bound_s) after it diverged is "stuck":
logged as an error, counted, skipped for new work like a down worker, and still driven; one that
converges later serves again, logged. Calls are futures whose answers, on gRPC's threads, are only
recorded: neither the pool's health thread, a Registry handler nor this thread waits on a worker.

Metrics: pdserve:worker_role_mismatch{worker} (1 while the worker has not converged, outside a
flip), pdserve:worker_stuck{worker} and pdserve:reconcile_actions{action,outcome}.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
SERVING, DRAINING, SWITCHING = "serving", "draining", "switching"
RECONCILING, STUCK = "reconciling", "stuck"  # pool states of a worker being driven to its intent
MIN_BACKOFF_S, MAX_BACKOFF_S = 0.1, 1.0
POLL_S = 0.2  # the thread's tick, and how often a drain on the way to a switch asks again
MAX_TRACKED = 4096  # workers remembered; past it, those that left the pool longest ago go
ACTIONS = ("probe", "undrain", "drain", "switch", "rehome")
_ORDER = itertools.count()  # which of two intents, reports and pool entries came first


@dataclass
class Intent:
    role: str
    state: str
    since: float  # time.monotonic() when it was set
    seq: int = field(default_factory=lambda: next(_ORDER))


@dataclass
class Report:
    role: str
    state: str
    at: float  # time.monotonic() when it came
    version: int = 0  # the worker's role_version (0: not reported)
    seq: int = field(default_factory=lambda: next(_ORDER))


@dataclass(eq=False)
class _Track:
    """One worker's intent, report and the thread's bookkeeping (under the Reconciler's lock)."""

    intent: Intent
    report: Report | None = None
    member: object = None  # the pool entry the report belongs to
    member_seq: int = -1
    version: int = 0  # the highest role_version heard from the member
    flipping: bool = False
    before_flip: Intent | None = None
    diverged_at: float | None = None  # when it was first found not converged, outside a flip
    stuck: bool = False
    waiting: str = ""  # why the pool would not let it go to switch (the last of its role)
    call: str | None = None  # the action in flight
    next_try: float = 0.0
    backoff: float = MIN_BACKOFF_S
    remaining: str | None = None  # the last Drain(true)'s answer; None: not asked since
    drain_began: float | None = None
    moved: bool = False
    left_at: float = 0.0  # when the thread last saw it outside the pool (pruning)


@dataclass(frozen=True)
class View:
    """A worker as `pdserve ctl roles` shows it (Admin.ListWorkers)."""

    intended_role: str
    intended_state: str
    reported_role: str
    reported_state: str
    reported_age_s: float | None  # None: no report from this pool entry yet
    mismatch: bool
    stuck: bool


class Reconciler:
    """Drives `pool`'s workers to their intents (the module docstring). open_legs: the router's
    OpenLegs (a switch moves what is still open after drain_s). control(worker): the worker's
    WorkerControl stub (tests give fakes)."""

    def __init__(
        self,
        pool,
        open_legs,
        *,
        bound_s: float = 10.0,
        drain_s: float = 5.0,
        rpc_timeout_s: float = 2.0,
        registry=None,
        model_name: str = "",
        control: Callable | None = None,
    ):
        if not bound_s > 0:
            raise ValueError(f"the reconcile bound must be > 0 s, got {bound_s}")
        self.pool = pool
        self.open_legs = open_legs
        self.bound_s = bound_s
        self.drain_s = drain_s
        self.rpc_timeout_s = rpc_timeout_s
        self._control = control or (lambda w: worker_pb2_grpc.WorkerControlStub(w.channel))
        self._model = model_name
        self._tracks: dict[str, _Track] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-reconcile", daemon=True)
        self.num_passes = 0
        self._actions = Counter(
            "pdserve:reconcile_actions",
            "Calls the router made to bring a worker to its intended role and state "
            "(router/reconcile.py), by action (probe, undrain, drain, switch, rehome) and outcome.",
            ["model_name", "action", "outcome"],
            registry=registry,
        )
        if registry is not None:
            registry.register(_Collector(self))
        pool.on_report(self._on_report)

    def start(self) -> Reconciler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(5)

    # ---- what the pool and the flips tell it ----------------------------------------------------
    def _track(self, name: str, role: str) -> _Track:
        """`name`'s track, made with the intent to serve `role` on first sight (under the lock)."""
        track = self._tracks.get(name)
        if track is None:
            track = self._tracks[name] = _Track(Intent(role, SERVING, time.monotonic()))
        return track

    def _on_report(self, worker, stats) -> None:
        """WorkerPool.on_report: a heartbeat's or a sweep's WorkerStats (never waits)."""
        if not stats.role or not self.pool.is_member(worker):  # nothing to hold it to
            return
        name = self.pool.name(worker)
        with self._lock:
            track = self._track(name, worker.role)
            self._note_member(track, worker, time.monotonic())
            if not self._fresh(track, stats.role_version):
                return  # sent before a change already heard of: it would undo what it knows
            track.report = Report(stats.role, stats.role_state or SERVING, time.monotonic())
            wake = not track.flipping and not self._converged(track, worker)
        if wake:
            self._wake.set()

    def _note_member(self, track: _Track, worker, now: float) -> None:
        """A new pool entry (a registration) starts without a report, and its bound afresh."""
        if track.member is not worker:
            track.member, track.member_seq = worker, next(_ORDER)
            track.report, track.remaining, track.version = None, None, 0
            track.diverged_at, track.stuck, track.waiting = None, False, ""
            track.drain_began, track.moved = None, False

    @staticmethod
    def _fresh(track: _Track, version: int) -> bool:
        """Whether a report of the member's `version` is not older than one already heard (a
        Stats answer or heartbeat that left the worker before a switch, arriving after the switch's
        own answer); notes it as heard. Unversioned reports (0) always count."""
        if version and version < track.version:
            return False
        track.version = max(track.version, version)
        return True

    def begin_flip(self, name: str, role: str) -> str | None:
        """A flip of `name` out of `role` begins: from now on the flip drives it. Returns why not
        instead, changing nothing, while the thread is still bringing it to its intent."""
        with self._lock:
            track = self._track(name, role)
            if track.call is not None or track.diverged_at is not None:
                report = track.report
                says = f"{report.role} {report.state}" if report else "nothing yet"
                return (
                    f"the router is still bringing it to {track.intent.role} {track.intent.state}"
                    f" (it reports {says}): try again once `pdserve ctl roles` shows it serving"
                )
            track.flipping, track.before_flip = True, track.intent
            track.intent = Intent(role, DRAINING, time.monotonic())
        return None

    def flip_state(self, name: str, role: str, state: str) -> None:
        """The flip under way on `name` moved on (switching to `role`)."""
        with self._lock:
            track = self._tracks.get(name)
            if track is not None and track.flipping:
                track.intent = Intent(role, state, time.monotonic())

    def end_flip(
        self, name: str, role: str, status: worker_pb2.RoleStatus | None = None, began=True
    ) -> None:
        """The flip of `name` ended: its intent is `role`, serving (the new role when done, the old
        one when given up). status: the worker's answer to the switch, a report. began=False: the
        flip changed nothing (refused before the drain), the intent stays as it was."""
        member = self.pool.registered(name)
        with self._lock:
            track = self._tracks.get(name)
            if track is None or not track.flipping:
                return
            track.flipping = False
            now = time.monotonic()
            if not began and track.before_flip is not None:
                track.intent = track.before_flip
            else:
                track.intent = Intent(role, SERVING, now)
                track.diverged_at, track.stuck, track.waiting = None, False, ""
                track.next_try, track.backoff = now, MIN_BACKOFF_S
                track.drain_began, track.moved = None, False
            track.before_flip = None
            if status is not None and status.role and member is not None:
                self._note_member(track, member, now)
                if self._fresh(track, status.role_version):
                    # the switch's answer fulfils the intent just set: it counts as newer than
                    # it (_converged), else the worker would look diverged until its next
                    # heartbeat
                    track.report = Report(
                        status.role, status.state or SERVING, math.nextafter(now, math.inf)
                    )
        self._wake.set()

    def view(self, worker) -> View:
        """`worker`'s intent and report, for Admin.ListWorkers."""
        now = time.monotonic()
        with self._lock:
            track = self._track(self.pool.name(worker), worker.role)
            if not track.flipping:
                self._note_member(track, worker, now)
            report = track.report if track.member is worker else None
            return View(
                track.intent.role,
                track.intent.state,
                report.role if report else "",
                report.state if report else "",
                now - report.at if report else None,
                not track.flipping and not self._converged(track, worker),
                track.stuck,
            )

    # ---- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.step()
            except Exception:  # a dead reconciler would leave every worker where it is
                log.exception("reconcile pass failed")

    def step(self) -> None:
        """One pass over the pool's members (the thread runs one per wake-up)."""
        now = time.monotonic()
        members = self.pool.members()
        todo, states = [], []
        with self._lock:
            present = set()
            for worker in members:
                name = self.pool.name(worker)
                present.add(name)
                track = self._track(name, worker.role)
                if track.flipping:
                    continue
                self._note_member(track, worker, now)
                action = self._pass_one(name, track, worker, now, states)
                if action is not None:
                    track.call = action
                    todo.append((name, track, worker, action))
            self._prune(present, now)
            # under the lock, so that a flip cannot begin between the decision and the change
            # (the pool never calls back into this object while it holds its own lock)
            for track, worker, state in states:
                self._set_state(track, worker, state)
        for name, track, worker, action in todo:
            self._send(name, track, worker, action)
        self.num_passes += 1

    def _set_state(self, track: _Track, worker, state: str) -> None:
        """The pool state of `worker`; "begin_drain": WorkerPool.begin_drain (under the lock)."""
        if state != "begin_drain":
            self.pool.set_state(worker, state)
            return
        why = self.pool.begin_drain(worker)
        if why is not None and why != track.waiting:
            log.warning(
                "%s worker %s waits to switch to %s: %s",
                worker.role,
                self.pool.name(worker),
                track.intent.role,
                why,
            )
        track.waiting = why or ""

    def _converged(self, track: _Track, worker) -> bool:
        report, intent = track.report, track.intent
        if report is None:  # a pool entry not heard from yet: as it joined, unless told since
            return worker.role == intent.role and intent.seq < track.member_seq
        return (
            report.seq > intent.seq
            and (report.role, report.state) == (intent.role, SERVING)
            and worker.role == intent.role
        )

    def _pass_one(self, name: str, track: _Track, worker, now: float, states: list):
        """The next call for one worker outside a flip, or None (under the lock); the pool
        states to set go to `states` ("begin_drain": WorkerPool.begin_drain)."""
        if self._converged(track, worker):
            if track.diverged_at is not None:
                log.info(
                    "%s worker %s serves its intended role again after %.1f s",
                    worker.role,
                    name,
                    now - track.diverged_at,
                )
            if worker.state != SERVING and (
                track.diverged_at is not None
                or worker.state
                in (
                    RECONCILING,
                    STUCK,
                )
            ):
                states.append((track, worker, SERVING))
            track.diverged_at, track.stuck, track.waiting = None, False, ""
            track.drain_began, track.moved, track.backoff = None, False, MIN_BACKOFF_S
            return None
        intent, report = track.intent, track.report
        if track.diverged_at is None:
            track.diverged_at = now
            said = "nothing yet"
            if report is not None:
                said = f"{report.role} {report.state}"
                said += "" if report.seq > intent.seq else ", before the router's intent changed"
            log.warning(
                "%s worker %s is not where the router wants it (%s %s; it reports %s): reconciling",
                worker.role,
                name,
                intent.role,
                intent.state,
                said,
            )
        fresh = report is not None and report.seq > intent.seq
        # serving the other role, as the pool believes: it waits for the pool to let it go
        elsewhere = worker.role != intent.role and (not fresh or report.role == worker.role)
        if fresh and report.role == intent.role or worker.role == intent.role:
            want = RECONCILING  # it refuses the work the pool would give it
        else:
            want = None
        if not track.stuck and now - track.diverged_at >= self.bound_s:
            if not (elsewhere and worker.state == SERVING):
                track.stuck = True
                log.error(
                    "%s worker %s could not be brought to %s %s within %g s (router."
                    "reconcile_bound_s; it reports %s): treated as down, still trying",
                    worker.role,
                    name,
                    intent.role,
                    intent.state,
                    self.bound_s,
                    f"{report.role} {report.state}" if report else "nothing",
                )
        if track.stuck:
            want = STUCK
        if want is not None and want != worker.state:
            states.append((track, worker, want))
        if track.call is not None or now < track.next_try:
            return None
        if not fresh:
            return "probe"
        if report.state == SWITCHING:
            track.next_try = now + POLL_S
            return None
        if report.role == intent.role:
            return "rehome" if worker.role != intent.role and not worker.static else "undrain"
        if worker.state == SERVING:  # the pool picks it still: it stops first, if it may
            states.append((track, worker, "begin_drain"))
            track.next_try = now + (MAX_BACKOFF_S if track.waiting else 0.0)
            return None
        if report.state == DRAINING and track.remaining == "" and not self.open_legs_on(worker):
            return "switch"
        return "drain"

    def open_legs_on(self, worker) -> int:
        return self.open_legs.count(worker) if self.open_legs is not None else 0

    def _prune(self, present: set, now: float) -> None:
        for name, track in self._tracks.items():
            if name not in present and not track.flipping and not track.left_at:
                track.left_at = now
            elif name in present:
                track.left_at = 0.0
        if len(self._tracks) > MAX_TRACKED:
            gone = sorted((t.left_at, n) for n, t in self._tracks.items() if t.left_at)
            for _, name in gone[: len(self._tracks) - MAX_TRACKED]:
                del self._tracks[name]

    # ---- the calls ------------------------------------------------------------------------------
    def _send(self, name: str, track: _Track, worker, action: str) -> None:
        """Starts `action` on `worker` (outside the lock); its answer comes to _answered."""
        try:
            if action == "rehome":
                self._rehome(name, track, worker)
                return
            if action == "probe":
                call = worker.stub.Stats.future(
                    worker_pb2.StatsRequest(), timeout=self.rpc_timeout_s
                )
            else:
                control = self._control(worker)
                if action == "switch":
                    request = worker_pb2.SwitchRoleRequest(role=track.intent.role)
                    call = control.SwitchRole.future(request, timeout=self.rpc_timeout_s)
                else:
                    request = worker_pb2.DrainRequest(draining=action == "drain")
                    call = control.Drain.future(request, timeout=self.rpc_timeout_s)
        except Exception:  # never leave the worker with a call marked in flight
            log.exception("reconcile %s of %s failed to start", action, name)
            self._done(name, track, action, None, "failed")
            return
        call.add_done_callback(lambda f: self._answered(name, track, worker, action, f))

    def _rehome(self, name: str, track: _Track, worker) -> None:
        """The worker serves its intended role but the pool holds it in the other one (its
        switch's registration went through, the switch itself did not): the pool moves it."""
        role = track.intent.role
        log.warning(
            "%s worker %s serves %s: the router moves it to the %s pool",
            worker.role,
            name,
            role,
            role,
        )
        moved = self.pool.register(role, name, worker.address)
        with self._lock:  # the new pool entry: what the worker reported still holds for it
            if track.member is worker:
                track.member, track.member_seq = moved, next(_ORDER)
        self._done(name, track, "rehome", None, "ok")

    def _answered(self, name: str, track: _Track, worker, action: str, future) -> None:
        """A call's answer, on a gRPC thread: recorded, then the thread wakes."""
        try:
            reply = future.result()
        except grpc.RpcError as e:
            code = e.code() if callable(getattr(e, "code", None)) else None
            details = e.details() if callable(getattr(e, "details", None)) else str(e)
            with self._lock:
                first = track.backoff == MIN_BACKOFF_S
            (log.info if first else log.debug)(
                "reconcile %s of %s failed: %s %s",
                action,
                name,
                code.name if code else "?",
                details,
            )
            self._done(name, track, action, None, "failed")
            return
        except Exception:
            log.exception("reconcile %s of %s failed", action, name)
            self._done(name, track, action, None, "failed")
            return
        member = self.pool.registered(name) if action == "switch" else worker
        self._done(name, track, action, (reply, member), "ok")

    def _done(self, name: str, track: _Track, action: str, answer, outcome: str) -> None:
        now = time.monotonic()
        moves = None
        with self._lock:
            track.call = None
            if outcome == "ok":
                track.backoff = MIN_BACKOFF_S
                track.next_try = now + (POLL_S if action == "drain" else 0.0)
            else:
                track.next_try = now + track.backoff
                track.backoff = min(2 * track.backoff, MAX_BACKOFF_S)
                if action == "switch":
                    track.remaining = None  # what is left: the next Drain(true) says
            if answer is not None and not track.flipping:
                reply, member = answer
                if action == "switch" and member is not None:
                    self._note_member(track, member, now)
                if track.member is member:
                    role = reply.role
                    state = reply.role_state if action == "probe" else reply.state
                    if role and self._fresh(track, reply.role_version):
                        track.report = Report(role, state or SERVING, now)
                    if action == "drain":
                        track.remaining = reply.remaining
                        if track.drain_began is None:
                            track.drain_began = now
                        if now - track.drain_began >= self.drain_s and not track.moved:
                            track.moved, moves = True, member
        self._actions.labels(self._model, action, outcome).inc()
        if moves is not None and self.open_legs is not None:
            lost = self.open_legs.dropped(
                moves, f"worker {name} is switching to {track.intent.role}", None, moved=True
            )
            log.info("reconcile %s: drain bound reached, moved %d calls", name, len(lost))
        self._wake.set()

    # ---- metrics --------------------------------------------------------------------------------
    def gauges(self) -> list[tuple[str, str, bool, bool]]:
        """(role, worker, mismatch, stuck) of every member."""
        out = []
        for worker in self.pool.members():
            v = self.view(worker)
            out.append((worker.role, self.pool.name(worker), v.mismatch, v.stuck))
        return out


class _Collector(Collector):
    """pdserve:worker_role_mismatch and pdserve:worker_stuck, read at scrape time."""

    def __init__(self, reconciler: Reconciler):
        self.reconciler = reconciler

    def describe(self):
        return self._families()

    def _families(self):
        labels = ["model_name", "role", "worker"]
        return (
            GaugeMetricFamily(
                "pdserve:worker_role_mismatch",
                "1 while the worker's own report (its role and state) differs from what the "
                "router intends for it, outside a flip: the router is driving it there "
                "(router/reconcile.py).",
                labels=labels,
            ),
            GaugeMetricFamily(
                "pdserve:worker_stuck",
                "1 while the worker has not reached its intended role and state within "
                "router.reconcile_bound_s: it is skipped for new work.",
                labels=labels,
            ),
        )

    def collect(self):
        mismatch, stuck = self._families()
        model = self.reconciler._model
        for role, name, differs, is_stuck in self.reconciler.gauges():
            mismatch.add_metric([model, role, name], 1.0 if differs else 0.0)
            stuck.add_metric([model, role, name], 1.0 if is_stuck else 0.0)
        return [mismatch, stuck]
