"""Peer fetch in this process (no sockets): the block manager installing fetched blocks, the checks a
fetched block passes (kvtransfer/peer.py), a prefill engine pulling a conversation's earlier turns
from another engine that holds them (prefill_worker/peer_fetch.py, its DecodeWorker.FetchKV stub
replaced by one reading the holder's reservation in this process), and the router's choice
(router/peer_fetch.py).

Greedy tokens are identical with the fetch and without; a corrupted block (bytes, hash, layout) is
refused and its tokens computed; a holder that dies mid-fetch leaves what arrived installed and the
rest computed, the prompt served all the same."""

from __future__ import annotations

from concurrent.futures import Future

import grpc
import pytest

from helpers.engine import KV, greedy
from helpers.models import random_prompts
from pdserve.engine import LLM
from pdserve.engine.block_manager import BlockManager, block_hash
from pdserve.kvtransfer.peer import (
    block_nbytes,
    check_block,
    check_state,
    digest,
    hash_bytes,
    read_block,
)
from pdserve.prefill_worker.peer_fetch import PeerFetcher, check_spec
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.router.peer_fetch import PeerFetch, PeerFetchCost
from pdserve.worker_common.kv_events import engine_fingerprint

pytestmark = pytest.mark.usefixtures("one_thread")
BS = 16


# ---- the block manager ----------------------------------------------------------------------
def chain(tokens, n, bs=4):
    out, parent = [], None
    for i in range(n):
        parent = block_hash(parent, tuple(tokens[i * bs : (i + 1) * bs]))
        out.append(parent)
    return out


def test_installed_blocks_are_prefix_hits_counted_as_peer():
    bm = BlockManager(8, 4)
    tokens = list(range(100, 117))  # 4 full blocks and one token
    written = []
    n = bm.install_fetched(tokens, 0, chain(tokens, 3), lambda i, b: written.append((i, b)))
    assert n == 3 and [i for i, _ in written] == [0, 1, 2]
    found = bm.find_cached_prefix(tokens, 16)
    assert found == [b for _, b in written]
    bm.take(found)
    bm.count_hits(found)
    assert bm.hit_tokens_peer == 12 and bm.hit_tokens_device == 0
    bm.free(found)
    bm.check_consistency()
    assert bm.num_free_blocks == 8  # installed blocks are cached and free, not held


def test_installed_blocks_continue_each_other_in_memory_where_they_are_free():
    """Each fetched block continues the run of the one before it (BlockManager.allocate's
    `after`), not the free queue's order, so the decode kernel reads the prefix in one run."""
    bm = BlockManager(16, 4)
    order = [b for pair in zip(range(8), range(8, 16)) for b in pair]  # 0, 8, 1, 9, ...
    taken = bm.allocate(16)
    bm.free(order[::-1])  # the queue is `order` (free gives a table back tail first)
    assert len(taken) == 16 and list(bm._free)[:4] == [0, 8, 1, 9]
    tokens = list(range(100, 117))
    written = []
    assert bm.install_fetched(tokens, 0, chain(tokens, 3), lambda i, b: written.append(b)) == 3
    assert written == [0, 1, 2]  # in the queue's order: 0, 8, 1
    bm.check_consistency()


def test_install_stops_at_a_hash_the_tokens_do_not_give_and_needs_the_chain_before():
    bm = BlockManager(8, 4)
    tokens = list(range(100, 117))
    hashes = chain(tokens, 3)
    hashes[1] ^= 1  # not the chain's hash at block 1
    assert bm.install_fetched(tokens, 0, hashes, lambda i, b: None) == 1
    # blocks after one this manager does not hold: nothing (the chain would have a hole)
    other = list(range(200, 217))
    assert bm.install_fetched(other, 1, chain(other, 3)[1:], lambda i, b: None) == 0
    bm.check_consistency()


# ---- the checks -----------------------------------------------------------------------------
def block_msg(h: int, data: bytes, fp: str = "ab", index: int = 0) -> worker_pb2.FetchKVBlock:
    key = hash_bytes(h)
    return worker_pb2.FetchKVBlock(
        index=index, block_hash=key, data=data, digest=digest(key, data), layout_fingerprint=fp
    )


def test_check_block_refuses_each_mismatch():
    good = block_msg(7, b"x" * 8)
    assert check_block(good, 7, "ab", 8) == ""
    assert "fingerprint" in check_block(good, 7, "cd", 8)
    assert "hash" in check_block(good, 8, "ab", 8)
    assert "bytes where" in check_block(good, 7, "ab", 9)
    bad = block_msg(7, b"x" * 8)
    bad.data = b"x" * 7 + b"y"  # changed on the way: the digest no longer matches
    assert "digest" in check_block(bad, 7, "ab", 8)


def test_check_state_refuses_a_state_of_another_size_or_changed():
    """A hybrid's state on the last fetched block: exactly one whole-model state's bytes, under
    its own digest."""
    block = block_msg(7, b"x" * 8)
    block.state = b"s" * 12
    block.state_digest = digest(block.block_hash, block.state)
    assert check_state(block, 12) == ""
    assert "bytes where one has 16" in check_state(block, 16)
    block.state = b"s" * 11 + b"t"
    assert "digest" in check_state(block, 12)


def test_check_spec_bounds_every_field():
    ok = worker_pb2.PeerFetch(address="h:1", max_blocks=4, max_bytes=1, timeout_ms=10)
    assert check_spec(ok) == ""
    for field, value in (("address", ""), ("max_blocks", 0), ("max_bytes", 0), ("timeout_ms", 0)):
        spec = worker_pb2.PeerFetch()
        spec.CopyFrom(ok)
        setattr(spec, field, value)
        assert field in check_spec(spec)


# ---- an engine pulling from another ---------------------------------------------------------
class InlineLoop:
    """The EngineLoop calls PeerFetcher makes, run on this thread."""

    def __init__(self, engine):
        self.engine = engine

    def call(self, fn, *args, timeout=None):
        return fn(*args)

    def submit(self, fn, *args):
        done = Future()
        done.set_result(fn(*args))
        return done


class Stream:
    def __init__(self, blocks):
        self._it = iter(blocks)
        self.cancelled = False

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._it)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class Dead(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the holder died"


class HolderStub:
    """DecodeWorker.FetchKV as the holder engine serves it: its reservation's cached blocks.
    tamper(index, message) may change a block on the way; die_after: the stream fails then."""

    def __init__(self, engine, reservation, tamper=None, die_after=None):
        self.engine, self.res = engine, reservation
        self.tamper, self.die_after = tamper, die_after
        self.calls = []

    def FetchKV(self, request, timeout=None):
        self.calls.append(request)
        bm, caches = self.engine.block_manager, self.engine.rank_kv_caches()
        fp = engine_fingerprint(self.engine)
        out = []
        for i in range(request.first_block, request.first_block + request.num_blocks):
            if self.die_after is not None and len(out) == self.die_after:
                out.append(Dead())
                break
            block_id = self.res.block_ids[i]
            msg = block_msg(bm.blocks[block_id].hash, read_block(caches, block_id), fp, i)
            if self.tamper:
                self.tamper(i, msg)
            out.append(msg)
        return Stream(out)


@pytest.fixture(scope="module")
def turn(tiny_models):
    """A holder engine that served turn 1 and holds turn 2's reservation (as a decode worker
    would), turn 2's prompt, and the greedy answer a fresh engine gives it."""
    model_dir, _ = tiny_models("llama-gqa")
    first, message = random_prompts([70, 10], seed=41)
    holder = LLM(model_dir, kv_cache_memory=KV, block_size=BS)
    (out,) = holder.generate([first], greedy(40), use_tqdm=False)
    prompt = first + out.outputs[0].token_ids + message
    res = holder.engine.reserve("turn-2", prompt, greedy(8))
    assert res.num_cached_tokens >= 96  # the first turn, prompt and answer, but its last token
    fresh = LLM(model_dir, kv_cache_memory=KV, block_size=BS)
    (want,) = fresh.generate([prompt], greedy(8), use_tqdm=False)
    return model_dir, holder, res, prompt, want.outputs[0].token_ids


def fetch_then_generate(turn, **stub):
    model_dir, holder, res, prompt, _ = turn
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=BS)
    engine = llm.engine
    fetcher = PeerFetcher(InlineLoop(engine), engine.rank_kv_caches())
    fake = HolderStub(holder.engine, res, **stub)
    fetcher._stub = lambda address: fake
    request = worker_pb2.PrefillRequest(
        request_id="turn-2",
        prompt_token_ids=prompt,
        reservation=worker_pb2.ReserveResponse(
            block_ids=res.block_ids, block_size=BS, num_cached_tokens=res.num_cached_tokens
        ),
        peer_fetch=worker_pb2.PeerFetch(
            address="d:1", max_blocks=64, max_bytes=1 << 30, timeout_ms=5000
        ),
    )
    result = fetcher.fetch(request, None, deadline=float("inf")).settle()
    (out,) = llm.generate([prompt], greedy(8), use_tqdm=False)
    return result, out, engine.block_manager, fake


def test_greedy_tokens_are_identical_with_the_fetch(turn):
    *_, res, prompt, want = turn
    result, out, bm, fake = fetch_then_generate(turn)
    held = res.num_cached_tokens // BS * BS
    assert result.tokens == held and not result.refused and not result.failed
    assert result.bytes == held // BS * block_nbytes([turn[1].engine.kv_cache])
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == held  # nothing of the fetched prefix recomputed
    assert bm.hit_tokens_peer == held and bm.hit_tokens_device == 0


def test_a_corrupted_block_is_refused_and_computed(turn):
    *_, want = turn

    def flip_a_byte(index, msg):
        if index == 2:
            data = bytearray(msg.data)
            data[100] ^= 0xFF
            msg.data = bytes(data)

    result, out, bm, fake = fetch_then_generate(turn, tamper=flip_a_byte)
    assert result.refused == 1 and result.tokens == 2 * BS  # blocks 0 and 1 only
    assert out.outputs[0].token_ids == want
    assert bm.hit_tokens_peer == 2 * BS


def test_a_block_under_another_hash_is_refused(turn):
    *_, want = turn

    def rehash(index, msg):  # a block of other tokens, digest recomputed to match
        if index == 0:
            msg.block_hash = hash_bytes(12345)
            msg.digest = digest(msg.block_hash, msg.data)

    result, out, bm, _ = fetch_then_generate(turn, tamper=rehash)
    assert result.refused == 1 and result.tokens == 0
    assert out.outputs[0].token_ids == want and bm.hit_tokens_peer == 0


def test_the_holder_dying_mid_fetch_leaves_the_rest_computed(turn):
    *_, want = turn
    result, out, bm, _ = fetch_then_generate(turn, die_after=3)
    assert "UNAVAILABLE" in result.failed and result.tokens == 3 * BS
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == 3 * BS and bm.hit_tokens_peer == 3 * BS


def test_nothing_is_fetched_that_the_prefill_engine_holds(turn):
    model_dir, holder, res, prompt, want = turn
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=BS)
    llm.generate([prompt[:40]], greedy(1), use_tqdm=False)  # holds the first 2 blocks
    fetcher = PeerFetcher(InlineLoop(llm.engine), llm.engine.rank_kv_caches())
    fake = HolderStub(holder.engine, res)
    fetcher._stub = lambda address: fake
    request = worker_pb2.PrefillRequest(
        request_id="turn-2",
        prompt_token_ids=prompt,
        reservation=worker_pb2.ReserveResponse(
            block_ids=res.block_ids, block_size=BS, num_cached_tokens=res.num_cached_tokens
        ),
        peer_fetch=worker_pb2.PeerFetch(
            address="d:1", max_blocks=2, max_bytes=1 << 30, timeout_ms=9
        ),
    )
    result = fetcher.fetch(request, None, deadline=float("inf")).settle()
    assert fake.calls[0].first_block == 2 and fake.calls[0].num_blocks == 2  # max_blocks
    assert result.tokens == 2 * BS
    (out,) = llm.generate([prompt], greedy(8), use_tqdm=False)
    assert out.outputs[0].token_ids == want and out.num_cached_tokens == 4 * BS


# ---- the router's choice --------------------------------------------------------------------
def reply(prompt, cached, bytes_sent, compute_s, fetch_bytes=0, fetch_s=0.0):
    return worker_pb2.PrefillResponse(
        num_cached_tokens=cached,
        bytes_sent=bytes_sent,
        peer_fetch_bytes=fetch_bytes,
        peer_fetch_seconds=fetch_s,
        timings=pdserve_pb2.Timings(
            prefill_start_unix_ns=1, prefill_end_unix_ns=1 + int(compute_s * 1e9)
        ),
    )


def test_the_router_fetches_when_cheaper_and_recomputes_when_not():
    res = worker_pb2.ReserveResponse(block_size=16, num_cached_tokens=512)
    cost = PeerFetchCost(PeerFetch(min_tokens=32))
    # not measured yet: fetch (bounded, and its reply measures it)
    assert cost.choose(600, res, 0)[0]
    # the decode worker holds too little to be worth asking
    small = worker_pb2.ReserveResponse(block_size=16, num_cached_tokens=16)
    assert not cost.choose(600, small, 0)[0]
    # the affinity view says the prefill worker holds it: asked all the same (a guess; the
    # prefill worker pulls only what it lacks)
    fetch, why = cost.choose(600, res, 500)
    assert fetch and why["pdserve.peer_fetch_gain_tokens"] == 12
    # 1 kB a token, 1000 tokens/s: 512 tokens recompute in 0.5 s
    cost.observe(1000, worker_pb2.ReserveResponse(), reply(1000, 0, 1_000_000, 1.0))
    assert cost.choose(600, res, 0, handoff_bytes_per_s=1e9)[0]  # 0.5 ms to fetch
    fetch, why = cost.choose(600, res, 0, handoff_bytes_per_s=1e5)  # 5 s to fetch
    assert not fetch and why["pdserve.peer_fetch_est_s"] > why["pdserve.peer_fetch_recompute_est_s"]
    # a measured fetch replaces the hand-off's bandwidth
    cost.observe(1000, worker_pb2.ReserveResponse(), reply(1000, 0, 1_000_000, 1.0, 10**9, 1.0))
    assert cost.choose(600, res, 0, handoff_bytes_per_s=1e5)[0]
    assert not PeerFetchCost(PeerFetch(enabled=False)).choose(600, res, 0)[0]
    with pytest.raises(ValueError, match="max_blocks"):
        PeerFetch(max_blocks=0)


# ---- the deployment's key ----------------------------------------------------------------------
def test_the_yaml_key_reaches_the_router_and_needs_both_prefix_caches(tmp_path):
    from helpers.deploy_config import error_of, write
    from pdserve.deploy.config.load import load_config
    from pdserve.deploy.launcher import _peer_fetch

    on = load_config(write(tmp_path, "router:\n  peer_fetch: {max_blocks: 64, timeout_s: 2}\n"))
    assert _peer_fetch(on) == PeerFetch(max_blocks=64, timeout_s=2.0)
    off = load_config(
        write(tmp_path, "pools:\n  prefill:\n    enable_prefix_caching: false\n", "off.yaml")
    )
    assert not _peer_fetch(off).enabled
    bad = error_of(write(tmp_path, "router:\n  peer_fetch: {max_blocks: 0}\n", "bad.yaml"))
    assert "router.peer_fetch.max_blocks" in bad


# ---- the legs: which path, in the trace --------------------------------------------------------
class FakePool:
    def handoff_bandwidth(self):
        return 0.0

    def on_drop(self, listener):
        pass


class FakeSpan:
    def __init__(self):
        self.events = []

    def add_event(self, name, attributes=None):
        self.events.append((name, dict(attributes or {})))


class FakeWorker:
    address = "10.0.0.7:5000"


def test_a_leg_asks_for_a_fetch_says_so_and_counts_the_path():
    from pdserve.router.legs import Inflight, Leg, Legs

    legs = Legs(pool=FakePool(), executor=None, options=None)
    paths = []
    legs.on_reuse_path = lambda path, reply: paths.append(path)
    req, leg = Inflight("r"), Leg(1)
    req.span = FakeSpan()
    leg.decode = FakeWorker()
    prompt = list(range(300))
    # the decode worker holds nothing: no fetch, nothing said
    leg.reservation = worker_pb2.ReserveResponse(block_size=16, num_cached_tokens=0)
    assert legs._fetch_for(req, leg, prompt, 0) is None and not req.span.events
    # it holds 256 tokens: a fetch from its address, within the settings' bounds
    leg.reservation = worker_pb2.ReserveResponse(block_size=16, num_cached_tokens=256)
    fetch = legs._fetch_for(req, leg, prompt, 64)
    assert fetch.address == FakeWorker.address and fetch.max_blocks == PeerFetch().max_blocks
    assert req.span.events[-1][0] == "peer_fetch"
    assert req.span.events[-1][1]["pdserve.peer_fetch_gain_tokens"] == 192
    # measured slower than recomputing: recompute, said and counted
    legs.peer_fetch.observe(1000, worker_pb2.ReserveResponse(), reply(1000, 0, 10**6, 1.0))
    legs.peer_fetch.fetch_bytes_per_s = 1e4  # 1 kB a token at 10 kB/s: far slower
    assert legs._fetch_for(req, leg, prompt, 64) is None
    assert req.span.events[-1][0] == "recompute" and paths == ["recompute"]
    legs.close()
