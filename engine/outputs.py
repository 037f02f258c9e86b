"""The output side of an engine step: text for the tokens a sequence received, stop strings, and
the RequestOutput a caller sees.

LLMEngine (engine/engine_core.py) calls `emit_tokens` for each sequence a step touched, once for
all the tokens it received (one, or several when speculative decoding kept guesses), then builds
one `request_output` per request. A stop string ends the sequence at the token that completes it:
tokens the same step appended after that one are taken back, so the output is what an engine
without speculation would have produced.
"""

from __future__ import annotations

import time

from pdserve.engine.request import CompletionOutput, FinishReason, RequestOutput
from pdserve.engine.sampling_params import RequestOutputKind
from pdserve.engine.tokenizer import find_stop_string


def emit_tokens(scheduler, seq, detok, params, count: int = 1) -> None:
    """Detokenizes the last `count` tokens of `seq` in order, finishing it at a stop string
    (detok None: the request asked for no text, and has no stop strings)."""
    if seq.first_token_time is None:
        seq.first_token_time = time.monotonic()
    if detok is None:
        return
    first = seq.num_tokens - count
    for i in range(count):
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
        scheduler.finish(seq, FinishReason.STOP, stop)
        extra = count - i - 1  # tokens after the one that completed the stop string
        if extra:
            del seq.token_ids[-extra:]
            if len(seq.logprobs) > seq.num_output_tokens:
                del seq.logprobs[seq.num_output_tokens :]
        return


def request_output(req) -> RequestOutput | None:
    """The RequestOutput of an engine request (engine_core._Request) as it stands, in the form
    its params' output_kind asks for: everything so far, only what is new since its last output
    (whose ends `req.sent` keeps), or nothing until it finishes (None). A running request's text
    holds back what a stop string could still take back (SamplingParams.stop_holdback)."""
    params, finished = req.params, req.finished
    kind = params.output_kind
    if kind == RequestOutputKind.FINAL_ONLY and not finished:
        return None
    delta = kind == RequestOutputKind.DELTA
    if delta and req.sent is None:
        req.sent = [(0, 0, 0)] * len(req.seqs)
    completions = [_completion(req, i, delta) for i in range(len(req.seqs))]
    first = req.seqs[0]
    if first.first_token_time is not None:
        req.metrics.setdefault("first_token", first.first_token_time)
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is not None:  # in full once the prompt is, and only then under DELTA
        if delta and (req.prompt_logprobs_sent or not (finished or first.num_output_tokens)):
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


def _completion(req, i: int, delta: bool) -> CompletionOutput:
    """Sequence i's CompletionOutput: cumulative, or (delta) what follows req.sent[i]."""
    s, d, params = req.seqs[i], req.detoks[i], req.params
    text = "" if d is None else d.text
    if not s.is_finished and params.stop_holdback:
        text = text[: max(0, len(text) - params.stop_holdback)]
    want_logprobs = params.logprobs
    if delta:
        tokens_sent, logprobs_sent, text_sent = req.sent[i]
        token_ids = s.token_ids[s.num_prompt_tokens + tokens_sent :]
        logprobs = s.logprobs[logprobs_sent:] if want_logprobs else None
        req.sent[i] = (
            tokens_sent + len(token_ids),
            logprobs_sent + (len(logprobs) if want_logprobs else 0),
            len(text),
        )
        text = text[text_sent:]
    else:
        token_ids = s.output_token_ids
        logprobs = list(s.logprobs) if want_logprobs else None
    return CompletionOutput(
        index=s.index,
        text=text,
        token_ids=token_ids,
        finish_reason=s.finish_reason.value if s.finish_reason else None,
        stop_reason=s.stop_reason,
        logprobs=logprobs,
        accepted_prediction_tokens=s.prediction_accepted,
        rejected_prediction_tokens=s.prediction_rejected,
    )
