"""vLLM's /ping (GET and POST, SageMaker's and some load balancers' probe) answers as /health does:
200 {"status": "ok"} while serving, 503 with the reason otherwise, never a key, and a 503 is not
counted among the HTTP errors (router/openai/status.py). A 405 carries the Allow header RFC 9110
asks for, naming the methods of every route on its path, not Starlette's first route alone
(router/openai/app.py allowed_methods). On the front's ASGI app (no socket)."""

from __future__ import annotations

import asyncio

import pytest

from helpers.http_front import asgi_call, front_app
from pdserve.protos.security import ClientKeys

KEY = "sk-ping-test-0123456789"


def _call(app, method: str, path: str):
    return asyncio.run(asgi_call(app, method, path))


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_as_health_does_without_a_key(method):
    errors = []
    app = front_app(keys=ClientKeys((KEY,)), on_error=errors.append)
    ok = (200, {"status": "ok"})
    assert _call(app, method, "/ping")[::2] == _call(app, "GET", "/health")[::2] == ok
    down = front_app(keys=ClientKeys((KEY,)), ready=lambda: "no decode worker in the pool")
    status, headers, reply = _call(down, method, "/ping")
    assert (status, reply) == _call(down, "GET", "/health")[::2]
    assert status == 503 and reply["error"]["message"] == "no decode worker in the pool"
    assert headers["retry-after"] == "1"
    assert errors == []  # a probe's answer, not a failed request


@pytest.mark.parametrize(
    "method, path, allowed",
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("OPTIONS", "/v1/completions", "POST"),  # no CORS configured: a preflight is a 405 too
        ("DELETE", "/health", "GET"),
        ("PUT", "/ping", "GET, POST"),
        # a path served by one route per method: all of them, not the first route's
        ("PUT", "/v1/conversations/conv_1", "DELETE, GET, POST"),
        ("POST", "/v1/responses/resp_1", "DELETE, GET"),
    ],
)
def test_a_405_names_every_method_its_path_takes(method, path, allowed):
    status, headers, reply = _call(front_app(), method, path)
    assert status == 405 and reply["error"]["code"] == "method_not_allowed", reply
    assert headers["allow"] == allowed


def test_the_allow_header_is_sent_on_anthropics_paths_too():
    status, headers, reply = _call(front_app(), "GET", "/v1/messages")
    assert status == 405 and reply["type"] == "error" and headers["allow"] == "POST"
