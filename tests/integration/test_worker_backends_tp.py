"""Decode and prefill workers over every KV backend and across different TP sizes, in one process
over 127.0.0.1 (tensor-parallel ranks are spawned processes; at most one tensor-parallel worker per
process, which holds one default torch.distributed group): Reserve -> Prefill -> Stream gives the
engine's greedy tokens, one at a time and concurrently, and the decode pool ends fully free.

With TP, rank 0 of each worker reaches every rank's KV pool through shared files: the prefill side
sends each rank's heads, the decode side writes each frame into every rank it overlaps (and with
shm, the sender writes straight into each decode rank's pool).
"""

from __future__ import annotations

import pytest

from helpers.models import random_prompts
from helpers.threads import wait_until
from helpers.worker import GREEDY, BackendCluster, generate_concurrently
from pdserve.engine import LLM, SamplingParams
from pdserve.protos.convert import sampling_kwargs


@pytest.fixture(scope="module")
def expected(tiny_models):
    prompts = random_prompts([30, 7, 21, 45], seed=11)
    llm = LLM(tiny_models("llama-gqa")[0], kv_cache_memory=1 << 20)
    outs = llm.generate(prompts, SamplingParams(**sampling_kwargs(GREEDY)), use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "backend,prefill_tp,decode_tp",
    [("shm", 1, 1), ("torch", 1, 1), ("grpc", 2, 1), ("shm", 1, 2), ("torch", 2, 1)],
)
def test_backend_and_tp_mix_matches_engine(tiny_models, expected, backend, prefill_tp, decode_tp):
    prompts, want = expected
    cluster = BackendCluster(tiny_models("llama-gqa")[0], backend, prefill_tp, decode_tp)
    try:
        assert [cluster.generate(f"seq-{i}", p) for i, p in enumerate(prompts)] == want
        assert generate_concurrently(cluster, prompts) == want

        def idle():
            s = cluster.stats()
            return (
                s.num_free_blocks == s.num_total_blocks
                and s.num_reserved == 0
                and s.num_running == 0
            )

        wait_until(idle, 5, f"decode pool not back to idle: {cluster.stats()}")
    finally:
        cluster.stop()


@pytest.mark.parametrize("backend,prefill_tp,decode_tp", [("shm", 1, 1), ("grpc", 2, 1)])
def test_bf16_kv_cache_hands_off(tiny_models, backend, prefill_tp, decode_tp):
    """kv_cache_dtype="bfloat16" under float32 activations: the hand-off moves bf16 KV (half the
    bytes) and the cluster gives the engine's greedy tokens in the same mode."""
    model_dir = tiny_models("llama-gqa")[0]
    prompts = random_prompts([30, 7, 21], seed=12)
    llm = LLM(model_dir, kv_cache_memory=1 << 20, kv_cache_dtype="bfloat16")
    outs = llm.generate(prompts, SamplingParams(**sampling_kwargs(GREEDY)), use_tqdm=False)
    want = [o.outputs[0].token_ids for o in outs]
    llm.shutdown()
    cluster = BackendCluster(model_dir, backend, prefill_tp, decode_tp, kv_cache_dtype="bfloat16")
    try:
        assert [cluster.generate(f"seq-{i}", p) for i, p in enumerate(prompts)] == want
    finally:
        cluster.stop()
