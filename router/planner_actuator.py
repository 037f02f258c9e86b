"""The router's side of the planner (planner/live.py): the live signals it reads and the
actuator it acts through, over this router's pool, flips and legs.

PlannerLoop calls `signals` once per decision. It builds Signals from what the router already
has, with no RPC: TTFT and TPOT p90 and the prefill speed of the requests that ended in the last
window (RouterMetrics.recent; a worker's prompt tokens over the time it computed:
recent.prefill_speed), the prompt tokens started for the prefill pool per second over that
window and those in flight there (WorkerPool), the median gap between the streams' tokens over
the last interval, the longest wait for decode KV (the decode queue), the decode pool's KV use
from the workers' last Stats, the serving workers of each role, and the local prefill bound. A
flip batch goes, one worker after another, to the least loaded serving worker of the pool the
policy takes from, through the same Flips an operator's `pdserve ctl flip` uses (so it drains,
moves and checks alike, and refuses what would empty a pool); a local prefill change replaces
the Legs' LocalPrefill bound. It lives as long as the router's PlannerLoop.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable

from pdserve.planner.policy import DECODE, PREFILL, Signals, p90
from pdserve.router.flips import FlipRefused
from pdserve.router.recent import prefill_speed

log = logging.getLogger(__name__)


class RouterActuator:
    """The live deployment a PlannerLoop reads and acts on (the module docstring)."""

    def __init__(self, pool, flips, legs, recent):
        self.pool, self.flips, self.legs, self.recent = pool, flips, legs, recent
        self._started: deque = deque()  # (when, pool.prefill_tokens_started) over the window

    def signals(self, window_s: float, interval_s: float) -> Signals:
        now = time.monotonic()
        rows = self.recent.since(now - window_s)
        started = self._started
        started.append((now, self.pool.prefill_tokens_started))
        while len(started) > 1 and started[0][0] < now - window_s:
            started.popleft()
        span = max(now - started[0][0], interval_s)
        serving = {PREFILL: 0, DECODE: 0}
        kv = []
        for role, _, stats, down, state in self.pool.snapshot():
            if down or state != "serving":
                continue
            serving[role] += 1
            if role == DECODE and stats is not None and stats.num_total_blocks:
                kv.append(1 - stats.num_free_blocks / stats.num_total_blocks)
        return Signals(
            now=now,
            prefill_workers=serving[PREFILL],
            decode_workers=serving[DECODE],
            ttft_p90_s=p90([r[1] for r in rows if r[1] is not None]),
            tpot_p90_s=p90([r[2] for r in rows if r[2] is not None]),
            prefill_queued_tokens=self.pool.queued_tokens(PREFILL),
            prefill_tokens_per_s=prefill_speed([r[3] for r in rows if r[3]]),
            decode_kv_use=sum(kv) / len(kv) if kv else 0.0,
            local_max=self.local_max,
            decode_wait_s=self.legs.decode_queue.longest_wait_s(),
            prompt_tokens_per_s=(started[-1][1] - started[0][1]) / span,
            itl_p50_s=_median(self.recent.gaps_since(now - interval_s)),
        )

    @property
    def local_max(self) -> int:
        return self.legs.local_prefill.max_prompt_tokens

    def set_local_max(self, bound: int) -> None:
        policy = self.legs.local_prefill
        self.legs.local_prefill = dataclasses.replace(policy, max_prompt_tokens=bound)
        log.info("planner: local prefill bound %d -> %d", policy.max_prompt_tokens, bound)

    def flip(self, source: str, count: int, done: Callable[[float], None]) -> None:
        """`count` flips out of `source`, each drained and checked before the next; done when
        the batch ends, refused or not."""
        target = PREFILL if source == DECODE else DECODE
        try:
            for _ in range(count):
                worker = self._least_loaded(source)
                if worker is None:
                    log.info("planner: no %s worker can flip now", source)
                    return
                self.flips.flip(worker, target)
        except FlipRefused as e:
            log.info("planner: flip refused: %s", e)
        finally:
            done(time.monotonic())

    def _least_loaded(self, role: str) -> str | None:
        """The serving, registered worker of `role` with the fewest sequences and tokens in
        flight (the cheapest to drain)."""
        best, best_load = None, None
        for w in self.pool.members():
            if w.role != role or w.down or w.state != "serving" or w.static:
                continue
            s = w.stats
            load = (s.num_running + s.num_waiting + s.num_reserved if s else 0, w.queued_tokens)
            if best_load is None or load < best_load:
                best, best_load = w.worker_id, load
        return best


def _median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None
