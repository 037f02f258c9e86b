"""Tool calls served (router/openai/protocol.py, router/openai/responses/tool_calls.py): a router in
front of a prefill and a decode worker on a tiny random model with a byte-level tokenizer and a
short chat template that takes tools (the Hermes fallback for templates that do not is
tests/unit/test_tool_calls.py's, and SmolLM2's in tests/e2e/test_openai_up.py). Through the
official `openai` client, streamed and not: a forced call (a named function, or "required" over
two tools) gives arguments that validate against the function's schema, and the round trip goes
on with the tool's result to a final answer; in "auto" mode a <tool_call> block the model writes
(a guided_regex makes this model write one) comes back as tool_calls. Bad values get a 400 naming
the field, and the router keeps serving."""

from __future__ import annotations

import json

import pytest

from helpers.http import CHAT, Workers, assert_error, openai_client as client, post, serves
from helpers.structured import TOOL_TEMPLATE as TEMPLATE, WEATHER, byte_level_model

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

MODEL = "tiny"
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}, "exact": {"type": "boolean"}},
    "required": ["zone", "exact"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
USER = {"role": "user", "content": "What is the weather in Paris?"}
ANSWER = "It is sunny."


@pytest.fixture(scope="module")
def router(tiny_models, tmp_path_factory, one_thread):
    src, _ = tiny_models("llama-gqa")
    model_dir = byte_level_model(src, tmp_path_factory.mktemp("byte-tools"), TEMPLATE)
    w = Workers(model_dir, max_model_len=512)
    r = w.router()
    yield r
    r.stop()
    w.stop()


def _create(router_, stream: bool, **kwargs):
    """(content, tool_calls as dicts, finish_reason) of a chat completion, streamed or not."""
    args = {"model": MODEL, "max_tokens": 96, "temperature": 1.0, "seed": 3, **kwargs}
    c = client(router_)
    if not stream:
        choice = c.chat.completions.create(**args).choices[0]
        calls = [t.model_dump() for t in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", {}, None
    for chunk in c.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for t in ch.delta.tool_calls or []:
            call = calls.setdefault(
                t.index,
                {"id": None, "type": "function", "function": {"name": None, "arguments": ""}},
            )
            if t.id:
                call["id"], call["function"]["name"] = t.id, t.function.name
            call["function"]["arguments"] += t.function.arguments or ""
        reason = ch.finish_reason or reason
    return content or None, [calls[i] for i in sorted(calls)], reason


def _valid(call: dict, names=("get_weather", "get_time")) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_"), call
    name = call["function"]["name"]
    assert name in names, call
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, SCHEMA_OF[name])
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_round_trip(router, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, reason = _create(
        router, stream, messages=[USER], tools=TOOLS, tool_choice=named
    )
    assert reason == "tool_calls" and content is None and len(calls) == 1, (content, calls)
    args = _valid(calls[0], names=("get_weather",))
    # the call and its result go back; the final answer (guided here: a random model's words)
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {
            "role": "tool",
            "tool_call_id": calls[0]["id"],
            "content": json.dumps({"sky": "sun", **args}),
        },
    ]
    content, calls2, reason = _create(
        router, stream, messages=messages, tools=TOOLS, extra_body={"guided_choice": [ANSWER]}
    )
    assert (content, calls2, reason) == (ANSWER, [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_required_picks_one_of_the_tools(router, stream):
    for seed in range(3):
        _, calls, reason = _create(
            router, stream, messages=[USER], tools=TOOLS, tool_choice="required", seed=seed
        )
        assert reason == "tool_calls" and len(calls) == 1, calls
        _valid(calls[0])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_calls_the_model_writes(router, stream):
    block = (
        r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)", '
        r'"exact": (true|false)\}\}</tool_call>'
    )
    content, calls, reason = _create(
        router, stream, messages=[USER], tools=TOOLS, extra_body={"guided_regex": r"Ok\." + block}
    )
    assert (content, reason, len(calls)) == ("Ok.", "tool_calls", 1), (content, calls)
    _valid(calls[0], names=("get_time",))
    # tool_choice none: the same output stays text
    content, calls, reason = _create(
        router,
        stream,
        messages=[USER],
        tools=TOOLS,
        tool_choice="none",
        extra_body={"guided_regex": r"Ok\." + block},
    )
    assert content.startswith("Ok.<tool_call>") and calls == [] and reason == "stop"


BAD_NAME = [{"type": "function", "function": {"name": "get weather"}}]
BAD_SCHEMA = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
NAMED = {"type": "function", "function": {"name": "nope"}}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": BAD_NAME}, "tools[0].function.name"),
        ({"tools": BAD_SCHEMA}, "tools[0].function.parameters"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": TOOLS * 65}, "tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": "get_weather"}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": NAMED}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ({"messages": [USER, {"role": "tool", "content": "x"}]}, "messages[1]"),
        ({"messages": [USER, {"role": "assistant", "content": None}]}, "messages[1].content"),
        (
            {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}]},
            "messages[1].tool_calls[0].type",
        ),
    ],
)
def test_bad_values_get_a_400_naming_the_field(router, extra, param):
    body = {"model": MODEL, "messages": [USER], "max_tokens": 4, **extra}
    status, _, raw = post(router, CHAT, body)
    err = assert_error(status, raw, 400, param)
    assert param.split("[")[0] in err["message"], err
    serves(router)


def test_a_schema_without_a_grammar_is_served_in_auto_mode(router):
    """An agent's tool whose schema uses keywords the grammar library does not implement ("not",
    "propertyNames") is served in "auto" mode; forcing it is a 400 naming tool_choice."""
    odd = {
        "type": "object",
        "properties": {"x": {"not": {"type": "string"}}},
        "propertyNames": {"pattern": "^[a-z]+$"},
    }
    tools = [{"type": "function", "function": {"name": "odd", "parameters": odd}}]
    body = {"model": MODEL, "messages": [USER], "max_tokens": 4, "tools": tools}
    status, _, raw = post(router, CHAT, body)
    assert status == 200, raw[:300]
    status, _, raw = post(router, CHAT, {**body, "tool_choice": "required"})
    assert_error(status, raw, 400, "tool_choice")
    serves(router)
