"""A forced tool call (tool_choice required or named; Anthropic's any or tool) that max_tokens cut
off before its object ended (router/openai/responses/tool_calls.py `_forced_finish`): never the
grammar's {"arguments", "name"} object as the assistant's text. On the chat path it is the call,
as vLLM gives a cut forced call: named by the object when its name came whole, else by the tool
it must be (the only tool, or the named choice), its arguments as far as they came; a call that
cannot be named, or never began, is nothing. On /v1/messages (router/openai/messages_api.py) it
is a tool_use block (input {} where the cut arguments do not parse), whole and streamed, with
stop_reason max_tokens; a call named by tool_choice "tool" is its block even when the chat could
not name it."""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers.sdk import LazyModule
from pdserve.router.openai.messages_api import MessagesRequest, Shape
from pdserve.router.openai.responses.tool_calls import ToolCallParser, delta_of, join_events

anthropic_types = LazyModule("anthropic.types")

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
STEPS = [1, 3, 1000]


def _calls(text: str, step: int, tools: list, name: str | None = None):
    p = ToolCallParser(True, tools=tools, name=name)
    events = []
    for i in range(0, len(text), step):
        events += p.feed(text[i : i + step])
    events += p.finish()
    content, calls = join_events(events)
    assert content is None, content  # never the grammar's object as content
    assert [delta_of(e) for e in events] == [{"tool_calls": [_delta(c)]} for c in calls]
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _delta(call: dict) -> dict:
    return {"index": 0, "id": call["id"], "type": "function", "function": call["function"]}


@pytest.mark.parametrize("step", STEPS)
def test_a_cut_forced_call_is_the_call_as_far_as_it_came(step):
    # the only tool names it; the arguments as they came (vLLM's arguments of a cut named call)
    assert _calls('{"arguments": {"city": "Par', step, [WEATHER]) == [
        ("get_weather", '{"city": "Par')
    ]
    assert _calls('{"arg', step, [WEATHER]) == [("get_weather", "")]
    # whole arguments, the name cut: the arguments' JSON; a name that came whole names it
    assert _calls('{"arguments": {"city": "Paris"}, "na', step, [WEATHER]) == [
        ("get_weather", '{"city": "Paris"}')
    ]
    both = [WEATHER, NOW]
    assert _calls('{"arguments": {}, "name": "now"', step, both) == [("now", "{}")]
    # several tools and no name yet: the named choice's tool, else nothing
    assert _calls('{"arguments": {"ci', step, both, name="get_weather") == [("get_weather", '{"ci')]
    assert _calls('{"arguments": {"ci', step, both) == []
    # nothing of the call came (a reasoning model cut off in its reasoning): no call
    assert _calls("", step, [WEATHER]) == []


def _messages(choice: dict, tools=1) -> MessagesRequest:
    declared = [
        {"name": "get_weather", "input_schema": PARAMS},
        {"name": "now", "input_schema": {"type": "object"}},
    ][:tools]
    return MessagesRequest.model_validate(
        {
            "model": "tiny",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": declared,
            "tool_choice": choice,
        }
    )


def _chat(calls: list, reasoning: str | None = None) -> dict:
    message = {"content": None, "tool_calls": calls}
    if reasoning is not None:
        message["reasoning"] = reasoning
    return {
        "choices": [{"message": message, "finish_reason": "length", "stop_reason": None}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14},
    }


def _call(arguments: str, name: str = "get_weather") -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_cut_forced_call_is_a_tool_use_block():
    shape = Shape(_messages({"type": "any"}), "tiny")
    for arguments, given in (('{"city": "Par', {}), ('{"city": "Paris"}', {"city": "Paris"})):
        m = anthropic_types.Message.model_validate(shape.whole(_chat([_call(arguments)])))
        assert [b.type for b in m.content] == ["tool_use"]
        assert (m.content[0].name, m.content[0].input) == ("get_weather", given)
        assert m.stop_reason == "max_tokens"
    # named by tool_choice where the chat could not name it (several tools, the name not come)
    shape = Shape(_messages({"type": "tool", "name": "now"}, tools=2), "tiny")
    m = anthropic_types.Message.model_validate(shape.whole(_chat([])))
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "now", {})]
    assert m.content[0].id.startswith("toolu_") and m.stop_reason == "max_tokens"
    # any: no tool to name it by; a reasoning model's answer may have been cut in its reasoning
    shape = Shape(_messages({"type": "any"}, tools=2), "tiny")
    assert shape.whole(_chat([]))["content"] == []
    shape = Shape(_messages({"type": "tool", "name": "now"}, tools=2), "tiny")
    assert [b["type"] for b in shape.whole(_chat([], reasoning="Hm"))["content"]] == ["thinking"]


def _frames(shape: Shape, chunks: list) -> list[dict]:
    async def run():
        async def gen():
            for c in chunks:
                yield c

        return [e async for e in shape.events(gen())]

    return [
        json.loads(f.decode().split("\n")[1].removeprefix("data: ")) for f in asyncio.run(run())
    ]


def _stream(calls: list) -> list:
    first = {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}
    return [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": first},
        *[{"choices": [{"index": 0, "delta": {"tool_calls": [c]}}]} for c in calls],
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length", "stop_reason": None}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}},
        "[DONE]",
    ]


def test_a_cut_forced_call_streams_as_a_tool_use_block():
    call = {**_call('{"city": "Par'), "index": 0}
    frames = _frames(Shape(_messages({"type": "any"}), "tiny"), _stream([call]))
    blocks = [f["content_block"] for f in frames if f["type"] == "content_block_start"]
    assert [(b["type"], b["name"]) for b in blocks] == [("tool_use", "get_weather")]
    deltas = [f["delta"] for f in frames if f["type"] == "content_block_delta"]
    assert deltas == [{"type": "input_json_delta", "partial_json": '{"city": "Par'}]
    assert not any(d.get("type") == "text_delta" for d in deltas)
    assert [f for f in frames if f["type"] == "message_delta"][0]["delta"]["stop_reason"] == (
        "max_tokens"
    )
    # named by tool_choice where the chat gave no call: the block, opened and closed
    frames = _frames(
        Shape(_messages({"type": "tool", "name": "now"}, tools=2), "tiny"), _stream([])
    )
    kinds = [f["type"] for f in frames]
    assert kinds == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert frames[2]["content_block"]["name"] == "now" and frames[2]["content_block"]["input"] == {}


def test_the_chat_bodys_named_choice_names_a_cut_call_among_several_tools():
    """The chat path's parser (whole.py chat_text, also the stream's) takes the name from the
    body's tool_choice: with two tools the cut call is still the named tool's."""
    from pdserve.router.openai.protocol import ChatCompletionRequest
    from pdserve.router.openai.responses.reasoning import Reading
    from pdserve.router.openai.responses.whole import chat_text

    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [WEATHER, NOW],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
    )
    parser = chat_text(body, Reading())
    assert parser.tools.name == "get_weather"
