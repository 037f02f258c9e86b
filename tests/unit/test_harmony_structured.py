"""Structured output and forced tool calls for gpt-oss (Harmony), without a server or a model:
the engine's grammar (engine/structured/grammar.py harmony_grammar) fed outputs token by token as
the engine feeds it, on a byte-level tokenizer with Harmony's tags (helpers/harmony.py): any
analysis messages, then the answer in the final channel ("harmony"), or the forced call as
Harmony's call of the function ("harmony_call"); the values refused by name where a spec or a
model cannot take them; the router's hook (router/service.py `_as_run`) that picks the value for
a Harmony chat with structured output, from the request the HTTP front builds; and the forced
call read back by the front (router/openai/responses/harmony.py), whole and streamed.
"""

from __future__ import annotations

import asyncio
import json
import types

import pytest

from helpers.harmony import HarmonyRouter, harmony_grammars, harmony_tokenizer, taken
from helpers.http_front import asgi_call, front_app
from pdserve.engine.errors import BadSamplingParams
from pdserve.engine.structured.spec import StructuredSpec
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.chat import chat_request
from pdserve.router.openai.protocol import ChatCompletionRequest
from pdserve.router.openai.responses.reasoning import ChatText
from pdserve.router.openai.responses.tool_calls import ToolCallParser, join_events
from pdserve.router.service import PDServeServicer, ServiceOptions

httpx = pytest.importorskip("httpx2")

TOK = harmony_tokenizer()
THOUGHT = 'I should answer {"a"} in JSON.'
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
PREAMBLE = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
FINAL = '<|channel|>final<|message|>{"a":[1,2]}<|return|>'
CALL = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"SF"}'
    "<|call|>"
)
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
# a tool whose parameters use a $ref: the forced call's schema moves it (protocol.py _rebase)
ZONE = {
    "type": "object",
    "properties": {"tz": {"$ref": "#/$defs/tz"}},
    "required": ["tz"],
    "additionalProperties": False,
    "$defs": {"tz": {"enum": ["utc", "pst"]}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "now", "parameters": ZONE}},
]


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def feed(spec: StructuredSpec, text: str, tok=TOK):
    """taken's answer for `text` under `spec`'s grammar, on a fresh Harmony GrammarCache."""
    return taken(harmony_grammars(tok).matcher(spec), tok.encode(text, add_special_tokens=False))


# ---- the grammar: analysis messages, then the final channel's answer ----------------------------
def test_the_grammar_takes_analysis_then_a_final_json_answer():
    spec = StructuredSpec(json_object=True, reasoning="harmony")
    assert feed(spec, ANALYSIS + FINAL) is None
    assert feed(spec, ANALYSIS + ANALYSIS + FINAL) is None
    assert feed(spec, FINAL) is None  # no analysis at all
    # a preamble is content: it would stand before the JSON in the message's content
    assert feed(spec, ANALYSIS + PREAMBLE + FINAL) == len(ids(ANALYSIS + "<|channel|>"))
    schema = StructuredSpec(json_schema=CITY, reasoning="harmony")
    assert feed(schema, ANALYSIS + '<|channel|>final<|message|>{"city":"SF"}<|return|>') is None


def test_the_grammar_refuses_a_final_body_that_is_not_json():
    spec = StructuredSpec(json_object=True, reasoning="harmony")
    text = ANALYSIS + "<|channel|>final<|message|>It is sunny.<|return|>"
    assert feed(spec, text) == len(ids(ANALYSIS + "<|channel|>final<|message|>"))
    # bare JSON with no Harmony header: what the grammar held from the first token forced
    assert feed(spec, '{"a":1}<|return|>') == 0
    # the stop token or another tag inside the analysis; a final body with the stop too early
    body = "<|channel|>analysis<|message|>x"
    assert feed(spec, body + "<|return|>") == feed(spec, body + "<|channel|>") == len(ids(body))
    early = '<|channel|>final<|message|>{"a":'
    assert feed(spec, early + "<|return|>") == len(ids(early))
    schema = StructuredSpec(json_schema=CITY, reasoning="harmony")
    wrong = '<|channel|>final<|message|>{"town":"SF"}<|return|>'
    assert feed(schema, wrong) == len(ids('<|channel|>final<|message|>{"'))


def test_a_bad_reasoning_value_and_a_model_without_the_tags_are_refused_by_name():
    with pytest.raises(BadSamplingParams, match=r"structured.reasoning must be one of .*harmony"):
        StructuredSpec(json_object=True, reasoning="harmonic")
    with pytest.raises(BadSamplingParams, match="'harmony_call' needs a json_schema"):
        StructuredSpec(regex="a", reasoning="harmony_call")
    plain = harmony_tokenizer(tags=())
    with pytest.raises(
        BadSamplingParams,
        match=r"'harmony' needs a model that writes Harmony \(gpt-oss\): this one has no "
        r"<\|start\|>, <\|channel\|>, <\|message\|>, <\|end\|> tokens",
    ):
        feed(StructuredSpec(json_object=True, reasoning="harmony"), "{}", plain)
    # the message tags but not the call's: its answers, not its calls
    four = harmony_tokenizer(tags=("<|start|>", "<|end|>", "<|message|>", "<|channel|>"))
    assert (
        feed(
            StructuredSpec(regex="ok", reasoning="harmony"),
            FINAL.replace('{"a":[1,2]}<|return|>', "ok"),
            four,
        )
        is None
    )
    call = StructuredSpec(json_schema=_forced("get_weather"), reasoning="harmony_call")
    with pytest.raises(BadSamplingParams, match=r"this one has no <\|constrain\|>, <\|call\|>"):
        feed(call, CALL, four)
    with pytest.raises(BadSamplingParams, match="needs a json_schema of a forced call"):
        feed(StructuredSpec(json_schema=CITY, reasoning="harmony_call"), CALL)


# ---- the router's hook: which reasoning a Harmony chat's grammar gets ---------------------------
class _Aborted(Exception):
    pass


class _Context:
    def abort(self, code, details):
        raise _Aborted(code, details)


def _servicer(tool_format: str = "harmony") -> PDServeServicer:
    """The servicer as _as_run needs it: its options and the model's tokenizer, no pool."""
    one = object.__new__(PDServeServicer)
    one.options = ServiceOptions(model_id="m", max_model_len=4096, vocab_size=len(TOK), dtype="f")
    one.sampling_defaults = {}
    one.encoder = types.SimpleNamespace(with_prediction=lambda request: request.sampling)
    one.reasoning_tags = None  # gpt-oss has no <think>
    one.tool_format = tool_format
    one.tokenizer = TOK
    return one


PROMPT = ids("<|start|>user<|message|>weather?<|end|><|start|>assistant")
FRONT = types.SimpleNamespace(
    settings=types.SimpleNamespace(max_model_len=4096),
    check_prompt_size=lambda texts, param: None,
    think_special=True,
    tags_special=False,
)


def _http(**fields) -> pdserve_pb2.GenerateRequest:
    """The GenerateRequest the HTTP front sends for a chat body with `fields`."""
    body = {"messages": [{"role": "user", "content": "weather?"}], **fields}
    return chat_request(FRONT, ChatCompletionRequest.model_validate(body))


def _reasoning(request, prompt=PROMPT, tool_format: str = "harmony") -> str | None:
    """The structured reasoning the request runs with (None: no structured output)."""
    ran, _ = _servicer(tool_format)._as_run(request, prompt, _Context())
    return ran.sampling.structured.reasoning if ran.sampling.HasField("structured") else None


JSON_OBJECT = {"response_format": {"type": "json_object"}}


def test_the_routers_hook_sets_harmony_only_for_a_harmony_chat_with_structured_output():
    assert _reasoning(_http(**JSON_OBJECT)) == "harmony"
    assert _reasoning(_http(tools=TOOLS, **JSON_OBJECT)) == "harmony"  # auto: not a call
    assert _reasoning(_http()) is None  # no structured output: none added
    assert _reasoning(_http(**JSON_OBJECT), tool_format="hermes") == ""  # another model
    text = pdserve_pb2.GenerateRequest(text="hi", sampling=_http(**JSON_OBJECT).sampling)
    assert _reasoning(text) == ""  # a completion: no Harmony generation prompt
    # the prompt ends elsewhere (no generation prompt): the grammar from the first token
    assert _reasoning(_http(**JSON_OBJECT), PROMPT[:-9]) == ""
    own = _http(structured_outputs={"json_object": True, "enable_in_reasoning": True})
    assert _reasoning(own) == "none"  # the client's own value stands
    named = {"type": "function", "function": {"name": "now"}}
    assert _reasoning(_http(tools=TOOLS, tool_choice=named)) == "harmony_call"
    assert _reasoning(_http(tools=TOOLS, tool_choice="required")) == "harmony_call"


# ---- the forced call: its grammar, and the front's reading -----------------------------------------
def _forced(name: str | None) -> str:
    """The json_schema the HTTP front sends for tool_choice naming `name` (None: "required")."""
    choice = "required" if name is None else {"type": "function", "function": {"name": name}}
    return _http(tools=TOOLS, tool_choice=choice).sampling.structured.json_schema


def test_a_forced_calls_grammar_is_harmonys_call_of_the_function():
    named = StructuredSpec(json_schema=_forced("get_weather"), reasoning="harmony_call")
    assert feed(named, ANALYSIS + CALL) is None
    assert feed(named, PREAMBLE + CALL) is None
    head = "<|channel|>commentary to=functions."
    assert feed(named, CALL.replace("get_weather", "now")) == len(ids(head))
    assert feed(named, ANALYSIS + FINAL) == len(ids(ANALYSIS + "<|channel|>"))  # no answer
    number = CALL.replace('"SF"', "7")  # arguments that break the tool's schema
    assert feed(named, number) == len(ids(number.split("7")[0]))
    required = StructuredSpec(json_schema=_forced(None), reasoning="harmony_call")
    assert feed(required, ANALYSIS + CALL) is None
    now = CALL.replace("get_weather", "now").replace('{"city":"SF"}', '{"tz":"utc"}')
    assert feed(required, now) is None  # its $ref moved back: the enum holds
    assert feed(required, now.replace("utc", "gmt")) == len(ids(now.split("utc")[0]))


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"]
)
def test_the_forced_call_reads_back_whole_and_streamed(tool_choice):
    output = ANALYSIS + PREAMBLE.replace("Checking.", "") + CALL
    router = HarmonyRouter(TOK, output)
    app = front_app(stub=router, tokenizer=TOK)
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    body["tool_choice"] = tool_choice
    status, _, reply = asyncio.run(
        asgi_call(app, "POST", "/v1/chat/completions", json.dumps(body).encode())
    )
    assert status == 200, reply
    choice = reply["choices"][0]
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls == [("get_weather", '{"city":"SF"}')] and choice["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == THOUGHT and message["content"] is None

    chunks = _sse(app, {**body, "stream": True})
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert not "".join(d.get("content") or "" for d in deltas)
    pieces = [t for d in deltas for t in d.get("tool_calls", ())]
    assert [p["function"]["name"] for p in pieces if "id" in p] == ["get_weather"]
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"city":"SF"}'
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert reasons[-1] == "tool_calls"
    # the output is one the router's grammar for the front's request takes
    assert _reasoning(router.gens[0]) == "harmony_call"
    schema = router.gens[0].sampling.structured.json_schema
    assert feed(StructuredSpec(json_schema=schema, reasoning="harmony_call"), output) is None


def _read_forced(text: str, name: str | None = "get_weather"):
    """[(name, arguments)] of a forced call's output, read as the front reads a Harmony chat's."""
    parser = ChatText("harmony", ToolCallParser(True, fmt="harmony", name=name))
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    _, calls = join_events(events)
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_a_forced_harmony_call_cut_off_or_bare_reads_as_a_forced_call_does():
    # cut by max_tokens: as far as it came; before the call began: none
    assert _read_forced(ANALYSIS + CALL.split("F")[0]) == [("get_weather", '{"city":"S')]
    assert _read_forced(ANALYSIS + "<|channel|>commentary to=functions.get_we") == []
    # a grammar held from the first token (the client's reasoning "none"): the bare object
    bare = '{"arguments": {"city": "SF"}, "name": "get_weather"}'
    assert _read_forced(bare) == [("get_weather", '{"city": "SF"}')]


def _sse(app, body: dict) -> list:
    async def post():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/chat/completions", json=body)

    r = asyncio.run(post())
    assert r.status_code == 200, r.text
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    return [json.loads(d) for d in data if d != "[DONE]"]
