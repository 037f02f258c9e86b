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


@pytest.fixture(scope="module", params=["llama-gqa", "qwen3.5"])
def cluster(request, tiny_models, tmp_path_factory, one_thread):
    """The cluster on a tiny Llama, and on a tiny Qwen3.5 (a hybrid: its decode worker's hit
    ends where it kept a recurrent state, which its KV events report to the router's index)."""
    if request.param == "qwen3.5":
        from helpers.arch import build_arch_model

        model_dir = tmp_path_factory.mktemp("hybrid") / "qwen3.5"
        build_arch_model(model_dir, "qwen3.5")
    else:
        model_dir = tiny_models(request.param)[0]
    with leaves_no_threads():
        c = LocalCluster(str(model_dir))
        c.model_dir, c.hybrid = str(model_dir), request.param == "qwen3.5"
        yield c
        c.stop()


def transfers(worker) -> int:
    return worker.stats().kv_transfers


def local_count(cluster) -> float:
    return cluster.router.metrics_registry.get_sample_value(
        "pdserve:local_prefills_total", {"model_name": cluster.router.servicer.options.model_id}
    )


def test_short_prompts_prefill_on_their_decode_worker_long_ones_on_the_pool(cluster, tiny_models):
    llm = LLM(cluster.model_dir, kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
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


def _counter(cluster, name: str) -> float:
    value = cluster.router.metrics_registry.get_sample_value(
        name, {"model_name": cluster.router.servicer.options.model_id}
    )
    return value or 0.0


@pytest.mark.parametrize("length", [44, 34])
def test_a_conversations_next_turn_runs_where_its_earlier_turns_are(cluster, length):
    """Turn 2 of a conversation (turn 1's prompt, its answer, a new message) goes back to the
    decode worker that served turn 1 and runs there: only its new tokens are computed, nothing
    is transferred, and the tokens are the engine's own for the whole prompt. On the hybrid,
    only where that worker kept a recurrent state: after a block boundary its decode passed (the
    state arrived with turn 1's KV at the prompt's end, mid-block). A 44-token prompt's 8-token
    answer passes 48; a 34-token prompt's passes none, so the hybrid's turn 2 goes through the
    prefill pool as it must (its decode worker holds turn 1's blocks, no state after them), and
    the router knew that beforehand (no Reserve refused: the worker's events say where its
    states are, and the router expected none there)."""
    llm = LLM(cluster.model_dir, kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
    turn1, message = random_prompts([length, 12], seed=length)
    params = SamplingParams(**sampling_kwargs(GREEDY))
    answer, _, first = cluster.generate(token_ids=turn1)
    assert first.usage.cache_hits.decode_worker == 0 == first.usage.cached_prompt_tokens
    turn2 = turn1 + answer + message
    want = list(llm.generate([turn2], params)[0].outputs[0].token_ids)
    stale = _counter(cluster, "pdserve:stale_cache_hints_total")
    before = transfers(cluster.prefill), local_count(cluster)
    got, _, finish = cluster.generate(token_ids=turn2)
    assert got == want
    assert _counter(cluster, "pdserve:stale_cache_hints_total") == stale
    # turn 1's prompt and all but the answer's last token were computed there: its full blocks
    block = cluster.stats().block_size
    held = (len(turn1) + len(answer) - 1) // block * block
    if cluster.hybrid and held <= len(turn1):
        assert local_count(cluster) == before[1] and transfers(cluster.prefill) > before[0]
        # (the prefill worker kept turn 1's state at its prompt's last boundary: a hit there)
        assert finish.usage.cache_hits.prefill_worker > 0
        return
    assert (transfers(cluster.prefill), local_count(cluster)) == (before[0], before[1] + 1)
    assert finish.usage.cache_hits.decode_worker == held == finish.usage.cached_prompt_tokens
    assert finish.usage.cache_hits.prefill_worker == 0 and finish.usage.kv_transfer_bytes == 0
    assert finish.timings.prefill_worker == ""
