"""The planner in a running router: PlannerLoop gathers the live signals, asks the policy
(router/planner.py) and carries out what it decides.

The Router starts one when the deployment's YAML enables the planner (`planner:`; off by default,
the static split stays) and stops it first when it stops. Its thread wakes every `interval_s`
and builds Signals from what the router already has, with no RPC: TTFT and TPOT p90 and the
prefill speed of the requests that ended in the last `window_s` (RouterMetrics.recent; a
worker's prompt tokens over the time it computed: recent.prefill_speed), the prompt tokens
started for the prefill pool per second over that window and those in flight there
(WorkerPool), the median gap between the streams' tokens over the last interval, the longest
wait for decode KV (the decode queue), the decode pool's KV use from the workers' last Stats,
the serving workers of each role, and the local prefill bound. A flip (a decision may ask for
several, done one after another) goes to the least loaded serving worker of the pool the policy
takes from, through the same Flips an operator's `pdserve ctl flip` uses (so it drains, moves and
checks alike, and refuses what would empty a pool); a local prefill change replaces the Legs'
LocalPrefill bound. Every decision that acts is logged at INFO with its reason (the others at
DEBUG) and counted in pdserve:planner_decisions_total{action}.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque

from prometheus_client import Counter

from pdserve.router.flips import FlipRefused
from pdserve.router.planner import (
    ACTIONS,
    LOCAL_LESS,
    LOCAL_MORE,
    NONE,
    TO_DECODE,
    TO_PREFILL,
    Planner,
    PlannerConfig,
    Signals,
    p90,
)
from pdserve.router.recent import prefill_speed

log = logging.getLogger(__name__)


class PlannerLoop:
    """`config`'s policy over `pool`, acting through `flips` and `legs` (the module docstring)."""

    def __init__(
        self, config: PlannerConfig, pool, flips, legs, recent, registry=None, model_name=""
    ):
        self.planner = Planner(config)
        self.config = config
        self.pool, self.flips, self.legs, self.recent = pool, flips, legs, recent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-planner", daemon=True)
        self._decisions = Counter(
            "pdserve:planner_decisions",
            "The planner's decisions, by action (none included).",
            ["model_name", "action"],
            registry=registry,
        )
        for action in ACTIONS:
            self._decisions.labels(model_name, action)
        self._model = model_name
        self.last: tuple[Signals, object] | None = None  # the last (signals, decision)
        self._started: deque = deque()  # (when, pool.prefill_tokens_started) over the window

    def start(self) -> PlannerLoop:
        self._thread.start()
        log.info("planner on: %s", self.config)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.step()
            except Exception:  # the planner must never take the router down
                log.exception("planner step failed")

    def signals(self) -> Signals:
        now = time.monotonic()
        rows = self.recent.since(now - self.config.window_s)
        started = self._started
        started.append((now, self.pool.prefill_tokens_started))
        while len(started) > 1 and started[0][0] < now - self.config.window_s:
            started.popleft()
        span = max(now - started[0][0], self.config.interval_s)
        serving = {"prefill": 0, "decode": 0}
        kv = []
        for role, _, stats, down, state in self.pool.snapshot():
            if down or state != "serving":
                continue
            serving[role] += 1
            if role == "decode" and stats is not None and stats.num_total_blocks:
                kv.append(1 - stats.num_free_blocks / stats.num_total_blocks)
        return Signals(
            now=now,
            prefill_workers=serving["prefill"],
            decode_workers=serving["decode"],
            ttft_p90_s=p90([r[1] for r in rows if r[1] is not None]),
            tpot_p90_s=p90([r[2] for r in rows if r[2] is not None]),
            prefill_queued_tokens=self.pool.queued_tokens("prefill"),
            prefill_tokens_per_s=prefill_speed([r[3] for r in rows if r[3]]),
            decode_kv_use=sum(kv) / len(kv) if kv else 0.0,
            local_max=self.legs.local_prefill.max_prompt_tokens,
            decode_wait_s=self.legs.decode_queue.longest_wait_s(),
            prompt_tokens_per_s=(started[-1][1] - started[0][1]) / span,
            itl_p50_s=_median(self.recent.gaps_since(now - self.config.interval_s)),
        )

    def step(self) -> None:
        """One decision, carried out before it returns (a flip included)."""
        s = self.signals()
        d = self.planner.decide(s)
        self.last = (s, d)
        self._decisions.labels(self._model, d.action).inc()
        if d.action == NONE:
            log.debug("planner: nothing to do: %s", d.reason)
            return
        log.info("planner: %s: %s", d.action, d.reason)
        policy = self.legs.local_prefill
        bound = self.planner.next_local_max(d.action, policy.max_prompt_tokens)
        if bound != policy.max_prompt_tokens:
            self.legs.local_prefill = dataclasses.replace(policy, max_prompt_tokens=bound)
            log.info("planner: local prefill bound %d -> %d", policy.max_prompt_tokens, bound)
        if d.action in (LOCAL_MORE, LOCAL_LESS):
            return
        source = "decode" if d.action == TO_PREFILL else "prefill"
        target = "prefill" if d.action == TO_PREFILL else "decode"
        assert d.action in (TO_PREFILL, TO_DECODE)
        try:
            for _ in range(d.count):  # a batch: one flip after another, each drained and checked
                worker = self._least_loaded(source)
                if worker is None:
                    log.info("planner: no %s worker can flip now", source)
                    return
                self.flips.flip(worker, target)
        except FlipRefused as e:
            log.info("planner: flip refused: %s", e)
        finally:
            self.planner.flip_done(time.monotonic())

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
