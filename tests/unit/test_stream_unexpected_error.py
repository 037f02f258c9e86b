"""An unexpected exception (a bug, not a gRPC status) after a stream started ends the stream as a
gRPC failure does, as vLLM's stream generators do (router/openai/responses/stream.py `chunks`):
one error event with a 500 server_error, then [DONE] on chat and completions, and the error event
of /v1/responses and /v1/messages, which their shapes make of it; its traceback is logged once.
Before, the exception left the ASGI app and the connection was cut. On the front's ASGI app with
a fake router whose call fails after its first token."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from helpers.http_front import FakeCall, front_app
from pdserve.protos.pdserve.v1 import pdserve_pb2

httpx = pytest.importorskip("httpx2")

MESSAGES = [{"role": "user", "content": "t1"}]


class _FailingCall(FakeCall):
    """One token, then a RuntimeError from the next read."""

    def __init__(self):
        delta = pdserve_pb2.TokenDelta(index=0, token_ids=[8], text="t8")
        super().__init__([pdserve_pb2.GenerateResponse(delta=delta)])
        self.cancelled = False

    async def read(self):
        if self._left:
            return self._left.pop(0)
        raise RuntimeError("a bug after the first token")

    def cancel(self):
        self.cancelled = True


class _Router:
    def __init__(self):
        self.calls = []

    def Generate(self, gen, metadata=(), timeout=None):
        self.calls.append(_FailingCall())
        return self.calls[-1]


def _stream(path: str, body: dict) -> tuple[str, _Router]:
    router = _Router()
    app = front_app(stub=router)

    async def call():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post(path, json={**body, "stream": True})

    r = asyncio.run(call())
    assert r.status_code == 200
    return r.text, router


def _data(text: str) -> list:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": "t1", "max_tokens": 5}),
    ],
)
def test_an_openai_stream_ends_with_the_error_and_done(path, body, caplog):
    with caplog.at_level(logging.ERROR):
        text, router = _stream(path, body)
    data = _data(text)
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert error["type"] == "server_error" and error["message"] == "internal error: RuntimeError"
    assert "choices" in json.loads(data[-3])  # the token before it went out
    logged = [r for r in caplog.records if r.exc_info and "failed" in r.getMessage()]
    assert len(logged) == 1 and "a bug after the first token" in str(logged[0].exc_info[1])
    assert router.calls[0].cancelled  # the router aborts the request


def test_a_messages_stream_ends_with_anthropics_error_event():
    text, _ = _stream("/v1/messages", {"model": "org/tiny", "max_tokens": 5, "messages": MESSAGES})
    events = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "error"
    error = json.loads(_data(text)[-1])["error"]
    assert error == {"type": "api_error", "message": "internal error: RuntimeError"}


def test_a_responses_stream_ends_with_its_error_event():
    text, _ = _stream("/v1/responses", {"input": "t1"})
    events = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert events[0] == "response.created" and events[-1] == "error"
    assert json.loads(_data(text)[-1])["message"] == "internal error: RuntimeError"


class _WorkingCall(FakeCall):
    """One token and the end: a call that works (the bug is in the front's event writer)."""

    def __init__(self):
        delta = pdserve_pb2.TokenDelta(index=0, token_ids=[8], text="t8")
        finish = pdserve_pb2.Finish(index=0, finish_reason="length")
        super().__init__([pdserve_pb2.GenerateResponse(delta=delta)])
        self._left.append(pdserve_pb2.GenerateResponse(finish=finish))


def test_a_bug_in_the_messages_event_writer_ends_the_stream_with_its_error_event(
    monkeypatch, caplog
):
    from pdserve.router.openai import messages_api

    def broken(self, *args, **kwargs):
        raise KeyError("a bug in a content block")

    monkeypatch.setattr(messages_api._EventWriter, "_block", broken)
    router = _Router()
    router.Generate = lambda gen, metadata=(), timeout=None: _WorkingCall()
    app = front_app(stub=router)
    body = {"model": "org/tiny", "max_tokens": 5, "messages": MESSAGES, "stream": True}

    async def call():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/messages", json=body)

    with caplog.at_level(logging.ERROR):
        r = asyncio.run(call())
    assert r.status_code == 200
    events = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert events[-1] == "error", events
    error = json.loads(_data(r.text)[-1])["error"]
    assert error == {"type": "api_error", "message": "internal error: KeyError"}
    logged = [rec for rec in caplog.records if rec.exc_info and "events failed" in rec.getMessage()]
    assert len(logged) == 1
