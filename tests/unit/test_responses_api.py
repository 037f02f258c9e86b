"""/v1/responses without a server (router/openai/responses_api.py): a body is read as the chat it
describes, bad values get a 400 naming the field, and a chat's answer (whole, and as chunks)
becomes a Response and the stream events the openai SDK's own types accept."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from helpers.sdk import LazyModule
from pdserve.router.openai.errors import validation_error
from pdserve.router.openai.responses_api import RESPONSES_FIELDS, ResponsesRequest, Shape

openai_types = LazyModule("openai.types.responses")

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMS}
USAGE = {
    "prompt_tokens": 3,
    "completion_tokens": 4,
    "total_tokens": 7,
    "prompt_tokens_details": {"cached_tokens": 1},
}


def body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps({"input": "hi", **fields}))


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"input": [{"type": "computer_call", "id": "x"}]}, "input", "'computer_call'"),
        (
            {"input": [{"type": "reasoning", "encrypted_content": "gAAA"}]},
            "input[0].encrypted_content",
            "not written by this server",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
            "input",
            "'input_file'",
        ),
        (  # an image neither as data nor by link
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].image_url",
            "base64 data URL",
        ),
        ({"input": []}, "input", "at least 1"),
        ({"input": 5}, "input", None),
        ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"tools": [TOOL, TOOL]}, "tools", "unique"),
        ({"tools": [{**TOOL, "name": "no spaces"}]}, "tools[0].name", None),
        ({"tools": [{**TOOL, "parameters": {"type": "nonsense"}}]}, "tools[0].parameters", None),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
            None,
        ),
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        ({"temperature": 2.5}, "temperature", None),
        ({"top_p": 0}, "top_p", None),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format", "name and schema"),
        ({"include": ["file_search_call.results"]}, "include[0]", None),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort", None),
        ({"top_logprobs": 21}, "top_logprobs", None),
        ({"priority": -(1 << 31) - 1}, "priority", None),
        ({"stream": "yes"}, "stream", None),
        ({"frobnicate": 1}, "frobnicate", "unknown field"),
        ({"tools": [TOOL], "text": {"verbosity": "loud"}}, "text.verbosity", None),
    ],
)
def test_bad_values_name_the_field(fields, param, words):
    with pytest.raises(ValidationError) as e:
        body(**fields)
    err = validation_error(e.value, RESPONSES_FIELDS)
    assert err.status == 400 and err.param == param, err.message
    assert words is None or words in err.message, err.message


def test_text_input_and_instructions_are_a_chat():
    chat = body(
        instructions="Be brief.", max_output_tokens=5, temperature=0, top_p=0.5, store=False
    ).as_chat()
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", "hi"),
    ]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p) == (5, 0, 0.5)
    assert chat.tools is None and not chat.stream


def test_vllm_s_sampling_fields_reach_the_chat():
    chat = body(min_tokens=2, thinking_token_budget=64, top_k=5).as_chat()
    assert (chat.min_tokens, chat.thinking_token_budget, chat.top_k) == (2, 64, 5)
    assert body().as_chat().thinking_token_budget is None


def test_item_input_with_a_function_round_trip_is_a_chat():
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    chat = body(input=items, tools=[TOOL], tool_choice="auto", stream=True).as_chat()
    roles = [m.role for m in chat.messages]
    assert roles == ["developer", "user", "assistant", "tool"]
    assistant, tool = chat.messages[2], chat.messages[3]
    assert assistant.content is None and assistant.tool_calls[0].id == "c1"
    assert assistant.tool_calls[0].function.name == "get_weather"
    assert tool.tool_call_id == "c1" and tool.text() == "sunny"
    assert chat.tools[0].function.parameters == PARAMS and chat.tool_choice == "auto"
    assert chat.stream_options.include_usage  # the stream's usage ends up in response.completed


def test_named_tool_choice_and_json_schema_format_map_to_chat():
    fmt = {"type": "json_schema", "name": "w", "schema": PARAMS}
    chat = body(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    assert chat.as_chat().tool_choice.function.name == "get_weather"
    plain = body(text={"format": fmt}).as_chat()
    assert plain.response_format.json_schema.schema_ == PARAMS


def test_a_forced_call_and_a_text_format_are_refused_together():
    with pytest.raises(ValidationError) as e:
        body(tools=[TOOL], tool_choice="required", text={"format": {"type": "json_object"}})
    err = validation_error(e.value, RESPONSES_FIELDS)
    assert err.param == "text" and "tool_choice" in err.message


def test_whole_chat_completion_becomes_a_response():
    chat = {
        "choices": [
            {
                "message": {
                    "content": "Looking.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": USAGE,
        "pdserve": {"request_id": "x"},
    }
    out = Shape(body(tools=[TOOL]), "tiny").whole(chat)
    r = openai_types.Response.model_validate(out)
    assert r.status == "completed" and r.output_text == "Looking." and r.model == "tiny"
    assert r.output[1].type == "function_call" and r.output[1].call_id == "call_1"
    assert json.loads(r.output[1].arguments) == {"city": "Paris"}
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (3, 4, 7)
    assert r.usage.input_tokens_details.cached_tokens == 1 and r.store is False
    cut = {**chat, "choices": [{"message": {"content": "ab"}, "finish_reason": "length"}]}
    r = openai_types.Response.model_validate(Shape(body(), "tiny").whole(cut))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"]


def _chunk(delta=None, reason=None, **extra) -> dict:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": reason}], **extra}


async def _collect(shape, chunks):
    async def gen():
        for c in chunks:
            yield c

    return [e async for e in shape.events(gen())]


def _events(raw: list[bytes]) -> list:
    from pydantic import TypeAdapter

    adapter = TypeAdapter(openai_types.ResponseStreamEvent)
    out = []
    for frame in raw:
        head, data = frame.decode().rstrip("\n").split("\n")
        event = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {event.type}"
        out.append(event)
    return out


def test_chat_chunks_become_the_sdk_stream_events():
    call = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":'},
    }
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}),
        _chunk({"tool_calls": [call]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        _chunk(reason="tool_calls"),
        {"choices": [], "usage": USAGE, "pdserve": {"request_id": "x"}},
        "[DONE]",
    ]
    events = _events(asyncio.run(_collect(Shape(body(tools=[TOOL]), "tiny"), chunks)))
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    done = events[-1].response
    assert done.output_text == "Hello" and done.usage.output_tokens == 4
    assert json.loads(done.output[1].arguments) == {"city": "Paris"}


def test_a_failure_mid_stream_is_one_error_event():
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "x"}),
        {
            "error": {
                "message": "the request was aborted",
                "type": "server_error",
                "code": "aborted",
            }
        },
        "[DONE]",
    ]
    events = _events(asyncio.run(_collect(Shape(body(), "tiny"), chunks)))
    assert events[-1].type == "error" and events[-1].message == "the request was aborted"
    assert not any(e.type == "response.completed" for e in events)


def test_openapi_schema_names_do_not_collide_across_bodies():
    """The OpenAPI document merges every body's nested models by name (app.document_bodies): two
    different models of one name would leave one body described wrongly."""
    from pdserve.router.openai.app import _BODIES

    seen: dict[str, dict] = {}
    for model in _BODIES.values():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schema.get("$defs", {}).items():
            assert seen.setdefault(name, sub) == sub, name
    assert "ResponsesRequest" in {m.__name__ for m in _BODIES.values()}


def test_a_reasoning_models_answer_has_a_reasoning_item():
    usage = {**USAGE, "completion_tokens_details": {"reasoning_tokens": 3}}
    chat = {
        "choices": [
            {"message": {"content": "Paris.", "reasoning": "The capital."}, "finish_reason": "stop"}
        ],
        "usage": usage,
    }
    r = openai_types.Response.model_validate(Shape(body(), "tiny").whole(chat))
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "Paris."
    assert r.output[0].content[0].text == "The capital."
    assert r.usage.output_tokens_details.reasoning_tokens == 3
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning": "The ", "reasoning_content": "The "}),
        _chunk({"reasoning": "capital.", "reasoning_content": "capital."}),
        _chunk({"content": "Paris."}),
        _chunk(reason="stop"),
        {"choices": [], "usage": usage},
        "[DONE]",
    ]
    events = _events(asyncio.run(_collect(Shape(body(), "tiny"), chunks)))
    assert [e.type for e in events][2:7] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
    ]
    done = {e.type: e for e in events}
    assert done["response.reasoning_text.done"].text == "The capital."
    final = done["response.completed"].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "The capital." and final.output_text == "Paris."
    assert final.usage.output_tokens_details.reasoning_tokens == 3


def test_replayed_reasoning_items_go_with_the_next_assistant_turn():
    b = body(
        input=[
            {"role": "user", "content": "Capital?"},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Hm."}],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "Paris"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Found."}]},
            {"role": "assistant", "content": "Paris."},
        ],
        reasoning={"effort": "minimal", "summary": "auto"},
    )
    chat = b.as_chat()
    turns = [(m.role, m.thought()) for m in chat.messages]
    assert turns == [("user", None), ("assistant", "Hm."), ("tool", None), ("assistant", "Found.")]
    assert chat.reasoning_effort == "low"


def test_logprobs_and_sealed_reasoning_when_included():
    b = body(
        include=["message.output_text.logprobs", "reasoning.encrypted_content"], top_logprobs=2
    )
    chat = b.as_chat()
    assert chat.logprobs and chat.top_logprobs == 2
    assert not body().as_chat().logprobs
    entry = {"token": "Pa", "logprob": -0.1, "bytes": [80, 97], "top_logprobs": []}
    whole = {
        "choices": [
            {
                "message": {"content": "Paris.", "reasoning": "The capital."},
                "logprobs": {"content": [entry]},
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }
    r = openai_types.Response.model_validate(Shape(b, "tiny").whole(whole))
    thought, message = r.output
    assert message.content[0].logprobs[0].token == "Pa"
    assert thought.encrypted_content.startswith("pdserve:v1:")
    # sent back with store false (Codex's way): the text reaches the next assistant turn
    replay = body(
        input=[
            {"role": "user", "content": "Capital?"},
            {"type": "reasoning", "summary": [], "encrypted_content": thought.encrypted_content},
            {"role": "assistant", "content": "Paris."},
        ]
    )
    assert replay.as_chat().messages[1].thought() == "The capital."
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _with_logprobs(_chunk({"content": "Pa"}), entry),
        _with_logprobs(_chunk({"content": "ris."}), {**entry, "token": "ris."}),
        _chunk(reason="stop"),
        {"choices": [], "usage": USAGE},
        "[DONE]",
    ]
    events = _events(asyncio.run(_collect(Shape(b, "tiny"), chunks)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [[lp.token for lp in e.logprobs] for e in deltas] == [["Pa"], ["ris."]]
    final = events[-1].response
    assert [lp.token for lp in final.output[0].content[0].logprobs] == ["Pa", "ris."]


def _with_logprobs(chunk: dict, entry: dict) -> dict:
    chunk["choices"][0]["logprobs"] = {"content": [entry]}
    return chunk


def test_cache_salt_and_max_tool_calls():
    chat = body(cache_salt="tenant-a", max_tool_calls=3).as_chat()
    assert chat.cache_salt == "tenant-a"
    assert body().as_chat().cache_salt is None
