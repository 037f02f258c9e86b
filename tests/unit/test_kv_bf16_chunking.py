"""A bf16 KV cache under float32 activations gives a prompt the same logits however it is cut
into chunks: a chunk attends its own K/V rounded as the cache holds them, as the chunks after it
read them. Speculative decoding changes how much of a step's budget prompts get, so without this
the same greedy request could take another token with speculation on (a near-tie)."""

from __future__ import annotations

import pytest

from conftest import random_prompts
from engine_helpers import KV
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompt_logprobs(model_dir, prompt, budget):
    llm = LLM(
        model_dir,
        dtype="float32",
        kv_cache_dtype="bfloat16",
        kv_cache_memory=KV,
        block_size=4,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
    )
    try:
        out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        llm.shutdown()
    return [None if d is None else next(iter(d.values())) for d in out[0].prompt_logprobs]


def test_chunking_does_not_change_a_prompt_under_a_bf16_cache(tiny_models):
    model_dir, _ = tiny_models()
    prompt = random_prompts([90], seed=5)[0]
    whole = _prompt_logprobs(model_dir, prompt, 2048)
    chunked = _prompt_logprobs(model_dir, prompt, 16)
    assert chunked[1:] == pytest.approx(whole[1:], abs=1e-5)
