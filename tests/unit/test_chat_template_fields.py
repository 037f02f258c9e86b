"""vLLM's chat template fields as the router renders a chat (router/text.py's PromptEncoder, which
Generate and POST /tokenize share): add_generation_prompt, continue_final_message and
chat_template_kwargs change the rendered prompt as vLLM's do, and bad values are refused with
INVALID_ARGUMENT naming the field (the HTTP front's 400s: tests/unit/test_http_logprobs.py)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.tokenizer import load_tokenizer
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.text import BadRequest, PromptEncoder

# word-level test tokenizer: "tN" is token N; t9 only with the template variable `flag`
TEMPLATE = (
    "{% for m in messages %}t3 {{ m.content }} t4 {% endfor %}{% if flag %}t9 {% endif %}"
    "{% if add_generation_prompt %}t7{% endif %}"
)


@pytest.fixture(scope="module")
def encoder(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    tok = load_tokenizer(model_dir)
    tok.chat_template = TEMPLATE
    enc = PromptEncoder(tok, 256)
    yield enc
    enc.close()


def _chat(*contents, roles=("user", "assistant"), **fields) -> pdserve_pb2.ChatMessages:
    chat = pdserve_pb2.ChatMessages(**fields)
    for i, c in enumerate(contents):
        chat.messages.add(role=roles[i % 2], content=c)
    return chat


def _generate(chat) -> pdserve_pb2.GenerateRequest:
    req = pdserve_pb2.GenerateRequest()
    req.chat.CopyFrom(chat)
    return req


def test_defaults_add_the_generation_prompt(encoder):
    assert encoder.encode(_generate(_chat("t5"))) == [3, 5, 4, 7]
    assert encoder.tokenize_chat(_chat("t5")) == [3, 5, 4, 7]


def test_add_generation_prompt_false_leaves_it_out(encoder):
    assert encoder.encode(_generate(_chat("t5", add_generation_prompt=False))) == [3, 5, 4]


def test_continue_final_message_leaves_the_last_message_open(encoder):
    chat = _chat("t5", "t6 t8", continue_final_message=True)
    # rendered up to the end of the assistant's content: no closing t4, no generation prompt
    assert encoder.encode(_generate(chat)) == [3, 5, 4, 3, 6, 8]


def test_chat_template_kwargs_reach_the_template(encoder):
    chat = _chat("t5", chat_template_kwargs_json='{"flag": true}')
    assert encoder.encode(_generate(chat)) == [3, 5, 4, 9, 7]
    chat = _chat("t5", chat_template_kwargs_json='{"flag": false}')
    assert encoder.encode(_generate(chat)) == [3, 5, 4, 7]


@pytest.mark.parametrize(
    "chat, field",
    [
        (_chat("t5", continue_final_message=True), "chat.continue_final_message"),
        (
            _chat("t5", "t6", continue_final_message=True, add_generation_prompt=True),
            "chat.continue_final_message",
        ),
        (_chat("t5", chat_template_kwargs_json='"x"'), "chat.chat_template_kwargs_json"),
        (
            _chat("t5", chat_template_kwargs_json='{"tokenize": true}'),
            "chat.chat_template_kwargs_json",
        ),
    ],
)
def test_bad_fields_are_invalid_argument(encoder, chat, field):
    with pytest.raises(BadRequest) as e:
        encoder.encode(_generate(chat))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.message
    assert encoder.encode(_generate(_chat("t5"))) == [3, 5, 4, 7]  # it keeps serving


def test_tokenize_text_counts_without_the_context_check(encoder):
    assert encoder.tokenize_text("t5 t6", False) == [5, 6]
    assert encoder.tokenize_text("", True) == []
    with pytest.raises(BadRequest):  # bounded like a prompt all the same
        encoder.tokenize_text("t5 " * 5000)


class _CountingTokenizer:
    """What PromptEncoder touches of a tokenizer, counting the chat renders."""

    def __init__(self, template, fail=False):
        self.chat_template, self.fail, self.renders = template, fail, 0

    def __len__(self):
        return 8

    def batch_decode(self, ids, skip_special_tokens=False):
        return ["ab" for _ in ids]

    def encode(self, text, add_special_tokens=True):
        return [1, 2]

    def apply_chat_template(self, conversation, tokenize=False, **options):
        self.renders += 1
        if self.fail:
            raise ValueError("this template wants a system message first")
        return "rendered"


@pytest.mark.parametrize("fail", [False, True])
def test_the_template_is_compiled_before_the_first_chat(fail):
    """The encoder renders one chat on its own thread when made, so the first client's chat does
    not pay for compiling the template; a template that refuses that chat changes nothing."""
    tok = _CountingTokenizer("{{ messages }}", fail=fail)
    enc = PromptEncoder(tok, 256)
    try:
        enc._executor.submit(lambda: None).result(timeout=10)  # the warm-up ran before it
        assert tok.renders == 1
        if not fail:
            assert enc.tokenize_chat(_chat("t5")) == [1, 2]
    finally:
        enc.close()


def test_truncate_prompt_tokens_keeps_the_last_tokens_after_templating(encoder):
    """vLLM's truncate_prompt_tokens: the prompt (ids, or a chat after its template) keeps its
    last k tokens; -1 keeps as many as max_model_len holds with one left; 0 and -2 are refused."""
    ids = pdserve_pb2.TokenIds(ids=list(range(2, 302)))  # 300 tokens: past max_model_len 256
    keep3 = pdserve_pb2.GenerateRequest(token_ids=ids, truncate_prompt_tokens=3)
    assert encoder.encode(keep3) == [299, 300, 301]
    keep_all = pdserve_pb2.GenerateRequest(token_ids=ids, truncate_prompt_tokens=-1)
    assert encoder.encode(keep_all) == list(range(47, 302))  # the last 255
    chat = pdserve_pb2.GenerateRequest(chat=_chat("t5 t6"), truncate_prompt_tokens=2)
    whole = encoder.encode(pdserve_pb2.GenerateRequest(chat=_chat("t5 t6")))
    assert encoder.encode(chat) == whole[-2:] and len(whole) > 2
    for k in (0, -2):
        bad = pdserve_pb2.GenerateRequest(token_ids=ids, truncate_prompt_tokens=k)
        with pytest.raises(BadRequest, match="truncate_prompt_tokens") as e:
            encoder.encode(bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
