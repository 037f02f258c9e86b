"""Fill-in-the-middle through the HTTP front (router/openai/fim.py): a completion's `suffix` on a
code model whose vocabulary has fill-in-the-middle tokens becomes the prefix-suffix-middle prompt
the model was trained on, and its answer is the middle, ended by the end of text or by a token
that ends a middle (`<|fim_pad|>`, `<|file_sep|>`), which is not in the answer. A tiny random
model whose byte-level tokenizer has Qwen2.5-Coder's tokens, special as in Qwen's tokenizer
(tests/helpers/structured.py), behind a router in front of a
prefill and a decode worker; `logit_bias` makes the random model write the ending token where the
test needs it. A model without the tokens refuses a suffix (tests/integration/test_http_api.py)."""

from __future__ import annotations

import json

import pytest

from helpers.http import Workers, assert_error, post, serves
from helpers.structured import byte_level_model

WORDS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|file_sep|>")
PRE, SUF, MID, PAD, SEP = range(2, 7)  # their ids (byte_level_model: ids 2, 3, ...)


@pytest.fixture(scope="module")
def router(tiny_models, tmp_path_factory, one_thread):
    src, _ = tiny_models("llama-gqa")
    model_dir = byte_level_model(src, tmp_path_factory.mktemp("byte-fim"), None, WORDS, True)
    w = Workers(model_dir, max_model_len=256)
    r = w.router()
    yield r
    r.stop()
    w.stop()


def _complete(router, **fields) -> dict:
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    status, _, raw = post(router, "/v1/completions", {**body, **fields})
    assert status == 200, raw[:400]
    return json.loads(raw)


def test_a_suffix_makes_the_prefix_suffix_middle_prompt(router):
    got = _complete(router, prompt="def f(", suffix="):\n", logit_bias={str(PAD): -100})
    ids = [PRE, *b"def f(", SUF, *b"):\n", MID]
    choice = got["choices"][0]
    assert choice["prompt_token_ids"] == ids, choice
    assert got["usage"]["prompt_tokens"] == len(ids)
    assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"


@pytest.mark.parametrize("end", [PAD, SEP])
def test_a_token_that_ends_the_middle_stops_it(router, end):
    # every other token of the vocabulary pushed down: the model writes `end` first
    got = _complete(router, prompt="x = ", suffix="\n", logit_bias={str(end): 100})
    choice = got["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == [end], choice
    assert "<|" not in choice["text"]


def test_a_batch_of_prompts_shares_the_suffix(router):
    got = _complete(router, prompt=["a", "bc"], suffix="z", max_tokens=2)
    firsts = [c["prompt_token_ids"] for c in sorted(got["choices"], key=lambda c: c["index"])]
    assert firsts == [[PRE, *b"a", SUF, *b"z", MID], [PRE, *b"bc", SUF, *b"z", MID]]


@pytest.mark.parametrize(
    "fields",
    [{"echo": True}, {"prompt": [70, 71]}],
    ids=["with-echo", "token-id-prompt"],
)
def test_a_suffix_it_cannot_serve_is_a_400_naming_it(router, fields):
    status, _, raw = post(
        router, "/v1/completions", {"model": "tiny", "prompt": "a", "suffix": "b", **fields}
    )
    assert_error(status, raw, 400, "suffix")
    serves(router)


def test_the_router_says_what_it_read_from_the_model(router):
    line = router._formats_line()
    assert "fill-in-the-middle qwen" in line and "reasoning none" in line, line
