"""A quantized checkpoint under tensor parallelism: each of two ranks (gloo, one process each)
dequantizes the whole checkpoint as it loads and keeps its own shard, and the pair gives HF
transformers' greedy tokens on the dequantized weights (tests/helpers/prequantized.py), for
GPTQ with act-order (whose groups run across the inputs a row-parallel layer splits) and for
AWQ."""

from __future__ import annotations

import pytest

from helpers.arch import arch_prompts, build_arch_model
from helpers.models import hf_greedy
from helpers.prequantized import engine_greedy, quantized_copy

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 16


@pytest.mark.parametrize("fmt", ["gptq-actorder", "awq"])
def test_tp2_serves_hf_s_tokens_on_the_dequantized_weights(tmp_path, fmt):
    hf = build_arch_model(tmp_path / "float", "llama", initializer_range=0.1)
    ref = quantized_copy(tmp_path / "float", tmp_path / fmt, fmt, hf)
    prompts = arch_prompts()[:4]
    got = engine_greedy(tmp_path / fmt, prompts, NEW, tensor_parallel_size=2)
    assert got == [hf_greedy(ref, p, NEW) for p in prompts]
