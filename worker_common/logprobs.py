"""The engine's logprobs as the wire's messages, for both workers: a sampled token's most likely
alternatives (engine/sampler.py's TokenLogprob) and a prompt's logprobs (RequestOutput's
prompt_logprobs) as pdserve.v1.TopLogprobs and the flat lists pdserve.proto documents.

The prefill worker puts the prompt's logprobs and each sequence's first token's alternatives in
its PrefillResponse; the decode worker puts every later token's alternatives in its TokenEvents
and, when it computed the prompt itself (colocated, or a local prefill), the prompt's logprobs on
each sequence's last event. The router reads them back into the client's TokenDeltas and
Finishes (router/call.py). Pure functions of the engine's outputs: no state.

A prompt logprob entry is {token id: logprob} built by the model runner from the position's top-k
(most likely first) and then the prompt token itself, so its first k items are the top-k whether
or not the prompt token is among them.
"""

from __future__ import annotations

from pdserve.protos.pdserve.v1 import pdserve_pb2


def top_of(logprob) -> pdserve_pb2.TopLogprobs:
    """A sampled token's alternatives; empty for a plain float (no top_logprobs, or a first token
    another worker sampled)."""
    top = getattr(logprob, "top", None) or {}
    return pdserve_pb2.TopLogprobs(token_ids=list(top), logprobs=list(top.values()))


def wants_top(logprobs) -> bool:
    return any(getattr(x, "top", None) is not None for x in logprobs)


def prompt_fields(prompt_ids, entries, k: int) -> dict:
    """The prompt's logprobs as the keyword arguments PrefillResponse, TokenEvent and Finish take:
    prompt_logprobs[p] is prompt token p + 1's, prompt_top_logprobs[p] the k most likely tokens
    at that position. Empty when `entries` is None (no prompt_logprobs asked for)."""
    if entries is None:
        return {}
    lps, tops = [], []
    for p in range(1, len(prompt_ids)):
        entry = entries[p] if p < len(entries) else None
        if entry is None:  # never computed (cannot happen for a finished prompt): say so
            raise ValueError(f"the prompt's logprob at position {p} was not computed")
        lps.append(entry[prompt_ids[p]])
        items = list(entry.items())[:k]
        tops.append(
            pdserve_pb2.TopLogprobs(token_ids=[t for t, _ in items], logprobs=[v for _, v in items])
        )
    return {"prompt_logprobs": lps, "prompt_top_logprobs": tops}
