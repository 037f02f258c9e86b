"""The planner in a simulation: SimulatedLoop is the loop the simulator ticks, the counterpart of
the live one (planner/live.py), so that a policy is judged on any trace before it is deployed.

A PlannerSimulator (tuning/sim_planner.py) creates one per run. As the run plays, the simulator
reports what the router would see (each first token's TTFT, each finished request's TPOT, each
prompt that arrives for the prefill pool, each decode step's length); every `interval_s` of
simulated time it calls `tick` with the pools' state now and itself as the Actuator. A tick keeps
the last `window_s` of those reports, builds the Signals a running router would, asks the
policy, records the decision (every one in `timeline`, the acting ones in `decisions`) and
carries it out through the actuator with the same `carry_out` the live loop uses. The loop holds
no clock of its own: time is what the simulator says.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.planner.actuator import Actuator, carry_out
from pdserve.planner.policy import NONE, Decision, Planner, PlannerConfig, Signals, p90


@dataclass(frozen=True)
class PoolState:
    """The pools as the simulator sees them at a tick (Signals' fields of the same names)."""

    prefill_workers: int
    decode_workers: int
    prefill_queued_tokens: int
    prefill_tokens_per_s: float
    decode_kv_use: float
    decode_wait_s: float


class SimulatedLoop:
    """`config`'s policy (of `planner_cls`: Planner or a variant) ticked by a simulator."""

    def __init__(self, config: PlannerConfig, planner_cls: type = Planner):
        self.config = config
        self.planner = planner_cls(config)
        self._ttft: deque = deque()  # (first token at, ttft)
        self._tpot: deque = deque()  # (done at, tpot)
        self._arrived: deque = deque()  # (arrival, prompt tokens) of legs for the prefill pool
        self._gaps: deque = deque()  # (step end, step time) of decode steps with streams
        # one row per decision: (now, prefill workers, decode workers, local_max, ttft and tpot
        # pressure as the planner computed them, action)
        self.timeline: list[tuple] = []
        self.decisions: list[tuple[float, str, str]] = []  # the acting ones

    def first_token(self, now: float, ttft_s: float) -> None:
        self._ttft.append((now, ttft_s))

    def finished(self, now: float, tpot_s: float) -> None:
        self._tpot.append((now, tpot_s))

    def prompt_arrived(self, now: float, tokens: int) -> None:
        self._arrived.append((now, tokens))

    def decode_step(self, now: float, step_s: float) -> None:
        """A decode step with streams ended: its length is their gap between tokens."""
        self._gaps.append((now, step_s))

    def signals(self, now: float, pools: PoolState, local_max: int) -> Signals:
        cfg = self.config
        for window in (self._ttft, self._tpot, self._arrived, self._gaps):
            while window and window[0][0] <= now - cfg.window_s:
                window.popleft()
        pace = sorted(g for t, g in self._gaps if t > now - cfg.interval_s)  # decode steps' pace
        return Signals(
            now=now,
            prefill_workers=pools.prefill_workers,
            decode_workers=pools.decode_workers,
            ttft_p90_s=p90([x for _, x in self._ttft]),
            tpot_p90_s=p90([x for _, x in self._tpot]),
            prefill_queued_tokens=pools.prefill_queued_tokens,
            prefill_tokens_per_s=pools.prefill_tokens_per_s,
            decode_kv_use=pools.decode_kv_use,
            local_max=local_max,
            decode_wait_s=pools.decode_wait_s,
            itl_p50_s=pace[len(pace) // 2] if pace else None,
            prompt_tokens_per_s=sum(n for _, n in self._arrived)
            / max(min(cfg.window_s, now), cfg.interval_s),
        )

    def tick(self, now: float, pools: PoolState, actuator: Actuator) -> Decision:
        """One decision at `now`, recorded and carried out through `actuator`."""
        s = self.signals(now, pools, actuator.local_max)
        d = self.planner.decide(s)
        ttft_p, tpot_p = self.planner.pressures(s)
        self.timeline.append(
            (now, s.prefill_workers, s.decode_workers, s.local_max, ttft_p, tpot_p, d.action)
        )
        if d.action != NONE:
            self.decisions.append((now, d.action, d.reason))
        carry_out(self.planner, d, actuator)
        return d
