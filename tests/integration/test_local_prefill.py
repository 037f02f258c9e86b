"""Local prefill per request (planner/local_prefill.py) in a disaggregated deployment: a short
prompt runs on its decode worker (no Prefill call, no KV transfer) and streams the engine's own
greedy tokens; a prompt past max_prompt_tokens still goes through the prefill pool.

One DecodeWorker, one PrefillWorker and the Router in this process over 127.0.0.1."""

from __future__ import annotations

import pytest

from helpers.models import random_prompts
from helpers.router_cluster import GREEDY, MAX_MODEL_LEN, RPC_TIMEOUT, Cluster
from helpers.threads import leaves_no_threads
from pdserve.engine import LLM, SamplingParams
from pdserve.planner.local_prefill import LocalPrefill
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import worker_pb2


class LocalCluster(Cluster):
    """helpers.router_cluster.Cluster with local prefill for prompts of up to 16 tokens."""

    ROUTER_CONFIG = dict(local_prefill=LocalPrefill(max_prompt_tokens=16))


@pytest.fixture(scope="module")
def cluster(tiny_models, one_thread):
    with leaves_no_threads():
        c = LocalCluster(tiny_models("llama-gqa")[0])
        yield c
        c.stop()


def transfers(worker) -> int:
    return worker.stats().kv_transfers


def local_count(cluster) -> float:
    return cluster.router.metrics_registry.get_sample_value(
        "pdserve:local_prefills_total", {"model_name": cluster.router.servicer.options.model_id}
    )


def test_short_prompts_prefill_on_their_decode_worker_long_ones_on_the_pool(cluster, tiny_models):
    llm = LLM(tiny_models("llama-gqa")[0], kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
    short, long_ = random_prompts([9, 40], seed=41)
    want = [
        list(o.outputs[0].token_ids)
        for o in llm.generate([short, long_], SamplingParams(**sampling_kwargs(GREEDY)))
    ]
    before = transfers(cluster.prefill), local_count(cluster)
    assert cluster.generate(token_ids=short)[0] == want[0]
    assert (transfers(cluster.prefill), local_count(cluster)) == (before[0], before[1] + 1)
    assert cluster.generate(token_ids=long_)[0] == want[1]
    assert (transfers(cluster.prefill), local_count(cluster)) == (before[0] + 1, before[1] + 1)
    stats = cluster.d.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)
    assert stats.num_free_blocks == stats.num_total_blocks and not stats.num_reserved


def test_a_conversations_next_turn_runs_where_its_earlier_turns_are(cluster, tiny_models):
    """Turn 2 of a conversation (turn 1's prompt, its answer, a new message) goes back to the
    decode worker that served turn 1 and runs there: only its new tokens are computed, nothing
    is transferred, and the tokens are the engine's own for the whole prompt."""
    llm = LLM(tiny_models("llama-gqa")[0], kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
    turn1, message = random_prompts([40, 12], seed=43)
    params = SamplingParams(**sampling_kwargs(GREEDY))
    answer, _, first = cluster.generate(token_ids=turn1)
    assert first.usage.cache_hits.decode_worker == 0 == first.usage.cached_prompt_tokens
    turn2 = turn1 + answer + message
    want = list(llm.generate([turn2], params)[0].outputs[0].token_ids)
    before = transfers(cluster.prefill), local_count(cluster)
    got, _, finish = cluster.generate(token_ids=turn2)
    assert got == want
    assert (transfers(cluster.prefill), local_count(cluster)) == (before[0], before[1] + 1)
    # turn 1's prompt and all but the answer's last token were computed there: its full blocks
    block = cluster.stats().block_size
    held = (len(turn1) + len(answer) - 1) // block * block
    assert finish.usage.cache_hits.decode_worker == held == finish.usage.cached_prompt_tokens
    assert finish.usage.cache_hits.prefill_worker == 0 and finish.usage.kv_transfer_bytes == 0
    assert finish.timings.prefill_worker == ""
