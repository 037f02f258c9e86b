"""The planner's policy: from a deployment's live signals, decide whether to flip a worker between
the prefill and the decode pool, change how much the decode workers prefill locally, or do
nothing. Pure logic with no clock, thread or RPC of its own, so that the same code decides in a
running router (router/planner_loop.py) and inside the simulator (tuning/), where a policy can be
judged on any trace before it is deployed.

Every `interval_s` its owner gathers Signals over the last `window_s` and calls `Planner.decide`,
which returns a Decision (an action and the reason, in words). The owner carries the action out
and reports a flip's end with `flip_done`. The policy compares each side with its SLO:

    ttft pressure = TTFT p90 / ttft_s (or, before any first token, the prefill pool's queued
                    prompt tokens against what it computes in ttft_s)
    tpot pressure = TPOT p90 / tpot_s; a decode pool whose KV use is over kv_high while TPOT
                    is past 1 - margin counts as pressed

One side over 1 + margin while the other is under 1 - margin, for `sustain` decisions in a row,
flips a worker from the relaxed pool to the pressed one (never its last worker). TTFT pressed and
no decode worker to spare: prefill more locally, if TPOT has room; TPOT pressed: prefill less
locally first. After a flip nothing moves for `cooldown_s`, and at most `max_flips_per_min`
flips happen in any minute.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

NONE, TO_PREFILL, TO_DECODE = "none", "flip_to_prefill", "flip_to_decode"
LOCAL_MORE, LOCAL_LESS = "local_more", "local_less"
ACTIONS = (NONE, TO_PREFILL, TO_DECODE, LOCAL_MORE, LOCAL_LESS)


@dataclass(frozen=True)
class PlannerConfig:
    ttft_s: float  # the SLO's TTFT (p90)
    tpot_s: float  # the SLO's TPOT (p90)
    interval_s: float = 5.0
    window_s: float = 30.0
    margin: float = 0.2  # hysteresis around 1.0
    sustain: int = 2  # decisions in a row a condition must hold
    cooldown_s: float = 30.0
    max_flips_per_min: int = 2
    kv_high: float = 0.9  # decode KV use that counts as TPOT pressure
    local_step: int = 64  # prompt tokens added to or taken from local_max per decision
    local_cap: int = 1024  # the most local_max grows to (0: the planner never prefills locally)

    def __post_init__(self):
        for name in ("ttft_s", "tpot_s", "interval_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"planner.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"planner.margin must be in [0, 1), got {self.margin}")
        if self.sustain < 1 or self.max_flips_per_min < 0 or self.cooldown_s < 0:
            raise ValueError("planner: sustain >= 1, max_flips_per_min >= 0, cooldown_s >= 0")


@dataclass(frozen=True)
class Signals:
    """What the planner reads, over the last window_s (None: no sample in the window)."""

    now: float  # seconds, on the owner's clock
    prefill_workers: int  # serving (not draining, not down)
    decode_workers: int
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    prefill_queued_tokens: int  # prompt tokens waiting or computing in the prefill pool
    prefill_tokens_per_s: float  # what one prefill worker computes (0: unknown)
    decode_kv_use: float  # mean over the decode pool, 0..1
    local_max: int = 0  # the local prefill bound now (router/local_prefill.py)


@dataclass(frozen=True)
class Decision:
    action: str
    reason: str


@dataclass
class Planner:
    config: PlannerConfig
    _streak: dict = field(default_factory=dict)  # action -> decisions in a row it was wanted
    _flips: deque = field(default_factory=deque)  # when each flip began (now), for the rate
    _last_flip: float = -float("inf")
    flipping: bool = False  # a flip the owner carries out, until flip_done

    def pressures(self, s: Signals) -> tuple[float | None, float | None]:
        c = self.config
        ttft = s.ttft_p90_s / c.ttft_s if s.ttft_p90_s is not None else None
        if ttft is None and s.prefill_tokens_per_s > 0 and s.prefill_workers:
            ttft = s.prefill_queued_tokens / (s.prefill_tokens_per_s * s.prefill_workers * c.ttft_s)
        tpot = s.tpot_p90_s / c.tpot_s if s.tpot_p90_s is not None else None
        # KV use over kv_high with TPOT near its SLO: preemptions are near, so it counts as
        # pressed. Not with TPOT well inside it: in simulation that flipped back and forth at 16
        # GPUs (a full KV pool with TPOT at 0.72 x SLO) and cost 7% goodput
        if s.decode_kv_use > c.kv_high and tpot is not None and tpot > 1 - c.margin:
            tpot = max(tpot, 1 + c.margin + s.decode_kv_use - c.kv_high)
        return ttft, tpot

    def decide(self, s: Signals) -> Decision:
        c = self.config
        ttft, tpot = self.pressures(s)
        hi, lo = 1 + c.margin, 1 - c.margin
        say = f"ttft {_fmt(ttft)} x SLO, tpot {_fmt(tpot)} x SLO, {s.prefill_workers}P:{s.decode_workers}D"
        want, why = NONE, "within the SLO's margins"
        if ttft is not None and ttft > hi and (tpot is None or tpot < lo):
            if s.decode_workers > 1:
                want, why = TO_PREFILL, "TTFT over its SLO while TPOT has room"
            elif s.local_max < c.local_cap:
                want, why = (
                    LOCAL_MORE,
                    "TTFT over its SLO, TPOT has room, no decode worker to spare",
                )
        elif tpot is not None and tpot > hi and (ttft is None or ttft < lo):
            if s.local_max > 0:
                want, why = LOCAL_LESS, "TPOT over its SLO: prefill less on the decode workers"
            elif s.prefill_workers > 1:
                want, why = TO_DECODE, "TPOT over its SLO while TTFT has room"
        elif tpot is not None and tpot > hi and s.local_max > 0:
            want, why = LOCAL_LESS, "both over their SLOs: local prefills cost TPOT"
        for action in ACTIONS:
            self._streak[action] = self._streak.get(action, 0) + 1 if action == want else 0
        if want == NONE:
            return Decision(NONE, f"{why} ({say})")
        if self._streak[want] < c.sustain:
            return Decision(NONE, f"{why}, {self._streak[want]} of {c.sustain} in a row ({say})")
        if want in (TO_PREFILL, TO_DECODE):
            blocked = self._flip_blocked(s.now)
            if blocked:
                return Decision(NONE, f"{why}, but {blocked} ({say})")
            self._flips.append(s.now)
            self._last_flip, self.flipping = s.now, True
        self._streak[want] = 0
        return Decision(want, f"{why} ({say})")

    def _flip_blocked(self, now: float) -> str | None:
        c = self.config
        if self.flipping:
            return "a flip is under way"
        if now - self._last_flip < c.cooldown_s:
            return f"in the cooldown ({now - self._last_flip:.0f} of {c.cooldown_s:g} s)"
        while self._flips and now - self._flips[0] >= 60.0:
            self._flips.popleft()
        if len(self._flips) >= c.max_flips_per_min:
            return f"{len(self._flips)} flips in the last minute (max_flips_per_min)"
        return None

    def flip_done(self, now: float) -> None:
        """The owner finished (or gave up) the flip decide asked for; the cooldown runs from now."""
        self.flipping = False
        self._last_flip = now

    def next_local_max(self, action: str, local_max: int) -> int:
        c = self.config
        if action == LOCAL_MORE:
            return min(c.local_cap, local_max + c.local_step)
        if action == LOCAL_LESS:
            return max(0, local_max - c.local_step)
        return local_max


def p90(xs) -> float | None:
    """The 90th percentile of `xs` (the nearest rank at or above it); None for none."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"
