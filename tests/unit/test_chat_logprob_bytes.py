"""Chat logprobs' `bytes` are the token's own UTF-8 bytes (router/openai/responses/logprobs.py
TokenText.bytes_of), as OpenAI documents them ("useful when characters are represented by
multiple tokens"): a token that is only part of a character decodes alone to U+FFFD, whose bytes
say nothing, so a byte-level BPE token's bytes come through GPT-2's byte alphabet and a
sentencepiece byte token's (<0xE6>) are that byte. Whole tokens keep their text's bytes."""

from __future__ import annotations

from helpers.structured import bytes_to_unicode
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.responses.logprobs import TokenIdText, TokenText, chat_logprobs


def _byte_level_tokenizer():
    """A 256-token byte-level BPE tokenizer (ids 0 and 1 bos and eos, id b the byte b), and one
    merge: id 256 is "é" whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = bytes_to_unicode()
    vocab = {"<s>": 0, "</s>": 1, **{b2u[b]: b for b in range(2, 256)}}
    e_acute = b2u[0xC3] + b2u[0xA9]
    vocab[e_acute] = 256
    tok = Tokenizer(models.BPE(vocab, [(b2u[0xC3], b2u[0xA9])], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


class _Sentencepiece:
    """A sentencepiece-like vocabulary: byte tokens <0x00>..<0xFF> at ids 0..255, "▁hi" at 256."""

    def convert_ids_to_tokens(self, token_id):
        return f"<0x{token_id:02X}>" if token_id < 256 else "▁hi"

    def decode(self, ids, skip_special_tokens=False):
        (t,) = ids
        return "hi" if t == 256 else (chr(t) if t < 0x80 else "\ufffd")


def _bytes(content) -> list[list[int]]:
    return [entry["bytes"] for entry in content]


def test_byte_level_tokens_of_a_split_character_give_their_own_bytes():
    tok = _byte_level_tokenizer()
    ids = [0xE6, 0x97, 0xA5, 256, ord("a")]  # 日 in three tokens, é whole, a
    assert tok.decode(ids) == "日éa"
    top = pdserve_pb2.TopLogprobs(token_ids=[0x97, 256], logprobs=[-0.5, -1.0])
    out = chat_logprobs(ids, [-0.1] * 5, TokenText(tok), [top] * 5, 2)["content"]
    assert [e["token"] for e in out] == ["\ufffd", "\ufffd", "\ufffd", "é", "a"]
    assert _bytes(out) == [[0xE6], [0x97], [0xA5], [0xC3, 0xA9], [ord("a")]]
    assert _bytes(out[0]["top_logprobs"]) == [[0x97], [0xC3, 0xA9]]
    assert bytes(b for e in out for b in e["bytes"]) == "日éa".encode()


def test_sentencepiece_byte_tokens_give_their_byte():
    ids = [0xE6, 0x97, 0xA5, ord("a"), 256]
    out = chat_logprobs(ids, [-0.1] * 5, TokenText(_Sentencepiece()))["content"]
    assert _bytes(out) == [[0xE6], [0x97], [0xA5], [ord("a")], list(b"hi")]


def test_tokens_named_by_id_keep_the_names_bytes():
    out = chat_logprobs([0xE6], [-0.1], TokenIdText(_byte_level_tokenizer()))["content"]
    assert out[0]["token"] == "token_id:230" and out[0]["bytes"] == list(b"token_id:230")
