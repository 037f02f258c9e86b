"""EngineLoop: the engine is built and stepped on one thread; loads are read without it."""

import threading
import time
from collections import deque

import pytest

from pdserve.engine import engine_loop
from pdserve.engine.engine_loop import EngineLoop


def spin(seconds: float) -> None:
    """Uses `seconds` of this thread's CPU time: work, as a step's, however busy the machine."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


class _Scheduler:
    def __init__(self):
        self.waiting, self.running = [], []


class _Blocks:
    num_blocks, num_free_blocks, block_size = 8, 8, 16


class FakeEngine:
    def __init__(self):
        self.built_on = threading.current_thread()
        self.scheduler, self.block_manager = _Scheduler(), _Blocks()

    def has_unfinished_requests(self):
        return False


def test_build_constructs_and_steps_the_engine_on_the_loop_thread():
    loop = EngineLoop.build(FakeEngine, name="t-loop", timeout=10)
    try:
        assert loop.engine.built_on.name == "t-loop"
        assert loop.call(threading.current_thread) is loop.engine.built_on
        load = loop.load()
        assert load.pop("engine_stalled_ms") < 1000  # 0 once the loop waits for work
        assert load.pop("engine_turn_cpu_ms") < 1000
        assert load.pop("engine_idle_ms") < 1000
        assert load.pop("engine_turn_ms_max") < 1000  # its turns so far were short
        assert load.pop("engine_turn_tokens") == 0  # no step running
        assert load.pop("engine_us_per_token_max") == engine_loop.PRIOR_US_PER_TOKEN
        assert load.pop("engine_loading_weights") is False
        assert load == {
            "num_free_blocks": 8,
            "num_total_blocks": 8,
            "block_size": 16,
            "num_running": 0,
            "num_waiting": 0,
            "queued_prompt_tokens": 0,
        }
    finally:
        loop.stop()


def test_a_blocked_turn_shows_as_a_growing_stall_and_idle_time_and_idle_as_none():
    """What WorkerStats.engine_stalled_ms and engine_idle_ms report for a turn whose thread
    waits (a deadlock, a lost peer): both grow, its CPU time does not. The router tells a
    blocked engine by engine_idle_ms."""
    loop = EngineLoop.build(FakeEngine, name="t-stall", timeout=10)
    gate = threading.Event()
    try:
        loop.submit(gate.wait, 30)  # a call that hangs the loop thread, as a stuck step would
        time.sleep(0.3)
        first, first_idle = loop.stalled_ms(), loop.idle_ms()
        time.sleep(0.3)
        assert 250 <= first < loop.stalled_ms()
        assert 250 <= first_idle < loop.idle_ms()
        assert loop.turn_cpu_ms() < 100
        gate.set()
        deadline = time.monotonic() + 10
        while loop.stalled_ms() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.stalled_ms() == 0 and loop.idle_ms() == 0 and loop.turn_cpu_ms() == 0
    finally:
        gate.set()
        loop.stop()


def test_the_longest_finished_turn_is_reported_and_a_running_one_is_not():
    """engine_turn_ms_max: the CPU time of a costly turn that ended raises it (the router's
    hang bound scales by it); a turn still running does not (a hung turn must not raise its own
    bound), nor does one that waited without computing."""
    loop = EngineLoop.build(FakeEngine, name="t-turns", timeout=10)
    gate = threading.Event()
    try:
        loop.call(time.sleep, 0.6)
        time.sleep(0.05)
        assert loop.turn_ms_max() < 300  # long by the wall clock, cheap on the CPU
        loop.call(spin, 0.4)
        time.sleep(0.05)  # the turn that ran the call ends as the loop waits again
        assert 400 <= loop.turn_ms_max() < 5000
        loop.submit(gate.wait, 30)
        time.sleep(0.8)
        assert loop.stalled_ms() >= 700
        assert loop.turn_ms_max() < 700  # still the 0.4 s turn
    finally:
        gate.set()
        loop.stop()


class SteppingEngine(FakeEngine):
    """Steps of `tokens` tokens taking `seconds`, reported as LLMEngine reports them."""

    def __init__(self):
        super().__init__()
        self.work: list[tuple[int, float]] = []
        self.running_step_tokens = 0
        self.last_step = (0, 0.0)
        self.seen_running: list[int] = []

    def has_unfinished_requests(self):
        return bool(self.work)

    def step(self):
        tokens, seconds = self.work.pop(0)
        self.running_step_tokens = tokens
        spin(seconds)
        self.running_step_tokens = 0
        self.last_step = (tokens, seconds)
        return []


def test_a_running_step_reports_its_tokens_and_steps_their_slowest_rate(monkeypatch):
    """engine_turn_tokens and engine_us_per_token_max (CPU time per token): what the router
    scales a large step's hang bound by; steps of fewer than RATE_MIN_TOKENS tokens are no rate;
    the rate ages out after two windows, back to the prior."""
    monkeypatch.setattr(engine_loop, "RATE_WINDOW_S", 1.0)
    loop = EngineLoop.build(SteppingEngine, name="t-rate", timeout=10)
    try:
        engine = loop.engine

        def run(tokens, seconds):
            loop.call(lambda: engine.work.append((tokens, seconds)))
            while loop.call(lambda: bool(engine.work)):
                time.sleep(0.01)

        run(4, 0.2)  # a decode-sized step: not a rate
        assert loop.us_per_token_max() == engine_loop.PRIOR_US_PER_TOKEN
        loop.call(lambda: engine.work.append((64, 0.4)))
        deadline = time.monotonic() + 5
        while loop.load()["engine_turn_tokens"] != 64 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.load()["engine_turn_tokens"] == 64  # read while the step runs
        while loop.call(lambda: bool(engine.work)):
            time.sleep(0.01)
        assert loop.load()["engine_turn_tokens"] == 0
        assert loop.us_per_token_max() == pytest.approx(0.4 / 64 * 1e6, rel=0.05)
        run(32, 0.05)  # faster per token: the slowest stays
        assert loop.us_per_token_max() == pytest.approx(0.4 / 64 * 1e6, rel=0.05)
        time.sleep(2.1)  # two windows with no rate
        assert loop.us_per_token_max() == engine_loop.PRIOR_US_PER_TOKEN
    finally:
        loop.stop()


def test_a_computing_turn_shows_its_cpu_time_and_no_idle_time():
    """A turn whose thread computes (a long step): engine_turn_cpu_ms grows with the work and
    engine_idle_ms stays near 0 however long the turn lasts: the router never takes it for a
    blocked engine, and takes it for a spinning one only past what its work should cost."""
    loop = EngineLoop.build(FakeEngine, name="t-busy", timeout=10)
    try:
        fut = loop.submit(spin, 1.5)
        idle = []
        deadline = time.monotonic() + 30
        while loop.turn_cpu_ms() < 1000 and time.monotonic() < deadline:
            idle.append(loop.idle_ms())  # a reading every 0.1 s: progress each time
            time.sleep(0.1)
        assert loop.turn_cpu_ms() >= 1000
        assert max(idle[2:]) < 500, idle  # each reading saw the thread compute since the last
        fut.result(30)
        time.sleep(0.05)
        assert loop.turn_ms_max() >= 1500
    finally:
        loop.stop()


def test_an_engine_with_pipeline_stages_is_judged_by_the_wall_clock():
    """Rank 0 of a pipelined engine waits for its later stages inside a step, without using the
    CPU, while they compute: its figures are the wall clock's, so such a wait is judged as the
    turn's length, not as a blocked thread."""

    class Pipelined(FakeEngine):
        class config:
            pipeline_parallel_size = 2

    loop = EngineLoop.build(Pipelined, name="t-pp", timeout=10)
    gate = threading.Event()
    try:
        loop.submit(gate.wait, 30)  # waiting for a later stage, as far as rank 0 can tell
        time.sleep(0.5)
        assert loop.turn_cpu_ms() >= 400 and loop.idle_ms() >= 400  # the turn's wall time
        gate.set()
        time.sleep(0.05)
        assert loop.turn_ms_max() >= 400
    finally:
        gate.set()
        loop.stop()


def test_the_longest_turn_ages_out_after_two_windows(monkeypatch):
    from pdserve.engine import engine_loop

    monkeypatch.setattr(engine_loop, "TURN_WINDOW_S", 0.2)
    loop = EngineLoop.build(FakeEngine, name="t-age", timeout=10)
    try:
        loop.call(spin, 0.1)
        time.sleep(0.02)
        assert loop.turn_ms_max() >= 100
        time.sleep(0.5)  # two windows with only short turns (idle waits end turns too)
        loop.call(lambda: None)
        time.sleep(0.02)
        assert loop.turn_ms_max() < 100
    finally:
        loop.stop()


def test_the_hang_hook_blocks_a_turn_while_its_file_exists(monkeypatch, tmp_path):
    """PDSERVE_TEST_ENGINE_HANG_FILE: the loop named NAME hangs while PATH.NAME exists, its
    stall growing as a hung engine's would, and carries on once the file is gone; another
    loop's file does not stop it."""
    path = tmp_path / "hang"
    monkeypatch.setenv("PDSERVE_TEST_ENGINE_HANG_FILE", str(path))
    loop = EngineLoop.build(FakeEngine, name="t-hook", timeout=10)
    try:
        (tmp_path / "hang.other-engine").touch()
        assert loop.call(lambda: 7, timeout=10) == 7
        (tmp_path / "hang.t-hook").touch()
        time.sleep(0.7)  # the idle wait ends within 0.5 s; the next turn then blocks
        fut = loop.submit(lambda: 8)
        time.sleep(0.5)
        assert not fut.done() and loop.stalled_ms() >= 400 and loop.idle_ms() >= 400
        (tmp_path / "hang.t-hook").unlink()
        assert fut.result(10) == 8
    finally:
        loop.stop()


def test_build_raises_what_the_factory_raised_and_leaves_no_thread():
    def broken():
        raise ValueError("model file not found: /nowhere")

    with pytest.raises(ValueError, match="/nowhere"):
        EngineLoop.build(broken, name="t-broken", timeout=10)
    for t in [t for t in threading.enumerate() if t.name == "t-broken"]:
        t.join(5)
        assert not t.is_alive()


def test_take_step_trace_returns_the_records_once():
    engine = FakeEngine()
    engine.step_trace = deque([1, 2, 3])
    loop = EngineLoop(engine).start()
    try:
        assert loop.take_step_trace() == [1, 2, 3]
        assert loop.take_step_trace() == []
    finally:
        loop.stop()


class BrokenEngine(FakeEngine):
    """Its steps fail, as when a tensor-parallel or pipeline rank died (gloo: "Connection closed
    by peer")."""

    def __init__(self):
        super().__init__()
        self.requests, self.aborted = set(), []

    def add_request(self, request_id, *args, **kwargs):
        self.requests.add(request_id)
        self.scheduler.waiting.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        raise RuntimeError("Connection closed by peer")

    def abort(self, request_id):
        self.aborted.append(request_id)
        self.requests.discard(request_id)
        self.scheduler.waiting.remove(request_id)
        return True


def test_a_failed_step_ends_each_request_at_once_with_the_error():
    loop = EngineLoop.build(BrokenEngine, name="t-broken", timeout=10)
    try:
        got = []
        done = threading.Event()

        def on_output(out):
            got.append(out)
            done.set()

        loop.add_request("r1", [1, 2, 3], None, on_output)
        assert done.wait(5), "the caller never heard of the failed step"
        [out] = got
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert out.outputs[0].stop_reason == "engine step failed: Connection closed by peer"
        assert loop.call(lambda: loop.engine.aborted) == ["r1"]
    finally:
        loop.stop()
