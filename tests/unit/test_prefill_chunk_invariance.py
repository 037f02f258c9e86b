"""A prompt gets the same logits, to the last bit, however it is cut into chunks: where the
compiled CPU kernel attends, every prompt token is one of its rows and a row's result depends on
its position and context only. Speculative decoding changes how much of a step's budget prompts
get, so without this the same greedy request could take another token with speculation on (a
near-tie): an SDPA call's shape changes its last bits, and int8's per-row activation scaling
turns those into whole quantization steps in the next layer. A bf16 cache adds its own rounding,
which a chunk must see for its own K/V as later chunks read them."""

from __future__ import annotations

import pytest
import torch

from helpers.engine import KV
from helpers.models import random_prompts
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention import decode_kernel

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompt_logprobs(model_dir, prompt, budget, quantization, kv_dtype):
    llm = LLM(
        model_dir,
        dtype="float32",
        quantization=quantization,
        kv_cache_dtype=kv_dtype,
        kv_cache_memory=KV,
        block_size=4,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
        speculative_config=None,
    )
    try:
        out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        llm.shutdown()
    return [None if d is None else next(iter(d.values())) for d in out[0].prompt_logprobs]


@pytest.mark.parametrize(
    "quantization,kv_dtype",
    [(None, "float32"), (None, "bfloat16"), ("int8", "float32"), ("int8", "bfloat16")],
)
def test_chunking_does_not_change_a_prompts_logits(tiny_models, quantization, kv_dtype):
    model_dir, hf = tiny_models()
    head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    kv = getattr(torch, kv_dtype)
    if decode_kernel(torch.device("cpu"), torch.float32, head_dim, kv) is None:
        pytest.skip("the compiled CPU kernel is not available here")
    prompt = random_prompts([90], seed=5)[0]
    whole = _prompt_logprobs(model_dir, prompt, 2048, quantization, kv_dtype)
    for budget in (16, 7):
        chunked = _prompt_logprobs(model_dir, prompt, budget, quantization, kv_dtype)
        assert chunked[1:] == whole[1:], f"budget {budget}"
