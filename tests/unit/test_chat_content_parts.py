"""A chat message's OpenAI text content parts reach the chat template one per line, as vLLM's
chat parsing joins them (and as the offline LLM.chat does: tests/unit/test_llm_vllm_api.py); on
the front's ASGI app with a fake router."""

from __future__ import annotations

import asyncio
import json

from helpers.http_front import FakeRouter, asgi_call, front_app, one_token


def test_text_parts_are_joined_with_a_newline():
    stub = FakeRouter(lambda gen: one_token(2))
    parts = [{"type": "text", "text": "t5 t6"}, {"type": "text", "text": "t7"}]
    body = {"model": "org/tiny", "messages": [{"role": "user", "content": parts}]}
    status, _, got = asyncio.run(
        asgi_call(front_app(stub=stub), "POST", "/v1/chat/completions", json.dumps(body).encode())
    )
    assert status == 200, got
    (gen,) = stub.gens
    assert [m.content for m in gen.chat.messages] == ["t5 t6\nt7"]
