"""The router's block index (router/kv_index.py) over real workers with a real eviction: a decode
worker with a small KV cache reports the blocks it stores and evicts with its Stats, so the router
sends a conversation's next turn back to it while it holds the earlier turns, and no longer once
they are evicted; and when the eviction happens between two polls (the router's view is stale),
the worker refuses the local prefill it was chosen for (min_cached_tokens) and the turn goes to
the prefill pool, with the engine's own tokens and no error (the stale-hint guard).

One DecodeWorker, one PrefillWorker and the Router in this process over 127.0.0.1."""

from __future__ import annotations

import pytest

from helpers.models import random_prompts
from helpers.router_cluster import GREEDY, MAX_MODEL_LEN, Cluster
from helpers.threads import leaves_no_threads, wait_until
from pdserve.engine import LLM, SamplingParams
from pdserve.protos.convert import sampling_kwargs


@pytest.fixture(scope="module")
def cluster(tiny_models, one_thread):
    with leaves_no_threads():
        c = Cluster(tiny_models("llama-gqa")[0])
        yield c
        c.stop()


def counter(cluster, name: str) -> float:
    return cluster.router.metrics_registry.get_sample_value(
        name, {"model_name": cluster.router.servicer.options.model_id}
    )


def transfers(cluster) -> int:
    return cluster.prefill.stats().kv_transfers


def held_by_worker(cluster, tokens: list[int]) -> int:
    """The leading tokens of `tokens` the decode worker's prefix cache holds (on its loop)."""
    engine = cluster.decode.loop.engine
    bm = engine.block_manager
    return cluster.decode.loop.call(
        lambda: len(bm.find_cached_prefix(tokens, len(tokens) - 1)) * bm.block_size
    )


def evict(cluster, tokens: list[int], seed: int) -> None:
    """Fresh prompts through the router until the decode worker holds nothing of `tokens`."""
    num_blocks = cluster.stats().num_total_blocks
    fresh = random_prompts([200] * (num_blocks // 12 + 4), seed=seed)
    for prompt in fresh:
        if held_by_worker(cluster, tokens) == 0:
            return
        cluster.generate(token_ids=prompt)
    assert held_by_worker(cluster, tokens) == 0, "the fresh prompts did not evict the turn"


def reference(tiny_models, prompt: list[int]) -> list[int]:
    llm = LLM(tiny_models("llama-gqa")[0], kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
    return list(
        llm.generate([prompt], SamplingParams(**sampling_kwargs(GREEDY)))[0].outputs[0].token_ids
    )


def test_the_index_follows_what_the_decode_worker_stores_and_evicts(cluster, tiny_models):
    pool = cluster.router.pool
    (worker,) = pool.decode
    turn1, message = random_prompts([40, 12], seed=51)
    answer = cluster.generate(token_ids=turn1)[0]
    turn2 = turn1 + answer + message
    held = held_by_worker(cluster, turn2)
    assert held >= 32
    # the worker's own events (not the router's record) say what it holds
    wait_until(lambda: pool.kv_index.synced(worker), 30, "the index never synced")
    wait_until(
        lambda: pool.kv_index.matched_tokens(turn2, {worker: 16}).get(worker) == held,
        30,
        "the index never learned the turn's blocks",
    )
    evict(cluster, turn2, seed=52)
    wait_until(
        lambda: pool.decode_matches(turn2).get(worker, 0) == 0,
        30,
        f"the index kept evicted blocks: {pool.decode_matches(turn2)}",
    )
    # the next turn goes to the prefill pool: no stale hint, the engine's own tokens
    before = transfers(cluster), counter(cluster, "pdserve:stale_cache_hints_total")
    assert cluster.generate(token_ids=turn2)[0] == reference(tiny_models, turn2)
    after = transfers(cluster), counter(cluster, "pdserve:stale_cache_hints_total")
    assert after == (before[0] + 1, before[1])


def test_an_eviction_between_polls_is_refused_and_served_by_the_prefill_pool(cluster, tiny_models):
    pool = cluster.router.pool
    (worker,) = pool.decode
    turn1, message = random_prompts([40, 12], seed=61)
    answer = cluster.generate(token_ids=turn1)[0]
    turn2 = turn1 + answer + message
    held = held_by_worker(cluster, turn2)
    wait_until(
        lambda: pool.decode_matches(turn2).get(worker) == held,
        30,
        "the index never learned the turn's blocks",
    )
    # the router stops polling (its view freezes here), then the worker evicts the turn
    pool._stop.set()
    pool._thread.join(30)
    assert not pool._thread.is_alive()
    evict(cluster, turn2, seed=62)
    assert pool.decode_matches(turn2).get(worker) == held  # the router's view is stale now
    local = counter(cluster, "pdserve:local_prefills_total")
    before = transfers(cluster), counter(cluster, "pdserve:stale_cache_hints_total")
    got, _, finish = cluster.generate(token_ids=turn2)
    assert got == reference(tiny_models, turn2)
    assert counter(cluster, "pdserve:local_prefills_total") == local + 1  # chosen for the reuse
    after = transfers(cluster), counter(cluster, "pdserve:stale_cache_hints_total")
    assert after == (before[0] + 1, before[1] + 1)  # refused, then the prefill pool served it
    assert finish.usage.cache_hits.decode_worker == 0
    # what the router believed of the worker went with the refusal: its index entries wait for
    # a resync from a snapshot (no poll runs here any more)
    assert not pool.kv_index.synced(worker)
