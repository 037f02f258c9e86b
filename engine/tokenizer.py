"""Tokenizer loading and incremental detokenization.

Decoding one token at a time loses the spaces that depend on the previous token and splits
multi-byte characters, so each step decodes a short window (prefix_offset..end) and emits only
the text past the window's already-emitted part (the scheme of TGI and vLLM). Only the length of
that part's text is needed: it is kept until the window moves, and where the part is one token
(each step that emits leaves that) it comes from a per-tokenizer table of one-token texts, so a
step makes one decode call. That call goes to the Rust tokenizer directly where HF's decode
would return its text unchanged (a plain fast tokenizer without clean-up of spaces).
"""

from __future__ import annotations

import functools
import weakref

from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

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
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        if not ids:  # (text the tokenizer makes nothing of: nothing to run, nothing to sample from)
            raise InvalidRequest(
                "prompt's text comes to no tokens with this model's tokenizer: send text it "
                "tokenizes, or token ids"
            )
        return ids
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


# The text length of each token decoded alone, per tokenizer: (its vocabulary's size, and per
# (skip_special_tokens, clean_up_tokenization_spaces) a table {id: length})
_ONE_TOKEN_LENGTHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _one_token_lengths(tokenizer, skip_special_tokens: bool) -> dict[int, int]:
    """The table of one-token text lengths for this tokenizer and mode, emptied where the
    vocabulary has changed size since it was filled (tokens added); a table of its own for a
    tokenizer that cannot be a weak key."""
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    mode = (skip_special_tokens, bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)))
    try:
        entry = _ONE_TOKEN_LENGTHS.get(tokenizer)
        if entry is None or entry[0] != size:
            entry = _ONE_TOKEN_LENGTHS[tokenizer] = (size, {})
    except TypeError:
        return {}
    return entry[1].setdefault(mode, {})


def _decoder(tokenizer, skip_special_tokens: bool):
    """A function of a list of ids that gives HF's decode of them: the Rust tokenizer's own
    decode where HF's would return that text unchanged (a fast tokenizer whose class keeps HF's
    decode, without clean-up of spaces), else HF's decode."""
    cls = type(tokenizer)
    plain = (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    decode = tokenizer._tokenizer.decode if plain else tokenizer.decode
    return functools.partial(decode, skip_special_tokens=skip_special_tokens)


# Tokens read without new text (a character's bytes, tokens with no text) after which the window
# moves on anyway: no UTF-8 character takes more, and each step's decode stays this short where a
# model repeats such a token (an ignore_eos run past its end of text), instead of growing with
# the output.
MAX_UNREAD_TOKENS = 16


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # a few prompt tokens as left context, so the first output token gets its leading space
        self.ids = list(prompt_token_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._lengths = _one_token_lengths(tokenizer, skip_special_tokens)
        # the text length of ids[prefix_offset:read_offset]; None until measured after a move
        self._prefix_len: int | None = None

    def _window_len(self) -> int:
        """The text length of ids[prefix_offset:read_offset], one token's from the table."""
        if self.read_offset - self.prefix_offset != 1:
            return len(self._decode(self.ids[self.prefix_offset : self.read_offset]))
        token = self.ids[self.prefix_offset]
        n = self._lengths.get(token)
        if n is None:
            n = self._lengths[token] = len(self._decode([token]))
        return n

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly readable text (may be empty)."""
        ids = self.ids
        ids.append(token_id)
        prefix_len = self._prefix_len
        if prefix_len is None:
            prefix_len = self._prefix_len = self._window_len()
        full = self._decode(ids[self.prefix_offset :])
        if (len(full) <= prefix_len or full.endswith("\ufffd")) and (
            len(ids) - self.read_offset < MAX_UNREAD_TOKENS
        ):
            return ""  # an incomplete UTF-8 sequence or a token with no text yet
        delta = full[prefix_len:]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self._prefix_len = None
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
