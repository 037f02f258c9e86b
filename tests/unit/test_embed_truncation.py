"""Embed's truncate_prompt_tokens in the router (router/service.py), as vLLM truncates a pooling
model's inputs (its tokenizer's truncation_side "right"): each input keeps its FIRST k tokens,
token ids as sent, a text after tokenizing with the special tokens its tokenizer adds at either
end kept (what HF's own truncation gives, checked against it for four post-processors); and a
text to truncate is not held to max_prompt_bytes (the bytes max_model_len tokens can hold), which
would refuse the long documents truncation is for, while without truncation it still is. On the
servicer's own code with a real PromptEncoder and word-level tokenizers, no cluster."""

from __future__ import annotations

import grpc
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.service import PDServeServicer, ServiceOptions, first_tokens, special_ends
from pdserve.router.text import PromptEncoder

MAX_MODEL_LEN = 128
SPECIALS = {"[BOS]": 1, "[EOS]": 2}
TEMPLATES = {"none": None, "bos": "[BOS] $A", "bos+eos": "[BOS] $A [EOS]", "eos": "$A [EOS]"}


def _tokenizer(template: str | None) -> PreTrainedTokenizerFast:
    """Words "t3".."t99" are ids 3..99 ("t0" the unknown one), with [BOS] and [EOS] added as
    `template` says (tokenizers' TemplateProcessing, as real checkpoints' tokenizer.json do)."""
    vocab = {"t0": 0, **SPECIALS, **{f"t{i}": i for i in range(3, 100)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if template is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=list(SPECIALS.items())
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="[BOS]", eos_token="[EOS]"
    )


@pytest.mark.parametrize("template", TEMPLATES.values(), ids=TEMPLATES.keys())
def test_first_tokens_are_hf_truncation_on_the_right(template):
    tok = _tokenizer(template)
    ends = special_ends(tok.encode("a b"), tok.encode("a b", add_special_tokens=False))
    text = " ".join(f"t{i}" for i in range(10, 40))
    full = tok.encode(text)
    for keep in range(3, len(full) + 3):
        want = tok(text, truncation=True, max_length=keep)["input_ids"]
        assert first_tokens(full, keep, ends) == want, (template, keep)


class _Aborted(Exception):
    pass


class _Context:
    def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted(details)


@pytest.fixture
def servicer():
    """The servicer as Embed's prompts need it (its options and prompt encoder): no pool, no
    workers. Its tokenizer adds [BOS] before a text and [EOS] after it."""
    one = object.__new__(PDServeServicer)
    one.options = ServiceOptions(
        model_id="m", max_model_len=MAX_MODEL_LEN, vocab_size=100, dtype="float32"
    )
    one.encoder = PromptEncoder(_tokenizer("[BOS] $A [EOS]"), MAX_MODEL_LEN, 100)
    one._ends = None
    yield one
    one.encoder.close()


def _prompts(servicer, inputs, truncate=None):
    request = pdserve_pb2.EmbedRequest(inputs=inputs)
    if truncate is not None:
        request.truncate_prompt_tokens = truncate
    return servicer._embed_prompts(request, _Context())


def _refusal(servicer, inputs, truncate=None) -> tuple:
    context = _Context()
    request = pdserve_pb2.EmbedRequest(inputs=inputs)
    if truncate is not None:
        request.truncate_prompt_tokens = truncate
    with pytest.raises(_Aborted):
        servicer._embed_prompts(request, context)
    return context.code, context.details


def test_a_long_text_is_tokenized_whole_and_keeps_its_first_tokens(servicer):
    words = [3 + i % 90 for i in range(3000)]  # 3000 words, about 11 KB: 17 times the bound
    text = pdserve_pb2.EmbedInput(text=" ".join(f"t{i}" for i in words))
    assert len(text.text) > 10 * servicer.encoder.max_prompt_bytes
    code, details = _refusal(servicer, [text])
    assert code == grpc.StatusCode.OUT_OF_RANGE and "shorten it" in details
    (ids,) = _prompts(servicer, [text], truncate=10)
    assert ids == [1, *words[:8], 2]  # [BOS], the first 8 words, [EOS]
    (ids,) = _prompts(servicer, [text], truncate=-1)
    assert ids == [1, *words[: MAX_MODEL_LEN - 3], 2]


def test_token_ids_keep_their_first_k(servicer):
    ids = pdserve_pb2.EmbedInput(token_ids=pdserve_pb2.TokenIds(ids=range(3, 99)))
    short = pdserve_pb2.EmbedInput(text="t5 t6")
    assert _prompts(servicer, [ids, short], truncate=10) == [list(range(3, 13)), [1, 5, 6, 2]]


@pytest.mark.parametrize("k", [0, -2])
def test_a_bad_k_is_refused_naming_it(servicer, k):
    text = pdserve_pb2.EmbedInput(text="t5 " * 3000)
    code, details = _refusal(servicer, [text], truncate=k)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(f"inputs[0]: truncate_prompt_tokens={k}")


def test_an_empty_text_is_still_refused(servicer):
    code, details = _refusal(servicer, [pdserve_pb2.EmbedInput(text="")], truncate=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt is empty" in details
