"""POST /tokenize with `messages` counts exactly the prompt a chat completion with the same body
runs: the ids of /tokenize are those the router's PromptEncoder (router/text.py) makes of the
GenerateRequest the front sends for /v1/chat/completions, with add_generation_prompt,
continue_final_message, chat_template_kwargs (enable_thinking) and `tools` (vLLM's
TokenizeChatRequest takes them), for a template that renders tools itself and for one that gets
them in Hermes' style (router/chat_tools.py). vLLM's `chat_template` is refused with a 400 that
says the model's template is used, on /tokenize as on chat completions. On the front's ASGI app
with a fake router that records each GenerateRequest (no socket), and a word-level tokenizer
that adds a BOS, as /tokenize leaves out for messages by default, as chat does."""

from __future__ import annotations

import asyncio
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from helpers.http_front import FakeRouter, asgi_call, front_app, one_token
from pdserve.router.text import PromptEncoder

# "tN" is token N (t0 the unknown); <s> (2) is the BOS the tokenizer adds to a text, </s> (1)
# ends a turn. A template that renders tools (t20 <names> t21), assistant tool calls (t22
# <names>) and Qwen3's enable_thinking (false: an empty reasoning block, t11 t12, after the
# generation prompt)
TOOLS_TEMPLATE = (
    "{% if tools %}t20 {% for t in tools %}{{ t.function.name }} {% endfor %}t21 {% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}t3 {% elif m.role == 'assistant' %}t4 {% else %}t5 {% endif %}"
    "{{ m.content }}{% if m.tool_calls %} t22{% for c in m.tool_calls %} {{ c.function.name }}"
    "{% endfor %}{% endif %} </s> {% endfor %}"
    "{% if add_generation_prompt %}t4 {% if enable_thinking is defined and not enable_thinking %}"
    "t11 t12 {% endif %}{% endif %}"
)
# a template that knows no tools: they reach it in the system message (Hermes' style)
PLAIN_TEMPLATE = (
    "{% for m in messages %}t3 {{ m.content }} </s> {% endfor %}"
    "{% if add_generation_prompt %}t4{% endif %}"
)

USER = {"role": "user", "content": "t5 t6"}
TOOLS = [
    {"type": "function", "function": {"name": "t30", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "t31", "description": "t9"}},
]
CALL = {"id": "c1", "type": "function", "function": {"name": "t30", "arguments": "{}"}}
TOOL_TURNS = [
    USER,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "t7"},
]

BODIES = {
    "plain": {"messages": [USER]},
    "no generation prompt": {"messages": [USER], "add_generation_prompt": False},
    "continue final message": {
        "messages": [USER, {"role": "assistant", "content": "t6 t8"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "enable_thinking false": {
        "messages": [USER],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "enable_thinking true": {"messages": [USER], "chat_template_kwargs": {"enable_thinking": True}},
    "tools": {"messages": [USER], "tools": TOOLS},
    "tool calls and results": {"messages": TOOL_TURNS, "tools": TOOLS},
    "tools, thinking off": {
        "messages": TOOL_TURNS,
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False},
    },
}


def _tokenizer(template: str) -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(64) if i not in (1, 2)} | {"</s>": 1, "<s>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 2)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = template
    return hf


@pytest.fixture(scope="module", params=["tools template", "plain template"])
def front(request):
    """(the front's app, its fake router, the router's encoder) for one of the templates."""
    template = TOOLS_TEMPLATE if request.param == "tools template" else PLAIN_TEMPLATE
    tokenizer = _tokenizer(template)
    encoder = PromptEncoder(tokenizer, 256, 64)
    router = FakeRouter(lambda gen: one_token(3))
    app = front_app(router, tokenizer=tokenizer, encoder=encoder, max_model_len=256)
    yield app, router, encoder
    encoder.close()


def _post(app, path: str, body: dict):
    status, _, got = asyncio.run(asgi_call(app, "POST", path, json.dumps(body).encode()))
    return status, got


@pytest.mark.parametrize("name", list(BODIES))
def test_tokenize_counts_the_prompt_chat_runs(front, name):
    app, router, encoder = front
    body = BODIES[name]
    status, got = _post(app, "/v1/chat/completions", body)
    assert status == 200, got
    chat_ids = encoder.encode(router.gens[-1])  # what the router runs for that request
    status, got = _post(app, "/tokenize", body)
    assert status == 200, got
    assert got["tokens"] == chat_ids and got["count"] == len(chat_ids)
    assert chat_ids[0] != 2  # the template writes the prompt: no BOS added on top, in either


def test_tools_change_the_count(front):
    """The tools are rendered (so a body without them is counted short)."""
    app, _, _ = front
    _, bare = _post(app, "/tokenize", {"messages": [USER]})
    _, with_tools = _post(app, "/tokenize", {"messages": [USER], "tools": TOOLS})
    assert with_tools["count"] > bare["count"]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"messages": [USER], "chat_template": "{{ x }}"}, "the served model's chat template"),
        ({"messages": [USER], "tools": [{"type": "function"}]}, "function"),
        ({"messages": [USER], "tools": TOOLS + TOOLS[:1]}, "unique"),
        ({"messages": [USER], "tools": []}, "at least 1"),
        ({"prompt": "t5", "tools": TOOLS}, "messages only"),
    ],
)
def test_bad_tools_and_chat_template_are_400s_naming_the_field(front, body, message):
    app, _, _ = front
    field = "chat_template" if "chat_template" in body else "tools"
    status, got = _post(app, "/tokenize", body)
    assert status == 400, got
    assert got["error"]["param"].startswith(field) and message in got["error"]["message"], got


def test_chat_refuses_chat_template_with_the_same_reason(front):
    app, router, _ = front
    before = len(router.gens)
    status, got = _post(app, "/v1/chat/completions", {"messages": [USER], "chat_template": "x"})
    assert status == 400 and got["error"]["param"] == "chat_template", got
    assert "the served model's chat template" in got["error"]["message"]
    assert len(router.gens) == before  # refused before the router
