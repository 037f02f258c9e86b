"""Protobuf <-> plain Python values for the worker services. Pure protobuf: no engine import,
so the router can use it too."""

from __future__ import annotations

import time

# proto3 `optional` scalars of pdserve.v1.SamplingParams; names equal the engine's keywords (and,
# but for n, max_tokens, logprobs, prompt_logprobs and top_logprobs, the OpenAI body's fields:
# router/openai_format.py)
OPTIONAL_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "prompt_logprobs",
    "top_logprobs",
)
_REPEATED_FIELDS = ("stop", "stop_token_ids")


def sampling_kwargs(msg) -> dict:
    """Keyword arguments for the engine's SamplingParams from a pdserve.v1.SamplingParams: only
    the fields the client set, so the engine's defaults (and its validation) apply to the rest."""
    if msg is None:
        return {}
    kwargs = {name: getattr(msg, name) for name in OPTIONAL_FIELDS if msg.HasField(name)}
    for name in _REPEATED_FIELDS:
        values = list(getattr(msg, name))
        if values:
            kwargs[name] = values
    return kwargs


def unix_ns() -> int:
    """Wall-clock now for Timings fields: unix time in nanoseconds."""
    return time.time_ns()
