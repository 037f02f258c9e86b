"""The prompt encoder's calls of the HTTP front (router/openai/state.py FrontState.encode:
/tokenize, /v1/messages/count_tokens, a score template's pairs) go through no admission, so they
run on threads of their own, at most MAX_ENCODER_CALLS running or waiting: past that a 429 with
Retry-After, and meanwhile every other request's body is still parsed (on the default executor's
threads, which the encoder's calls no longer hold). On the ASGI app with an encoder that blocks
until the test lets it go; nothing is timed (the waits only keep a broken build from hanging).
The router's tokenizer queue being full (router/text.py) is a 429 with Retry-After too."""

from __future__ import annotations

import asyncio
import json
import threading

import grpc

from helpers.http_front import asgi_call, front_app
from pdserve.router.openai.state import MAX_ENCODER_CALLS
from pdserve.router.text import BadRequest

GUARD_S = 60  # a broken build's hang becomes a failure after this long


class _Encoder:
    """Holds every call until `release` is set, as a router's busy tokenizer thread does."""

    def __init__(self):
        self.release = threading.Event()
        self.calls = 0

    def tokenize_text(self, text, special):
        self.calls += 1
        self.release.wait(GUARD_S)
        return [1, 2]

    def tokenize_chat(self, chat, special):
        return self.tokenize_text("", special)


async def _call(app, path: str, body: dict):
    """(status, headers, body) of one POST sent straight to the ASGI app."""
    return await asyncio.wait_for(asgi_call(app, "POST", path, json.dumps(body).encode()), GUARD_S)


def test_encoder_calls_are_bounded_and_leave_parsing_free():
    encoder = _Encoder()
    app = front_app(encoder=encoder)
    slots = app.state.front._encoding._slots
    prompt = {"prompt": "hi"}

    async def run():
        held = [
            asyncio.create_task(_call(app, "/tokenize", prompt)) for _ in range(MAX_ENCODER_CALLS)
        ]
        for _ in range(100 * GUARD_S):  # until every one holds its slot
            if slots._value == 0:
                break
            await asyncio.sleep(0.01)
        status, headers, got = await _call(app, "/tokenize", prompt)
        assert status == 429 and headers["retry-after"] == "1", got
        assert got["error"]["code"] == "rate_limit_exceeded"
        assert f"{MAX_ENCODER_CALLS} tokenizer calls" in got["error"]["message"]
        count = {"model": "org/tiny", "messages": [{"role": "user", "content": "hi"}]}
        status, _, got = await _call(app, "/v1/messages/count_tokens", count)
        assert status == 429 and got["error"]["type"] == "rate_limit_error", got
        # another endpoint's body is parsed (and decoded) while the encoder is held
        status, headers, got = await _call(app, "/detokenize", {"tokens": [3, 4]})
        assert (status, headers["content-type"], got) == (
            200,
            "application/json",
            {"prompt": "t3 t4"},
        )
        encoder.release.set()
        done = await asyncio.gather(*held)
        assert [status for status, _, _ in done] == [200] * MAX_ENCODER_CALLS
        assert encoder.calls == MAX_ENCODER_CALLS
        status, _, got = await _call(app, "/tokenize", prompt)  # the slots are free again
        assert status == 200 and got["tokens"] == [1, 2]

    asyncio.run(run())


class _FullQueue:
    """An encoder whose tokenizer queue is full (router/text.py PromptEncoder's bound)."""

    def tokenize_text(self, text, special):
        raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED, "the tokenizer's queue is full")


def test_a_full_tokenizer_queue_is_a_429_with_retry_after():
    app = front_app(encoder=_FullQueue())
    status, headers, got = asyncio.run(_call(app, "/tokenize", {"prompt": "hi"}))
    assert status == 429 and headers["retry-after"] == "1", got
    assert "queue is full" in got["error"]["message"]
