"""JSON fields of a chat nested deeper than Python's json goes (chat_template_kwargs_json,
tools_json, a tool call's arguments) are refused INVALID_ARGUMENT naming the field, never a
RecursionError (which the servicer would send as UNKNOWN with a logged traceback):
router/text.py template_options and router/chat_tools.py. Over gRPC:
tests/integration/test_router_refuses_costly_input.py."""

from __future__ import annotations

import json

import grpc
import pytest

from pdserve.engine.tokenizer import load_tokenizer
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.text import BadRequest, PromptEncoder

# a template that ignores tools (the calls are written in Hermes' style) and one that takes them
PLAIN = "{% for m in messages %}t3 {{ m.content }} t4 {% endfor %}"
TOOLS = (
    "{% for m in messages %}t3 {{ m.content }}{% for c in m.tool_calls or [] %} t5"
    "{% endfor %} t4 {% endfor %}{% if tools %}t6{% endif %}"
)
DEEP = "[" * 3000 + "]" * 3000  # well under every size limit


@pytest.fixture(scope="module")
def encoders(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    out = {}
    for name, template in (("plain", PLAIN), ("tools", TOOLS)):
        tok = load_tokenizer(model_dir)
        tok.chat_template = template
        out[name] = PromptEncoder(tok, 8192)
    yield out
    for enc in out.values():
        enc.close()


def _request(tools_json="", arguments=None, kwargs_json="") -> pdserve_pb2.GenerateRequest:
    req = pdserve_pb2.GenerateRequest()
    chat = req.chat
    chat.tools_json = tools_json
    chat.chat_template_kwargs_json = kwargs_json
    chat.messages.add(role="user", content="t7")
    if arguments is not None:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        chat.messages.add(role="assistant", content="", tool_calls_json=json.dumps([call]))
        chat.messages.add(role="tool", content="t8", tool_call_id="c1")
        chat.messages.add(role="user", content="t9")
    return req


def _refused(encoder, request) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        encoder.encode(request)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return e.value


@pytest.mark.parametrize("kind", ["plain", "tools"])
def test_deep_json_is_refused_naming_the_field(encoders, kind):
    enc = encoders[kind]
    said = _refused(enc, _request(kwargs_json=DEEP)).message
    assert said.startswith("chat.chat_template_kwargs_json nests JSON too deeply")
    said = _refused(enc, _request(tools_json=DEEP)).message
    assert said.startswith("chat.tools_json nests JSON too deeply")
    said = _refused(enc, _request(arguments=DEEP)).message
    assert said.startswith("chat.messages[1].tool_calls_json[0].function.arguments nests JSON")
    # the server keeps serving: the same encoder renders the next chat
    assert enc.encode(_request())


def _deepest_json_loads_reads() -> int:
    """The deepest nesting json.loads reads from here (about the recursion limit less the
    stack's depth)."""
    depth = 100
    while True:
        try:
            json.loads("[" * (depth + 1) + "]" * (depth + 1))
        except RecursionError:
            return depth
        depth += 1


@pytest.mark.parametrize("kind", ["plain", "tools"])
def test_json_just_deep_enough_to_read_is_rendered_or_refused_never_a_recursion_error(
    encoders, kind
):
    """Nesting that json.loads still reads may be too deep to write back out (the Hermes
    system prompt's json.dumps, or the template's): each depth around the edge either renders or
    is refused INVALID_ARGUMENT."""
    enc = encoders[kind]
    edge = _deepest_json_loads_reads()
    for depth in range(edge - 40, edge + 5):
        inner = '{"a":' * depth + "1" + "}" * depth
        for request in (_request(tools_json=f"[{inner}]"), _request(arguments=inner)):
            try:
                enc.encode(request)
            except BadRequest as e:
                assert e.code == grpc.StatusCode.INVALID_ARGUMENT, (depth, e.message)
