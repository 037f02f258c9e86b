"""OpenAI Responses fields /v1/responses accepts and echoes (router/openai/responses_api.py):
text.verbosity and prompt_cache_retention (no effect here), tool_choice allowed_tools (only the
listed tools reach the model), OpenAI's metadata bounds (responses and conversations), the
accepted fields echoed in the Response (completed_at set once it completed), and a turn with no
input that continues a conversation. On the front's ASGI app with a fake router where a route is
needed."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from helpers.http_front import FakeRouter, asgi_call, front_app, one_token
from helpers.sdk import LazyModule
from pdserve.router.openai.errors import validation_error
from pdserve.router.openai.responses_api import RESPONSES_FIELDS, ResponsesRequest, Shape

openai_types = LazyModule("openai.types.responses")

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "parameters": PARAMS}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
CHAT = {"choices": [{"message": {"content": "Hi."}, "finish_reason": "stop"}]}


def _body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps({"input": "hi", **fields}))


def _refused(**fields):
    with pytest.raises(ValidationError) as e:
        _body(**fields)
    return validation_error(e.value, RESPONSES_FIELDS)


def _allowed(mode: str, *names: str) -> dict:
    tools = [{"type": "function", "name": n} for n in names]
    return {"type": "allowed_tools", "mode": mode, "tools": tools}


def test_verbosity_and_prompt_cache_retention_are_accepted_and_echoed():
    b = _body(text={"verbosity": "low"}, prompt_cache_retention="24h")
    r = openai_types.Response.model_validate(Shape(b, "tiny").whole(CHAT))
    assert r.text.verbosity == "low" and r.prompt_cache_retention == "24h"
    assert Shape(_body(), "tiny").whole(CHAT)["text"]["verbosity"] == "medium"  # OpenAI's default
    assert _body(text={"verbosity": "high"}).as_chat() == _body().as_chat()  # no effect
    for fields, param in (
        ({"text": {"verbosity": "loud"}}, "text.verbosity"),
        ({"prompt_cache_retention": "1y"}, "prompt_cache_retention"),
    ):
        assert _refused(**fields).param == param


def test_allowed_tools_restrict_the_tools_the_model_may_call():
    b = _body(tools=[WEATHER, TIME], tool_choice=_allowed("required", "get_time"))
    chat = b.as_chat()
    assert [t.function.name for t in chat.tools] == ["get_time"]
    assert chat.tool_choice == "required"
    chat = _body(tools=[WEATHER, TIME], tool_choice=_allowed("auto", "get_weather")).as_chat()
    assert [t.function.name for t in chat.tools] == ["get_weather"] and chat.tool_choice == "auto"
    # echoed as sent, with every tool
    r = openai_types.Response.model_validate(Shape(b, "tiny").whole(CHAT))
    assert r.tool_choice.type == "allowed_tools" and r.tool_choice.mode == "required"
    assert r.tool_choice.tools == [{"type": "function", "name": "get_time"}]
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]


@pytest.mark.parametrize(
    "choice, param, words",
    [
        (_allowed("auto", "get_time", "nope"), "tool_choice", "'nope' is not one of the tools"),
        (_allowed("sometimes", "get_time"), "tool_choice.mode", None),
        (
            {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp"}]},
            "tool_choice.tools",
            "only function tools",
        ),
        ({"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice.tools", None),
    ],
)
def test_bad_allowed_tools_name_the_field(choice, param, words):
    err = _refused(tools=[WEATHER, TIME], tool_choice=choice)
    assert err.status == 400 and err.param == param, err.message
    assert words is None or words in err.message, err.message


def test_a_required_allowed_tool_and_a_text_format_are_refused_together():
    fmt = {"format": {"type": "json_object"}}
    err = _refused(tools=[TIME], tool_choice=_allowed("required", "get_time"), text=fmt)
    assert err.param == "text" and "tool_choice" in err.message
    _body(tools=[TIME], tool_choice=_allowed("auto", "get_time"), text=fmt)  # auto: accepted


def test_metadata_takes_openai_s_bounds():
    b = _body(metadata={"k" * 64: "v" * 512})
    assert Shape(b, "tiny").whole(CHAT)["metadata"] == {"k" * 64: "v" * 512}
    for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}):
        assert _refused(metadata=metadata).param == "metadata"


def test_metadata_bounds_on_conversations():
    app = front_app()

    async def post(path, body):
        status, _, reply = await asgi_call(app, "POST", path, json.dumps(body).encode())
        return status, reply

    async def run():
        status, conv = await post("/v1/conversations", {"metadata": {"k" * 64: "v" * 512}})
        assert status == 200 and conv["metadata"] == {"k" * 64: "v" * 512}, conv
        path = f"/v1/conversations/{conv['id']}"
        for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}):
            for where in ("/v1/conversations", path):
                status, reply = await post(where, {"metadata": metadata})
                assert status == 400 and reply["error"]["param"] == "metadata", reply

    asyncio.run(run())


def test_accepted_fields_are_echoed():
    b = _body(
        prompt_cache_key="k",
        safety_identifier="s",
        service_tier="auto",
        max_tool_calls=3,
        top_logprobs=2,
        tools=[WEATHER],
    )
    out = Shape(b, "tiny").whole(CHAT)
    r = openai_types.Response.model_validate(out)
    assert (r.prompt_cache_key, r.safety_identifier, r.service_tier) == ("k", "s", "default")
    assert (r.max_tool_calls, r.top_logprobs) == (3, 2)
    assert r.status == "completed" and isinstance(out["completed_at"], int)
    assert abs(out["completed_at"] - out["created_at"]) <= 60
    assert _body(service_tier="flex").as_chat() == _body().as_chat()
    assert Shape(_body(service_tier="flex"), "t").whole(CHAT)["service_tier"] == "flex"
    cut = {"choices": [{"message": {"content": "H"}, "finish_reason": "length"}]}
    assert Shape(_body(), "tiny").whole(cut)["completed_at"] is None  # incomplete
    assert Shape(_body(), "tiny").response("in_progress", [])["completed_at"] is None


def test_a_turn_without_input_continues_a_conversation():
    router = FakeRouter(lambda gen: one_token(5))
    app = front_app(stub=router)

    async def post(path, body):
        status, _, reply = await asgi_call(app, "POST", path, json.dumps(body).encode())
        return status, reply

    async def run():
        status, reply = await post("/v1/responses", {})
        assert status == 400 and reply["error"]["param"] == "input", reply
        assert "conversation" in reply["error"]["message"]
        _, empty = await post("/v1/conversations", {})
        status, reply = await post("/v1/responses", {"conversation": empty["id"]})
        assert status == 400 and reply["error"]["param"] == "input", reply
        first = {"type": "message", "role": "user", "content": "Hello?"}
        _, conv = await post("/v1/conversations", {"items": [first]})
        status, reply = await post("/v1/responses", {"conversation": conv["id"]})
        assert status == 200, reply
        assert [(m.role, m.content) for m in router.gens[0].chat.messages] == [("user", "Hello?")]
        status, _, listed = await asgi_call(
            app, "GET", f"/v1/responses/{reply['id']}/input_items", query=""
        )
        assert status == 200 and listed["data"] == []  # no input of its own
        status, _, items = await asgi_call(
            app, "GET", f"/v1/conversations/{conv['id']}/items", query="order=asc"
        )
        assert [i["role"] for i in items["data"]] == ["user", "assistant"]
        # and continuing a previous response alone
        status, again = await post("/v1/responses", {"previous_response_id": reply["id"]})
        assert status == 200, again
        roles = [m.role for m in router.gens[1].chat.messages]
        assert roles == ["user", "assistant"]

    asyncio.run(run())
