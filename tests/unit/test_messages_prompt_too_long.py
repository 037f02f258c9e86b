"""/v1/messages: a prompt the context cannot hold is worded as Anthropic words it (Claude Code and
other agents match "prompt is too long: N tokens > M maximum" to compact the conversation), then
the router's advice; still a 400 invalid_request_error in Anthropic's error shape, streamed or
not, and the front keeps serving. The OpenAI chat path keeps the router's wording."""

from __future__ import annotations

import asyncio
import json

import grpc
import grpc.aio
import pytest

from helpers.http_front import asgi_call, front_app

TOO_LONG = "prompt has 617 tokens but max_model_len is 512: shorten it to at most 511 tokens"


class _Refusing:
    """A router that refuses every call as its tokenizer refuses a prompt past max_model_len
    (router/text.py), or with `details` and `code`."""

    def __init__(self, code=grpc.StatusCode.OUT_OF_RANGE, details: str = TOO_LONG):
        self.code, self.details, self.calls = code, details, 0

    def Generate(self, gen, metadata=(), timeout=None):
        self.calls += 1
        return _RefusedCall(self.code, self.details)


class _RefusedCall:
    def __init__(self, code, details: str):
        self.code, self.details = code, details

    async def read(self):
        raise grpc.aio.AioRpcError(
            self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=self.details
        )

    def cancel(self):
        return True


def _post(app, path: str, body: dict):
    return asyncio.run(asgi_call(app, "POST", path, json.dumps(body).encode()))


MESSAGES = {"model": "org/tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_too_long_is_worded_as_anthropic_words_it(stream):
    router = _Refusing()
    app = front_app(stub=router)
    status, _, body = _post(app, "/v1/messages", {**MESSAGES, "stream": stream})
    assert status == 400, body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    assert message.startswith("prompt is too long: 617 tokens > 511 maximum"), message
    assert message.endswith(TOO_LONG), message  # then pdserve's advice
    # the front keeps serving, and another refusal keeps its own words
    app = front_app(stub=_Refusing(grpc.StatusCode.INVALID_ARGUMENT, "top_k is bad"))
    status, _, body = _post(app, "/v1/messages", MESSAGES)
    assert status == 400 and body["error"]["message"] == "top_k is bad", body


def test_the_chat_path_keeps_the_routers_wording():
    app = front_app(stub=_Refusing())
    chat = {"model": "org/tiny", "messages": [{"role": "user", "content": "hi"}]}
    status, _, body = _post(app, "/v1/chat/completions", chat)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert body["error"]["message"] == TOO_LONG
