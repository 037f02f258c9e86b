"""An empty prompt: POST /tokenize gives the tokenizer's special tokens for it (a BOS-adding
tokenizer's BOS, as HF's tokenizer("") and vLLM's /tokenize do; none with add_special_tokens
false), while a generation or embedding prompt of "" is still refused as empty (OpenAI refuses
an empty input): the router's PromptEncoder.encode (router/text.py), which Generate and Embed
both call, refuses it INVALID_ARGUMENT even where the tokenizer would give it a BOS. On the
front's ASGI app (no socket) with a word-level tokenizer whose post-processor adds a BOS, <s>
(token 2), and with one that adds none. The engine refuses a text that comes to no tokens."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from helpers.http_front import asgi_call, front_app
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.text import BadRequest, PromptEncoder


def _tokenizer(bos: bool) -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(16) if i not in (1, 2)} | {"</s>": 1, "<s>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 2)]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module", params=[True, False], ids=["bos", "no bos"])
def served(request):
    """(the front's app, the router's encoder, whether the tokenizer adds a BOS)."""
    tokenizer = _tokenizer(request.param)
    encoder = PromptEncoder(tokenizer, 64, 16)
    yield front_app(tokenizer=tokenizer, encoder=encoder, max_model_len=64), encoder, request.param
    encoder.close()


def _tokenize(app, body: dict):
    status, _, got = asyncio.run(asgi_call(app, "POST", "/tokenize", json.dumps(body).encode()))
    assert status == 200, got
    return got


def test_empty_prompt_gives_the_special_tokens(served):
    app, _, bos = served
    got = _tokenize(app, {"prompt": ""})
    assert got["tokens"] == ([2] if bos else []) and got["count"] == len(got["tokens"])
    assert _tokenize(app, {"prompt": "", "add_special_tokens": False})["tokens"] == []
    assert _tokenize(app, {"prompt": "t5"})["tokens"] == ([2, 5] if bos else [5])


@pytest.mark.parametrize("truncate", [None, 4])
def test_an_empty_generation_or_embedding_prompt_is_still_refused(served, truncate):
    _, encoder, _ = served
    request = pdserve_pb2.GenerateRequest(text="")
    if truncate is not None:
        request.truncate_prompt_tokens = truncate
    with pytest.raises(BadRequest) as e:
        encoder.encode(request)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt is empty" in e.value.message


def test_the_engine_refuses_text_its_tokenizer_makes_nothing_of():
    """A non-empty text that comes to no tokens (whitespace, with a tokenizer that adds no BOS)
    is refused where the engine tokenizes it, instead of reaching the scheduler as an empty
    prompt (which no step can sample from)."""
    from pdserve.engine.errors import InvalidRequest
    from pdserve.engine.tokenizer import prompt_token_ids

    with pytest.raises(InvalidRequest, match="comes to no tokens"):
        prompt_token_ids(_tokenizer(bos=False), "   ", 16)
    assert prompt_token_ids(_tokenizer(bos=True), "   ", 16) == [2]
