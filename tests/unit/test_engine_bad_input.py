"""Input validation on tiny random models: bad requests and bad engine configs are refused with a
ValueError that names the field, nothing leaks, and the engine still serves afterwards."""

from __future__ import annotations

import pytest

from helpers.engine import KV, greedy, run_until_done
from helpers.models import hf_greedy, random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import (
    BadSamplingParams,
    DuplicateRequestId,
    InvalidRequest,
    PromptTooLong,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def small_llm(refs):
    model_dir, hf, *_ = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV, max_model_len=64, max_num_batched_tokens=32)
    prompt = random_prompts([30], seed=31)[0]
    return llm, prompt, hf_greedy(hf, prompt, 20)


BAD_REQUESTS = {
    "empty-str": (lambda: "", None, ("prompt", "non-empty")),
    "empty-list": (lambda: [[]], None, ("prompt", "non-empty")),
    "too-long": (lambda: list(range(2, 66)), None, ("max_model_len", "63")),
    "token-out-of-vocab": (lambda: [5, 256, 7], None, ("prompt", "[0, 256)")),
    "negative-token": (lambda: [5, -1, 7], None, ("prompt", "[0, 256)")),
    "max_tokens=0": (lambda: [5, 6], dict(max_tokens=0), ("max_tokens", ">= 1")),
    "top_p=0": (lambda: [5, 6], dict(top_p=0), ("top_p", "(0, 1]")),
    "top_p=1.5": (lambda: [5, 6], dict(top_p=1.5), ("top_p", "(0, 1]")),
    "temperature=-1": (lambda: [5, 6], dict(temperature=-1), ("temperature", ">= 0")),
    "n=0": (lambda: [5, 6], dict(n=0), ("n must", ">= 1")),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_engine_still_serves(small_llm, case):
    llm, prompt, want = small_llm
    make_prompt, params_kw, needles = BAD_REQUESTS[case]
    with pytest.raises(ValueError) as exc:
        params = SamplingParams(**params_kw) if params_kw else greedy()
        llm.generate(make_prompt(), params, use_tqdm=False)
    for needle in needles:
        assert needle in str(exc.value), str(exc.value)
    assert_no_leaks(llm.engine)
    assert llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0].token_ids == want
    assert_no_leaks(llm.engine)


def test_bad_prompt_in_batch_rolls_back_the_others(small_llm):
    llm, prompt, want = small_llm
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([prompt, prompt[:5], [300]], greedy(20), use_tqdm=False)
    assert_no_leaks(llm.engine)
    assert llm.generate([prompt], greedy(20), use_tqdm=False)[0].outputs[0].token_ids == want
    # the longest prompt that fits (63) runs to the context limit: finish "length" at 64 tokens
    out = llm.generate(list(range(2, 65)), greedy(20), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert_no_leaks(llm.engine)


def test_engine_level_bad_input(small_llm):
    llm, prompt, want = small_llm
    engine = llm.engine
    # typed (engine/errors.py), so the workers choose a status by kind, never by the wording
    with pytest.raises(InvalidRequest, match="prompt"):
        engine.add_request("bad", [], greedy())
    with pytest.raises(PromptTooLong, match="max_model_len"):
        engine.reserve("bad", list(range(2, 66)), greedy())
    with pytest.raises(InvalidRequest, match="first tokens"):  # n=2 commits two (test_n_sequences)
        engine.reserve("n2", prompt, SamplingParams(n=2))
        engine.commit("n2", [5])
    engine.abort("n2")
    with pytest.raises(BadSamplingParams, match="top_p"):
        SamplingParams(top_p=0)
    engine.add_request("dup", prompt, greedy(20))
    with pytest.raises(DuplicateRequestId, match="request_id"):
        engine.add_request("dup", prompt, greedy(20))
    outs = [o for o in run_until_done(engine) if o.finished]
    assert [o.outputs[0].token_ids for o in outs] == [want]
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(model="/nonexistent"), "model"),
        (dict(kv_cache_memory=1000), "kv_cache_memory"),
        (dict(kv_cache_memory=0), "kv_cache_memory"),
        (dict(block_size=3), "block_size"),
        (dict(block_size=0), "block_size"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(max_model_len=100_000), "max_model_len"),
    ],
)
def test_bad_engine_config(refs, kwargs, field):
    model_dir, *_ = refs("llama-gqa")
    kwargs = dict(dict(model=model_dir, kv_cache_memory=KV), **kwargs)
    with pytest.raises(ValueError) as exc:
        LLM(kwargs.pop("model"), **kwargs)
    assert field in str(exc.value), str(exc.value)
    if field == "block_size":
        assert "power of two" in str(exc.value)
