"""Where one request's time went, in seconds per stage, from its Finish.timings.

One definition for every place that reports it: the gRPC Finish carries the raw timestamps, the
HTTP response's `pdserve.timings` extension and the per-stage histograms use these durations.
"""

from __future__ import annotations

from protos.pdserve.v1 import pdserve_pb2

_NS = 1e-9


def _span(start_ns: int, end_ns: int) -> float | None:
    """end - start in seconds, or None when either stage was not reached."""
    if not start_ns or not end_ns or end_ns < start_ns:
        return None
    return (end_ns - start_ns) * _NS


def stage_durations(t: pdserve_pb2.Timings) -> dict[str, float | None]:
    """The stages of a request, in order, in seconds (None: not reached)."""
    return {
        "queue_to_prefill_s": _span(t.queued_unix_ns, t.prefill_start_unix_ns),
        "prefill_s": _span(t.prefill_start_unix_ns, t.prefill_end_unix_ns),
        "kv_transfer_exposed_s": _span(t.prefill_end_unix_ns, t.transfer_end_unix_ns),
        "transfer_to_first_token_s": _span(t.transfer_end_unix_ns, t.first_token_unix_ns),
        "ttft_s": _span(t.queued_unix_ns, t.first_token_unix_ns),
        "decode_s": _span(t.first_token_unix_ns, t.last_token_unix_ns),
        "e2e_s": _span(t.queued_unix_ns, t.last_token_unix_ns),
    }
