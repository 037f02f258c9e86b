"""Tool calls without sockets: the parser of calls in an output
(router/openai/responses/tool_calls.py), whole and in chunks of every size (a forced call's
object read whole); the tools' fields of a chat body (router/openai/protocol.py) and their 400s
naming the field; the forced call's grammar (its arguments validate against the tool's schema,
local $refs moved along); and the chat's tools rendered (router/chat_tools.py): a template that
takes tools gets them, one that does not gets Hermes' system message, calls and results."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.chat_tools import chat_conversation, tool_call_format
from pdserve.router.openai.errors import validation_error
from pdserve.router.openai.protocol import (
    KNOWN_FIELDS,
    ChatCompletionRequest,
    _compile_error,
    chat_messages,
    sampling_params,
)
from pdserve.router.openai.responses.tool_calls import ToolCallParser, delta_of, join_events
from pdserve.router.text import BadRequest

jsonschema = pytest.importorskip("jsonschema")

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "now"}},
]
USER = {"role": "user", "content": "hi"}


def _parse(
    text: str, forced: bool, step: int, fmt: str = "hermes", tools=None
) -> tuple[str | None, list[dict], list[dict]]:
    p = ToolCallParser(forced, fmt=fmt, tools=tools)
    events = []
    for i in range(0, len(text), step):
        events += p.feed(text[i : i + step])
    events += p.finish()
    content, calls = join_events(events)
    assert p.num_calls == len(calls)
    return content, calls, events


def _call(name, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


STEPS = [1, 2, 3, 7, 1000]


@pytest.mark.parametrize("step", STEPS)
def test_auto_parses_several_calls_and_keeps_the_text(step):
    text = (
        "Let me check.\n"
        + _call("get_weather", {"city": "Paris"})
        + "\n"
        + _call("now", {})
        + "\n<tool_call>{not json}</tool_call> done <tool"
    )
    content, calls, events = _parse(text, False, step)
    assert content == "Let me check.\n\n\n<tool_call>{not json}</tool_call> done <tool"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # each call is one event; its stream delta carries index, id, type and the name
    deltas = [delta_of(e) for e in events if "index" in e]
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 1]
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"


QWEN3_CODER_CALLS = (
    "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n02134 Boston\n"
    '</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=note>\n{"a": [1, 2]}\n'
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n"
    "</tool_call>"
)


@pytest.mark.parametrize("step", STEPS)
def test_qwen3_coder_xml_calls_are_typed_by_the_tools_schemas(step):
    """Qwen3-Coder's calls (vLLM's qwen3_coder parser) in <tool_call> blocks: a string
    parameter stays text even where it reads as a number, an integer one is JSON, one the schema
    does not declare is read as JSON where it parses; a function without parameters has {}."""
    content, calls, _ = _parse(QWEN3_CODER_CALLS, False, step, tools=TOOLS)
    assert content == "I will look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    args = [json.loads(c["function"]["arguments"]) for c in calls]
    assert args == [{"city": "02134 Boston", "days": 3, "note": {"a": [1, 2]}}, {}]


def test_an_xml_value_without_a_schema_is_json_where_it_parses():
    text = "<tool_call><function=f><parameter=n>7</parameter><parameter=s>x y</parameter>"
    text += "<parameter=b>true</parameter><parameter=z>null</parameter></function></tool_call>"
    content, calls, _ = _parse(text, False, 1000)
    assert content is None and calls[0]["function"]["name"] == "f"
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "n": 7,
        "s": "x y",
        "b": True,
        "z": None,
    }


@pytest.mark.parametrize("step", STEPS)
def test_glm_calls_are_typed_by_the_tools_schemas(step):
    """GLM-4.5's calls (vLLM's glm45 parser): the name, then key/value pairs."""
    text = (
        "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>02134</arg_value>"
        "\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>now"
        "</tool_call>"
    )
    content, calls, _ = _parse(text, False, step, tools=TOOLS)
    assert content == "Checking."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    args = [json.loads(c["function"]["arguments"]) for c in calls]
    assert args == [{"city": "02134", "days": 3}, {}]


def test_a_block_that_is_neither_json_nor_xml_stays_text():
    for text in (
        "<tool_call><function=>x</function></tool_call>",
        "<tool_call>two words <b>x</b></tool_call>",
        '<tool_call>{"name": 1}</tool_call>',
        "<tool_call>f <arg_key>k</arg_key> junk</tool_call>",
    ):
        assert _parse(text, False, 1000)[:2] == (text, [])


@pytest.mark.parametrize("step", STEPS)
def test_parallel_tool_calls_false_keeps_the_first_call_only(step):
    """vLLM's rule for parallel_tool_calls=false (and Anthropic's disable_parallel_tool_use): the
    first call is given, a later one dropped, the text kept."""
    text = "Two.\n" + _call("get_weather", {"city": "Paris"}) + _call("now", {}) + " end"
    p = ToolCallParser(False, single=True)
    events = []
    for i in range(0, len(text), step):
        events += p.feed(text[i : i + step])
    content, calls = join_events(events + p.finish())
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and p.num_calls == 1
    assert content == "Two.\n end"


@pytest.mark.parametrize("step", STEPS)
def test_auto_plain_text_and_unclosed_blocks(step):
    assert _parse("no calls here < > <tool", False, step)[:2] == ("no calls here < > <tool", [])
    # an unclosed block at the end: a call if its JSON is one, else text
    _, calls, _ = _parse(_call("now", {})[: -len("</tool_call>")], False, step)
    assert [c["function"]["name"] for c in calls] == ["now"]
    assert _parse('<tool_call>{"name": ', False, step)[:2] == ('<tool_call>{"name":', [])
    # JSON that is not a call (no name, arguments not an object) stays text
    bad = '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": 3}</tool_call>'
    assert _parse(bad, False, step)[:2] == (bad, [])
    # only whitespace around the calls: no content
    assert _parse("\n " + _call("now", {}) + "\n", False, step)[0] is None


@pytest.mark.parametrize("step", STEPS)
def test_forced_reads_the_object_whole(step):
    # the grammar's order (keys sorted) and the other one; the call comes at the end, one event
    for text in (
        '{"arguments":{"city":"Paris","days":{"a":[1,{}]}},"name":"get_weather"}',
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": {"a": [1, {}]}}}',
    ):
        content, calls, events = _parse(text, True, step)
        assert content is None and len(calls) == len(events) == 1
        assert calls[0]["function"]["name"] == "get_weather"
        assert json.loads(calls[0]["function"]["arguments"]) == {
            "city": "Paris",
            "days": {"a": [1, {}]},
        }
    # cut off by max_tokens with no tool to name it by: nothing, never the grammar's object as
    # content (named cut calls: test_forced_call_cut_off.py)
    assert _parse('{"arguments":{"ci', True, step)[:2] == (None, [])


def _body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(
        json.dumps({"messages": [USER], "max_tokens": 8, **fields})
    )


def test_modes_and_the_forced_grammar():
    assert _body().tool_mode() == "none"
    assert _body(tools=TOOLS).tool_mode() == "auto"
    assert _body(tools=TOOLS, tool_choice="none").tool_mode() == "none"
    assert _body(tools=TOOLS).structured_spec() is None
    named = _body(
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    spec, param = named.structured_spec()
    assert param == "tools[0].function.parameters"
    schema = spec["json_schema"]
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "x"}}, schema)
    for bad in ({"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    # the gRPC request carries it as the structured spec
    s = sampling_params(named, 8)
    assert json.loads(s.structured.json_schema) == schema
    spec, param = _body(tools=TOOLS, tool_choice="required").structured_spec()
    assert param == "tools" and len(spec["json_schema"]["anyOf"]) == 2
    jsonschema.validate({"name": "now", "arguments": {}}, spec["json_schema"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "now", "arguments": {"x": 1}}, spec["json_schema"])


def test_local_refs_move_with_the_arguments():
    params = {
        "type": "object",
        "$defs": {"c": {"enum": ["a", "b"]}},
        "properties": {"x": {"$ref": "#/$defs/c"}},
        "required": ["x"],
    }
    tools = [{"type": "function", "function": {"name": n, "parameters": params}} for n in "fg"]
    for choice in ("required", {"type": "function", "function": {"name": "g"}}):
        schema = _body(tools=tools, tool_choice=choice).structured_spec()[0]["json_schema"]
        assert _compile_error(json.dumps(schema)) == ""
        jsonschema.validate({"name": "g", "arguments": {"x": "a"}}, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"name": "g", "arguments": {"x": "z"}}, schema)


NAMED = {"type": "function", "function": {"name": "nope"}}


ODD = {  # valid JSON Schema that the grammar library does not implement (agents' tools use it)
    "type": "object",
    "properties": {"x": {"not": {"type": "string"}}},
    "propertyNames": {"pattern": "^[a-z]+$"},
}


def test_a_valid_schema_without_a_grammar_is_served_in_auto_mode_only():
    """Tools in "auto" mode only describe themselves to the model: a valid schema the grammar
    library cannot compile is taken; forcing a call through it (a grammar) is a 400 naming
    tool_choice and the tool."""
    tools = [{"type": "function", "function": {"name": "odd", "parameters": ODD}}, TOOLS[0]]
    assert _body(tools=tools).tool_mode() == "auto"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert _body(tools=tools, tool_choice=named).tool_mode() == "forced"  # its schema compiles
    for choice in ("required", {"type": "function", "function": {"name": "odd"}}):
        with pytest.raises(ValidationError) as e:
            _body(tools=tools, tool_choice=choice)
        err = validation_error(e.value, KNOWN_FIELDS)
        assert err.param == "tool_choice" and "tools[0]" in err.message, err.message
        assert "propertyNames" in err.message, err.message


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
            "64",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
                ]
            },
            "tools[0].function.parameters",
            "not a valid JSON schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{"}}]},
            "tools[0].function.parameters",
            "an object",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
            "tools[0].function.x",
            "unknown",
        ),
        ({"tools": []}, "tools", "at least 1"),
        ({"tools": TOOLS * 65}, "tools", "130"),
        ({"tools": TOOLS + TOOLS}, "tools", "unique"),
        ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "required"),
        ({"tools": TOOLS, "tool_choice": NAMED}, "tool_choice", "nope"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "response_format",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "tools"),
        ({"messages": [USER, {"role": "tool", "content": "r"}]}, "messages[1]", "tool_call_id"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages[0]",
            "tool_call_id",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "null"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages[0]",
            "assistant",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": {}},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
            "string",
        ),
    ],
)
def test_bad_values_name_the_field(fields, param, words):
    with pytest.raises(ValidationError) as e:
        _body(**fields)
    err = validation_error(e.value, KNOWN_FIELDS)
    assert err.status == 400 and err.param == param, err.message
    assert words in err.message, err.message


def _chat(body: ChatCompletionRequest) -> pdserve_pb2.ChatMessages:
    return chat_messages(body)


ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "noon"},
]


def test_a_template_without_tools_gets_hermes_text():
    chat = _chat(_body(tools=TOOLS, messages=ROUND_TRIP))
    conv, extra = chat_conversation(chat, "{{ messages }}", BadRequest)
    assert extra == {}
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "user"]
    system = conv[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and "<tools>\n" in system
    assert json.dumps(json.loads(chat.tools_json)[0]) in system and "<tool_call>" in system
    assert conv[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    assert conv[3]["content"] == (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
    )
    # no system message: one of its own
    conv, _ = chat_conversation(_chat(_body(tools=TOOLS)), "{{ messages }}", BadRequest)
    assert conv[0]["role"] == "system" and conv[0]["content"].startswith("# Tools")


def test_a_template_with_tools_gets_them_its_way():
    chat = _chat(_body(tools=TOOLS, messages=ROUND_TRIP))
    conv, extra = chat_conversation(chat, "{{ tools }} {{ m.tool_calls }}", BadRequest)
    assert extra["tools"] == json.loads(chat.tools_json)
    assert conv[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # a dict
    assert conv[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    # no tools anywhere: the conversation as it was
    conv, extra = chat_conversation(_chat(_body()), "{{ tools }}", BadRequest)
    assert (conv, extra) == ([USER], {})


def test_grpc_tools_json_is_checked():
    chat = pdserve_pb2.ChatMessages(tools_json="[1]")
    chat.messages.add(role="user", content="hi")
    with pytest.raises(BadRequest, match="chat.tools_json must be a JSON list of objects"):
        chat_conversation(chat, "", BadRequest)
    chat = pdserve_pb2.ChatMessages()
    chat.messages.add(role="assistant", content="", tool_calls_json="{")
    with pytest.raises(BadRequest, match=r"chat.messages\[0\].tool_calls_json is not JSON"):
        chat_conversation(chat, "", BadRequest)


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("step", STEPS)
def test_llama3_json_calls(step):
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    two = one + '; {"name": "now", "parameters": {}}'
    for text in (one, " \n" + one, "<|python_tag|>" + two, two + "\n"):
        content, calls, _ = _parse(text, False, step, "llama3_json")
        want = [("get_weather", {"city": "Paris"})] + ([("now", {})] if "now" in text else [])
        assert content is None and _calls(calls) == want, text
    # an answer that is not a call: content, as it came
    for text in ("It is sunny. {not a call}", '{"answer": 42}', "{unclosed", "<|python"):
        assert _parse(text, False, step, "llama3_json")[:2] == (text, []), text


@pytest.mark.parametrize("step", STEPS)
def test_mistral_calls(step):
    old = 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    new = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}'
    content, calls, _ = _parse(old, False, step, "mistral")
    assert content == "Checking." and _calls(calls) == [("get_weather", {"city": "Paris"})]
    content, calls, _ = _parse(new, False, step, "mistral")
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert content == "Checking."
    for text in ("plain [TOOL", "x[TOOL_CALLS]not json", "[TOOL_CALLS]f[ARGS]{bad"):
        assert _parse(text, False, step, "mistral")[:2] == (text, []), text


DS_BEGIN, DS_CALL, DS_SEP, DS_END = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
)


@pytest.mark.parametrize("step", STEPS)
def test_deepseek_calls(step):
    """DeepSeek-V3.1's calls (the name, then the arguments' JSON) and V3's and R1's (the type
    "function", then the name and a json block), after text that is content."""
    v31 = (
        f'Checking.{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{"city": "Paris"}}{DS_END}'
        f"{DS_CALL}now{DS_SEP}{{}}{DS_END}<｜tool▁calls▁end｜>"
    )
    content, calls, _ = _parse(v31, False, step, "deepseek")
    assert content == "Checking."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("now", {})]
    v3 = f'{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Rome"}}\n```{DS_END}'
    content, calls, _ = _parse(v3, False, step, "deepseek")
    assert content is None and _calls(calls) == [("get_weather", {"city": "Rome"})]
    for text in ("no calls <｜tool", f"x{DS_BEGIN}{DS_CALL}f{DS_SEP}{{bad{DS_END}"):
        assert _parse(text, False, step, "deepseek")[:2] == (text, []), text


@pytest.mark.parametrize("step", STEPS)
def test_kimi_k2_calls(step):
    text = (
        "On it.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>'
        "functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>"
    )
    content, calls, _ = _parse(text, False, step, "kimi_k2")
    assert content == "On it."
    assert _calls(calls) == [("get_weather", {"city": "Oslo"}), ("now", {})]
    bad = "x<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0 no args"
    assert _parse(bad, False, step, "kimi_k2")[:2] == (bad, [])


class _Tok:
    def __init__(self, vocab, template):
        self.vocab, self.chat_template = vocab, template

    def get_vocab(self):
        return self.vocab


@pytest.mark.parametrize(
    "vocab, template, fmt",
    [
        ({"[TOOL_CALLS]": 5}, "{{ tools }}", "mistral"),
        ({DS_BEGIN: 9}, "{{ tools }}", "deepseek"),
        ({"<|tool_calls_section_begin|>": 9}, "{{ tools }}<tool_call>", "kimi_k2"),
        ({}, "{% for t in tools %}<tool_call>{% endfor %}", "hermes"),  # Qwen's
        ({"<|python_tag|>": 7}, "{% if tools %}{{ tools }}{% endif %}", "llama3_json"),
        # Hermes-3 on Llama 3.1: its template writes <tool_call>
        ({"<|python_tag|>": 7}, "{{ tools }}<tool_call>", "hermes"),
        ({}, "{{ messages }}", "hermes"),  # no tools: Hermes' text (chat_conversation)
    ],
)
def test_the_call_format_is_read_from_the_model(vocab, template, fmt):
    assert tool_call_format(_Tok(vocab, template)) == fmt
