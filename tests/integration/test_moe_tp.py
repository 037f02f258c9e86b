"""Mixture-of-experts under tensor parallelism (two ranks, gloo) on models whose experts move the
logits enough that a missing or doubled reduction of the experts' partial sums changes the greedy
tokens (at tests/arch_helpers.py's default weight scale a missing all_reduce after Qwen2-MoE's
sparse block still gave HF's tokens); and the experts quantized on each rank's shard."""

from __future__ import annotations

import pytest

from arch_helpers import arch_prompts, build_arch_model
from conftest import assert_no_leaks, hf_greedy
from engine_helpers import KV, greedy, needs_x86_int8, prompt_logprob_diff
from pdserve.engine import LLM

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 32


@pytest.mark.parametrize("kind", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_tp2_moe_matches_hf(tmp_path, kind):
    hf = build_arch_model(tmp_path, kind, initializer_range=0.1)
    prompts = [p for i, p in enumerate(arch_prompts()) if i in (1, 3, 6)]
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    llm = LLM(
        str(tmp_path),
        tensor_parallel_size=2,
        kv_cache_memory=KV,
        block_size=16,
        max_num_batched_tokens=64,
    )
    try:
        outs = llm.generate(prompts, greedy(NEW), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


@needs_x86_int8
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tp2_quantized_experts_stay_near_float32(tmp_path, mode):
    """Each rank quantizes its shard of every expert (and of the shared expert): prompt logprobs
    within tests/unit/test_architectures.py's bounds of one float32 rank."""
    build_arch_model(tmp_path, "qwen2-moe")
    ref = LLM(str(tmp_path), dtype="float32", kv_cache_memory=KV)
    llm = LLM(str(tmp_path), quantization=mode, tensor_parallel_size=2, kv_cache_memory=KV)
    try:
        for p in arch_prompts()[2:5]:
            diff = prompt_logprob_diff(ref, llm, p)
            assert diff < (0.05 if mode == "int8" else 0.25), (p, diff)
    finally:
        ref.shutdown()
        llm.shutdown()
