"""A reasoning model's thinking budget (engine/thinking.py): once its reasoning holds
`thinking_token_budget` tokens the next token is </think>, counted from the prompt's open tag
(DeepSeek-R1's template) or from a <think> the model writes (Qwen3's), the same with speculation
on, and the same when a stream resumes with its earlier tokens in the prompt (the router's
failover); a grammar that forbids </think> at that point wins; a model without the tags refuses
the budget. A tiny random model with a byte-level tokenizer whose ids 2 and 3 are <think> and
</think> (tests/helpers/structured.py); `logit_bias` keeps the random model from closing its
reasoning on its own, so only the budget closes it."""

from __future__ import annotations

import pytest

from helpers.engine import KV
from helpers.structured import byte_level_model
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.thinking import ThinkingBudget

pytestmark = pytest.mark.usefixtures("one_thread")

OPEN, CLOSE = 2, 3
PROMPT = [72, 105, 33, 10, OPEN, 10]  # "Hi!\n<think>\n": the template opened the reasoning


@pytest.fixture(scope="module")
def model_dir(tiny_models, tmp_path_factory):
    src, _ = tiny_models("llama-gqa")
    return byte_level_model(src, tmp_path_factory.mktemp("think"), None, ("<think>", "</think>"))


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = LLM(model_dir, dtype="float32", kv_cache_memory=KV)
    yield engine
    engine.shutdown()


def _run(llm, prompt, budget, max_tokens=24, **kw):
    kw.setdefault("logit_bias", {CLOSE: -100.0})  # it never closes its reasoning by itself
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, thinking_token_budget=budget, **kw
    )
    return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)


@pytest.mark.parametrize("budget", [0, 1, 5, 12])
def test_a_reasoning_the_prompt_opened_ends_after_its_budget(llm, budget):
    out = _run(llm, PROMPT, budget)
    # the template's newline after <think> counts: it is a token of the reasoning
    spent = budget - 1 if budget else 0
    assert out[spent] == CLOSE and CLOSE not in out[:spent], out
    assert CLOSE not in out[spent + 1 :]


def test_without_a_budget_the_reasoning_runs_on(llm):
    out = _run(llm, PROMPT, None)
    assert CLOSE not in out


def test_a_reasoning_the_model_opens_is_counted_from_its_tag(llm):
    # a grammar makes the model write <think> first; `</think>` is allowed anywhere after it
    grammar = "start: <[2]> /[a-z ]*/ <[3]> /[a-z ]*/"
    out = _run(llm, [72, 105, 10], 6, structured={"grammar": grammar})
    assert out[0] == OPEN and out[7] == CLOSE and CLOSE not in out[:7], out


def test_a_grammar_that_forbids_the_close_wins(llm):
    out = _run(llm, PROMPT, 2, structured={"regex": "[a-z]{10}"}, max_tokens=10)
    assert CLOSE not in out


def test_speculation_gives_the_same_tokens(model_dir):
    spec = LLM(
        model_dir,
        dtype="float32",
        kv_cache_memory=KV,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    plain = LLM(model_dir, dtype="float32", kv_cache_memory=KV, speculative_config=None)
    try:
        # a repeated prompt gives prompt lookup something to guess from
        prompt = PROMPT[:4] * 6 + PROMPT
        for budget in (3, 9):
            assert _run(spec, prompt, budget, 32) == _run(plain, prompt, budget, 32)
    finally:
        spec.shutdown()
        plain.shutdown()


@pytest.mark.parametrize("k", [1, 4, 9])
def test_a_stream_resumed_with_its_tokens_in_the_prompt_spends_the_same_budget(llm, k):
    whole = _run(llm, PROMPT, 8)
    assert _run(llm, PROMPT + whole[:k], 8, 24 - k) == whole[k:]


def test_a_model_without_the_tags_refuses_a_budget(tiny_models):
    src, _ = tiny_models("llama-gqa")
    llm = LLM(src, dtype="float32", kv_cache_memory=KV)
    try:
        with pytest.raises(InvalidRequest, match="thinking_token_budget needs a reasoning model"):
            llm.generate([[5, 6]], SamplingParams(thinking_token_budget=4), use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_negative_budget_is_refused():
    with pytest.raises(InvalidRequest, match="thinking_token_budget must be >= 0"):
        SamplingParams(thinking_token_budget=-1)


def test_the_state_counts_guesses_without_keeping_them():
    b = ThinkingBudget(3, (OPEN, CLOSE), [9, OPEN])
    assert not b.forces_close([7, 7], 2)
    assert b.forces_close([7, 7, 7], 2)  # the guess makes three
    assert not b.forces_close([7, 7], 2)  # and was not kept
    assert b.forces_close([7, 7, 7, 7], 4)
    assert not b.forces_close([7, 7, 7, 7, CLOSE], 5)  # closed: nothing to force
    closed = ThinkingBudget(0, (OPEN, CLOSE), [OPEN, 5, CLOSE, 8])
    assert not closed.forces_close([], 0)
    assert closed.forces_close([OPEN], 1)
