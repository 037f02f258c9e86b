"""The router's window of recent requests, for the planner (planner/live.py): what the last
`keep` finished requests' TTFT, TPOT and prefill were, and the latest gaps between the tokens of
the streams, in flight too.

RouterMetrics creates one RecentRequests as the router starts (RouterMetrics.recent) and feeds it
from the same request ends that its Prometheus metrics observe, and from every token event the
router streams (gap). PlannerLoop reads the rows and gaps of its sliding window on its own
thread; the bounded deques forget the oldest, so the window never grows with traffic.
prefill_speed turns the rows' prefills into one prefill worker's speed, the divisor of the
planner's prefill demand.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class RecentRequests:
    """The last `keep` finished requests' TTFT, TPOT and prefill (which worker, when its compute
    ran, the prompt tokens it computed), with when each ended (time.monotonic()), and the latest
    gaps between the tokens of the streams (in flight too), for the planner's sliding window
    (planner/live.py)."""

    def __init__(self, keep: int = 4096):
        # (ended, ttft_s, tpot_s, (prefill worker, start ns, end ns, tokens computed) or None)
        self._rows: deque = deque(maxlen=keep)
        self._gaps: deque = deque(maxlen=16 * keep)  # (when, gap between a stream's tokens)
        self._lock = threading.Lock()

    def gap(self, gap_s: float) -> None:
        with self._lock:
            self._gaps.append((time.monotonic(), gap_s))

    def gaps_since(self, t: float) -> list[float]:
        with self._lock:
            return [g for at, g in self._gaps if at >= t]

    def add(self, ttft_s, decode_s, usage, timings) -> None:
        tpot = None
        if decode_s is not None and usage.completion_tokens > 1:
            tpot = decode_s / (usage.completion_tokens - 1)
        prefill = None
        start, end = timings.prefill_start_unix_ns, timings.prefill_end_unix_ns
        computed = usage.prompt_tokens - usage.cached_prompt_tokens
        if start and end > start and computed > 0:
            prefill = (timings.prefill_worker, start, end, computed)
        with self._lock:
            self._rows.append((time.monotonic(), ttft_s, tpot, prefill))

    def since(self, t: float) -> list[tuple]:
        with self._lock:
            return [r for r in self._rows if r[0] >= t]


def prefill_speed(prefills) -> float:
    """What one prefill worker computes per second (0: unknown), from (worker, start ns, end ns,
    tokens) of prefills: each worker's tokens over the time it was computing (the union of its
    prefills' intervals), over all of them. Not the mean of each prompt's own tokens/s: a worker
    that batches ten prompts into one step gives each a tenth of its speed, and that made the
    planner's prefill demand read 3-5 workers where one sufficed."""
    by_worker: dict[str, list] = {}
    for worker, start, end, tokens in prefills:
        by_worker.setdefault(worker, []).append((start, end, tokens))
    tokens = busy_ns = 0
    for spans in by_worker.values():
        spans.sort()
        reach = spans[0][0]
        for start, end, n in spans:
            busy_ns += max(0, end - max(start, reach))
            reach = max(reach, end)
            tokens += n
    return tokens / (busy_ns / 1e9) if busy_ns > 0 else 0.0
