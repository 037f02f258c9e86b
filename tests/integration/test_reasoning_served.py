"""A reasoning model's output split into `reasoning` (and DeepSeek's `reasoning_content`) and
`content` by the HTTP front (router/openai/responses/reasoning.py), through a router in front of a
prefill and a decode worker: a tiny random model whose byte-level tokenizer has <think> and </think>
as tokens, with a chat template that opens the block when asked (DeepSeek-R1's way: `open_think`) or
writes it empty and closed (Qwen3's enable_thinking false). A grammar (vLLM's structured_outputs;
llguidance's `<[id]>` is a token by its id) makes the random model write the tags where the test
needs them.

Whole and streamed alike: an output that starts with <think> is reasoning until </think>; a prompt
that ends with <think> makes the output reasoning from its first token; with the block closed in the
prompt, or no tags, it is all content; a JSON schema holds for the answer after the reasoning (the
tests' own grammars hold from the first token: enable_in_reasoning); thinking_token_budget ends the
reasoning after that many tokens; include_reasoning false drops the reasoning; tool calls are parsed
from the content only; an assistant's replayed reasoning reaches the template; and the text of a
model without the tags is untouched (tests/integration/test_http_api.py)."""

from __future__ import annotations

import json
import re

import pytest

from helpers.http import Workers, post, serves
from helpers.structured import byte_level_model

openai = pytest.importorskip("openai")

MODEL = "tiny"
TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: "
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content or '' }}{% for c in m.tool_calls or [] %} call {{ c.function.name }}"
    "{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: "
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif open_think is defined and open_think %}<think>\n{% endif %}{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# a call as Llama 3.1 writes it: this tokenizer has <|python_tag|> and its template takes tools,
# so the router reads its format as llama3_json (router/chat_tools.py tool_call_format)
CALL = '{"name": "f", "parameters": {"x": 1}}'


@pytest.fixture(scope="module")
def router(tiny_models, tmp_path_factory, one_thread):
    src, _ = tiny_models("llama-gqa")
    model_dir = byte_level_model(
        src,
        tmp_path_factory.mktemp("byte-reasoning"),
        TEMPLATE,
        ("<think>", "</think>", "<|python_tag|>"),
    )
    w = Workers(model_dir, max_model_len=512)
    r = w.router()
    yield r
    r.stop()
    w.stop()


OPEN, CLOSE = "<[2]>", "<[3]>"  # <think> and </think> in a grammar


def _letters(n: int) -> str:
    return f"/[a-z]{{{n}}}/"


def _ask(router_, stream: bool, grammar: str | None, **fields) -> dict:
    """(reasoning or None, content or None, tool_calls) of a chat whose output is the lark
    grammar `start: <grammar>` (None: free)."""
    c = openai.OpenAI(
        base_url=f"http://{router_.http_address}/v1", api_key="unused", max_retries=0, timeout=60
    )
    body = dict(
        model=MODEL,
        messages=fields.pop("messages", [{"role": "user", "content": "Think."}]),
        max_tokens=fields.pop("max_tokens", 120),
        temperature=0,
        stream=stream,
        extra_body=fields.pop("extra_body", {}),
        **fields,
    )
    if grammar is not None:  # from the first token (the tags are the grammar's)
        spec = {"grammar": f"start: {grammar}", "enable_in_reasoning": True}
        body["extra_body"]["structured_outputs"] = spec
    if not stream:
        whole = c.chat.completions.create(**body)
        m = whole.choices[0].message
        extra = m.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]
        return {
            "reasoning": extra.get("reasoning"),
            "content": m.content,
            "calls": calls,
            "usage": whole.usage,
        }
    reasoning, content, calls, used = [], [], {}, None
    body["stream_options"] = {"include_usage": True}
    for chunk in c.chat.completions.create(**body):
        used = chunk.usage or used
        for choice in chunk.choices:
            d, extra = choice.delta, choice.delta.model_extra or {}
            if extra.get("reasoning") is not None:
                assert extra["reasoning"] == extra.get("reasoning_content")
                reasoning.append(extra["reasoning"])
            if d.content:
                content.append(d.content)
            for t in d.tool_calls or []:
                calls.setdefault(t.index, [t.function.name, ""])[1] += t.function.arguments
    return {
        "reasoning": "".join(reasoning) or None,
        "content": "".join(content) or None,
        "calls": [(name, json.loads(args)) for name, args in calls.values()],
        "usage": used,
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "grammar, kwargs, want",
    [
        # the output opens the block itself (Qwen3's thinking mode)
        (f'{OPEN} {_letters(6)} {CLOSE} "\\n\\n" {_letters(4)}', {}, ("R", "\n\nC")),
        (f'"\\n" {OPEN} {_letters(6)} {CLOSE} {_letters(4)}', {}, ("R", "C")),
        # the template opened it (DeepSeek-R1's): reasoning from the first token
        (f"{_letters(6)} {CLOSE} {_letters(4)}", {"open_think": True}, ("R", "C")),
        # closed in the prompt (enable_thinking false), or never opened: all content
        (_letters(4), {"enable_thinking": False}, (None, "C")),
        (f"{_letters(4)} {CLOSE} {_letters(2)}", {}, (None, "C</think>c")),
    ],
    ids=["opens", "space-first", "prompt-opened", "closed", "no-tags"],
)
def test_reasoning_is_split_from_the_content(router, stream, grammar, kwargs, want):
    got = _ask(router, stream, grammar, extra_body={"chat_template_kwargs": kwargs})
    for key, shape in zip(("reasoning", "content"), want, strict=True):
        text = got[key]
        if shape is None:
            assert text is None, got
            continue
        pattern = shape.replace("R", "[a-z]{6}").replace("C", "[a-z]{4}").replace("c", "[a-z]{2}")
        assert text is not None and re.fullmatch(pattern, text), (shape, got)
    serves(router)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("budget", [None, 0, 6])
def test_thinking_token_budget_ends_the_reasoning(router, stream, budget):
    """The prompt opened the block, whose newline is the reasoning's first token; logit_bias keeps
    the model from closing it, a grammar keeps it to letters: the budget alone closes it."""
    fields = {
        "chat_template_kwargs": {"open_think": True},
        "logit_bias": {3: -100},
        "min_tokens": 12,
    }
    if budget is not None:
        fields["thinking_token_budget"] = budget
    grammar = f"/[a-z]*/ {CLOSE} /[a-z]*/"
    got = _ask(router, stream, grammar, max_tokens=12, extra_body=fields)
    if budget is None:
        assert len(got["reasoning"]) == 12 and got["content"] is None, got
        return
    spent = max(budget - 1, 0)
    assert len(got["reasoning"] or "") == spent and len(got["content"]) == 11 - spent, got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("opened", [True, False], ids=["opened", "not-opened"])
def test_a_block_the_prompt_opened(router, stream, opened):
    """Free text (no grammar): logit_bias makes every token </think>, or never a tag."""
    kwargs = {"chat_template_kwargs": {"open_think": opened}}
    # the first </think> closes the block the prompt opened: no reasoning, the rest is content
    got = _ask(router, stream, None, max_tokens=5, extra_body={**kwargs, "logit_bias": {3: 100}})
    assert got["reasoning"] is None
    assert got["content"] == "</think>" * (4 if opened else 5), got
    # no tag at all: reasoning to the end (cut by max_tokens) where the prompt opened the block
    no_tags = {"logit_bias": {2: -100, 3: -100}, **kwargs}
    got = _ask(router, stream, None, max_tokens=12, extra_body=no_tags)
    assert (got["reasoning"] is not None) == opened and (got["content"] is None) == opened, got


@pytest.mark.parametrize("opened", [True, False], ids=["opened", "not-opened"])
def test_a_json_schema_holds_for_the_answer_after_the_reasoning(router, opened):
    """The router sets the grammar to start after the reasoning (engine/structured/grammar.py
    `reasoned`): logit_bias makes </think> the likeliest token wherever the grammar allows it,
    so the prompt's open block closes at once and the answer is the schema's JSON."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fields = {
        "chat_template_kwargs": {"open_think": opened},
        "logit_bias": {3: 100},
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    }
    got = _ask(router, False, None, max_tokens=40, extra_body=fields)
    assert got["reasoning"] is None and isinstance(json.loads(got["content"])["n"], int), got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_reasoning_tokens_are_counted(router, stream):
    # <think>, six letters and </think> (one token each) are reasoning; "\n\n" and four not
    got = _ask(router, stream, f'{OPEN} {_letters(6)} {CLOSE} "\\n\\n" {_letters(4)}')
    details = got["usage"].completion_tokens_details
    assert details.reasoning_tokens == 8 and got["usage"].completion_tokens >= 14, got
    got = _ask(router, stream, _letters(4), extra_body={"chat_template_kwargs": {"open_think": 0}})
    assert got["usage"].completion_tokens_details.reasoning_tokens == 0, got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_include_reasoning_false_drops_it(router, stream):
    grammar = f"{OPEN} {_letters(6)} {CLOSE} {_letters(4)}"
    got = _ask(router, stream, grammar, extra_body={"include_reasoning": False})
    assert got["reasoning"] is None and got["content"] and len(got["content"]) == 4, got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_calls_are_parsed_from_the_content_only(router, stream):
    # a call written inside the reasoning is thought, not a call; the one after it is the call,
    # read in the model's own format (Llama 3.1's JSON)
    call = json.dumps(CALL)  # a lark string literal
    got = _ask(router, stream, f"{OPEN} {call} {CLOSE} {call}", tools=[TOOL])
    assert got["reasoning"] == CALL and got["calls"] == [("f", {"x": 1})], got
    assert not got["content"], got


def test_replayed_reasoning_reaches_the_template(router):
    messages = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
        {"role": "user", "content": "Bye."},
    ]
    status, _, raw = post(router, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200, raw
    tokens = json.loads(raw)["tokens"]
    # "assistant: <think>greet</think>Hello.": <think> is token 2, </think> token 3
    text = bytes(t for t in tokens if t > 3).decode()
    assert 2 in tokens and 3 in tokens and "assistant: greetHello." in text, tokens
    # vLLM's name for it reads the same
    messages[1] = {"role": "assistant", "content": "Hello.", "reasoning": "greet"}
    status, _, raw = post(router, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and json.loads(raw)["tokens"] == tokens, raw
    bad = [{"role": "user", "content": "Hi.", "reasoning": "no"}]
    status, _, raw = post(router, "/v1/chat/completions", {"model": MODEL, "messages": bad})
    assert status == 400 and "assistant" in json.loads(raw)["error"]["message"], raw


def test_anthropic_thinking_is_accepted_for_a_reasoning_model(router):
    # the tiny model of test_http_other_apis.py has no <think> token: a 400 there
    hi = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}):
        status, _, raw = post(router, "/v1/messages", {**hi, "thinking": thinking})
        assert status == 200 and json.loads(raw)["type"] == "message", raw


def test_the_router_says_it_reads_the_model_s_reasoning(router):
    line = router._formats_line()
    assert "reasoning in <think> tags" in line and "tool calls llama3_json" in line, line
