"""The pool's health decisions (router/pool.py), with a fake clock and fake Stats calls, no
sockets: a late or failed Stats makes a worker down (no new work) but drops none of its calls;
silence past worker_silence_s, or an engine stuck past its stall bound, makes it dead and drops
them (router/open_legs.py); the stall bound grows with the costliest turn the worker reports.
"Stuck" is judged on CPU time: a turn that uses the CPU past the bound (spinning), or goes that
long without using it (blocked); a turn that is merely long by the wall clock is a busy machine.
The same over real workers: tests/chaos/test_busy_and_hung_workers.py.
"""

from __future__ import annotations

import grpc
import pytest

from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router.legs import Leg
from pdserve.router.open_legs import OpenLegs
from pdserve.router.pool import WorkerPool, _Worker


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Failed(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "fake"


class Call:
    """A Stats call: ends when its worker answers (or fails) it."""

    def __init__(self):
        self.outcome = None  # ("ok", stats) | ("error", RpcError)
        self.cancelled = False

    def done(self):
        return self.outcome is not None

    def result(self, timeout=None):
        if self.outcome is None:
            raise Failed(grpc.StatusCode.DEADLINE_EXCEEDED)
        kind, value = self.outcome
        if kind == "error":
            raise value
        return value

    def cancel(self):
        self.cancelled = True


class FakeWorker:
    """The Stats side of a worker: every call it receives is kept; `answer` ends the open one."""

    def __init__(self, worker_id):
        self.worker_id = worker_id
        self.calls: list[Call] = []
        self.Stats = self  # stub.Stats.future(...)

    def future(self, request, timeout=None):
        self.calls.append(Call())
        return self.calls[-1]

    def stats(
        self, stalled_ms=0, cpu_ms=0, idle_ms=0, turn_ms_max=0, turn_tokens=0, us_per_token=0
    ):
        """stalled_ms: the turn's wall time; cpu_ms: the CPU time it used; idle_ms: how long it
        has gone without using the CPU."""
        return worker_pb2.WorkerStats(
            worker_id=self.worker_id,
            num_free_blocks=8,
            num_total_blocks=10,
            block_size=16,
            engine_stalled_ms=stalled_ms,
            engine_turn_cpu_ms=cpu_ms,
            engine_idle_ms=idle_ms,
            engine_turn_ms_max=turn_ms_max,
            engine_turn_tokens=turn_tokens,
            engine_us_per_token_max=us_per_token,
        )

    def answer(self, **kw):
        open_calls = [c for c in self.calls if not c.done()]
        open_calls[-1].outcome = ("ok", self.stats(**kw))

    def fail(self, code=grpc.StatusCode.UNAVAILABLE):
        open_calls = [c for c in self.calls if not c.done()]
        open_calls[-1].outcome = ("error", Failed(code))

    def outstanding(self):
        return sum(not c.done() for c in self.calls)


class FakePool(WorkerPool):
    """A WorkerPool whose workers are FakeWorkers by address: no channel is made."""

    fakes: dict = {}

    def _connect(self, role, address, **fields):
        fields.setdefault("heard_at", self._clock())
        return _Worker(role, address, None, self.fakes[address], **fields)

    def close(self):
        pass


class Cancel:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


@pytest.fixture
def setup():
    clock = Clock()
    fakes = {"d0": FakeWorker("d0"), "d1": FakeWorker("d1")}
    FakePool.fakes = fakes
    pool = FakePool(
        [], ["d0", "d1"], stats_ttl_s=0.5, down_s=2.0, silence_s=4.0, stall_s=5.0, clock=clock
    )
    open_legs = OpenLegs(pool, lambda fn: fn())  # cancels run at once
    return clock, fakes, pool, open_legs


def stream_leg(worker, heard):
    leg = Leg(1)
    leg.decode, leg.stream_call, leg.heard = worker, Cancel(), heard
    return leg


def tick(clock, pool, seconds, answer=(), **stats):
    """Sweeps every 0.5 s for `seconds`, the workers in `answer` answering each poll."""
    for _ in range(int(seconds / 0.5)):
        for fake in answer:
            if fake.outstanding():
                fake.answer(**stats)
        pool.sweep()
        clock.now += 0.5


def test_late_stats_make_a_worker_down_but_keep_its_calls(setup):
    clock, (d0, d1), pool, open_legs = setup[0], setup[1].values(), setup[2], setup[3]
    tick(clock, pool, 1, answer=(d0, d1))
    w0 = pool.decode[0]
    leg = stream_leg(w0, clock.now)
    open_legs.add(w0, leg)
    tick(clock, pool, 3, answer=(d1,))  # d0's poll stays unanswered for 3 s
    assert w0.down and not w0.dead
    assert [w.worker_id for w in pool.decode_order()] == ["d1", "d0"]  # d0 only as a fallback
    assert not leg.stream_call.cancelled and open_legs.count(w0) == 1
    assert d0.outstanding() == 1  # one poll at a time, however late
    d0.answer()  # one answer clears it
    tick(clock, pool, 0.5, answer=(d1,))
    assert not w0.down and {w.worker_id for w in pool.decode_order()} == {"d0", "d1"}


def test_a_failed_stats_makes_a_worker_down_and_only_a_stats_answer_clears_it(setup):
    clock, (d0, d1), pool, open_legs = setup[0], setup[1].values(), setup[2], setup[3]
    tick(clock, pool, 1, answer=(d0, d1))
    w0 = pool.decode[0]
    leg = stream_leg(w0, clock.now)
    open_legs.add(w0, leg)
    d0.fail()
    tick(clock, pool, 0.5, answer=(d1,))
    assert w0.down and not w0.dead and not leg.stream_call.cancelled
    pool._registered["d0"] = w0  # as if it had registered: its heartbeats are answers too
    assert pool.heartbeat("d0", d0.stats())
    assert w0.down  # a heartbeat is not a Stats answer
    tick(clock, pool, 1, answer=(d0, d1))
    assert not w0.down


def test_silence_past_the_bound_kills_a_worker_and_drops_its_silent_calls(setup):
    clock, (d0, d1), pool, open_legs = setup[0], setup[1].values(), setup[2], setup[3]
    tick(clock, pool, 1, answer=(d0, d1))
    w0 = pool.decode[0]
    quiet, busy = stream_leg(w0, clock.now), stream_leg(w0, clock.now)
    open_legs.add(w0, quiet)
    open_legs.add(w0, busy)
    start = clock.now
    while not quiet.stream_call.cancelled:
        busy.heard = clock.now  # this stream still gets tokens: not silent
        tick(clock, pool, 0.5, answer=(d1,))
        assert clock.now - start < 6
    assert 4.0 <= clock.now - start <= 5.0
    assert w0.dead == "silent" and w0.down and quiet.decode_lost and "silent" in quiet.lost_why
    assert not busy.stream_call.cancelled and pool.deaths["silent"] == 1
    d0.answer()  # back: alive and up
    tick(clock, pool, 0.5, answer=(d1,))
    assert not w0.dead and not w0.down and pool.deaths["silent"] == 1


def test_a_heartbeat_keeps_a_worker_alive_while_its_stats_are_late(setup):
    clock, fakes, pool, open_legs = setup
    w0 = pool.decode[0]
    pool._registered["d0"] = w0
    leg = stream_leg(w0, clock.now)
    open_legs.add(w0, leg)
    for _ in range(20):  # 10 s of unanswered polls, a heartbeat every second
        if int(clock.now * 2) % 2 == 0:
            assert pool.heartbeat("d0", fakes["d0"].stats())
        tick(clock, pool, 0.5, answer=(fakes["d1"],))
        assert not w0.dead and not w0.down
    assert not leg.stream_call.cancelled


def test_a_registered_worker_that_falls_silent_leaves_the_pool_with_its_calls(setup):
    clock, fakes, pool, open_legs = setup
    FakePool.fakes["r0"] = FakeWorker("r0")
    worker = pool.register("decode", "r0", "r0")
    leg = stream_leg(worker, clock.now + 100)  # even a call heard late: the worker is gone
    open_legs.add(worker, leg)
    tick(clock, pool, 3.5, answer=(fakes["d0"], fakes["d1"]))
    assert pool.is_member(worker) and not leg.stream_call.cancelled
    tick(clock, pool, 1, answer=(fakes["d0"], fakes["d1"]))
    assert not pool.is_member(worker) and leg.stream_call.cancelled
    assert not pool.heartbeat("r0", None)  # it must register again


def test_an_engine_blocked_past_its_bound_kills_a_worker_that_answers(setup):
    clock, (d0, d1), pool, open_legs = setup[0], setup[1].values(), setup[2], setup[3]
    tick(clock, pool, 1, answer=(d0, d1))
    w0 = pool.decode[0]
    stuck_at = clock.now
    leg = stream_leg(w0, stuck_at - 0.1)  # its last token came out of the turn before
    open_legs.add(w0, leg)
    while not leg.stream_call.cancelled:
        stalled = int((clock.now - stuck_at) * 1000)
        # the server answers every poll; its engine uses no CPU (a deadlock, a lost peer)
        d0.answer(stalled_ms=stalled, cpu_ms=20, idle_ms=stalled, turn_ms_max=300)
        tick(clock, pool, 0.5, answer=(d1,))
        assert not w0.down or stalled >= 5000
        assert clock.now - stuck_at < 7
    assert w0.dead == "stalled" and w0.down and pool.deaths["stalled"] == 1
    assert "without using the CPU" in leg.lost_why
    assert [w.worker_id for w in pool.decode_order()] == ["d1"]  # dead: not even a fallback
    tick(clock, pool, 1, answer=(d0, d1))  # the turn ended: alive again
    assert not w0.dead and not w0.down


def test_a_big_reported_turn_raises_the_stall_bound(setup):
    clock, (d0, d1), pool, open_legs = setup[0], setup[1].values(), setup[2], setup[3]
    assert pool.stall_bound_s(d0.stats(turn_ms_max=1000)) == 5.0
    assert pool.stall_bound_s(d0.stats(turn_ms_max=3000)) == 12.0  # 4 x 3 s
    tick(clock, pool, 1, answer=(d0, d1))
    w0 = pool.decode[0]
    leg = stream_leg(w0, clock.now - 20)  # its last token came before the long turn began
    open_legs.add(w0, leg)
    # a busy engine: turns of 3 s of CPU, the current one 9 s so far; past worker_stall_s,
    # not dead
    for cpu_ms in (9000, 9500, 10000, 10500):
        d1.answer()
        d0.answer(stalled_ms=cpu_ms, cpu_ms=cpu_ms, turn_ms_max=3000)
        tick(clock, pool, 0.5)
    assert not w0.dead and not w0.down and not leg.stream_call.cancelled
    d0.answer(stalled_ms=12500, cpu_ms=12500, turn_ms_max=3000)  # spinning: hung
    tick(clock, pool, 0.5)
    assert w0.dead == "stalled" and leg.stream_call.cancelled
    assert "used 12.5 s of CPU" in leg.lost_why


def test_a_large_step_after_an_idle_spell_is_not_taken_for_a_hang(setup):
    """A step of 2,048 prompt tokens on a busy machine takes seconds, and after an idle spell no
    recent turn says so: its tokens at the slowest recent time per token do. (guidellm's
    saturation stage saw a live prefill worker declared dead at default settings.)"""
    clock, (d0, d1), pool, open_legs = setup[0], setup[1].values(), setup[2], setup[3]
    big = dict(turn_tokens=2048, us_per_token=3000)  # 6.1 s expected, 24.6 s bound
    assert pool.stall_bound_s(d0.stats(**big)) == pytest.approx(4 * 2048 * 3e-3)
    assert pool.stall_bound_s(d0.stats(turn_tokens=1, us_per_token=3000)) == 5.0  # a decode
    tick(clock, pool, 1, answer=(d0, d1))
    w0 = pool.decode[0]
    leg = stream_leg(w0, clock.now - 30)
    open_legs.add(w0, leg)
    for cpu_ms in (6000, 12000, 20000):
        d1.answer()
        d0.answer(stalled_ms=cpu_ms, cpu_ms=cpu_ms, **big)
        tick(clock, pool, 0.5)
    assert not w0.dead and not w0.down and not leg.stream_call.cancelled
    d0.answer(stalled_ms=25000, cpu_ms=25000, **big)  # four times what it should cost: hung
    tick(clock, pool, 0.5)
    assert w0.dead == "stalled" and leg.stream_call.cancelled


def test_a_step_long_by_the_wall_clock_on_a_busy_machine_is_not_a_hang(setup):
    """A prefill step that shares the cores with other busy processes takes many times its
    quiet wall time, with nothing recent to scale the bound (the first large step after a
    start: the prior 3 ms a token). Its CPU time is what the work costs and its thread keeps
    using the CPU, so the worker stays alive however long the step lasts by the wall clock
    (a CI run saw a prefill worker declared dead 5.2 s into a step of 366 tokens)."""
    clock, (d0, d1), pool, open_legs = setup[0], setup[1].values(), setup[2], setup[3]
    step = dict(turn_tokens=366, us_per_token=3000)  # 1.1 s expected, bound 5 s
    tick(clock, pool, 1, answer=(d0, d1))
    w0 = pool.decode[0]
    leg = stream_leg(w0, clock.now - 1)
    open_legs.add(w0, leg)
    for second in range(1, 61):  # a minute, a fifteenth of it on the CPU
        d1.answer()
        d0.answer(stalled_ms=second * 1000, cpu_ms=second * 66, idle_ms=300, **step)
        tick(clock, pool, 1)
    assert not w0.dead and not w0.down and not leg.stream_call.cancelled
    assert pool.deaths["stalled"] == 0


def test_a_heartbeat_without_figures_does_not_clear_a_stall(setup):
    clock, fakes, pool, open_legs = setup
    w0 = pool.decode[0]
    pool._registered["d0"] = w0
    assert pool.heartbeat("d0", fakes["d0"].stats(stalled_ms=5100, idle_ms=5100))
    assert w0.dead == "stalled"
    assert pool.heartbeat("d0", None)
    assert w0.dead == "stalled" and w0.down
    clock.now += 0.3  # a report of the same stuck turn, taken 0.5 s earlier, arrives late
    assert pool.heartbeat("d0", fakes["d0"].stats(stalled_ms=4900, idle_ms=4900))
    assert w0.dead == "stalled" and pool.deaths["stalled"] == 1
    assert pool.heartbeat("d0", fakes["d0"].stats(stalled_ms=0))
    assert not w0.dead and not w0.down


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="down_s <= silence_s"):
        WorkerPool(down_s=5.0, silence_s=4.0)
    with pytest.raises(ValueError, match="stall_factor"):
        WorkerPool(stall_factor=0.5)


def test_deaths_are_counted_by_cause_on_the_metrics(setup):
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.router.metrics import DeathCollector

    clock, fakes, pool, _ = setup
    registry = CollectorRegistry()
    registry.register(DeathCollector(pool, "m"))
    tick(clock, pool, 5, answer=(fakes["d1"],))  # d0 silent past worker_silence_s
    text = generate_latest(registry).decode()
    assert 'pdserve:worker_deaths_total{cause="silent",model_name="m"} 1.0' in text
    assert 'pdserve:worker_deaths_total{cause="stalled",model_name="m"} 0.0' in text
