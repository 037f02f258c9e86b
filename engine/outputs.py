"""The output side of an engine step: text for the tokens a sequence received, stop strings, and
the RequestOutput a caller sees; and the offline API's outputs in vLLM's shapes.

LLMEngine (engine/engine_core.py) calls `emit_tokens` for each sequence a step touched, once for
all the tokens it received (one, or several when speculative decoding kept guesses), then builds
one `request_output` per request. A stop string ends the sequence at the token that completes it:
tokens the same step appended after that one are taken back, so the output is what an engine
without speculation would have produced.

The engine's outputs keep the logprobs the workers put on the wire: a float per sampled token (a
TokenLogprob with its alternatives) and {token id: logprob} per prompt position. `vllm_output`
turns a finished request's into vLLM's offline shapes (LLM.generate calls it): a dict
{token id: Logprob} per position, each Logprob with its rank and text, and cumulative_logprob.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.engine.request import CompletionOutput, FinishReason, RequestOutput
from pdserve.engine.sampling_params import RequestOutputKind, SamplingParams
from pdserve.engine.tokenizer import find_stop_string


def emit_tokens(scheduler, seq, detok, params, count: int = 1) -> None:
    """Detokenizes the last `count` tokens of `seq` in order, finishing it at a stop string
    (detok None: the request asked for no text, and has no stop strings).

    As vLLM V1's detokenizer does: the text of a token that ended the sequence as a stop token
    (an end-of-sequence token, which a complete grammar's end is too, or one of stop_token_ids)
    is left out unless include_stop_str_in_output, and no stop string is looked for in it; the
    token itself stays in the output's token ids and logprobs. A stop string is the reason the
    sequence ended whenever the text is cut at one, even where the token that completed it also
    reached max_tokens (or another end the same step found)."""
    if seq.first_token_time is None:
        seq.first_token_time = time.monotonic()
    if detok is None:
        return
    first = seq.num_tokens - count
    last = count - 1 if _ended_by_stop_token(scheduler, seq) else None
    for i in range(count):
        if i == last:
            if params.include_stop_str_in_output:
                detok.add(seq.token_ids[first + i])
            return
        delta = detok.add(seq.token_ids[first + i])
        stops = params.stop
        if not delta or not stops:
            continue
        hit = find_stop_string(detok.text, len(delta), stops)
        if hit is None:
            continue
        at, stop = hit
        detok.text = (
            detok.text[: at + len(stop)] if params.include_stop_str_in_output else detok.text[:at]
        )
        _stop_at_string(scheduler, seq, stop)
        extra = count - i - 1  # tokens after the one that completed the stop string
        if extra:
            del seq.token_ids[-extra:]
            if len(seq.logprobs) > seq.num_output_tokens:
                del seq.logprobs[seq.num_output_tokens :]
        return


def _ended_by_stop_token(scheduler, seq) -> bool:
    """Whether `seq` ended at its last token as a stop token: finish reason STOP with a stop
    token id as its reason, or with none and an end-of-sequence token last (a grammar's end is
    its end-of-sequence token; a grammar's refusal of a token gives a reason in words)."""
    if seq.finish_reason is not FinishReason.STOP or seq.num_output_tokens == 0:
        return False
    reason = seq.stop_reason
    if isinstance(reason, int):
        return True
    return reason is None and seq.token_ids[-1] in scheduler.eos_token_ids


# The ends a stop string found in the same step's text replaces (not an abort, nor a prefill
# worker's hand-off, which the decode side goes on from)
_RESTATED = (FinishReason.LENGTH, FinishReason.STOP, FinishReason.REPETITION)


def _stop_at_string(scheduler, seq, stop: str) -> None:
    """Ends `seq` at stop string `stop`; a sequence this step already ended otherwise (its
    max_tokens, a stop token the same step appended after the string, repetition) now ends for
    the string: its text is cut there (vLLM V1's output processor does the same)."""
    if not seq.is_finished:
        scheduler.finish(seq, FinishReason.STOP, stop)
    elif seq.finish_reason in _RESTATED:
        seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop


# (read for every request every step: an enum member's lookup is not free)
_DELTA, _FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


def request_output(req, finished: bool) -> RequestOutput | None:
    """The RequestOutput of an engine request (engine_core._Request; `finished`: whether it is)
    as it stands, in the form its params' output_kind asks for: everything so far, only what is
    new since its last output (whose ends `req.sent` keeps), or nothing until it finishes (None).
    A running request's text holds back what a stop string could still take back
    (SamplingParams.stop_holdback). Built for every request a step touched: kept lean."""
    params = req.params
    kind = params.output_kind
    if kind == _FINAL_ONLY and not finished:
        return None
    seqs = req.seqs
    first = seqs[0]
    if kind == _DELTA:
        sent = req.sent
        if sent is None:
            sent = req.sent = [(0, 0, 0)] * len(seqs)
        completions = (
            [_delta(req, 0, sent)]
            if len(seqs) == 1
            else [_delta(req, i, sent) for i in range(len(seqs))]
        )
    else:
        completions = [_cumulative(req, i) for i in range(len(seqs))]
    if first.first_token_time is not None and "first_token" not in req.metrics:
        req.metrics["first_token"] = first.first_token_time
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is not None:  # in full once the prompt is, and only then under DELTA
        if kind == _DELTA and (
            req.prompt_logprobs_sent or not (finished or first.num_output_tokens)
        ):
            prompt_logprobs = None
        else:
            req.prompt_logprobs_sent = True
            prompt_logprobs = list(prompt_logprobs)
    return RequestOutput(
        req.request_id,
        req.prompt,
        first.prompt_token_ids,
        completions,
        finished,
        first.num_cached_tokens,
        dict(req.metrics),
        prompt_logprobs,
        first.pooled if first.pooling is not None and first.is_finished else None,
    )


def _text(req, i: int, s) -> str:
    """Sequence i's text so far, less what a stop string could still take back."""
    d = req.detoks[i]
    if d is None:
        return ""
    text, holdback = d.text, req.params.stop_holdback
    if holdback and not s.is_finished:
        text = text[: max(0, len(text) - holdback)]
    return text


def _delta(req, i: int, sent: list[tuple[int, int, int]]) -> CompletionOutput:
    """Sequence i's CompletionOutput of what follows sent[i], which it moves past that."""
    s = req.seqs[i]
    tokens_sent, logprobs_sent, text_sent = sent[i]
    token_ids = s.token_ids[len(s.prompt_token_ids) + tokens_sent :]
    logprobs = s.logprobs[logprobs_sent:] if req.params.logprobs is not None else None
    text = "" if req.detoks[i] is None else _text(req, i, s)
    sent[i] = (
        tokens_sent + len(token_ids),
        logprobs_sent + (len(logprobs) if logprobs is not None else 0),
        len(text),
    )
    reason = s.finish_reason
    return CompletionOutput(
        s.index,
        text[text_sent:] if text_sent else text,
        token_ids,
        reason.value if reason else None,
        s.stop_reason,
        logprobs,
        s.prediction_accepted,
        s.prediction_rejected,
    )


def _cumulative(req, i: int) -> CompletionOutput:
    """Sequence i's CompletionOutput of everything so far."""
    s = req.seqs[i]
    reason = s.finish_reason
    return CompletionOutput(
        s.index,
        _text(req, i, s),
        s.output_token_ids,
        reason.value if reason else None,
        s.stop_reason,
        list(s.logprobs) if req.params.logprobs is not None else None,
        s.prediction_accepted,
        s.prediction_rejected,
    )


# ---- the offline API's outputs in vLLM's shapes ------------------------------------------------


class Logprob(float):
    """vLLM's Logprob: `logprob`, `rank` (1: the most likely token; for the sampled or prompt
    token, vLLM's count of the tokens at least as likely) and `decoded_token` (the token decoded
    alone; None where the request asked for no text: detokenize=False). A float of the logprob
    too, so code that reads these dicts' values as numbers keeps working; equality is the
    float's."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        obj = super().__new__(cls, logprob)
        obj.rank = rank
        obj.decoded_token = decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return (
            f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
            f"decoded_token={self.decoded_token!r})"
        )

    def __reduce__(self):
        return (Logprob, (float(self), self.rank, self.decoded_token))


@dataclass(slots=True)
class OfflineCompletionOutput(CompletionOutput):
    """A CompletionOutput of the offline API, with vLLM's cumulative_logprob: the sum of the
    sampled tokens' logprobs where logprobs were asked for, else None."""

    cumulative_logprob: float | None = None


class _TokenTexts:
    """Each token decoded alone, as vLLM's logprobs give it (convert_ids_list_to_tokens), once
    per id; None throughout without a tokenizer (the request asked for no text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.cache.get(token)
        if text is None:
            text = self.cache[token] = self.tokenizer.decode([token]) or ""
        return text

    def position(self, ids: list[int], previous: int | None) -> list[str | None]:
        """The texts of one position's ids (the sampled or prompt token first), with vLLM's
        repair of a text that ends in an incomplete character (U+FFFD): decoded after the id
        before it in the list, then after `previous` (the last position's sampled token) as
        well, else empty (vLLM's LogprobsProcessor._verify_tokens)."""
        texts = [self(t) for t in ids]
        if self.tokenizer is None:
            return texts
        for i, text in enumerate(texts):
            if not text.endswith("\ufffd"):
                continue
            tries = [ids[i - 1 : i + 1]] if i > 0 else []
            if previous is not None:
                tries.append([previous, *(ids[i - 1 : i + 1] if i > 0 else ids[i : i + 1])])
            texts[i] = next(
                (t for t in map(self.tokenizer.decode, tries) if not t.endswith("\ufffd")), ""
            )
        return texts


def _position(
    token: int, value: float, rank, top: list, texts: _TokenTexts, previous: int | None
) -> dict[int, Logprob]:
    """vLLM's dict for one position: the sampled (or prompt) token first with its rank, then the
    top tokens with ranks 1, 2, ... (a top token that is the sampled one keeps its place first
    and takes its top entry)."""
    ids = [token, *(t for t, _ in top)]
    names = texts.position(ids, previous)
    out = {token: Logprob(value, rank, names[0])}
    for r, ((t, v), name) in enumerate(zip(top, names[1:]), start=1):
        out[t] = Logprob(v, r, name)
    return out


def _sample_logprobs(c: CompletionOutput, texts: _TokenTexts) -> list[dict[int, Logprob]]:
    """A sequence's logprobs (TokenLogprobs with top and rank: the sampler's for vLLM's form) as
    vLLM's list of dicts."""
    out, previous = [], None
    for token, x in zip(c.token_ids, c.logprobs):
        top = list((getattr(x, "top", None) or {}).items())
        out.append(_position(token, float(x), getattr(x, "rank", None), top, texts, previous))
        previous = token
    return out


def _prompt_logprobs(out: RequestOutput, k: int, texts: _TokenTexts) -> list:
    """The engine's prompt entries ({token id: logprob}, the k most likely first, then the
    prompt token where it is not among them; RankedLogprobs with its rank) as vLLM's."""
    ids, entries = out.prompt_token_ids, out.prompt_logprobs
    shaped: list = [None]
    for token, entry in zip(ids[1:], entries[1:]):
        if entry is None:
            shaped.append(None)
            continue
        items = list(entry.items())
        top = items if k == -1 else items[:k]
        shaped.append(
            _position(token, entry[token], getattr(entry, "rank", None), top, texts, None)
        )
    return shaped


def vllm_output(out: RequestOutput, params: SamplingParams, tokenizer) -> RequestOutput:
    """A finished request's output (as LLM.generate returns it), in place, in vLLM's offline
    shapes: each completion an OfflineCompletionOutput with cumulative_logprob; where `params`
    asked in vLLM's form (any but pdserve's logprobs=True), each sampled position's logprobs a
    dict {token id: Logprob} (the sampled token and its `logprobs` most likely) and each prompt
    position's after the first likewise (the prompt token and its prompt_logprobs most likely).
    pdserve's logprobs=True keeps the engine's floats (TokenLogprob, with .top) and prompt
    entries of floats. `tokenizer` decodes each token's decoded_token (not where detokenize is
    False). An output already in these shapes is returned as it is."""
    if all(isinstance(c, OfflineCompletionOutput) for c in out.outputs):
        return out
    texts = _TokenTexts(tokenizer if params.detokenize else None)
    vllm_form = params.logprobs is not True
    completions = []
    for c in out.outputs:
        cumulative, logprobs = None, c.logprobs
        if logprobs is not None:
            cumulative = sum(map(float, logprobs), 0.0)
            if vllm_form:
                logprobs = _sample_logprobs(c, texts)
        completions.append(
            OfflineCompletionOutput(
                c.index,
                c.text,
                c.token_ids,
                c.finish_reason,
                c.stop_reason,
                logprobs,
                c.accepted_prediction_tokens,
                c.rejected_prediction_tokens,
                cumulative,
            )
        )
    out.outputs = completions
    if out.prompt_logprobs is not None and vllm_form:
        out.prompt_logprobs = _prompt_logprobs(out, params.prompt_logprobs, texts)
    return out
