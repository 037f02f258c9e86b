"""Workers that hang rather than die: a stopped process keeps its connections open and answers
nothing, so no call on it fails by itself. The router must treat it as dead once its pool drops
it (router/open_legs.py): decode streams resume on another decode worker, and a pending prefill
is retried on another prefill worker, not failed with a deadline the client never set, whether
the pool dropped its worker for failed Stats or for an engine stuck past worker_stall_s. (A long
prefill that makes progress is never cut: tests/integration/test_router_long_prefill.py.)

Real workers and the router run in this process over 127.0.0.1 (as in
test_router_failover_workers.py). A hang is simulated by holding the worker's engine step and its
load report (what Stats answers from) on a gate, without stopping its gRPC server.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import grpc
import pytest

from helpers.hang import Streams, blocks_free, greedy, start_decode, start_prefill, stop_workers
from helpers.models import random_prompts
from helpers.router import start_router, stop_router
from helpers.threads import wait_until

HANG_WAIT_S = 30.0  # a hung worker's threads wait at most this long for the test to release them
# silent (no Stats answer, no heartbeat) 0.5 s: down; 1.2 s: dead, its calls resume elsewhere
FAST_HEALTH = dict(worker_down_s=0.5, worker_silence_s=1.2, heartbeat_ms=200)


class Hang:
    """Holds a worker's engine step (with `step`: it emits nothing) and its load report (with
    `stats`: its Stats calls time out) until `release()`; its gRPC server keeps accepting calls."""

    def __init__(self, worker, stats: bool = True, step: bool = True):
        self.gate = threading.Event()
        self.gate.set()
        self.hang_stats, self.hang_step = stats, step
        self.prompts = []  # requests added to the worker's engine
        loop = worker.loop
        step, load, add = loop.engine.step, loop.load, loop.add_request

        def held_step():
            if self.hang_step:
                self.gate.wait(HANG_WAIT_S)
            return step()

        def held_load():
            if self.hang_stats:
                self.gate.wait(HANG_WAIT_S)
            return load()

        def recorded_add(request_id, *args, **kwargs):
            self.prompts.append(request_id)
            return add(request_id, *args, **kwargs)

        loop.engine.step, loop.load, loop.add_request = held_step, held_load, recorded_add

    def start(self) -> None:
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()


def wait_freed(hangs, workers) -> None:
    """Releases the hung workers and waits until every worker freed every block."""
    for hang in hangs:
        hang.release()
    for w in workers:
        wait_until(lambda w=w: blocks_free(w), 10, f"{w.config.worker_id} still holds blocks")


@contextlib.contextmanager
def stopped_after(router, hangs, workers):
    """Releases the hangs, stops the router and the workers when the block ends."""
    try:
        yield
    finally:
        for hang in hangs:
            hang.release()
        stop_router(router)
        stop_workers(*workers)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([20, 24, 28, 32], seed=26)


@pytest.fixture(scope="module")
def want(model_dir, prompts):
    return greedy(model_dir, prompts)


def two_decode_workers(model_dir, prefill, how: str):
    """(router, [d0, d1]). swept: static workers, dead when their Stats polls go unanswered
    for worker_silence_s; heartbeats: registered workers, dropped when neither their heartbeats
    nor their Stats answer for that long; stalled: static workers whose Stats still answer, dead
    because they report their engine stuck in one step for worker_stall_s."""
    if how in ("swept", "stalled"):
        decodes = [start_decode(model_dir, "d0"), start_decode(model_dir, "d1")]
        addresses = [d.address for d in decodes]
        config = dict(FAST_HEALTH, worker_stall_s=1.0) if how == "stalled" else FAST_HEALTH
        return start_router(model_dir, [prefill.address], addresses, **config), decodes
    router = start_router(model_dir, [prefill.address], **FAST_HEALTH)
    decodes = [start_decode(model_dir, f"d{i}", router.address) for i in range(2)]
    wait_until(lambda: router.pool.num_workers("decode") == 2, 10, "both decode workers joined")
    return router, decodes


@pytest.mark.parametrize("how", ["swept", "heartbeats", "stalled"])
def test_streams_on_a_hung_decode_worker_resume_on_the_other_one(model_dir, prompts, want, how):
    prefill = start_prefill(model_dir, "p0")
    router, decodes = two_decode_workers(model_dir, prefill, how)
    hangs = [Hang(d, stats=how != "stalled") for d in decodes]
    with stopped_after(router, hangs, [prefill, *decodes]):
        streams = Streams(router, prompts)
        wait_until(lambda: all(len(ids) >= 2 for ids in streams.ids), 20, "every stream started")
        running = [len(d.loop.engine.scheduler.running) for d in decodes]
        victim = running.index(max(running))
        assert running[victim] >= 1
        hangs[victim].start()  # mid-stream: no token, no Stats answer, the process still there
        assert streams.join(20), "streams on the hung decode worker never finished"
        assert streams.errors == [None] * len(prompts)
        assert streams.ids == want  # every token once, in order: nothing from the hung worker
        survivor = decodes[1 - victim].config.worker_id
        for last, ids in zip(streams.last, want):
            assert last.finish.finish_reason == "length"
            assert last.finish.usage.completion_tokens == len(ids)
            assert last.finish.timings.decode_worker == survivor
        # it comes back: its cancelled streams and the reservations they held are freed
        wait_freed(hangs, [prefill, *decodes])


def test_a_decode_worker_that_streams_but_fails_its_stats_keeps_its_streams(
    model_dir, prompts, want, caplog
):
    """Failed Stats mark the worker down (no new requests), but it still sends tokens: it is busy
    or its Stats are lost, not hung, and its streams finish there, resumed nowhere."""
    prefill = start_prefill(model_dir, "p0")
    router, decodes = two_decode_workers(model_dir, prefill, "swept")
    hangs = [Hang(d, step=False) for d in decodes]
    with stopped_after(router, hangs, [prefill, *decodes]):
        streams = Streams(router, prompts)
        wait_until(lambda: all(len(ids) >= 2 for ids in streams.ids), 20, "every stream started")
        running = [len(d.loop.engine.scheduler.running) for d in decodes]
        slow = running.index(max(running))
        with caplog.at_level(logging.WARNING, logger="pdserve.router"):
            hangs[slow].start()
            wait_until(lambda: router.pool.decode[slow].down, 5, "the worker is marked down")
            assert streams.join(20)
        assert streams.errors == [None] * len(prompts) and streams.ids == want
        assert not any("resuming on another" in r.getMessage() for r in caplog.records)
        workers = [last.finish.timings.decode_worker for last in streams.last]
        assert workers.count(decodes[slow].config.worker_id) == running[slow]
        wait_freed(hangs, [prefill, *decodes])


def hung_prefill_cluster(model_dir, **router_config):
    """(router, [p0, p1], their Hangs, decode): two prefill workers, one decode worker."""
    prefills = [start_prefill(model_dir, "p0"), start_prefill(model_dir, "p1")]
    hangs = [Hang(p, stats=False) for p in prefills]
    decode = start_decode(model_dir, "d0")
    router = start_router(
        model_dir,
        [p.address for p in prefills],
        [decode.address],
        **FAST_HEALTH,
        **router_config,
    )
    # Timings name a prefill worker by the worker_id its first Stats told the router
    wait_until(lambda: router.pool.num_sweeps >= 1, 10, "the router's first health sweep")
    return router, prefills, hangs, decode


@pytest.mark.parametrize("how", ["dropped", "stalled"])
def test_a_prefill_on_a_hung_prefill_worker_is_retried_on_the_other_one(
    model_dir, prompts, want, how
):
    """dropped: the worker stops answering Stats too, so the pool marks it down and its pending
    prefill is cancelled; stalled: it still answers Stats, reporting its engine stuck in one step
    past worker_stall_s. Either way the request completes via the other prefill worker."""
    config = dict(worker_stall_s=1.0) if how == "stalled" else {}
    router, prefills, hangs, decode = hung_prefill_cluster(model_dir, **config)
    with stopped_after(router, hangs, [decode, *prefills]):
        hangs[0].start()  # p0 takes requests and never prefills them
        streams = Streams(router, prompts[:2])
        wait_until(lambda: hangs[0].prompts, 10, "a prefill reached the hung worker")
        if how == "dropped":
            hangs[0].hang_stats = True
        assert streams.join(15), "the prefill on the hung worker was never retried"
        assert streams.errors == [None, None]  # no DEADLINE_EXCEEDED: the client set no deadline
        assert streams.ids == want[:2]
        assert [last.finish.timings.prefill_worker for last in streams.last] == ["p1", "p1"]
        wait_freed(hangs, [decode, *prefills])


def test_a_reserve_on_a_hung_decode_worker_moves_to_the_other_one(model_dir, prompts, want):
    """Reserve runs on the worker's engine loop, so a hung engine never answers it. The pool's
    drop cancels it and the next decode worker takes the request; before, the client got
    DEADLINE_EXCEEDED after the Reserve timeout, and the worker kept what it reserved."""
    prefill = start_prefill(model_dir, "p0")
    router, decodes = two_decode_workers(model_dir, prefill, "swept")
    hangs = [Hang(d) for d in decodes]
    with stopped_after(router, hangs, [prefill, *decodes]):
        hangs[0].start()  # before any request: half the Reserves go to d0 until it is down
        streams = Streams(router, prompts)
        assert streams.join(8), "a Reserve on the hung worker was not moved within 8 s"
        assert streams.errors == [None] * len(prompts)
        assert streams.ids == want
        assert {last.finish.timings.decode_worker for last in streams.last} == {"d1"}
        wait_freed(hangs, [prefill, *decodes])


def test_a_prefill_on_the_only_prefill_worker_stalled_fails_unavailable(model_dir, prompts):
    """No other prefill worker: the retry would send the same leg id to the worker still running
    it (ALREADY_EXISTS, a second copy of the work); the call fails UNAVAILABLE, saying why."""
    prefill = start_prefill(model_dir, "p0")
    hang = Hang(prefill, stats=False)
    decode = start_decode(model_dir, "d0")
    router = start_router(
        model_dir, [prefill.address], [decode.address], worker_stall_s=1.0, **FAST_HEALTH
    )
    with stopped_after(router, [hang], [prefill, decode]):
        hang.start()
        streams = Streams(router, prompts[:1])
        assert streams.join(15)
        error = streams.errors[0]
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "prefill worker p0" in error.details(), error.details()
        assert len(hang.prompts) == 1  # sent once, not twice
        wait_freed([hang], [prefill, decode])
