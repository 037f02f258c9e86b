"""The incremental detokenizer (engine/tokenizer.py) against the algorithm it replaced, kept
here as the reference: two HF decode calls per token (the window's emitted part, and the whole
window). On random token streams and on the tokens of texts with multi-byte characters (emoji,
CJK, accents), the new one must give the same text piece for piece, with special tokens skipped
and kept, from the tiny models' word-level tokenizer, a byte-level BPE (tests/helpers), a
SentencePiece-style one with byte fallback and a stripped leading space, and WordPiece with HF's
clean-up of spaces. It must also make one decode call per token where each token emits text."""

from __future__ import annotations

import random

import pytest

from helpers.structured import byte_level_model
from pdserve.engine.tokenizer import MAX_UNREAD_TOKENS, IncrementalDetokenizer, load_tokenizer

TEXTS = (
    "Hello, world! It's a test.",
    "llamas 🦙🦙 and 👩‍👩‍👧 families",
    "日本語のテキスト、中文字符。",
    "  two leading spaces, café naïve  ",
    "don't stop ; can't ? yes !",
    "tab\tand\nnewline",
)


class Reference:
    """The detokenizer as it was: both texts decoded by HF on every token; since 2026-12-05 with
    the bound on tokens read without new text (MAX_UNREAD_TOKENS), after which the window moves
    on: text that can no longer complete a character comes out as it is."""

    def __init__(self, tokenizer, prompt_token_ids, skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(
            self.ids[self.prefix_offset : self.read_offset],
            skip_special_tokens=self.skip_special_tokens,
        )
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if (len(full) <= len(prefix) or full.endswith("\ufffd")) and (
            len(self.ids) - self.read_offset < MAX_UNREAD_TOKENS
        ):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


def _sentencepiece_style():
    """A Llama-2-style tokenizer: "▁" for spaces, bytes as <0xNN> tokens, and the decoder's
    strip of the text's first space."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["▁", "▁the", "▁a", "▁llama", "ing", "s", ",", ".", "日", "本", "▁▁", "é"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({p: 259 + i for i, p in enumerate(pieces)})
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _wordpiece_with_clean_up():
    """A BERT-style tokenizer whose HF decode cleans up spaces before punctuation."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "llama", "##s", "##ing", "run", "do"]
    words += [".", ",", "!", "?", "'", "s", "n", "##'", "##t", "t", "m", "re", "ve", "café"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(t, special=True) for t in words[:4]])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        clean_up_tokenization_spaces=True,
    )


@pytest.fixture(scope="module")
def tokenizers(tiny_models, tmp_path_factory):
    """name -> tokenizer: the ones the engine loads from disk, and two built here."""
    tiny = tiny_models("llama-gqa")[0]
    tags = ("<think>", "</think>")
    byte_level = load_tokenizer(byte_level_model(tiny, tmp_path_factory.mktemp("bl"), None, tags))
    special = load_tokenizer(
        byte_level_model(tiny, tmp_path_factory.mktemp("bls"), None, tags, special=True)
    )
    # a BPE with HF's clean-up asked for (which HF may refuse for BPE: both sides ask the same)
    cleaned = load_tokenizer(byte_level_model(tiny, tmp_path_factory.mktemp("blc")))
    cleaned.clean_up_tokenization_spaces = True
    return {
        "word-level": load_tokenizer(tiny),
        "byte-level": byte_level,
        "byte-level-special-tags": special,
        "byte-level-clean-up": cleaned,
        "sentencepiece-style": _sentencepiece_style(),
        "wordpiece-clean-up": _wordpiece_with_clean_up(),
    }


def _streams(tokenizer, rng: random.Random, total: int):
    """(prompt ids, output ids) pairs, `total` output tokens in all: random ids (any token,
    specials included, and byte tokens that leave UTF-8 sequences unfinished) mixed with the
    tokens of TEXTS."""
    size = len(tokenizer)
    text_ids = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    out = []
    while total > 0:
        prompt = [rng.randrange(size) for _ in range(rng.choice((0, 1, 3, 8)))]
        ids: list[int] = []
        while len(ids) < rng.randrange(1, 120):
            if rng.random() < 0.5:
                ids += rng.choice(text_ids)
            else:
                ids += [rng.randrange(size) for _ in range(rng.randrange(1, 6))]
        out.append((prompt, ids))
        total -= len(ids)
    return out


@pytest.mark.parametrize(
    "name",
    [
        "word-level",
        "byte-level",
        "byte-level-special-tags",
        "byte-level-clean-up",
        "sentencepiece-style",
        "wordpiece-clean-up",
    ],
)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_is_the_reference_algorithms(tokenizers, name, skip_special_tokens):
    tokenizer = tokenizers[name]
    rng = random.Random(f"{name}-{skip_special_tokens}")
    streams = _streams(tokenizer, rng, 3000)
    # the texts alone, each from an empty prompt and after one token: the first token's space
    streams += [([], tokenizer.encode(t, add_special_tokens=False)) for t in TEXTS]
    streams += [([5], tokenizer.encode(t, add_special_tokens=False)) for t in TEXTS]
    for prompt, ids in streams:
        new = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        ref = Reference(tokenizer, prompt, skip_special_tokens)
        for i, t in enumerate(ids):
            assert new.add(t) == ref.add(t), (prompt, ids[: i + 1])
        assert new.text == ref.text


def test_texts_round_trip(tokenizers):
    """The streams above are not all noise: the texts' own tokens give the texts back."""
    tokenizer = tokenizers["byte-level"]
    for t in TEXTS:
        detok = IncrementalDetokenizer(tokenizer, [], True)
        for token in tokenizer.encode(t, add_special_tokens=False):
            detok.add(token)
        assert detok.text == t


def test_one_decode_call_per_token(tokenizers, monkeypatch):
    """Where every token emits text, each token costs one decode call once the one-token table
    holds the tokens (HF's decode is the one called where clean-up of spaces is on)."""
    tokenizer = tokenizers["wordpiece-clean-up"]
    calls = []
    real = tokenizer.decode
    monkeypatch.setattr(
        tokenizer, "decode", lambda ids, **kw: calls.append(list(ids)) or real(ids, **kw)
    )
    ids = tokenizer.encode("the llamas run the llama run", add_special_tokens=False)
    first = IncrementalDetokenizer(tokenizer, [4], True)
    for t in ids:  # fills the table with these tokens' lengths
        first.add(t)
    detok = IncrementalDetokenizer(tokenizer, [4], True)
    calls.clear()
    for t in ids:
        assert detok.add(t)
    assert len(calls) == len(ids)  # the prompt's one-token window too comes from the table
    assert detok.text == first.text == " the llamas run the llama run"


@pytest.mark.parametrize("name", ["byte-level", "sentencepiece-style"])
def test_a_token_repeated_without_text_keeps_each_decode_short(tokenizers, name, monkeypatch):
    """A model that repeats a skipped special token, or a byte that completes no character (an
    ignore_eos run past its end of text), costs each step a decode of a bounded window, not of
    everything since the last text; the bytes' replacement characters come out every
    MAX_UNREAD_TOKENS tokens, none held back for good."""
    tokenizer = tokenizers[name]
    lone = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd")
    for token in (tokenizer.eos_token_id, lone):
        detok = IncrementalDetokenizer(tokenizer, [5], True)
        widths = []
        real = detok._decode
        detok._decode = lambda ids, real=real: widths.append(len(ids)) or real(ids)
        text = "".join(detok.add(token) for _ in range(300))
        assert max(widths) <= 2 * MAX_UNREAD_TOKENS and text == detok.text
    assert set(text) == {"\ufffd"} and len(text) >= 300 - MAX_UNREAD_TOKENS
