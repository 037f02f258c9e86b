"""The router's refusals of a chat or completions body's length or prompt name the body's own
field (router/openai/generate.py name_client_field): a max_tokens past max_model_len, or a prompt
plus max_tokens past the context, names max_tokens or max_completion_tokens as the client sent
it, in `param` and in the message (not the gRPC "sampling.max_tokens"); a prompt too long for the
context names "messages" (chat) or "prompt" (completions); an empty prompt names "prompt". The
status and code stay the router's. stream_options without stream names stream_options
(router/openai/protocol.py). On the front's ASGI app, with a fake router that refuses the call
with the router's own message."""

from __future__ import annotations

import asyncio
import json

import grpc
import grpc.aio
import pytest

from helpers.http_front import asgi_call, front_app
from pdserve.protos.limits import check_context, check_sampling
from pdserve.protos.pdserve.v1 import pdserve_pb2

MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "hi"}]


class _Refusing:
    """A router that refuses every call with (code, details); it keeps the requests."""

    def __init__(self, code: grpc.StatusCode, details: str):
        self.code, self.details = code, details
        self.requests = []

    def Generate(self, gen, metadata=(), timeout=None):
        self.requests.append(gen)
        return _RefusedCall(self.code, self.details)


class _RefusedCall:
    def __init__(self, code, details):
        self.code, self.details = code, details

    async def read(self):
        empty = grpc.aio.Metadata()
        raise grpc.aio.AioRpcError(self.code, empty, empty, details=self.details)

    def cancel(self):
        pass


def _error(router, path: str, body: dict) -> dict:
    app = front_app(stub=router)
    status, _, reply = asyncio.run(asgi_call(app, "POST", path, json.dumps(body).encode()))
    assert status == 400, reply
    return reply["error"]


def _too_many(max_tokens: int):
    """The router's refusal of a max_tokens past max_model_len (protos/limits.py)."""
    refusal = check_sampling(pdserve_pb2.SamplingParams(max_tokens=max_tokens), MAX_MODEL_LEN, 10)
    return _Refusing(refusal.code, refusal.message)


def _past_context(prompt_is: str, max_tokens: int):
    """The router's refusal of a prompt of 200 tokens plus max_tokens past the context."""
    sampling = pdserve_pb2.SamplingParams(max_tokens=max_tokens)
    refusal = check_context(200, sampling, MAX_MODEL_LEN, prompt_is)
    return _Refusing(refusal.code, refusal.message)


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 300}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 300}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_completion_tokens": 300},
            "max_completion_tokens",
        ),
    ],
)
def test_max_tokens_past_max_model_len_names_the_clients_field(path, body, field):
    error = _error(_too_many(300), path, body)
    assert error["param"] == field
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith(f"{field}=300 exceeds max_model_len={MAX_MODEL_LEN}")
    assert "sampling." not in error["message"]


@pytest.mark.parametrize(
    "path, body, prompt_is, field",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 57}, "prompt", "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_tokens": 57},
            "messages",
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_completion_tokens": 57},
            "messages",
            "max_completion_tokens",
        ),
    ],
)
def test_a_prompt_plus_max_tokens_past_the_context_names_the_clients_field(
    path, body, prompt_is, field
):
    error = _error(_past_context(prompt_is, 57), path, body)
    assert error["param"] == field
    assert error["code"] == "context_length_exceeded"
    assert "you requested 257 tokens" in error["message"]
    assert f"{field} can be at most 56" in error["message"], error["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi"}, "prompt"),
        ("/v1/chat/completions", {"messages": MESSAGES}, "messages"),
    ],
)
def test_a_prompt_longer_than_the_context_names_the_prompt(path, body, param):
    router = _Refusing(
        grpc.StatusCode.OUT_OF_RANGE,
        f"prompt has 300 tokens but max_model_len is {MAX_MODEL_LEN}: shorten it to at most "
        f"{MAX_MODEL_LEN - 1} tokens",
    )
    error = _error(router, path, body)
    assert error["param"] == param
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith("prompt has 300 tokens")


def test_an_empty_prompt_names_the_prompt():
    router = _Refusing(
        grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty: send text, token ids or chat messages"
    )
    error = _error(router, "/v1/completions", {"prompt": ""})
    assert error["param"] == "prompt"
    assert error["code"] is None  # the router's, as before


def test_stream_options_without_stream_names_stream_options():
    body = {"messages": MESSAGES, "stream_options": {"include_usage": True}}
    router = _Refusing(grpc.StatusCode.INTERNAL, "never called")
    error = _error(router, "/v1/chat/completions", body)
    assert error["param"] == "stream_options"
    assert "stream=true" in error["message"]
    assert router.requests == []
    body = {"prompt": "hi", "stream": False, "stream_options": {"include_usage": True}}
    error = _error(router, "/v1/completions", body)
    assert error["param"] == "stream_options"


def test_another_refusal_is_left_as_it_is():
    router = _Refusing(grpc.StatusCode.INVALID_ARGUMENT, "sampling.n=9: something else")
    error = _error(router, "/v1/completions", {"prompt": "hi"})
    assert error["param"] is None
    assert error["message"] == "sampling.n=9: something else"
