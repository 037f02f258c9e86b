"""gpt-oss's Harmony output (router/openai/responses/harmony.py) read as reasoning, content and
tool calls, without a server or a model: each output of the cases split the same whether it comes
whole, cut in two anywhere or a character at a time; the analysis tokens counted whatever the
deltas hold; the format read from the vocabulary (router/chat_tools.py tool_call_format) and told
to the front by the router (router/service.py REASONING_KEY); the tags kept in the text
(router/openai/state.py); an assistant's reasoning reaching the template as `thinking`; and the
HTTP front's chat completion (whole and streamed) and /v1/responses of a fake router's Harmony
tokens, on a byte-level tokenizer with Harmony's tags (helpers/harmony.py).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from helpers.harmony import TEMPLATE, HarmonyRouter, harmony_tokenizer
from helpers.http_front import asgi_call, front_app
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.chat_tools import chat_conversation, tool_call_format
from pdserve.router.openai.responses.reasoning import ChatText
from pdserve.router.openai.responses.tool_calls import ToolCallParser, join_events
from pdserve.router.service import REASONING_KEY, TOOL_FORMAT_KEY, PDServeServicer
from pdserve.router.text import BadRequest, TextStream

httpx = pytest.importorskip("httpx2")

HARMONY = "harmony"  # the format's name on the wire (router/chat_tools.py HARMONY)

ANALYSIS = "<|channel|>analysis<|message|>I should look up the weather.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"SF"}<|call|>'
)
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
WEATHER = ("get_weather", '{"city":"SF"}')


def _read(pieces, tools: bool = True, single: bool = False, keep: bool = True):
    """(reasoning or None, content or None, [(name, arguments)]) of an output fed in `pieces`."""
    calls = ToolCallParser(False, single=single, fmt=HARMONY) if tools else None
    parser = ChatText(HARMONY, calls, keep=keep)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    content, found = join_events(events)
    assert parser.num_calls == len(found)
    reasoning = "".join(e.get("reasoning", "") for e in events) or None
    return reasoning, content, [(c["function"]["name"], c["function"]["arguments"]) for c in found]


THOUGHT = "I should look up the weather."
CASES = {
    "analysis then a call": (ANALYSIS + CALL, (THOUGHT, None, [WEATHER])),
    "analysis then final": (ANALYSIS + FINAL, (THOUGHT, "It is sunny.", [])),
    # <|return|> and <|call|> end the sequence: the engine leaves their text out
    "final, its end left out": (
        ANALYSIS + FINAL[: -len("<|return|>")],
        (THOUGHT, "It is sunny.", []),
    ),
    "no analysis": ("<|channel|>final<|message|>Hi.<|return|>", (None, "Hi.", [])),
    "only analysis, cut by max_tokens": (
        "<|channel|>analysis<|message|>Let me thi",
        ("Let me thi", None, []),
    ),
    "two calls in a row": (
        ANALYSIS + CALL + CALL.replace("get_weather", "now").replace('{"city":"SF"}', "{}"),
        (THOUGHT, None, [WEATHER, ("now", "{}")]),
    ),
    "a commentary preamble, then a call": (
        ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL,
        (THOUGHT, "Checking.", [WEATHER]),
    ),
    "the recipient in the role's part": (
        ANALYSIS + "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"city":"SF"}<|call|>',
        (THOUGHT, None, [WEATHER]),
    ),
    "the first message's recipient, after the prompt's <|start|>assistant": (
        ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city":"SF"}',
        (None, None, [WEATHER]),
    ),
    "no format at all": (
        '<|channel|>commentary to=functions.get_weather<|message|>{"city":"SF"}<|call|>',
        (None, None, [WEATHER]),
    ),
    "a call cut by max_tokens": (
        ANALYSIS + CALL.split("F")[0],
        (THOUGHT, None, [("get_weather", '{"city":"S')]),
    ),
    "a built-in tool's call is reasoning": (
        '<|channel|>analysis to=browser.search code<|message|>{"query":"sf"}<|call|>',
        ('{"query":"sf"}', None, []),
    ),
    "text like a tag's start is text": (
        "<|channel|>final<|message|>a <|en b <|endoftext <|ca <|return x <|",
        (None, "a <|en b <|endoftext <|ca <|return x <|", []),
    ),
    "a header cut off is nothing": (
        ANALYSIS + "<|start|>assistant<|channel|>fin",
        (THOUGHT, None, []),
    ),
    "no Harmony at all (a grammar's JSON) is content": (
        '{"a": "to=x"}',
        (None, '{"a": "to=x"}', []),
    ),
    "nothing": ("", (None, None, [])),
}


@pytest.mark.parametrize("text, want", CASES.values(), ids=CASES.keys())
def test_an_output_reads_the_same_in_any_pieces(text, want):
    assert _read([text]) == want
    assert _read(list(text)) == want
    for cut in range(len(text) + 1):
        assert _read([text[:cut], text[cut:]]) == want, cut


def test_a_function_call_without_tools_is_reasoning_and_parallel_false_keeps_the_first():
    assert _read([ANALYSIS + CALL], tools=False) == (THOUGHT + '{"city":"SF"}', None, [])
    two = ANALYSIS + CALL + CALL.replace("get_weather", "now")
    assert _read([two], single=True) == (THOUGHT, None, [WEATHER])


def test_include_reasoning_false_drops_the_reasoning_only():
    text = ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL
    assert _read(list(text), keep=False) == (None, "Checking.", [WEATHER])


# an output as tokens (each tag one token), and how many are analysis: its headers and tags too
TOKENS = [
    (
        ["<|channel|>", "analysis", "<|message|>", "I", " think", "<|end|>", "<|start|>"]
        + ["assistant", "<|channel|>", "final", "<|message|>", "Hi", "<|return|>"],
        6,
    ),
    (
        ["<|channel|>", "analysis", "<|message|>", "a", "<|end|>", "<|start|>", "assistant"]
        + [" to=functions.f", "<|channel|>", "commentary", " json", "<|message|>", "{}"],
        5,
    ),
    (["<|channel|>", "analysis", " to=python", "<|message|>", "1+1"], 5),  # a built-in's call
    (["<|channel|>", "analysis", "<|message|>", "cut"], 4),
    (["<|channel|>", "final", "<|message|>", "Hi"], 0),
]


@pytest.mark.parametrize("tokens, want", TOKENS)
def test_analysis_tokens_are_counted_whatever_the_deltas_hold(tokens, want):
    """One token a delta, and every grouping into two deltas, count the same reasoning tokens
    (a worker sends what queued up for a stream as one delta)."""
    one_by_one = ChatText(HARMONY, ToolCallParser(False, fmt=HARMONY))
    for t in tokens:
        one_by_one.feed(t, 1)
    assert one_by_one.reasoning_tokens == want
    for cut in range(len(tokens) + 1):
        parser = ChatText(HARMONY, ToolCallParser(False, fmt=HARMONY))
        for part in (tokens[:cut], tokens[cut:]):
            parser.feed("".join(part), len(part), lambda part=part: list(part))
        assert parser.reasoning_tokens == want, cut


def test_a_forced_call_is_the_grammars_object_not_harmony():
    parser = ChatText(HARMONY, ToolCallParser(True, fmt=HARMONY))
    events = parser.feed('{"arguments": {"city": "SF"}, "name": "get_weather"}') + parser.finish()
    assert [(e["name"], json.loads(e["arguments"])) for e in events] == [
        ("get_weather", {"city": "SF"})
    ]


# ---- the format: read from the vocabulary, told to the front, its tags kept ------------------
def test_the_format_is_harmony_when_the_vocabulary_holds_its_tags():
    assert tool_call_format(harmony_tokenizer()) == HARMONY
    assert tool_call_format(harmony_tokenizer(tags=())) == "hermes"
    assert tool_call_format(harmony_tokenizer(tags=("<|start|>", "<|end|>"))) == "hermes"


def test_the_tags_survive_the_routers_detokenizer_with_special_tokens_kept():
    """What the front asks for a Harmony model's chat (skip_special_tokens false: the HTTP test
    below); skipped, the tags would be gone and the parser blind."""
    tok = harmony_tokenizer()
    ids = tok.encode(ANALYSIS + FINAL, add_special_tokens=False)
    for skip, want in (
        (False, ANALYSIS + FINAL),
        (True, f"analysis{THOUGHT}assistantfinalIt is sunny."),
    ):
        stream = TextStream(tok, [], skip, (), False)
        assert "".join(stream.add([i]) for i in ids) + stream.flush() == want


def test_the_router_tells_the_front_a_harmony_chat_with_tools_or_without():
    chat = pdserve_pb2.GenerateRequest(chat=pdserve_pb2.ChatMessages())
    text = pdserve_pb2.GenerateRequest(text="hi")
    meta = PDServeServicer._initial_metadata
    harmony = SimpleNamespace(tool_format=HARMONY)
    assert (REASONING_KEY, HARMONY) in meta(harmony, chat, [1, 2], None)
    assert (REASONING_KEY, HARMONY) not in meta(harmony, text, [1, 2], None)
    other = SimpleNamespace(tool_format="hermes")
    assert all(k != REASONING_KEY for k, _ in meta(other, chat, [1, 2], None))
    chat.chat.tools_json = "[]"
    assert (TOOL_FORMAT_KEY, HARMONY) in meta(harmony, chat, [1, 2], None)


# ---- the input side: an assistant's reasoning is gpt-oss's template's `thinking` -------------
def _chat(*messages) -> pdserve_pb2.ChatMessages:
    return pdserve_pb2.ChatMessages(messages=[pdserve_pb2.ChatMessage(**m) for m in messages])


def _bad(code, message):
    return BadRequest(code, message)


def test_an_assistants_reasoning_reaches_the_template_as_thinking():
    call = json.dumps([{"id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}])
    chat = _chat(
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning": "Look it up.",
            "tool_calls_json": call,
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    )
    conversation, _ = chat_conversation(chat, TEMPLATE, _bad)
    turn = conversation[1]
    # one analysis message per call's turn: the preamble joins the reasoning (the template
    # refuses content and thinking both)
    assert turn["thinking"] == "Look it up.\n\nChecking." and turn["content"] == ""
    rendered = harmony_tokenizer().apply_chat_template(conversation, tokenize=False)
    assert "<|channel|>analysis<|message|>Look it up.\n\nChecking.<|end|>" in rendered
    plain, _ = chat_conversation(chat, "{{ tools }}{{ m.tool_calls }}", _bad)  # another's
    assert "thinking" not in plain[1] and plain[1]["reasoning_content"] == "Look it up."


# ---- through the HTTP front: chat completions whole and streamed, and /v1/responses -----------
TOOL = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}
BODY = {
    "messages": [{"role": "user", "content": "weather?"}],
    "tools": [{"type": "function", "function": TOOL}],
}


def _front(output: str):
    tok = harmony_tokenizer()
    router = HarmonyRouter(tok, output)
    return front_app(stub=router, tokenizer=tok), router, tok


def test_the_fronts_chat_completion_whole_and_streamed():
    app, router, tok = _front(ANALYSIS + CALL)
    analysis_tokens = len(tok.encode(ANALYSIS, add_special_tokens=False))
    status, _, reply = asyncio.run(
        asgi_call(app, "POST", "/v1/chat/completions", json.dumps(BODY).encode())
    )
    assert status == 200, reply
    gen = router.gens[0]
    assert gen.sampling.HasField("skip_special_tokens") and not gen.sampling.skip_special_tokens
    choice = reply["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == THOUGHT and message["content"] is None
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls == [WEATHER] and choice["finish_reason"] == "tool_calls"
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == analysis_tokens

    streamed = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _sse(app, "/v1/chat/completions", streamed)
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert not "".join(d.get("content") or "" for d in deltas)
    pieces = [t for d in deltas for t in d.get("tool_calls", ())]
    assert [p["function"]["name"] for p in pieces if "id" in p] == ["get_weather"]
    assert "".join(p["function"]["arguments"] for p in pieces) == WEATHER[1]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][
        -1
    ] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == analysis_tokens


def test_the_fronts_responses_api_gives_reasoning_and_function_call_items():
    app, _, _ = _front(ANALYSIS + CALL)
    body = {"input": "weather?", "tools": [{"type": "function", **TOOL}], "store": False}
    status, _, reply = asyncio.run(
        asgi_call(app, "POST", "/v1/responses", json.dumps(body).encode())
    )
    assert status == 200, reply
    items = [(i["type"], i.get("name")) for i in reply["output"]]
    assert items == [("reasoning", None), ("function_call", "get_weather")]
    assert reply["output"][0]["content"][0]["text"] == THOUGHT
    assert reply["output"][1]["arguments"] == WEATHER[1]
    events = _sse(app, "/v1/responses", {**body, "stream": True})
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i.get("name")) for i in done] == items


def _sse(app, path: str, body: dict) -> list:
    async def post():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post(path, json=body)

    r = asyncio.run(post())
    assert r.status_code == 200, r.text
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    return [json.loads(d) for d in data if d != "[DONE]"]
