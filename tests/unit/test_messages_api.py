"""/v1/messages without a server (router/openai/messages_api.py): an Anthropic Messages body is
read as the chat it describes (system, text and tool blocks, prefill, tool choice, output format),
bad values get a 400 naming the field, and a chat's answer (whole, and as chunks) becomes the
Message and the stream events the anthropic SDK's own types and stream accumulator accept;
errors take Anthropic's error shape."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from helpers.sdk import LazyModule
from pdserve.router.openai.errors import ApiError, validation_error
from pdserve.router.openai.messages_api import (
    MESSAGES_FIELDS,
    CountTokensRequest,
    MessagesRequest,
    Shape,
)

anthropic_types = LazyModule("anthropic.types")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "The weather", "input_schema": SCHEMA}
USAGE = {
    "prompt_tokens": 10,
    "completion_tokens": 4,
    "total_tokens": 14,
    "prompt_tokens_details": {"cached_tokens": 3},
}
USER = {"role": "user", "content": "hi"}


def body(**fields) -> MessagesRequest:
    fields = {"model": "tiny", "max_tokens": 8, "messages": [USER], **fields}
    return MessagesRequest.model_validate_json(json.dumps(fields))


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"model": ""}, "model", None),
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", None),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages",
            "'image'",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]},
            "messages",
            "cannot hold a tool_result",
        ),
        (
            {
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    },
                ]
            },
            "messages",
            "tool_result",
        ),
        ({"temperature": 1.5}, "temperature", None),
        ({"top_k": -1}, "top_k", None),
        ({"stop_sequences": [""]}, "stop_sequences[0]", None),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools", "custom"),
        ({"tools": [TOOL, TOOL]}, "tools", "unique"),
        ({"tools": [{**TOOL, "name": "no spaces"}]}, "tools[0].name", None),
        ({"tools": [{**TOOL, "input_schema": {"type": "strin"}}]}, "tools[0].input_schema", None),
        ({"tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "x"}}, "tool_choice", None),
        ({"thinking": {"type": "on"}}, "thinking.type", None),
        (
            {
                "tools": [TOOL],
                "tool_choice": {"type": "any"},
                "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
            },
            "output_config",
            "one of them",
        ),
        ({"container": "c"}, "container", "unknown field"),
        ({"stream": "yes"}, "stream", None),
    ],
)
def test_bad_values_name_the_field(fields, param, words):
    with pytest.raises(ValidationError) as e:
        body(**fields)
    err = validation_error(e.value, MESSAGES_FIELDS)
    assert err.status == 400 and err.param == param, err.message
    assert words is None or words in err.message, err.message


def _roles(chat) -> list[tuple[str, str | None]]:
    return [(m.role, m.text() if m.content is not None else None) for m in chat.messages]


def test_system_blocks_and_sampling_fields_are_a_chat():
    chat = body(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        temperature=0,
        top_p=0.5,
        top_k=5,
        stop_sequences=["\n\n"],
        metadata={"user_id": "u"},
    ).as_chat()
    assert _roles(chat) == [("system", "Be brief."), ("user", "hi")]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.top_k) == (8, 0, 0.5, 5)
    assert chat.stop == ["\n\n"] and chat.add_generation_prompt and not chat.stream


def test_tool_use_round_trip_and_joined_turns_are_a_chat():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Paris?"}]},
        {"role": "user", "content": "And now?"},  # joined to the turn before, as Anthropic does
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Looking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "P"},
                    "caller": {"type": "direct"},  # as Anthropic's own answers replay it
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "no"}],
                    "is_error": True,
                },
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]
    chat = body(messages=messages, tools=[TOOL], tool_choice={"type": "auto"}, stream=True)
    chat = chat.as_chat()
    assert _roles(chat) == [
        ("user", "Paris?\nAnd now?"),
        ("assistant", "Looking."),
        ("tool", "sunny"),
        ("tool", "Error: no"),
        ("user", "Thanks."),
    ]
    assert chat.messages[1].thought() == "hm"  # the template's reasoning_content
    call = chat.messages[1].tool_calls[0]
    assert call.id == "toolu_1" and json.loads(call.function.arguments) == {"city": "P"}
    assert chat.messages[2].tool_call_id == "toolu_1"
    assert chat.tools[0].function.parameters == SCHEMA and chat.tool_choice == "auto"
    assert chat.stream_options.include_usage and chat.stream_options.continuous_usage_stats


def test_a_last_assistant_message_is_continued():
    messages = [USER, {"role": "assistant", "content": "The answer is ("}]
    chat = body(messages=messages).as_chat()
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert _roles(chat)[-1] == ("assistant", "The answer is (")


def test_tool_choices_and_the_output_format_map_to_chat():
    forced = body(tools=[TOOL], tool_choice={"type": "any"}).as_chat()
    assert forced.tool_choice == "required" and forced.tool_mode() == "forced"
    named = body(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"}).as_chat()
    assert named.tool_choice.function.name == "get_weather"
    assert body(tools=[TOOL], tool_choice={"type": "none"}).as_chat().tool_mode() == "none"
    fmt = {"format": {"type": "json_schema", "schema": SCHEMA}, "effort": "low"}
    shaped = body(output_config=fmt).as_chat()
    assert shaped.response_format.json_schema.schema_ == SCHEMA
    count = CountTokensRequest.model_validate({"model": "tiny", "messages": [USER]}).as_chat()
    assert _roles(count) == [("user", "hi")]


def _chat(content, calls=None, finish="stop", stop_reason=None) -> dict:
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    choice = {"message": message, "finish_reason": finish, "stop_reason": stop_reason}
    return {"choices": [choice], "usage": USAGE, "pdserve": {"request_id": "x"}}


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
}


def test_whole_chat_completion_becomes_a_message():
    out = Shape(body(tools=[TOOL]), "tiny").whole(_chat("Looking.", [CALL], "tool_calls"))
    m = anthropic_types.Message.model_validate(out)
    assert m.model == "tiny" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text == "Looking."
    tool = m.content[1]
    assert (tool.type, tool.id, tool.name, tool.input) == (
        "tool_use",
        "toolu_1",
        "get_weather",
        {"city": "Paris"},
    )
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    # input_tokens are the prompt's uncached tokens; the cached ones are read from the cache
    assert (m.usage.input_tokens, m.usage.cache_read_input_tokens, m.usage.output_tokens) == (
        7,
        3,
        4,
    )
    stops = [
        (_chat("a", finish="stop", stop_reason="###"), ("stop_sequence", "###")),
        (_chat("a", finish="stop", stop_reason=2), ("end_turn", None)),
        (_chat("a"), ("end_turn", None)),
        (_chat("a", finish="length"), ("model_context_window_exceeded", None)),  # 4 < 8
    ]
    for chat, want in stops:
        m = anthropic_types.Message.model_validate(Shape(body(), "tiny").whole(chat))
        assert (m.stop_reason, m.stop_sequence) == want
    m = anthropic_types.Message.model_validate(
        Shape(body(max_tokens=4), "tiny").whole(_chat("", finish="length"))
    )
    assert m.stop_reason == "max_tokens" and m.content == []


def _chunk(delta=None, reason=None, stop=None, **extra) -> dict:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": reason}
    if reason is not None:
        choice["stop_reason"] = stop
    return {"choices": [choice], **extra}


async def _collect(shape, chunks):
    async def gen():
        for c in chunks:
            yield c

    return [e async for e in shape.events(gen())]


def _events(raw: list[bytes]) -> list:
    from pydantic import TypeAdapter

    adapter = TypeAdapter(anthropic_types.RawMessageStreamEvent)
    out = []
    for frame in raw:
        head, data = frame.decode().rstrip("\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        if payload == {"type": "ping"}:  # the SDK skips pings (test_messages_stream_events.py)
            continue
        out.append(payload if payload["type"] == "error" else adapter.validate_python(payload))
    return out


def test_chat_chunks_become_the_sdk_stream_events():
    from anthropic.lib.streaming._messages import accumulate_event

    call = {**CALL, "index": 0, "function": {"name": "get_weather", "arguments": '{"city":'}}
    first = {"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10}
    chunks = [
        _chunk({"role": "assistant", "content": ""}, usage=first),
        _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}),
        _chunk({"tool_calls": [call]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        _chunk(reason="tool_calls"),
        {"choices": [], "usage": USAGE, "pdserve": {"request_id": "x"}},
        "[DONE]",
    ]
    events = _events(asyncio.run(_collect(Shape(body(tools=[TOOL]), "tiny"), chunks)))
    assert [e.type for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0].message.usage.input_tokens == 10
    snapshot, bufs = None, {}
    for e in events:
        snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot.content[0].text == "Hello"
    assert snapshot.content[1].name == "get_weather" and snapshot.content[1].id == "toolu_1"
    assert snapshot.content[1].input == {"city": "Paris"}
    assert snapshot.stop_reason == "tool_use"
    assert (snapshot.usage.input_tokens, snapshot.usage.cache_read_input_tokens) == (7, 3)
    assert snapshot.usage.output_tokens == 4


def test_a_stop_sequence_ends_the_stream_with_it():
    chunks = [
        _chunk({"role": "assistant", "content": ""}, usage=USAGE),
        _chunk({"content": "a"}),
        _chunk(reason="stop", stop="END"),
        "[DONE]",
    ]
    events = _events(asyncio.run(_collect(Shape(body(), "tiny"), chunks)))
    delta = [e for e in events if e.type == "message_delta"][0].delta
    assert (delta.stop_reason, delta.stop_sequence) == ("stop_sequence", "END")


def test_a_failure_mid_stream_is_one_error_event():
    aborted = {"message": "the request was aborted", "type": "server_error", "code": "aborted"}
    chunks = [
        _chunk({"role": "assistant", "content": ""}, usage=USAGE),
        _chunk({"content": "x"}),
        {"error": aborted},
        "[DONE]",
    ]
    events = _events(asyncio.run(_collect(Shape(body(), "tiny"), chunks)))
    assert events[-1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the request was aborted"},
    }
    assert not any(getattr(e, "type", None) == "message_stop" for e in events)


@pytest.mark.parametrize(
    "status, kind",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_errors_take_anthropics_shape(status, kind):
    response = ApiError(status, "why").response(anthropic=True)
    assert response.status_code == status
    assert json.loads(response.body) == {
        "type": "error",
        "error": {"type": kind, "message": "why"},
    }


def test_a_reasoning_models_thinking_is_a_thinking_block():
    from anthropic.lib.streaming._messages import accumulate_event

    chat = {
        "choices": [
            {
                "message": {"content": "Paris.", "reasoning": "The capital."},
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": USAGE,
    }
    m = anthropic_types.Message.model_validate(Shape(body(), "tiny").whole(chat))
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "The capital." and m.content[1].text == "Paris."
    first = {"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10}
    chunks = [
        _chunk({"role": "assistant", "content": ""}, usage=first),
        _chunk({"reasoning": "The ", "reasoning_content": "The "}),
        _chunk({"reasoning": "capital.", "reasoning_content": "capital."}),
        _chunk({"content": "Paris."}),
        _chunk(reason="stop"),
        {"choices": [], "usage": USAGE},
        "[DONE]",
    ]
    events = _events(asyncio.run(_collect(Shape(body(), "tiny"), chunks)))
    snapshot, bufs = None, {}
    for e in events:
        snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)
    assert [b.type for b in snapshot.content] == ["thinking", "text"]
    assert snapshot.content[0].thinking == "The capital." and snapshot.content[1].text == "Paris."


@pytest.mark.parametrize("kind, want", [("enabled", True), ("disabled", False), ("adaptive", None)])
def test_thinking_is_the_templates_switch(kind, want):
    chat = body(
        thinking={"type": kind, "budget_tokens": 1024} if kind == "enabled" else {"type": kind}
    )
    kwargs = chat.as_chat().chat_template_kwargs
    assert (kwargs or {}).get("enable_thinking") == want
    # an enabled one's budget caps the reasoning (engine/thinking.py)
    assert chat.as_chat().thinking_token_budget == (1024 if kind == "enabled" else None)
