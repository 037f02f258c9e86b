"""A burst of requests spreads over the decode workers (router/pool.py decode_order, router/legs.py
_reserve_once), with fake workers and no sockets.

The case from issue #47's interrupted flips (benchmarks/robustness/flips.py --interrupt): the
background streams had just ended, the pool's last view of one decode worker still counted
their KV blocks (a sweep old: the worker itself had freed them), and 16 streams arrived at once.
Every pick was made before the first Reserve answered, and only an answered Reserve raised a
worker's count, so all 16 went to the other worker. A pick now charges the prompt's blocks to
the worker it chose until its Reserve ends.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pdserve.planner.local_prefill import LocalPrefill
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.router.decode_queue import DecodeFull
from pdserve.router.legs import Inflight, Leg, Legs
from pdserve.router.pool import WorkerPool, _Worker
from pdserve.router.service import ServiceOptions

BURST = 16
PROMPT = list(range(2, 34))  # 32 tokens: two blocks of 16


class Answer:
    """A Stats or Reserve call that ends when `gate` opens (at once for Stats)."""

    def __init__(self, value, gate: threading.Event | None = None):
        self.value, self.gate = value, gate

    def done(self):
        return self.gate is None or self.gate.is_set()

    def result(self, timeout=None):
        if self.gate is not None and not self.gate.wait(10):
            raise AssertionError("the burst's Reserves were never all sent")
        return self.value

    def cancel(self):
        pass


class FakeDecode:
    """A decode worker's stub: Stats says `used` of 128 blocks are in use; every Reserve is
    answered once the whole burst has sent its Reserves (so that every pick happens first)."""

    def __init__(self, name: str, used: int, burst):
        self.name, self.used, self.burst = name, used, burst
        self.reserves = 0
        self.Stats = self.Reserve = self

    def future(self, request, timeout=None):
        if isinstance(request, worker_pb2.StatsRequest):
            return Answer(
                worker_pb2.WorkerStats(
                    worker_id=self.name,
                    num_total_blocks=128,
                    num_free_blocks=128 - self.used,
                    block_size=16,
                )
            )
        self.reserves += 1
        self.burst.sent()
        blocks = -(-len(request.prompt_token_ids) // 16)
        return Answer(
            worker_pb2.ReserveResponse(block_ids=list(range(blocks)), block_size=16),
            self.burst.all_sent,
        )


class Burst:
    def __init__(self, n: int):
        self.n, self.lock, self.all_sent = n, threading.Lock(), threading.Event()

    def sent(self):
        with self.lock:
            self.n -= 1
            if self.n == 0:
                self.all_sent.set()


class FakePool(WorkerPool):
    fakes: dict = {}

    def _connect(self, role, address, **fields):
        fields.setdefault("heard_at", self._clock())
        return _Worker(role, address, None, self.fakes[address], **fields)

    def close(self):
        pass


def burst_over(used: dict[str, int], registers: str = "") -> tuple[dict[str, int], WorkerPool]:
    """BURST disaggregated Reserves at once on decode workers whose last Stats showed `used`
    blocks in use, and on `registers`, a worker that registers after that Stats sweep (its
    blocks unknown): the Reserves each worker got, and the pool."""
    burst = Burst(BURST)
    FakePool.fakes = {name: FakeDecode(name, n, burst) for name, n in used.items()}
    pool = FakePool([], list(used), clock=lambda: 1000.0)
    pool.sweep(wait_s=1.0)  # the view the burst picks on
    assert {w.address: w.num_used_blocks for w in pool.decode} == used
    if registers:
        FakePool.fakes[registers] = FakeDecode(registers, 0, burst)
        assert pool.register("decode", registers, registers).num_free_blocks == -1
    legs = Legs(pool, executor=None, options=ServiceOptions("m", 256, 256, "float32"))
    sampling = pdserve_pb2.SamplingParams(max_tokens=8)
    picked, errors = [], []

    def one(k):
        try:
            worker, _ = legs._reserve_once(
                Inflight(f"r{k}"), Leg(1), PROMPT, sampling, time.monotonic() + 30
            )
            picked.append(worker.address)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    legs.close()
    assert not errors, errors
    assert len(picked) == BURST
    return {name: fake.reserves for name, fake in FakePool.fakes.items()}, pool


def test_a_burst_spreads_over_a_worker_whose_view_still_counts_ended_streams():
    got, pool = burst_over({"d0": 6, "d1": 0})
    assert got["d0"] > 0 and got["d1"] > 0, got
    # the emptier worker first, until its charged blocks reach the other's: 6 blocks = 3 prompts
    # more, the rest alternating
    assert abs(got["d1"] - got["d0"] - 3) <= 1, got
    # every charge was released when its Reserve ended: only the answered Reserves count now
    assert all(w.reserving_tokens == 0 for w in pool.decode)
    assert {w.address: w.num_used_blocks for w in pool.decode} == {
        "d0": 6 + 2 * got["d0"],
        "d1": 2 * got["d1"],
    }


def test_a_burst_reaches_a_worker_that_registered_before_its_first_stats_answer():
    """A worker that resumes after a given-up flip registers again in its role, a new pool
    entry whose blocks are unknown until its first Stats answer; a burst sent then (as the
    chaos test sends it, once the worker converged) ranked it after every known worker."""
    got, _ = burst_over({"d0": 0}, registers="d1")
    assert got["d0"] > 0 and got["d1"] > 0, got
    assert abs(got["d0"] - got["d1"]) <= 1, got


def test_a_burst_over_equal_workers_splits_evenly():
    got, _ = burst_over({"d0": 0, "d1": 0})
    assert got == {"d0": BURST // 2, "d1": BURST // 2}, got


def test_a_refused_reserve_releases_its_charge():
    burst = Burst(1)
    fake = FakeDecode("d0", 0, burst)
    FakePool.fakes = {"d0": fake, "d1": FakeDecode("d1", 0, burst)}
    pool = FakePool([], ["d0", "d1"], clock=lambda: 1000.0)
    pool.sweep(wait_s=1.0)

    class Full(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self):
            return "full"

    class Refusing(Answer):
        def result(self, timeout=None):
            raise Full()

    refused = []

    def reserve(request, timeout=None):
        refused.append(request.request_id)
        return Refusing(None)

    for w in pool.decode:
        w.stub.Reserve = type("Stub", (), {"future": staticmethod(reserve)})
    legs = Legs(pool, executor=None, options=ServiceOptions("m", 256, 256, "float32"))
    with pytest.raises(DecodeFull):  # both were full
        legs._reserve_once(
            Inflight("r"), Leg(1), PROMPT, pdserve_pb2.SamplingParams(), time.monotonic() + 5
        )
    legs.close()
    assert len(refused) == 2
    assert all(w.reserving_tokens == 0 and w.num_used_blocks == 0 for w in pool.decode)


def two_workers(used: dict[str, int]) -> tuple[WorkerPool, Legs]:
    burst = Burst(1)
    FakePool.fakes = {name: FakeDecode(name, n, burst) for name, n in used.items()}
    pool = FakePool([], list(used), clock=lambda: 1000.0)
    pool.sweep(wait_s=1.0)
    return pool, Legs(pool, executor=None, options=ServiceOptions("m", 256, 256, "float32"))


def test_a_conversation_goes_back_to_the_decode_worker_that_holds_it():
    """A turn that extends what a decode worker holds (its earlier prompt and answer) goes there
    even when that worker has more blocks in use than the held blocks save elsewhere... but not
    when it is busier than that; every charge is released when the Reserve ends."""
    pool, legs = two_workers({"d0": 0, "d1": 4})
    d0, d1 = sorted(pool.decode, key=lambda w: w.address)
    earlier = list(range(100, 196))  # 96 tokens: 6 blocks of 16
    turn = earlier + list(range(300, 340))
    assert pool.decode_matches(turn) == {}
    pool.remember_decoded(d1, earlier)
    assert pool.decode_matches(turn) == {d1: 96}
    sampling = pdserve_pb2.SamplingParams(max_tokens=8)
    leg = Leg(1)
    leg.held = pool.decode_matches(turn)
    worker, _ = legs._reserve_once(Inflight("r"), leg, turn, sampling, time.monotonic() + 30)
    assert worker is d1  # 4 in use - 6 held < 0 in use on d0
    assert d1.reserving_tokens == 0 and d0.reserving_tokens == 0
    d1.num_used_blocks = 20  # now far busier than the 6 held blocks save
    leg = Leg(2)
    leg.held = pool.decode_matches(turn)
    worker, _ = legs._reserve_once(Inflight("r2"), leg, turn, sampling, time.monotonic() + 30)
    assert worker is d0
    legs.close()


def test_a_next_turn_sent_as_the_last_one_ends_goes_back_to_its_holder():
    """The pool's last Stats of the holder was taken while turn 1 streamed (its 10 blocks in
    use), and a poll asked before the stream ended answers after it, still counting them: the
    ended stream's blocks count free all the same, so turn 2, sent at once, goes back to the
    holder, where the stale count (10 in use - 8 or 9 held > 0 on an idle worker) sent it to the
    other (the peer-fetch test's flake on a loaded machine). A poll asked after the end is the
    worker's own count again."""
    pool, legs = two_workers({"d0": 10, "d1": 0})
    d0, d1 = sorted(pool.decode, key=lambda w: w.address)
    pool.sweep()  # a poll asked while turn 1 streams, answered only at the next sweep
    leg = Leg(1)
    leg.decode, leg.num_blocks = d0, 8  # its Reserve: 120 prompt tokens
    leg.reservation = worker_pb2.ReserveResponse(block_ids=list(range(8)), block_size=16)
    legs._note_freed(leg, decoded=40)
    assert (d0.num_used_blocks, d0.num_free_blocks) == (0, 128)
    FakePool.fakes["d0"].used = 0  # the worker freed them (into its prefix cache)
    pool.sweep()  # takes the answer asked before the end (10 in use), asks again
    assert (d0.num_used_blocks, d0.num_free_blocks) == (0, 128)
    turn = list(range(100, 272))  # turn 1's 160 tokens, 12 new
    pool.remember_decoded(d0, turn[:159])
    held = pool.decode_usable(turn)
    assert list(held) == [d0] and held[d0] >= 128  # less than the 10 blocks the stale count had
    assert pool.decode_order(matched=held)[0] is d0
    pool.sweep(wait_s=1.0)  # the answer asked after the end: nothing left to take off
    assert d0.ended == [] and (d0.num_used_blocks, d0.num_free_blocks) == (0, 128)
    legs.close()


def test_a_local_turn_charges_only_its_new_tokens_to_the_holder():
    pool, legs = two_workers({"d0": 0, "d1": 0})
    d0, d1 = sorted(pool.decode, key=lambda w: w.address)
    earlier = list(range(100, 164))  # 64 tokens
    turn = earlier + list(range(300, 310))
    pool.remember_decoded(d1, earlier)
    leg = Leg(1)
    leg.held, leg.local = pool.decode_matches(turn), True
    worker, _ = legs._reserve_once(
        Inflight("r"), leg, turn, pdserve_pb2.SamplingParams(), time.monotonic() + 30
    )
    assert worker is d1 and leg.charged_tokens == 10 == d1.queued_tokens
    assert pool.decode_backlog(d1) == 10 and d0.queued_tokens == 0
    legs.release_charge(leg)
    assert d1.queued_tokens == 0
    legs.close()


def test_what_a_decode_worker_holds_is_forgotten_when_it_dies_or_reregisters():
    pool, legs = two_workers({"d0": 0, "d1": 0})
    d0, d1 = sorted(pool.decode, key=lambda w: w.address)
    earlier = list(range(100, 164))
    pool.remember_decoded(d0, earlier)
    pool.remember_decoded(d1, earlier)
    assert pool.decode_matches(earlier) == {d0: 64, d1: 64}
    pool._dropped(d1, "silent")  # a restart behind the same address loses its cache
    assert pool.decode_matches(earlier) == {d0: 64}
    # Legs.remember records only where reuse is on (the decode pools keep a prefix cache)
    leg = Leg(1)
    leg.decode = d1
    legs.remember(leg, earlier)
    assert pool.decode_matches(earlier) == {d0: 64, d1: 64}
    legs.local_prefill = LocalPrefill(reuse_max_new_tokens=0)
    legs.remember(leg, earlier + list(range(400, 432)))
    assert pool.decode_matches(earlier + list(range(400, 432))) == {d0: 64, d1: 64}
    legs.close()
