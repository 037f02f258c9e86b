"""Tokenizer loading and incremental detokenization.

Decoding one token at a time loses the spaces that depend on the previous token and splits
multi-byte characters, so each step decodes a short window (prefix_offset..end) and emits only
the text past the window's already-emitted part (the scheme of TGI and vLLM).
"""

from __future__ import annotations

from transformers import AutoTokenizer

from pdserve.engine.errors import InvalidRequest
from pdserve.engine.sampling_params import MAX_BAD_WORDS_TOKENS


def load_tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def reasoning_tags(tokenizer) -> tuple[int, int] | None:
    """The ids of a reasoning model's <think> and </think> (Qwen3, QwQ, DeepSeek-R1 and its
    distillations, SmolLM3: each one token of the vocabulary); None for a model without them."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids = vocab.get(THINK_OPEN), vocab.get(THINK_CLOSE)
    return None if None in ids else ids


def bad_words_token_ids(tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad words as token ids: each word as it would start the text, and after a space
    where that gives other tokens of the same count (a word inside a sentence is another token);
    InvalidRequest past MAX_BAD_WORDS_TOKENS ids in all, or for a word with no tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out += [plain] if plain else []
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    if len(out) < len(words) or sum(map(len, out)) > MAX_BAD_WORDS_TOKENS:
        raise InvalidRequest(
            f"bad_words come to {sum(map(len, out))} tokens (at most {MAX_BAD_WORDS_TOKENS}), "
            f"or a word has none"
        )
    return tuple(out)


def prompt_token_ids(tokenizer, prompt: str | list[int], vocab_size: int) -> list[int]:
    """A prompt as token ids: text through the tokenizer (with its special tokens), a list of ids
    checked (integers in [0, vocab_size)); InvalidRequest for an empty or bad one."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest(
                "prompt must be a non-empty string or a non-empty list of token ids"
            )
        return tokenizer.encode(prompt, add_special_tokens=True)
    ids = list(prompt)
    if not ids:
        raise InvalidRequest("prompt must be a non-empty string or a non-empty list of token ids")
    bad = [
        t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size
    ]
    if bad:
        raise InvalidRequest(
            f"prompt token ids must be integers in [0, {vocab_size}), got {bad[:3]}"
        )
    return ids


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # a few prompt tokens as left context, so the first output token gets its leading space
        self.ids = list(prompt_token_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly readable text (may be empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(
            self.ids[self.prefix_offset : self.read_offset],
            skip_special_tokens=self.skip_special_tokens,
        )
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence or a token with no text yet
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


def find_stop_string(
    text: str, num_new_chars: int, stops: tuple[str, ...]
) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `num_new_chars` characters of `text`."""
    best = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best
