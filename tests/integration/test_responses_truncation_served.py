"""truncation "auto" on /v1/responses (router/openai/responses_api.py `_fitted`) through the
official openai client, on a router in front of a prefill and a decode worker (a tiny random model
with a byte-level tokenizer, max_model_len 512, as tests/integration/test_http_other_apis.py's): a
conversation continued by previous_response_id that no longer fits the context with
max_output_tokens is refused without "auto" (as before) and runs with it, on its newest items (the
same text and prompt tokens as the chat of those items: the front counts the prompt as the router
does); a turn with no input continues a stored response."""

from __future__ import annotations

import pytest

from helpers.http import Workers, openai_client as client, serves
from helpers.structured import TOOL_TEMPLATE as TEMPLATE, byte_level_model

openai = pytest.importorskip("openai")

MODEL = "tiny"
LIMIT = 512


@pytest.fixture(scope="module")
def router(tiny_models, tmp_path_factory, one_thread):
    src, _ = tiny_models("llama-gqa")
    model_dir = byte_level_model(src, tmp_path_factory.mktemp("byte-truncation"), TEMPLATE)
    w = Workers(model_dir, max_model_len=LIMIT)
    r = w.router()
    yield r
    r.stop()
    w.stop()


def test_auto_truncation_runs_the_newest_items_that_fit(router):
    c = client(router)
    earlier = [
        {"role": "user", "content": "a" * 420},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "Go on."},
    ]
    first = c.responses.create(model=MODEL, input=earlier, max_output_tokens=4, temperature=0)
    args = dict(model=MODEL, input="b" * 50, max_output_tokens=20, temperature=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(previous_response_id=first.id, **args)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.responses.create(previous_response_id=first.id, truncation="disabled", **args)
    cut = c.responses.create(previous_response_id=first.id, truncation="auto", **args)
    assert cut.status in ("completed", "incomplete") and cut.truncation == "auto"
    assert cut.usage.input_tokens + 20 <= LIMIT
    # the first item alone was dropped: the chat of the rest and the new input
    answer = [{"role": "assistant", "content": first.output_text}] if first.output_text else []
    messages = [*earlier[1:], *answer, {"role": "user", "content": "b" * 50}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert cut.usage.input_tokens == whole.usage.prompt_tokens
    assert cut.output_text == whole.choices[0].message.content
    # what is stored is the whole conversation: the input items are this request's own
    items = c.responses.input_items.list(cut.id).data
    assert [i.content[0].text for i in items] == ["b" * 50]
    # even the new input alone does not fit: refused as without "auto"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(
            previous_response_id=first.id, **{**args, "input": "c" * 600}, truncation="auto"
        )
    assert e.value.code == "context_length_exceeded"
    serves(router)


def test_a_turn_without_input_continues_a_stored_response(router):
    c = client(router)
    args = dict(model=MODEL, max_output_tokens=8, temperature=0)
    first = c.responses.create(input="Hello.", **args)
    again = c.responses.create(previous_response_id=first.id, **args)
    messages = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": first.output_text},
    ]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert again.usage.input_tokens == whole.usage.prompt_tokens
    assert again.output_text == whole.choices[0].message.content
    assert c.responses.input_items.list(again.id).data == []
