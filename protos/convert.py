"""Protobuf <-> plain Python values for the worker services. Pure protobuf: no engine import,
so the router can use it too.

The workers turn a call's pdserve.v1.SamplingParams into the engine's keyword arguments
(`sampling_kwargs`: only the fields the client set, so the engine's defaults and its checks
apply to the rest) and its structured-output oneof into the mapping the engine's StructuredSpec
takes (`structured_dict`); the router fills the message from an OpenAI body the other way
(`structured_message`). The stamps every service puts in Timings are `unix_ns`. Nothing here
keeps state.
"""

from __future__ import annotations

import time

# proto3 `optional` scalars of pdserve.v1.SamplingParams; names equal the engine's keywords (and,
# but for n, max_tokens, logprobs, prompt_logprobs and top_logprobs, the OpenAI body's fields:
# router/openai/protocol.py)
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
    "speculative",
    "cache_salt",
    "thinking_token_budget",
    "max_repetition_pattern_size",
    "min_repetition_pattern_size",
    "repetition_min_count",
)
_REPEATED_FIELDS = (
    "stop",
    "stop_token_ids",
    "allowed_token_ids",
    "bad_words",
    "prediction_token_ids",
)


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
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("structured"):
        kwargs["structured"] = structured_dict(msg.structured)
    return kwargs


def structured_dict(msg) -> dict:
    """The set fields of a pdserve.v1.StructuredOutput as the engine's StructuredSpec keywords."""
    out: dict = {}
    for name in ("json_schema", "regex", "grammar"):
        if getattr(msg, name):
            out[name] = getattr(msg, name)
    if msg.json_object:
        out["json_object"] = True
    if len(msg.choice):
        out["choice"] = list(msg.choice)
    if msg.reasoning:
        out["reasoning"] = msg.reasoning
    return out


def structured_message(msg, spec: dict) -> None:
    """Fills pdserve.v1.StructuredOutput `msg` from StructuredSpec keywords (json_schema a dict or
    JSON text), the inverse of structured_dict."""
    import json

    for name, value in spec.items():
        if name == "json_schema" and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        if name == "choice":
            msg.choice.extend(value)
        else:
            setattr(msg, name, value)


def engine_priority(priority: int, share_tag: int = 0) -> int:
    """The order an engine queue (and the router's decode queue) keeps a request in, the lower
    first: its client priority, then within equal priorities its start tag in its tenant's fair
    share (router/admission.py; a uint64), as one Python int."""
    return (priority << 64) + share_tag


def unix_ns() -> int:
    """Wall-clock now for Timings fields: unix time in nanoseconds."""
    return time.time_ns()
