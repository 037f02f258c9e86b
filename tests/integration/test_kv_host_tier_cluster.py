"""A decode worker with a host-memory tier (engine/kv_host_tier.py) behind the router, under
eviction pressure: chat sessions whose KV together is about twice the decode worker's KV cache,
their turns interleaved, so each session's earlier turns are evicted before its next one. The
tier serves the later turns (restores > 0, host hits), the router's block index knows what the
tier holds, every answer is the engine's own greedy answer, the tier stays within its cap, and
when the cluster is idle no block is in use; a reset then empties the tier too.

One DecodeWorker, one PrefillWorker and the Router in this process over 127.0.0.1."""

from __future__ import annotations

import grpc
import pytest

from helpers.models import random_prompts
from helpers.router_cluster import GREEDY, MAX_MODEL_LEN, RPC_TIMEOUT
from helpers.threads import leaves_no_threads, wait_until
from helpers.worker import start_decode, start_prefill, start_router, stop_all
from pdserve.engine import LLM, SamplingParams
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.router.kv_index import HOST

BS = 16
POOL_BLOCKS = 24  # 384 tokens
TIER_BLOCKS = 30  # fewer than the sessions' blocks together: the tier pushes out too
SESSIONS, TURNS = 4, 3


@pytest.fixture(scope="module")
def per_block(tiny_models, one_thread) -> int:
    llm = LLM(tiny_models("llama-gqa")[0], kv_cache_memory=1 << 20, block_size=BS)
    cache = llm.engine.kv_cache
    return cache[:, :, 0].numel() * cache.element_size()


@pytest.fixture(scope="module")
def cluster(tiny_models, per_block):
    model_dir = tiny_models("llama-gqa")[0]
    engine = dict(
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=POOL_BLOCKS * per_block,
        block_size=BS,
        kv_host_tier_bytes=TIER_BLOCKS * per_block,
    )
    with leaves_no_threads():
        decode = start_decode(model_dir, engine=engine, lease_ms=5000)
        prefill = start_prefill(model_dir, engine=dict(max_model_len=MAX_MODEL_LEN))
        router = start_router(
            model_dir, decode, prefill, max_model_len=MAX_MODEL_LEN, max_inflight=16
        )
        channels = [grpc.insecure_channel(a) for a in (router.address, decode.address)]
        yield (
            router,
            decode,
            pdserve_pb2_grpc.PDServeStub(channels[0]),
            worker_pb2_grpc.DecodeWorkerStub(channels[1]),
        )
        stop_all(channels, router, prefill, decode)


def generate(api, ids: list[int]):
    """(token ids, Finish) of one greedy request."""
    responses = list(
        api.Generate(
            pdserve_pb2.GenerateRequest(sampling=GREEDY, token_ids=pdserve_pb2.TokenIds(ids=ids)),
            timeout=RPC_TIMEOUT,
        )
    )
    tokens = [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]
    return tokens, responses[-1].finish


def test_the_tier_serves_later_turns_within_its_cap_and_leaks_nothing(
    cluster, tiny_models, per_block
):
    router, decode, api, d = cluster
    firsts = random_prompts([100, 110, 120, 105], seed=71)
    messages = random_prompts([12] * (SESSIONS * TURNS), seed=72)
    history = list(firsts)
    sent, answers, hits = [], [], []
    cap = TIER_BLOCKS * per_block
    for turn in range(TURNS):
        for s in range(SESSIONS):
            tokens, finish = generate(api, history[s])
            sent.append(list(history[s]))
            answers.append(tokens)
            hits.append((turn, finish.usage.cache_hits.decode_worker))
            assert d.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT).kv_host_tier_bytes <= cap
            history[s] = history[s] + tokens + messages[turn * SESSIONS + s]
    # every answer is the engine's own greedy answer to that prompt
    llm = LLM(tiny_models("llama-gqa")[0], kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
    want = llm.generate(sent, SamplingParams(**sampling_kwargs(GREEDY)), use_tqdm=False)
    assert answers == [w.outputs[0].token_ids for w in want]
    stats = d.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)
    assert stats.kv_host_tier_capacity_bytes == cap and stats.kv_host_tier_stored > 0
    assert stats.kv_host_tier_restored > 0 and stats.prefix_hit_tokens_host > 0
    tier = decode.loop.engine.block_manager.tier
    assert tier.peak_bytes <= cap
    # the later turns found their earlier turns' KV on the decode worker (restored from the tier)
    assert all(n > 0 for turn, n in hits if turn > 0), hits
    # the router's block index knows what the tier holds
    pool = router.pool
    (worker,) = pool.decode
    wait_until(
        lambda: any(HOST in {t for _, t in hs} for hs in pool.kv_index._holders.values()),
        30,
        "the index never learned of a host-tier block",
    )
    # and its /metrics shows the tier
    labels = {"model_name": router.servicer.options.model_id, "role": "decode"}
    registry = router.metrics_registry

    def sample(name, **more):
        return registry.get_sample_value(name, {**labels, "worker": pool.name(worker), **more})

    wait_until(
        lambda: (sample("pdserve:kv_host_tier_restored_blocks_total") or 0) > 0,
        30,
        "the router never exported the tier's restores",
    )
    assert sample("pdserve:kv_host_tier_capacity_bytes") == cap
    assert 0 < sample("pdserve:kv_host_tier_bytes") <= cap
    assert sample("pdserve:prefix_cache_hit_tokens_by_source_total", source="host") > 0
    # idle: no block in use; a reset then empties the tier as well
    wait_until(
        lambda: (
            (s := d.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)).num_free_blocks
            == s.num_total_blocks
            and s.num_reserved == s.num_running == s.num_waiting == 0
        ),
        30,
        "the decode worker is not idle",
    )
    bm = decode.loop.engine.block_manager
    assert decode.loop.call(bm.reset_prefix_cache)
    stats = d.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)
    assert stats.kv_host_tier_bytes == 0 and len(tier) == 0
