"""SamplingParams(prompt_logprobs=k): each prompt token's logprob given the tokens before it, and
the k most likely tokens there, equal HF's log-softmax of the same positions; with chunked
prefill and over a prefix-cache hit (which such requests skip). Across TP ranks:
tests/integration/test_engine_prompt_logprobs_tp.py."""

from __future__ import annotations

import pytest

from helpers.engine import KV
from helpers.prompt_logprobs import check
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("chunk", [16, 512])
def test_prompt_logprobs_match_hf(refs, chunk):
    model_dir, hf, prompts, _ = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV, max_num_batched_tokens=chunk)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate([prompts[4], prompts[1]], params, use_tqdm=False)  # 40 and 5 tokens
    for out, prompt in zip(outs, [prompts[4], prompts[1]]):
        check(out, hf, prompt, 3)
    # zero alternatives: the prompt token's own logprob only; none asked: no list at all
    only = llm.generate(
        prompts[2], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    assert all(e is None or len(e) == 1 for e in only.prompt_logprobs)
    assert (
        llm.generate(prompts[2], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs
        is None
    )
    assert_no_leaks(llm.engine)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(refs):
    model_dir, hf, prompts, _ = refs("llama-gqa")
    shared = prompts[-1]  # the last prompts share a 48-token prefix
    llm = LLM(model_dir, kv_cache_memory=KV)
    llm.generate(prompts[-2], SamplingParams(max_tokens=1), use_tqdm=False)
    warm = llm.generate(shared, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert warm.num_cached_tokens > 0  # a plain request hits the cache
    out = llm.generate(shared, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check(out, hf, shared, 2)


@pytest.mark.parametrize("bad", [-2, 21, 2.5, "3"])  # (-1: the whole vocabulary, as vLLM)
def test_prompt_logprobs_out_of_range_is_refused(bad):
    with pytest.raises((ValueError, TypeError), match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
