"""Where one request's time went, in seconds per stage, from its Finish.timings.

This is the one definition for every place that reports it: the gRPC Finish carries the raw
timestamps, and the HTTP response's `pdserve.timings` extension and the per-stage histograms
(router/metrics.py) use the durations that `stage_durations` computes from them. The module holds
no state; the router calls it as each request ends, and `pdserve bench` (tuning/metrics.py) on
the Finish timings its client received. It reads one wire message and nothing else, so it lives
with the wire definitions, where both may import it without importing each other. A
disaggregated request's stages (STAGES) follow each other, so they add up to its end-to-end time;
`stage_durations` says what each one spans. Stamps come from the router, the prefill and the decode worker: on several machines their
clocks' offsets shift the stages at each change of machine.
"""

from __future__ import annotations

from pdserve.protos.pdserve.v1 import pdserve_pb2

_NS = 1e-9
STAGES = (
    "router_queue",
    "prefill_queue",
    "prefill",
    "kv_transfer_exposed",
    "commit_to_first_token",
    "decode",
)


def _span(start_ns: int, end_ns: int) -> float | None:
    """end - start in seconds, or None when either stage was not reached. A gap below zero
    (two machines' clocks) counts as 0, so that the stages still add up."""
    if not start_ns or not end_ns:
        return None
    return max(0, end_ns - start_ns) * _NS


def stage_durations(t: pdserve_pb2.Timings) -> dict[str, float | None]:
    """The stages of a request (STAGES, in order), then its totals ttft_s and e2e_s, in seconds
    (None: not reached). Keys end in "_s".

    router_queue           queued -> prefill_dispatch: checks, tokenizing, Reserve on a decode
                           worker (with any wait in the router's decode queue), opening its stream
    prefill_queue          prefill_dispatch -> prefill_start: the Prefill call's trip and the wait
                           in the prefill worker's engine queue (prefill_arrival splits the two)
    prefill                prefill_start -> prefill_end: the prompt's compute (per-layer KV pushes
                           that overlap it included) and sampling the first token
    kv_transfer_exposed    prefill_end -> transfer_end: the transfer not hidden behind the compute,
                           until the last KV frame and the commit landed on the decode worker
    commit_to_first_token  transfer_end -> first_token: the decode worker admits the request to
                           its batch (commit splits the two) and streams the first token
    decode                 first_token -> last_token
    A colocated request (no prefill worker) has router_queue (queued -> reserved) and decode; the
    stages it has no timestamps for are None."""
    if t.prefill_start_unix_ns:  # disaggregated
        marks = (
            t.queued_unix_ns,
            t.prefill_dispatch_unix_ns,
            t.prefill_start_unix_ns,
            t.prefill_end_unix_ns,
            t.transfer_end_unix_ns,
            t.first_token_unix_ns,
            t.last_token_unix_ns,
        )
        spans = [_span(a, b) for a, b in zip(marks, marks[1:])]
    else:
        spans = [_span(t.queued_unix_ns, t.reserved_unix_ns), None, None, None, None]
        spans.append(_span(t.first_token_unix_ns, t.last_token_unix_ns))
    out = {f"{name}_s": span for name, span in zip(STAGES, spans)}
    out["ttft_s"] = _span(t.queued_unix_ns, t.first_token_unix_ns)
    out["e2e_s"] = _span(t.queued_unix_ns, t.last_token_unix_ns)
    return out
