"""/v1/messages' stream events as Anthropic sends them (router/openai/messages_api.py Shape):
one ping right after message_start; message_start's usage never says what is not known (the
prompt's cached tokens, which the chat's first chunk does not carry: null, not 0) and agrees with
the final usage where the first chunk does carry them; thinking.display "omitted" keeps the
thinking block (its start, stop and signature) without its text, whole and streamed."""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers.sdk import LazyModule
from pdserve.router.openai.messages_api import MessagesRequest, Shape

anthropic_types = LazyModule("anthropic.types")
_messages = LazyModule("anthropic.lib.streaming._messages")


def accumulate(*args, **kwargs):
    return _messages.accumulate_event(*args, **kwargs)


FIRST = {"prompt_tokens": 76, "completion_tokens": 0, "total_tokens": 76}  # continuous usage
FINAL = {
    "prompt_tokens": 76,
    "completion_tokens": 2,
    "total_tokens": 78,
    "prompt_tokens_details": {"cached_tokens": 64},
}


def _body(**fields) -> MessagesRequest:
    base = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return MessagesRequest.model_validate({**base, **fields})


def _chunk(delta=None, reason=None, **extra) -> dict:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": reason}], **extra}


def _frames(shape: Shape, chunks: list) -> list[dict]:
    async def gen():
        for c in chunks:
            yield c

    async def run():
        return [e async for e in shape.events(gen())]

    out = []
    for frame in asyncio.run(run()):
        head, data = frame.decode().rstrip("\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        out.append(payload)
    return out


def _snapshot(frames: list[dict]):
    """The anthropic SDK's accumulated message (the SDK skips pings, as its stream does)."""
    from pydantic import TypeAdapter

    adapter = TypeAdapter(anthropic_types.RawMessageStreamEvent)
    snapshot, bufs = None, {}
    for f in frames:
        if f["type"] != "ping":
            event = adapter.validate_python(f)
            snapshot = accumulate(event=event, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


def _text_chunks(first_usage: dict) -> list:
    return [
        _chunk({"role": "assistant", "content": ""}, usage=first_usage),
        _chunk({"content": "Hi"}),
        _chunk(reason="stop"),
        {"choices": [], "usage": FINAL},
        "[DONE]",
    ]


def test_one_ping_follows_message_start():
    frames = _frames(Shape(_body(), "tiny"), _text_chunks(FIRST))
    kinds = [f["type"] for f in frames]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"], kinds
    assert kinds.count("ping") == 1 and frames[1] == {"type": "ping"}
    assert _snapshot(frames).content[0].text == "Hi"


def test_message_start_does_not_claim_an_uncached_prompt_it_does_not_know():
    start = _frames(Shape(_body(), "tiny"), _text_chunks(FIRST))[0]["message"]["usage"]
    # the first chunk says the prompt's count, not how much of it the cache held
    assert start["input_tokens"] == 76 and start["cache_read_input_tokens"] is None
    assert anthropic_types.Usage.model_validate(start).cache_read_input_tokens is None
    final = _frames(Shape(_body(), "tiny"), _text_chunks(FIRST))[-2]["usage"]
    assert (final["input_tokens"], final["cache_read_input_tokens"]) == (12, 64)


def test_message_start_agrees_with_the_final_usage_when_the_cached_count_is_known():
    first = {**FIRST, "prompt_tokens_details": {"cached_tokens": 64}}
    frames = _frames(Shape(_body(), "tiny"), _text_chunks(first))
    start, final = frames[0]["message"]["usage"], frames[-2]["usage"]
    for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        assert start[key] == final[key], key
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (12, 64)
    usage = _snapshot(frames).usage
    assert (usage.input_tokens, usage.cache_read_input_tokens) == (12, 64)


def _thinking(display: str | None) -> MessagesRequest:
    thinking = {"type": "enabled", "budget_tokens": 1024}
    if display is not None:
        thinking["display"] = display
    return _body(thinking=thinking)


@pytest.mark.parametrize("display", ["omitted", "summarized", None])
def test_omitted_thinking_keeps_the_block_without_its_text(display):
    omitted = display == "omitted"
    chat = {
        "choices": [
            {
                "message": {"content": "Paris.", "reasoning": "The capital."},
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": FINAL,
    }
    whole = anthropic_types.Message.model_validate(Shape(_thinking(display), "tiny").whole(chat))
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == ("" if omitted else "The capital.")
    assert whole.content[0].signature == "" and whole.content[1].text == "Paris."
    chunks = [
        _chunk({"role": "assistant", "content": ""}, usage=FIRST),
        _chunk({"reasoning": "The ", "reasoning_content": "The "}),
        _chunk({"reasoning": "capital.", "reasoning_content": "capital."}),
        _chunk({"content": "Paris."}),
        _chunk(reason="stop"),
        {"choices": [], "usage": FINAL},
        "[DONE]",
    ]
    frames = _frames(Shape(_thinking(display), "tiny"), chunks)
    starts = [f["content_block"] for f in frames if f["type"] == "content_block_start"]
    assert starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
    deltas = [f["delta"]["type"] for f in frames if f["type"] == "content_block_delta"]
    assert deltas == ["text_delta"] if omitted else ["thinking_delta"] * 2 + ["text_delta"]
    assert [f["index"] for f in frames if f["type"] == "content_block_stop"] == [0, 1]
    snapshot = _snapshot(frames)
    assert [b.type for b in snapshot.content] == ["thinking", "text"]
    assert snapshot.content[0].thinking == whole.content[0].thinking
