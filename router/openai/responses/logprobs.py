"""OpenAI's (and vLLM's) logprob shapes for the HTTP front, as pure functions of the router's gRPC
messages: the sampled tokens' logprobs with their most likely alternatives (TokenDelta's
logprobs and top_logprobs), and the prompt's (Finish's prompt_* fields) for completions' echo
and vLLM's prompt_logprobs. whole.py builds whole responses with them and stream.py the
streamed chunks. No server state lives here.

    completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; with echo the
                 prompt's tokens come first, the first of them with None (nothing precedes it);
                 each top_logprobs entry holds the `logprobs` most likely tokens and the token
                 itself (vLLM's), keyed by their text
    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [the top_logprobs
                 most likely, each {"token", "logprob", "bytes"}]}]}; "bytes" are the token's
                 own UTF-8 bytes, also where it is only part of a character (TokenText.bytes_of)
    vLLM's prompt_logprobs (on each completion choice): [None, {"<token id>": {"logprob", "rank",
                 "decoded_token"}}, ...] with the prompt token and the k most likely at each
                 position; rank is 1-based among those k, null for a prompt token outside them

A response whose numbers do not line up with its tokens is refused as a server error
(logprobs_unavailable): a client never gets a token paired with another token's logprob.
"""

from __future__ import annotations

import functools
import math
import re

from pdserve.router.openai.errors import ApiError

LOGPROB_FLOOR = -9999.0  # what -inf is sent as (JSON has no infinities; vLLM does the same)


def logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


class TokenText:
    """Each token's own text, for logprobs (decoded alone, as vLLM reports them)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def text(self, token_ids) -> str:
        """A prompt's text from its ids (echo of a token id prompt)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def bytes_of(self, token_id: int, text: str) -> bytes:
        """The token's own UTF-8 bytes (`text`: its text decoded alone). A token that is only
        part of a character decodes to U+FFFD alone, so its bytes are read from its vocabulary
        entry: a byte-level BPE token's through GPT-2's byte alphabet, a sentencepiece byte
        token's (<0xE6>) as that byte; otherwise, and for any token not read so, its text's."""
        if "\ufffd" in text:
            convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
            piece = convert(token_id) if convert is not None else None
            if isinstance(piece, str) and piece:
                byte = _BYTE_TOKEN.fullmatch(piece)
                if byte:
                    return bytes([int(byte.group(1), 16)])
                alphabet = _byte_alphabet()
                if all(c in alphabet for c in piece):
                    return bytes(alphabet[c] for c in piece)
        return text.encode("utf-8", "surrogatepass")


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (the ByteLevel pre-tokenizer's) read back: the byte each of its
    256 printable stand-in characters is for."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return {c: b for b, c in chars.items()}


class TokenIdText(TokenText):
    """vLLM's return_tokens_as_token_ids: each logprob's token named "token_id:<id>", so a token
    that is no whole UTF-8 character on its own stays identifiable; texts stay decoded."""

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def _unavailable(what: str) -> ApiError:
    return ApiError(
        500,
        f"logprobs: {what}; send the request without logprobs, and report this",
        "server_error",
        code="logprobs_unavailable",
    )


def check_logprobs(tokens, lps, tops=None, num_top: int = 0) -> None:
    """One logprob per token (and, with num_top, one non-empty set of alternatives per token), or
    the request fails."""
    if len(lps) != len(tokens):
        raise _unavailable(f"the workers returned {len(lps)} logprobs for {len(tokens)} tokens")
    if num_top and (tops is None or len(tops) != len(tokens) or any(not t.token_ids for t in tops)):
        raise _unavailable(f"the workers returned no top {num_top} alternatives for some tokens")


def check_prompt(finish, tokens_wanted: bool = True) -> None:
    """The Finish carries the prompt's logprobs: one per prompt token after the first."""
    ids, lps, tops = finish.prompt_token_ids, finish.prompt_logprobs, finish.prompt_top_logprobs
    if tokens_wanted and (not ids or len(lps) != len(ids) - 1 or len(tops) != len(lps)):
        raise _unavailable(
            f"the workers returned {len(lps)} prompt logprobs for a prompt of {len(ids)} tokens"
        )


def _top_dict(top, num_top: int, text_of) -> dict[str, float]:
    return {text_of(t): logprob(x) for t, x in zip(top.token_ids[:num_top], top.logprobs)}


def completion_logprobs(tokens, lps, text_of, offset: int = 0, tops=None, num_top: int = 0) -> dict:
    """The completions shape for sampled tokens; text_offset counts from `offset`."""
    strs = [text_of(t) for t in tokens]
    offsets, at = [], offset
    for s in strs:
        offsets.append(at)
        at += len(s)
    top_logprobs = []
    for i, (s, x) in enumerate(zip(strs, lps)):
        entry = _top_dict(tops[i], num_top, text_of) if num_top else {}
        entry[s] = logprob(x)
        top_logprobs.append(entry)
    return {
        "tokens": strs,
        "token_logprobs": [logprob(x) for x in lps],
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def echo_logprobs(finish, text_of, num_top: int) -> dict:
    """The completions shape for the prompt (echo): its first token with None."""
    ids = list(finish.prompt_token_ids)
    out = completion_logprobs(
        ids[1:], finish.prompt_logprobs, text_of, 0, finish.prompt_top_logprobs, num_top
    )
    first = text_of(ids[0])
    return {
        "tokens": [first] + out["tokens"],
        "token_logprobs": [None] + out["token_logprobs"],
        "top_logprobs": [None] + out["top_logprobs"],
        "text_offset": [0] + [o + len(first) for o in out["text_offset"]],
    }


def joined(head: dict, tail: dict) -> dict:
    return {key: head[key] + tail[key] for key in head}


def prompt_logprobs_field(finish, text_of, k: int) -> list:
    """vLLM's choices[].prompt_logprobs."""
    out: list = [None]
    ids = finish.prompt_token_ids
    for p, (x, top) in enumerate(zip(finish.prompt_logprobs, finish.prompt_top_logprobs)):
        token = ids[p + 1]
        entry = {}
        for rank, (t, v) in enumerate(zip(top.token_ids[:k], top.logprobs), start=1):
            entry[str(t)] = {"logprob": logprob(v), "rank": rank, "decoded_token": text_of(t)}
        if str(token) not in entry:
            entry[str(token)] = {
                "logprob": logprob(x),
                "rank": None,
                "decoded_token": text_of(token),
            }
        out.append(entry)
    return out


def _chat_entry(token_id: int, x: float, text_of) -> dict:
    s = text_of(token_id)
    bytes_of = getattr(text_of, "bytes_of", None)
    raw = bytes_of(token_id, s) if bytes_of is not None else s.encode("utf-8", "surrogatepass")
    return {"token": s, "logprob": logprob(x), "bytes": list(raw)}


def chat_logprobs(tokens, lps, text_of, tops=None, num_top: int = 0) -> dict:
    content = []
    for i, (t, x) in enumerate(zip(tokens, lps)):
        entry = _chat_entry(t, x, text_of)
        top = tops[i] if num_top else None
        entry["top_logprobs"] = (
            [_chat_entry(a, v, text_of) for a, v in zip(top.token_ids[:num_top], top.logprobs)]
            if top is not None
            else []
        )
        content.append(entry)
    return {"content": content}
