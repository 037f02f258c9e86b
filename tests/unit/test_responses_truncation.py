"""truncation "auto" on /v1/responses (router/openai/responses_api.py `_fitted`): a conversation
that does not fit the context with max_output_tokens loses its oldest items, as few as needed,
never the instructions nor the new input, and never so that a tool's output is left without its
call; the work is a bounded number of prompt counts (a binary search); the usage is that of the
prompt run. Without "auto" (and when even the new input alone does not fit) the whole
conversation goes to the router, which refuses it as before. On the front's ASGI app with a fake
prompt encoder and a fake router."""

from __future__ import annotations

import asyncio
import json
import math

from helpers.http_front import FakeRouter, asgi_call, front_app, one_token
from pdserve.router.openai.responses_api import _cuts

LIMIT = 100  # the context, in the fake encoder's tokens


def _tokens(chat) -> int:
    """The fake encoder's count of a chat: two per message, then one per word of its content."""
    return sum(2 + len(m.content.split()) for m in chat.messages)


class _Encoder:
    """The router's prompt encoder, faked (`_tokens`); it counts the chats it tokenized."""

    max_model_len = LIMIT

    def __init__(self):
        self.calls = 0

    def tokenize_chat(self, chat, add_special_tokens=False):
        self.calls += 1
        return [1] * _tokens(chat)


def _say(i: int, role: str = "user", words: str = "a b c d") -> dict:
    kind = "output_text" if role == "assistant" else "input_text"
    return {
        "type": "message",
        "id": f"msg_{i}",
        "role": role,
        "content": [{"type": kind, "text": f"m{i} {words}"}],
        "status": "completed",
    }


def _history(n: int) -> list[dict]:
    """n messages of 7 tokens each (`_tokens`), a user's and an assistant's in turn."""
    return [_say(i, "user" if i % 2 == 0 else "assistant") for i in range(n)]


def _run(body: dict, history: list[dict]):
    """(status, reply, the router's Generate requests, the encoder) of one POST /v1/responses
    continuing a stored response whose conversation is `history`."""
    router, encoder = FakeRouter(lambda gen: one_token(_tokens(gen.chat))), _Encoder()
    app = front_app(stub=router, encoder=encoder, max_model_len=LIMIT)
    app.state.front.responses.put({"id": "resp_1"}, history, (0, len(history)), None)
    full = {"previous_response_id": "resp_1", "instructions": "Be brief.", **body}
    raw = json.dumps(full).encode()
    status, _, reply = asyncio.run(asgi_call(app, "POST", "/v1/responses", raw))
    return status, reply, router.gens, encoder


def test_auto_drops_the_fewest_oldest_items_for_the_prompt_to_fit():
    history = _history(40)  # 280 tokens: with the rest, far past the context
    body = {"input": "new words here", "max_output_tokens": 20, "truncation": "auto"}
    status, reply, gens, encoder = _run(body, history)
    assert status == 200, reply
    messages = gens[0].chat.messages
    # 4 (instructions) + 7 per item kept + 5 (the input) + 20 (the answer) <= 100: ten items
    assert [m.content for m in messages][0] == "Be brief."
    assert [m.content.split()[0] for m in messages[1:-1]] == [f"m{i}" for i in range(30, 40)]
    assert messages[-1].content == "new words here"
    assert _tokens(gens[0].chat) + 20 <= LIMIT < _tokens(gens[0].chat) + 7 + 20
    # the usage is the prompt run's; nothing extra in the Response, truncation echoed
    assert reply["usage"]["input_tokens"] == _tokens(gens[0].chat) == 79
    assert reply["truncation"] == "auto" and reply["status"] == "completed"
    # bounded: the whole prompt, the input alone, then a binary search over the 41 cuts
    assert encoder.calls <= 2 + math.ceil(math.log2(41))


def test_a_conversation_that_fits_is_run_whole():
    history = _history(4)
    body = {"input": "hi", "max_output_tokens": 20, "truncation": "auto"}
    status, reply, gens, encoder = _run(body, history)
    assert status == 200, reply
    assert len(gens[0].chat.messages) == 6 and encoder.calls == 1


def test_without_auto_the_whole_conversation_goes_to_be_refused_as_before():
    history = _history(40)
    for extra in ({}, {"truncation": "disabled"}):
        body = {"input": "new words here", "max_output_tokens": 20, **extra}
        status, reply, gens, encoder = _run(body, history)
        assert len(gens[0].chat.messages) == 42 and encoder.calls == 0
    # "auto" where even the new input alone does not fit: the same as without it
    body = {"input": "w " * 90, "max_output_tokens": 20, "truncation": "auto"}
    status, reply, gens, encoder = _run(body, history)
    assert len(gens[0].chat.messages) == 42 and encoder.calls == 2


def test_cuts_leave_no_tool_output_without_its_call():
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c", "output": "x"}
    history = [
        _say(0),  # 0
        {"type": "reasoning", "summary": [], "content": []},  # 1
        call,  # 2
        call,  # 3: the second of parallel calls
        output,  # 4
        output,  # 5
        _say(6, "assistant"),  # 6
        call,  # 7
    ]
    assert _cuts(history, [output]) == [0, 1, 2, 6, 7, 8]
    assert _cuts(history, []) == [0, 1, 2, 6, 7]  # no input: the last item stays
