"""EngineLoop: the engine is built and stepped on one thread; loads are read without it."""

import threading
import time
from collections import deque

import pytest

from pdserve.engine.engine_loop import EngineLoop


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


def test_a_turn_that_never_ends_shows_as_a_growing_stall_and_idle_as_none():
    """What WorkerStats.engine_stalled_ms reports: the router tells a hung engine by it."""
    loop = EngineLoop.build(FakeEngine, name="t-stall", timeout=10)
    gate = threading.Event()
    try:
        loop.submit(gate.wait, 30)  # a call that hangs the loop thread, as a stuck step would
        time.sleep(0.3)
        first = loop.stalled_ms()
        time.sleep(0.3)
        assert 250 <= first < loop.stalled_ms()
        gate.set()
        deadline = time.monotonic() + 10
        while loop.stalled_ms() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.stalled_ms() == 0
    finally:
        gate.set()
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
