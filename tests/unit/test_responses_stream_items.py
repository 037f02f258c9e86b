"""/v1/responses' stream (router/openai/responses_api.py `_EventWriter`): each output item is
finished (its *.done events, then response.output_item.done) before the next item's
response.output_item.added, as OpenAI's and vLLM's streams go; a reasoning item's text is wrapped
in content_part.added/done with a reasoning_text part; and the openai SDK's own stream accumulator
ends with the response that response.completed carries."""

from __future__ import annotations

import asyncio
import json

from pydantic import TypeAdapter

from helpers.sdk import LazyModule
from pdserve.router.openai.responses_api import ResponsesRequest, Shape

openai_types = LazyModule("openai.types.responses")
streaming = LazyModule("openai.lib.streaming.responses._responses")

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMS}
USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def _body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps({"input": "hi", **fields}))


def _chunk(delta=None, reason=None) -> dict:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": reason}]}


def _call(index: int, name: str, arguments: str) -> dict:
    function = {"name": name, "arguments": arguments}
    return {"index": index, "id": f"call_{index}", "type": "function", "function": function}


def _events(shape: Shape, chunks: list) -> list:
    """The SDK's typed events of the stream `shape` writes for `chunks` (each frame's event line
    checked against its type)."""

    async def gen():
        for c in chunks:
            yield c

    async def collect():
        return [e async for e in shape.events(gen())]

    adapter = TypeAdapter(openai_types.ResponseStreamEvent)
    out = []
    for frame in asyncio.run(collect()):
        head, data = frame.decode().rstrip("\n").split("\n")
        event = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {event.type}"
        out.append(event)
    return out


def _check_items_finish_in_turn(events: list) -> None:
    """Every event of an output item comes after its output_item.added and before its
    output_item.done, and an item is added only once the one before it is done."""
    open_index = None
    for e in events:
        index = getattr(e, "output_index", None)
        if e.type == "response.output_item.added":
            assert open_index is None, f"item {e.output_index} added while {open_index} is open"
            open_index = e.output_index
        elif e.type == "response.output_item.done":
            assert index == open_index
            open_index = None
        elif index is not None:
            assert index == open_index, f"{e.type} for item {index} while {open_index} is open"
    assert open_index is None


def _accumulated(events: list, tools=()):
    """The final response the SDK's responses.stream accumulator gives for `events`."""
    state = streaming.ResponseStreamState(input_tools=list(tools), text_format=streaming.omit)
    for e in events:
        state.handle_event(e)
    return state._completed_response


REASONING_THEN_TEXT = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"reasoning": "The "}),
    _chunk({"reasoning": "capital."}),
    _chunk({"content": "Par"}),
    _chunk({"content": "is."}),
    _chunk(reason="stop"),
    {"choices": [], "usage": USAGE},
    "[DONE]",
]


def test_a_reasoning_item_is_finished_before_the_answer_starts():
    events = _events(Shape(_body(), "tiny"), REASONING_THEN_TEXT)
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    _check_items_finish_in_turn(events)
    added, done = events[3], events[7]
    assert (added.part.type, added.part.text, added.item_id) == (
        "reasoning_text",
        "",
        events[2].item.id,
    )
    assert (done.part.type, done.part.text, done.content_index) == (
        "reasoning_text",
        "The capital.",
        0,
    )
    assert events[8].item.status == "completed" and events[8].item.content[0].text == "The capital."
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output_text == "Paris."
    assert _accumulated(events).model_dump(exclude_none=True) == final.model_dump(exclude_none=True)


def test_a_message_is_finished_before_the_function_calls_after_it():
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Looking."}),
        _chunk({"tool_calls": [_call(0, "get_weather", '{"city":"Paris"}')]}),
        _chunk({"tool_calls": [_call(1, "get_weather", '{"city":')]}),
        _chunk({"tool_calls": [{"index": 1, "function": {"arguments": '"Rome"}'}}]}),
        _chunk(reason="tool_calls"),
        {"choices": [], "usage": USAGE},
        "[DONE]",
    ]
    events = _events(Shape(_body(tools=[TOOL]), "tiny"), chunks)
    _check_items_finish_in_turn(events)
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert [json.loads(o.arguments)["city"] for o in final.output[1:]] == ["Paris", "Rome"]
    assert _accumulated(events, [TOOL]).model_dump(exclude_none=True) == final.model_dump(
        exclude_none=True
    )


def test_text_after_a_call_is_an_item_of_its_own():
    chunks = [
        _chunk({"reasoning": "Hm."}),
        _chunk({"tool_calls": [_call(0, "get_weather", '{"city":"Paris"}')]}),
        _chunk({"content": "Done."}),
        _chunk(reason="stop"),
        {"choices": [], "usage": USAGE},
        "[DONE]",
    ]
    events = _events(Shape(_body(tools=[TOOL]), "tiny"), chunks)
    _check_items_finish_in_turn(events)
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "function_call", "message"]
    assert final.output_text == "Done." and all(o.status == "completed" for o in final.output)
    assert _accumulated(events, [TOOL]).model_dump(exclude_none=True) == final.model_dump(
        exclude_none=True
    )
