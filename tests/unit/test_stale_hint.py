"""The stale-hint guard, both sides, with fakes and no sockets: a decode worker asked to prefill a
prompt for the cached prefix it is believed to hold (ReserveRequest.min_cached_tokens) refuses
FAILED_PRECONDITION before any work when it holds fewer (decode_worker/service.py), and the
router then sends the prompt to the prefill pool, counts it, and forgets what it believed of that
worker (router/legs.py). The same over real workers with a real eviction:
tests/integration/test_kv_index_eviction.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import grpc
import pytest

from pdserve.decode_worker.service import DecodeServiceOptions, DecodeWorkerServicer, _Stream
from pdserve.engine.block_manager import BlockManager
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.router.legs import Inflight, Legs
from pdserve.router.pool import WorkerPool, _Worker
from pdserve.router.service import ServiceOptions

BS = 4


# ---- the decode worker ------------------------------------------------------------------------
class Aborted(Exception):
    pass


class Context:
    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


class FakeLoop:
    """An engine loop whose calls run in place, over a real block manager."""

    def __init__(self, bm: BlockManager):
        self.added, self.watched = [], []
        self.engine = SimpleNamespace(
            block_manager=bm, add_request=lambda rid, prompt, params, **kw: self.added.append(rid)
        )

    def every(self, period, fn):
        pass

    def call(self, fn, *args, timeout=None):
        return fn(*args)

    def watch(self, rid, on_output):
        self.watched.append(rid)

    def add_request(self, rid, prompt, params, on_output, timeout=None, **kw):
        self.added.append(rid)


def servicer_holding(tokens: list[int]):
    bm = BlockManager(16, BS)
    ids = bm.allocate(bm.blocks_needed(len(tokens)))
    bm.register_full_blocks(ids, tokens, 0, len(tokens))
    bm.free(ids)
    loop = FakeLoop(bm)
    return DecodeWorkerServicer(loop, handoff=None, options=DecodeServiceOptions()), loop


def run_here(servicer, prompt, min_cached):
    request = worker_pb2.ReserveRequest(
        request_id="r1", prompt_token_ids=prompt, run_prefill=True, min_cached_tokens=min_cached
    )
    servicer._streams["r1"] = stream = _Stream()
    return servicer._run_here("r1", request, None, stream, Context())


def test_worker_refuses_before_any_work_when_it_holds_fewer_tokens():
    servicer, loop = servicer_holding(list(range(8)))  # holds two blocks
    prompt = list(range(20))
    with pytest.raises(Aborted, match="holds 8 of the 12 leading prompt tokens"):
        run_here(servicer, prompt, 12)
    assert loop.added == [] and "r1" not in servicer._streams and servicer.stale_hints == 1


def test_worker_takes_the_prompt_when_it_holds_what_was_expected():
    servicer, loop = servicer_holding(list(range(8)))
    answer = run_here(servicer, list(range(20)), 8)
    assert answer.block_size == BS and loop.added == ["r1"] and loop.watched == ["r1"]


def test_worker_never_expects_more_than_the_engine_would_take():
    # a prompt of exactly two blocks: the engine takes at most the first block from the cache
    # (its last token must be computed), so an expectation of 8 asks for 4
    servicer, loop = servicer_holding(list(range(8)))
    run_here(servicer, list(range(8)), 8)
    assert loop.added == ["r1"]


def test_no_expectation_no_check(monkeypatch):
    servicer, loop = servicer_holding([])
    bm = loop.engine.block_manager
    monkeypatch.setattr(bm, "held_prefix_tokens", lambda *a: pytest.fail("looked at the cache"))
    run_here(servicer, list(range(20)), 0)
    assert loop.added == ["r1"] and loop.watched == ["r1"]


# ---- the router -------------------------------------------------------------------------------
class Answer:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def done(self):
        return True

    def result(self, timeout=None):
        if self.error is not None:
            raise self.error
        return self.value

    def cancel(self):
        pass


class Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self):
        return "stale cache hint: this worker holds 0 of the 32 leading prompt tokens"


class FakeDecode:
    """A decode worker that evicted everything: it refuses any min_cached_tokens."""

    def __init__(self):
        self.reserves = []
        self.Stats = self.Reserve = self

    def future(self, request, timeout=None):
        if isinstance(request, worker_pb2.StatsRequest):
            return Answer(
                worker_pb2.WorkerStats(
                    worker_id="d0", num_total_blocks=64, num_free_blocks=64, block_size=16
                )
            )
        self.reserves.append(request)
        if request.min_cached_tokens:
            return Answer(error=Refused())
        return Answer(worker_pb2.ReserveResponse(block_ids=[1, 2, 3], block_size=16))

    def Streams(self, requests, timeout=None):
        return iter(())  # the legs here are never read


class FakePool(WorkerPool):
    fakes: dict = {}

    def _connect(self, role, address, **fields):
        fields.setdefault("heard_at", self._clock())
        return _Worker(role, address, None, self.fakes[address], **fields)

    def close(self):
        pass


class Executor:
    def __init__(self):
        self.submitted = []

    def submit(self, fn, *args):
        self.submitted.append(fn)
        return None


def legs_over(decode: FakeDecode):
    FakePool.fakes = {"d0": decode}
    pool = FakePool([], ["d0"], clock=lambda: 1000.0)
    pool.sweep(wait_s=1.0)
    legs = Legs(pool, Executor(), ServiceOptions("m", 256, 256, "float32"))
    stale = []
    legs.on_stale_hint = lambda: stale.append(1)
    return pool, legs, stale


PROMPT = list(range(2, 42))  # 40 tokens: a held turn of 32 and 8 new ones
OTHER = list(range(100, 164))
SAMPLING = pdserve_pb2.SamplingParams(max_tokens=4)


def test_router_falls_back_to_the_prefill_pool_on_a_stale_hint():
    decode = FakeDecode()
    pool, legs, stale = legs_over(decode)
    (d0,) = pool.decode
    pool.remember_decoded(d0, PROMPT[:32])  # the router believes d0 holds the first turn
    pool.remember_decoded(d0, OTHER)  # and another conversation's
    assert pool.decode_matches(PROMPT) == {d0: 32}
    leg = legs.start(Inflight("c1"), PROMPT, SAMPLING, time.monotonic() + 30, 1)
    first, second = decode.reserves
    assert first.run_prefill and first.min_cached_tokens == 32
    assert not second.run_prefill and second.min_cached_tokens == 0
    assert not leg.local and leg.decode is d0 and leg.reservation.block_ids == [1, 2, 3]
    assert len(legs.executor.submitted) == 1  # the prefill leg, on the prefill pool
    assert stale == [1]
    # what it believed of d0 went; what it sends d0 now (this prompt's KV) is remembered again
    assert pool.decode_matches(OTHER) == {}
    assert d0.queued_tokens == 0  # the local charge was released
    legs.close()


def test_router_sends_no_expectation_without_a_holder():
    decode = FakeDecode()
    pool, legs, stale = legs_over(decode)
    legs.start(Inflight("c1"), PROMPT, SAMPLING, time.monotonic() + 30, 1)
    (only,) = decode.reserves
    assert not only.run_prefill and only.min_cached_tokens == 0 and stale == []
    legs.close()
