"""What each engine step was, as the latency models see it (tuning/perf_model.py): the
engine keeps the last STEP_TRACE_LEN steps that computed something in LLMEngine.step_trace, and
the serving-path calibration (experiments/calibration.py) fits step-time models from them."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.scheduler import StepPlan

STEP_TRACE_LEN = 32768  # steps kept in LLMEngine.step_trace (at 30 ms per step, 16 minutes)


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the latency models see it (tuning/perf_model.py): when it ran
    (time.monotonic seconds) and its shape. Decode rows are sequences that computed one token on
    top of a context; every other row is a prompt chunk."""

    start: float
    end: float
    tokens: int  # every token the step computed
    prefill_pairs: int  # sum over prompt chunks of n * (start + n)
    num_decode: int  # decode rows
    decode_context: int  # sum of the decode rows' context tokens (the new one included)


def step_record(plan: StepPlan, start: float, end: float) -> StepRecord:
    tokens = pairs = num_decode = context = 0
    for item in plan.scheduled:
        n = item.num_new_tokens
        tokens += n
        if n == 1 and item.start > 0:
            num_decode += 1
            context += item.start + 1
        else:
            pairs += n * (item.start + n)
    return StepRecord(start, end, tokens, pairs, num_decode, context)
