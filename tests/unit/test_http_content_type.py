"""A POST's body must be declared JSON (router/openai/state.py check_json_body): application/json,
with a charset or without, or a `+json` type, as the openai and anthropic SDKs and
`curl -H 'Content-Type: application/json'` send it. Anything else (text/plain, a form, no
Content-Type at all: what a web page may POST to another origin without a CORS preflight) is a
415 with OpenAI's error object, Anthropic's on /v1/messages, before the body is read and before
any call reaches the router. On the front's ASGI app, with a fake router that counts its calls.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers.http_front import FakeRouter, asgi_call, front_app, one_token

COMPLETION = {"model": "org/tiny", "prompt": [1, 2], "max_tokens": 1}
MESSAGES = {"model": "org/tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "t1"}]}


def with_content_type(app, value: str | None):
    """`app` with each request's Content-Type replaced by `value` (None: no such header)."""

    async def call(scope, receive, send):
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        if value is not None:
            headers.append((b"content-type", value.encode()))
        await app({**scope, "headers": headers}, receive, send)

    return call


def _post(content_type: str | None, path: str = "/v1/completions", body: dict = COMPLETION):
    """(status, reply, the Generate calls the router got) of one POST sent as `content_type`."""
    router = FakeRouter(lambda gen: one_token(2))
    app = with_content_type(front_app(router), content_type)
    status, _, reply = asyncio.run(asgi_call(app, "POST", path, json.dumps(body).encode()))
    return status, reply, router.gens


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",  # a browser's fetch() with a string body
        "application/x-www-form-urlencoded",  # curl -d without -H, a form
        "multipart/form-data; boundary=x",
        None,  # a fetch() of a Blob or an ArrayBuffer, http.client with a body
        "",
        "application/jsonx",
        "json",
    ],
)
def test_a_body_not_declared_json_is_refused_before_any_work(content_type):
    status, reply, calls = _post(content_type)
    assert status == 415, reply
    err = reply["error"]
    assert err["code"] == "unsupported_media_type" and err["type"] == "invalid_request_error"
    assert "Content-Type: application/json" in err["message"], err
    assert calls == []  # nothing reached the router


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",  # the SDKs, curl -H, guidellm, requests' json=
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/vnd.api+json",
    ],
)
def test_json_is_served(content_type):
    status, reply, calls = _post(content_type)
    assert status == 200, reply
    assert reply["choices"][0]["text"] == "t8" and len(calls) == 1


def test_messages_answer_in_anthropic_shape_naming_the_header():
    status, reply, calls = _post("text/plain", "/v1/messages", MESSAGES)
    assert status == 415 and calls == []
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    assert "'text/plain'" in reply["error"]["message"]
    assert "Content-Type: application/json" in reply["error"]["message"]
    status, reply, calls = _post("application/json", "/v1/messages", MESSAGES)
    assert status == 200 and len(calls) == 1, reply


def test_every_body_reader_checks_it():
    """Every endpoint that reads a body reads it through read_body: one of each kind."""
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t1"}]}),
        ("/v1/embeddings", {"input": "t1"}),
        ("/v1/responses", {"input": "t1"}),
        ("/v1/conversations", {}),
        ("/tokenize", {"prompt": "t1"}),
    ):
        status, reply, calls = _post("text/plain", path, body)
        assert status == 415 and reply["error"]["code"] == "unsupported_media_type", (path, reply)
        assert calls == []
