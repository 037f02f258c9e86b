"""A request larger than one gRPC message to the router may be (router/server.py
max_request_bytes) is a 413 `request_too_large` that names what to shrink, on FastAPI's test
client with a fake router: refused by the front before any call when it knows the router's limit
(router/openai/state.py check_request_size), and gRPC's own "larger than max" refusal is a 413
too (router/openai/errors.py), never the 429 with Retry-After that a client would retry for
ever. From the same mapping: the 404 of a model the router does not serve names `model`."""

from __future__ import annotations

import json

import grpc
import pytest
from fastapi.testclient import TestClient

from helpers.http_front import front_app
from helpers.rpc import Refused
from pdserve.router.openai.errors import ApiError
from pdserve.router.server import max_request_bytes

MAX_MODEL_LEN = 32768
MAX_PROMPT_BYTES = (MAX_MODEL_LEN - 1) * 17  # a tokenizer whose longest token has 16 bytes


class _Router:
    """A router stub that records the calls it was sent (none should be)."""

    def __init__(self):
        self.calls = []

    def Embed(self, request, metadata=()):
        self.calls.append(request)
        raise AssertionError("a request past the router's limit reached it")

    Generate = Embed


def _client(stub) -> TestClient:
    app = front_app(
        stub,
        max_model_len=MAX_MODEL_LEN,
        max_prompt_bytes=MAX_PROMPT_BYTES,
        max_body_bytes=8 << 20,
        labels=("no", "yes"),
    )
    return TestClient(app)


def _big_chat() -> dict:
    """A chat whose assistant tool call's arguments (not in the prompt's size check) make it
    larger than the router's limit."""
    messages = [{"role": "user", "content": "hi"}]
    for i in range(20):
        call = {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": "f", "arguments": "x" * 250_000},
        }
        messages.append({"role": "assistant", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": "ok"})
    return {"messages": messages}


@pytest.mark.parametrize(
    "path, body, param",
    [
        # 1000 inputs of 6 KB: each well within max_model_len, 6 MB in all
        ("/v1/embeddings", {"input": ["word " * 1200] * 1000}, "input"),
        ("/v1/chat/completions", _big_chat(), None),
    ],
)
def test_a_request_past_the_routers_limit_is_a_413_before_any_call(path, body, param):
    limit = max_request_bytes(MAX_MODEL_LEN, MAX_PROMPT_BYTES)
    assert len(json.dumps(body)) > limit  # (and within the body's limit: refused for its size)
    router = _Router()
    with _client(router) as c:
        got = c.post(path, json=body)
        error = got.json()["error"]
        assert got.status_code == 413, error
        assert error["code"] == "request_too_large" and error["param"] == param
        assert f"more than the {limit} the router takes" in error["message"]
        assert "Retry-After" not in got.headers
        assert router.calls == []
        assert c.get("/version").status_code == 200  # it keeps serving


class _Refused(grpc.RpcError):
    def __init__(self, details: str):
        self._details = details

    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return self._details


def test_grpcs_larger_than_max_refusal_is_a_413_and_other_exhaustion_a_429():
    too_large = ApiError.from_grpc(
        _Refused("Received message larger than max (6000000 vs. 4194304)")
    )
    assert (too_large.status, too_large.code) == (413, "request_too_large")
    assert "6000000 vs. 4194304" in too_large.message and "shorter" in too_large.message
    assert "Retry-After" not in too_large.response().headers
    busy = ApiError.from_grpc(_Refused("the router's queue is full"))
    assert (busy.status, busy.code) == (429, "rate_limit_exceeded")
    assert busy.response().headers["Retry-After"] == "1"


def test_an_unserved_models_404_names_the_model_field():
    """The router's API answers NOT_FOUND only for a model it does not serve; the completion's
    404 then names `model` as the front's own 404s (and vLLM's) do."""
    missing = ApiError.from_grpc(Refused(grpc.StatusCode.NOT_FOUND, "model x is not served"))
    assert (missing.status, missing.param, missing.code) == (404, "model", "model_not_found")
    busy = ApiError.from_grpc(Refused(grpc.StatusCode.UNAVAILABLE, "no decode worker"))
    assert busy.param is None
