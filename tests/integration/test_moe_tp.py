"""Mixture-of-experts experts quantized (int8, int4) on each tensor-parallel rank's shard (two
ranks, gloo), within the bounds of one rank. Their float32 tokens under TP=2 are
tests/integration/test_architectures_tp.py's, at weights where a missing all_reduce after the
sparse block changes them."""

from __future__ import annotations

import pytest

from helpers.arch import arch_prompts, build_arch_model
from helpers.engine import KV, needs_x86_int8, prompt_logprob_diff
from pdserve.engine import LLM

pytestmark = pytest.mark.usefixtures("one_thread")


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
