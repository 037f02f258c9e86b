"""Through a real router and workers over HTTP (helpers/http.py's cluster, the word-level tiny
model, greedy): a stop string completed by the last token max_tokens allows cuts the text and is
the reason, finish_reason "stop" and stop_reason the string, in chat and completions, whole and
streamed (the engine's end, engine/outputs.py, reaches the router's stream); a stop token id's
text is left out of the text unless include_stop_str_in_output, as vLLM V1 does (router/text.py
TextStream, router/legs.py); and a body with
OpenAI's nullable fields sent as null (as the SDK sends None) is served as if they were left out
(router/openai/protocol.py)."""

from __future__ import annotations

import json

import pytest

from helpers.http import CHAT, MODEL, C, post, sse_events

MAX = 8
GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True, "max_tokens": MAX}
BODIES = {
    C: {**GREEDY, "prompt": "t5 t9 t12"},
    CHAT: {**GREEDY, "messages": [{"role": "user", "content": "t5 t9 t12"}]},
}


def _text(path: str, choice: dict) -> str:
    return choice["text"] if path == C else choice["message"]["content"]


def _whole(router_, path: str, body: dict) -> dict:
    status, _, got = post(router_, path, body)
    assert status == 200, got
    return json.loads(got)["choices"][0]


def _streamed(router_, path: str, body: dict) -> tuple[str, list]:
    status, _, got = post(router_, path, {**body, "stream": True})
    assert status == 200, got
    text, ends = "", []
    for event in sse_events(got):
        if event == "[DONE]" or not event["choices"]:
            continue
        choice = event["choices"][0]
        piece = choice.get("text") if path == C else choice["delta"].get("content")
        text += piece or ""
        if choice.get("finish_reason") is not None:
            ends.append((choice["finish_reason"], choice.get("stop_reason")))
    return text, ends


@pytest.mark.parametrize("path", [C, CHAT])
def test_a_stop_string_ending_at_max_tokens_is_the_reason(router, idle, path):
    body = BODIES[path]
    full = _whole(router, path, body)
    text = _text(path, full)
    assert full["finish_reason"] == "length" and len(text.split()) == MAX, text
    stop = text.split()[-1]  # the last allowed token's word
    if text.split().count(stop) > 1:
        pytest.skip("the last word appears earlier too: the string would end the text sooner")
    cut = text[: text.rindex(stop)]
    got = _whole(router, path, {**body, "stop": [stop]})
    assert _text(path, got) == cut
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", stop)
    assert _streamed(router, path, {**body, "stop": [stop]}) == (cut, [("stop", stop)])


@pytest.mark.parametrize("path", [C, CHAT])
def test_nullable_fields_sent_as_null_are_their_defaults(router, idle, path):
    body = BODIES[path]
    nulls = dict.fromkeys(["n", "logprobs", "stream", "echo", "stream_options", "user"])
    if path == CHAT:
        nulls.update(
            dict.fromkeys(["top_logprobs", "add_generation_prompt", "continue_final_message"])
        )
    else:
        nulls.update(dict.fromkeys(["add_special_tokens", "best_of", "suffix"]))
    plain = _whole(router, path, body)
    got = _whole(router, path, {**body, **nulls})
    assert _text(path, got) == _text(path, plain)
    assert got["logprobs"] is None


@pytest.mark.parametrize("path", [C, CHAT])
def test_a_stop_token_ids_text_is_left_out_unless_asked_for(router, idle, path):
    body = BODIES[path]
    full = _whole(router, path, body)
    words = _text(path, full).split()
    # the word-level tokenizer's token i reads "t{i}": the first word after the first that does
    # not appear before it is the stop token id
    k = next(k for k in range(1, len(words)) if words.index(words[k]) == k)
    stop_id = int(words[k][1:])
    asked = {**body, "stop_token_ids": [stop_id]}
    got = _whole(router, path, asked)
    assert _text(path, got).split() == words[:k]
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", stop_id)
    text, ends = _streamed(router, path, asked)
    assert (text.split(), ends) == (words[:k], [("stop", stop_id)])
    kept = _whole(router, path, {**asked, "include_stop_str_in_output": True})
    assert _text(path, kept).split() == words[: k + 1]
