"""The official SDKs read the request's id that the HTTP front sends back
(router/openai/generate.py: x-request-id for openai's `_request_id`, request-id for anthropic's),
on the front's ASGI app with a fake router (no socket; here because the SDKs start a subprocess
to learn the platform). The id rules themselves: tests/unit/test_request_id_header.py."""

from __future__ import annotations

import asyncio

import pytest

from helpers.http_front import FakeRouter, front_app, one_token
from pdserve.router.openai.generate import RequestIdHeaders

httpx = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

MESSAGES = [{"role": "user", "content": "t1"}]


def test_the_sdks_read_the_id():
    app = front_app(stub=FakeRouter(lambda gen: one_token(2)))
    app.add_middleware(RequestIdHeaders, front=app.state.front)  # as build_app adds it

    async def calls():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as hc:
            oc = openai.AsyncOpenAI(
                base_url="http://t/v1", api_key="x", http_client=hc, max_retries=0
            )
            chat = await oc.chat.completions.create(
                model="org/tiny", messages=MESSAGES, extra_headers={"X-Request-Id": "o-1"}
            )
            plain = await oc.chat.completions.create(model="org/tiny", messages=MESSAGES)
            ac = anthropic.AsyncAnthropic(
                base_url="http://t", api_key="x", http_client=hc, max_retries=0
            )
            message = await ac.messages.create(
                model="org/tiny",
                max_tokens=5,
                messages=MESSAGES,
                extra_headers={"X-Request-Id": "a-1"},
            )
            return chat, plain, message

    chat, plain, message = asyncio.run(calls())
    assert chat._request_id == "o-1" and chat.id == "chatcmpl-o-1"
    assert plain._request_id and plain.id == f"chatcmpl-{plain._request_id}"
    assert message._request_id == "a-1" and message.id == "msg_a-1"
