"""The Reconciler (router/reconcile.py) against fake workers: each fake is a real RoleGate behind
a real ControlServicer (worker_common/role.py), reached through fake stubs whose calls answer at
once, or, while the fake is "stopped" (SIGSTOP), wait in its queue until it resumes and fail
DEADLINE_EXCEEDED when the test expires them. The clock is the test's. No socket, no thread: the
tests run the reconciler's passes themselves (Reconciler.step)."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry

from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router import reconcile
from pdserve.router.reconcile import (
    MAX_BACKOFF_S,
    RECONCILING,
    STUCK,
    Reconciler,
)
from pdserve.worker_common.role import DRAINING, SERVING, ControlServicer, RoleGate


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


class RpcError(grpc.RpcError):
    def __init__(self, code, details=""):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class Context:
    def abort(self, code, details):
        raise RpcError(code, details)


class Call:
    """A gRPC future: done at once, or pending while its worker is stopped."""

    def __init__(self):
        self.callbacks, self.done, self.value, self.error = [], False, None, None

    def add_done_callback(self, fn):
        if self.done:
            fn(self)
        else:
            self.callbacks.append(fn)

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value

    def finish(self, value=None, error=None):
        if self.done:
            return
        self.done, self.value, self.error = True, value, error
        for fn in self.callbacks:
            fn(self)


class Method:
    def __init__(self, process, handler):
        self.process, self.handler = process, handler

    def future(self, request, timeout=None):
        return self.process.call(self.handler, request)


class Process:
    """A two-role worker process: a RoleGate, its ControlServicer and Stats; stop() and resume()
    as SIGSTOP and SIGCONT do."""

    def __init__(self, pool, worker_id: str, role: str):
        self.pool, self.worker_id = pool, worker_id
        self.gate = RoleGate(worker_id, role)
        self.left = ""  # the work of its role still in it
        self.control = ControlServicer(self.gate, lambda role: self.left, self._register)
        self.stopped, self.queue, self.calls = False, [], []
        self.address = f"addr-{worker_id}"

    def _register(self, role):
        self.pool.register(role, self.worker_id, self.address)

    def stats(self, request=None, context=None):
        return self.gate.stamp(worker_pb2.WorkerStats(worker_id=self.worker_id))

    def call(self, handler, request):
        call = Call()
        self.calls.append((handler.__name__, request))
        if self.stopped:
            self.queue.append((handler, request, call))
        else:
            self._run(handler, request, call)
        return call

    def _run(self, handler, request, call):
        try:
            call.finish(handler(request, Context()))
        except RpcError as e:
            call.finish(error=e)

    def stop(self):
        self.stopped = True

    def expire(self):
        """The pending calls' deadlines pass (they still reach the process when it resumes)."""
        for _, _, call in self.queue:
            call.finish(error=RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"))

    def resume(self):
        """SIGCONT: the queued calls run now, the timed-out ones too (their answers are lost)."""
        self.stopped = False
        queue, self.queue = self.queue, []
        for handler, request, call in queue:
            self._run(handler, request, call)


class Worker:
    """A pool entry (as router/pool.py's _Worker)."""

    def __init__(self, role, process):
        self.role, self.process = role, process
        self.address, self.worker_id = process.address, process.worker_id
        self.static, self.state, self.down = False, SERVING, False
        self.channel = process
        self.stub = type("Stub", (), {"Stats": Method(process, process.stats)})()


class Pool:
    """The WorkerPool calls the Reconciler makes, over Processes."""

    def __init__(self):
        self.workers: dict[str, Worker] = {}
        self.processes: dict[str, Process] = {}
        self.listeners = []

    def start(self, worker_id, role) -> Process:
        """A worker process starts (or restarts) in `role` and registers."""
        process = self.processes[worker_id] = Process(self, worker_id, role)
        self.register(role, worker_id, process.address)
        return process

    def register(self, role, worker_id, address):
        old = self.workers.get(worker_id)
        if old is not None and old.role == role:
            return old
        self.workers[worker_id] = Worker(role, self.processes[worker_id])
        return self.workers[worker_id]

    def members(self):
        return list(self.workers.values())

    def is_member(self, worker):
        return worker in self.workers.values()

    def name(self, worker):
        return worker.worker_id

    def registered(self, worker_id):
        return self.workers.get(worker_id)

    def set_state(self, worker, state):
        worker.state = state

    def begin_drain(self, worker):
        others = [
            w
            for w in self.workers.values()
            if w is not worker and w.role == worker.role and w.state == SERVING
        ]
        if not others:
            return f"it is the last {worker.role} worker that is up and serving"
        worker.state = DRAINING
        return None

    def on_report(self, listener):
        self.listeners.append(listener)

    def heartbeat(self, worker_id):
        """A heartbeat's Stats reach the router (a stopped process sends none)."""
        process = self.processes[worker_id]
        if not process.stopped:
            for listener in self.listeners:
                listener(self.workers[worker_id], process.stats())


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(reconcile, "time", clock)
    return clock


def make(clock, roles, bound_s=10.0, registry=None):
    pool = Pool()
    for worker_id, role in roles.items():
        pool.start(worker_id, role)
    rec = Reconciler(
        pool,
        None,
        bound_s=bound_s,
        registry=registry,
        control=lambda worker: type(
            "Control",
            (),
            {
                "Drain": Method(worker.process, worker.process.control.Drain),
                "SwitchRole": Method(worker.process, worker.process.control.SwitchRole),
            },
        )(),
    )
    rec.step()  # first sight: every worker's intent is the role it joined with
    return pool, rec


def run(rec, clock, seconds: float, step_s: float = 0.05):
    """Passes of the reconciler over `seconds` of the test's clock."""
    end = clock.now + seconds
    while clock.now < end:
        rec.step()
        clock.now += step_s


def converged(rec, pool, worker_id) -> bool:
    view = rec.view(pool.workers[worker_id])
    return not view.mismatch and view.reported_state == SERVING


def given_up_flip(rec, pool, worker_id, old, new):
    """What router/flips.py does to a flip that drained `worker_id` and was then given up."""
    assert rec.begin_flip(worker_id, old) is None
    pool.workers[worker_id].state = DRAINING
    pool.processes[worker_id].gate.drain(True)
    rec.flip_state(worker_id, new, "switching")
    rec.end_flip(worker_id, old)


def test_a_given_up_flip_on_a_stopped_worker_is_undone_once_it_resumes(clock):
    pool, rec = make(clock, {"p0": "prefill", "d0": "decode", "d1": "decode"})
    d1 = pool.processes["d1"]
    d1.stop()
    given_up_flip(rec, pool, "d1", "decode", "prefill")
    run(rec, clock, 3.0)
    d1.expire()  # the undo's calls time out while it is stopped...
    run(rec, clock, 3.0)
    assert d1.gate.state == DRAINING and pool.workers["d1"].state == RECONCILING
    assert rec.view(pool.workers["d1"]).mismatch
    d1.resume()  # ...and are retried until one is answered
    run(rec, clock, MAX_BACKOFF_S + 0.5)
    assert d1.gate.state == SERVING and d1.gate.role == "decode"
    assert pool.workers["d1"].state == SERVING and converged(rec, pool, "d1")
    assert ("Drain", worker_pb2.DrainRequest(draining=False)) in d1.calls


def test_a_stale_drain_that_lands_after_the_undo_is_undone_too(clock):
    pool, rec = make(clock, {"p0": "prefill", "d0": "decode", "d1": "decode"})
    d1 = pool.processes["d1"]
    d1.stop()
    # the flip's own Drain(true), sent while the worker was stopped, is still queued in it
    d1.call(d1.control.Drain, worker_pb2.DrainRequest(draining=True))
    given_up_flip(rec, pool, "d1", "decode", "prefill")
    d1.gate.drain(False)  # (given_up_flip drained it by hand: the queued call drains it again)
    run(rec, clock, 1.0)
    d1.resume()  # the stale Drain(true) runs, then the router's Drain(false)
    run(rec, clock, 1.0)
    assert converged(rec, pool, "d1")
    d1.gate.drain(True)  # a stale Drain(true) after the undo was acknowledged
    pool.heartbeat("d1")  # its next heartbeat says so
    assert rec.view(pool.workers["d1"]).mismatch
    run(rec, clock, 1.0)
    assert d1.gate.state == SERVING and converged(rec, pool, "d1")
    assert pool.workers["d1"].state == SERVING


def test_a_worker_restarted_in_its_launch_role_is_switched_to_the_intended_one(clock):
    pool, rec = make(clock, {"p0": "prefill", "d0": "decode", "d1": "decode"})
    assert rec.begin_flip("d1", "decode") is None  # a flip to prefill that was done
    pool.processes["d1"].gate.drain(True)
    pool.processes["d1"].gate.switch("prefill", lambda: "", pool.processes["d1"]._register)
    rec.end_flip("d1", "prefill", pool.processes["d1"].control._status())
    run(rec, clock, 0.5)
    assert converged(rec, pool, "d1") and pool.workers["d1"].role == "prefill"
    restarted = pool.start("d1", "decode")  # kill -9: the supervisor starts it as launched
    assert pool.workers["d1"].role == "decode"
    run(rec, clock, 2.0)
    assert restarted.gate.role == "prefill" and restarted.gate.state == SERVING
    assert pool.workers["d1"].role == "prefill" and pool.workers["d1"].state == SERVING
    assert converged(rec, pool, "d1")
    names = [name for name, _ in restarted.calls]
    assert names.index("Drain") < names.index("SwitchRole")


@pytest.mark.parametrize("versioned", [True, False])
def test_a_report_sent_before_a_finished_flip_does_not_undo_it(clock, versioned):
    """A Stats answer (or heartbeat) stamped while the worker still drained in its old role and
    delivered after the switch's own answer: with role versions it is recognised as older and
    ignored; without them (a worker that does not send them) it looks like a worker gone back to
    the old role, which the reconciler would then drive (the race this guards against)."""
    pool, rec = make(clock, {"p0": "prefill", "d0": "decode", "d1": "decode"})
    d1 = pool.processes["d1"]
    assert rec.begin_flip("d1", "decode") is None
    d1.gate.drain(True)
    stale = d1.stats()  # leaves the worker now, arrives late
    d1.gate.switch("prefill", lambda: "", d1._register)
    rec.end_flip("d1", "prefill", d1.control._status())
    assert converged(rec, pool, "d1")
    if not versioned:
        stale.role_version = 0
    calls = len(d1.calls)
    for listener in pool.listeners:
        listener(pool.workers["d1"], stale)
    assert rec.view(pool.workers["d1"]).mismatch is not versioned
    if versioned:
        run(rec, clock, 2.0)
        assert converged(rec, pool, "d1") and len(d1.calls) == calls  # nothing to drive
        assert d1.gate.role == "prefill" and d1.gate.state == SERVING


def test_a_switch_waits_while_the_worker_is_the_last_of_its_role(clock):
    pool, rec = make(clock, {"d0": "decode", "p0": "prefill", "p1": "prefill"})
    rec._tracks["p1"].intent = reconcile.Intent("decode", SERVING, clock.now)
    pool.workers["d0"].state = DRAINING  # d0 is away: p1... is not the last prefill worker
    del pool.workers["p0"]  # p0 died: p1 is the last prefill worker
    run(rec, clock, 3.0)
    p1 = pool.processes["p1"]
    assert p1.gate.state == SERVING and pool.workers["p1"].state == SERVING
    assert not rec.view(pool.workers["p1"]).stuck  # it serves, the pool needs it
    assert "Drain" not in [name for name, _ in p1.calls]
    pool.start("p0", "prefill")  # p0 is back: p1 may go
    run(rec, clock, 3.0)
    assert pool.workers["p1"].role == "decode" and converged(rec, pool, "p1")


def test_a_worker_not_brought_back_within_the_bound_is_stuck_until_it_is(clock):
    registry = CollectorRegistry()
    pool, rec = make(clock, {"p0": "prefill", "d0": "decode", "d1": "decode"}, 2.0, registry)
    d1 = pool.processes["d1"]
    d1.stop()
    given_up_flip(rec, pool, "d1", "decode", "prefill")
    run(rec, clock, 1.0)
    assert pool.workers["d1"].state == RECONCILING
    run(rec, clock, 1.5)
    d1.expire()
    run(rec, clock, 0.5)
    assert pool.workers["d1"].state == STUCK and rec.view(pool.workers["d1"]).stuck
    labels = {"model_name": "", "role": "decode", "worker": "d1"}
    assert registry.get_sample_value("pdserve:worker_stuck", labels) == 1
    assert registry.get_sample_value("pdserve:worker_role_mismatch", labels) == 1
    assert registry.get_sample_value("pdserve:worker_role_mismatch", labels | {"worker": "d0"}) == 0
    d1.resume()
    run(rec, clock, 1.5)
    assert pool.workers["d1"].state == SERVING and converged(rec, pool, "d1")
    assert registry.get_sample_value("pdserve:worker_stuck", labels) == 0
    failed = {"model_name": "", "action": "probe", "outcome": "failed"}
    assert registry.get_sample_value("pdserve:reconcile_actions_total", failed) >= 1


def test_a_half_switched_worker_is_moved_back_to_its_pool(clock):
    """The switch's registration reached the router but the switch did not (the worker timed it
    out): the pool holds it as prefill, the worker serves decode again, still draining."""
    pool, rec = make(clock, {"p0": "prefill", "d0": "decode", "d1": "decode"})
    assert rec.begin_flip("d1", "decode") is None
    d1 = pool.processes["d1"]
    d1.gate.drain(True)
    d1._register("prefill")
    rec.end_flip("d1", "decode")  # given up
    assert pool.workers["d1"].role == "prefill"
    run(rec, clock, 2.0)
    assert pool.workers["d1"].role == "decode" and pool.workers["d1"].state == SERVING
    assert d1.gate.state == SERVING and converged(rec, pool, "d1")


def test_a_flip_waits_for_the_reconciler_and_a_refused_one_changes_nothing(clock):
    pool, rec = make(clock, {"p0": "prefill", "d0": "decode", "d1": "decode"})
    pool.processes["d1"].stop()
    given_up_flip(rec, pool, "d1", "decode", "prefill")
    rec.step()
    assert "still bringing it to decode serving" in rec.begin_flip("d1", "decode")
    assert rec.begin_flip("d0", "decode") is None
    rec.end_flip("d0", "decode", began=False)
    run(rec, clock, 0.5)
    d0 = pool.workers["d0"]
    assert not rec.view(d0).mismatch and d0.state == SERVING
    assert pool.processes["d0"].calls == []  # nothing to drive: the refused flip changed nothing


def test_a_reconcile_bound_must_be_positive():
    with pytest.raises(ValueError, match="bound must be > 0"):
        Reconciler(Pool(), None, bound_s=0)
