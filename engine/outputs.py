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
from pdserve.engine.tokenizer import find_stop_string


def emit_tokens(scheduler, seq, detok, params, count: int = 1) -> None:
    """Detokenizes the last `count` tokens of `seq` in order, finishing it at a stop string."""
    if seq.first_token_time is None:
        seq.first_token_time = time.monotonic()
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


def request_output(req) -> RequestOutput:
    """The RequestOutput of an engine request (engine_core._Request) as it stands."""
    first = req.seqs[0]
    completions = [
        CompletionOutput(
            index=s.index,
            text=d.text,
            token_ids=s.output_token_ids,
            finish_reason=s.finish_reason.value if s.finish_reason else None,
            stop_reason=s.stop_reason,
            logprobs=list(s.logprobs) if req.params.logprobs else None,
            accepted_prediction_tokens=s.prediction_accepted,
            rejected_prediction_tokens=s.prediction_rejected,
        )
        for s, d in zip(req.seqs, req.detoks)
    ]
    if first.first_token_time is not None:
        req.metrics.setdefault("first_token", first.first_token_time)
    return RequestOutput(
        req.request_id,
        req.prompt,
        first.prompt_token_ids,
        completions,
        req.finished,
        first.num_cached_tokens,
        dict(req.metrics),
        list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
        first.pooled if first.pooling is not None and first.is_finished else None,
    )
