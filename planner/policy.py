"""The planner's policy: from a deployment's live signals, decide whether to flip a worker between
the prefill and the decode pool, change how much the decode workers prefill locally, or do
nothing. Pure logic with no clock, thread or RPC of its own, so that the same code decides in a
running router (planner/live.py) and inside the simulator (planner/simulated.py), where a
policy can be judged on any trace before it is deployed. tests/unit/test_planner_scenarios.py
holds the runs, live and simulated, that shaped its rules.

Every `interval_s` its owner gathers Signals over the last `window_s` and calls `Planner.decide`,
which returns a Decision (an action and the reason, in words). The owner carries the action
out (planner/actuator.py carry_out) and reports a flip's end with `flip_done`. The policy
compares each side with its SLO:

    ttft pressure = TTFT p90 / ttft_s (or, before any first token, the prefill pool's queued
                    prompt tokens against what it computes in ttft_s)
    tpot pressure = TPOT p90 / tpot_s, or the median gap between tokens over the last
                    interval (in-flight streams too) / tpot_s if higher; a decode pool whose
                    KV use is over kv_high while TPOT is past 1 - margin counts as pressed,
                    and so does one that has kept a request waiting for KV blocks nearly
                    ttft_s (that TTFT is the decode pool's)

A side is pressed from 1 - margin/2 on and has room under 1 - margin. One side pressed while the
other has room, for `sustain` decisions in a row, flips workers from the relaxed pool to the
pressed one (never its last worker), as many as the prefill demand asks for: the prompt tokens
arriving per second plus the queue, over one prefill worker's speed at `prefill_use`, against
the prefill workers serving. The same estimate holds a flip that would starve the pool it takes
from, and it decides when one side is pressed and the other has no room: a demand for fewer
prefill workers than serve flips toward decode, one for more toward prefill, each only toward
the more pressed side. No decode worker goes to prefill when the decode pool left would be more
pressed than prefill is now (TPOT pressure scaled by the workers left). TTFT pressed and no
decode worker to spare: prefill more locally, if TPOT is under half its room; TPOT with no
room: local prefill stops. With neither side pressed, a prefill worker the demand leaves spare
goes to decode once TPOT is past half its room and TTFT under half of its own. After a batch of
flips nothing moves for `cooldown_s`, and at most `max_flips_per_min` flips happen in any
minute; a batch back the other way within 3 cooldowns of the last moves at most half as many
workers as that one did.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field

PREFILL, DECODE = "prefill", "decode"  # the two pools
NONE, TO_PREFILL, TO_DECODE = "none", "flip_to_prefill", "flip_to_decode"
LOCAL_MORE, LOCAL_LESS = "local_more", "local_less"
ACTIONS = (NONE, TO_PREFILL, TO_DECODE, LOCAL_MORE, LOCAL_LESS)


@dataclass(frozen=True)
class PlannerConfig:
    ttft_s: float  # the SLO's TTFT (p90)
    tpot_s: float  # the SLO's TPOT (p90)
    interval_s: float = 5.0
    window_s: float = 15.0
    margin: float = 0.2  # a side is pressed from 1 - margin/2 x SLO on, has room under 1 - margin
    sustain: int = 2  # decisions in a row a condition must hold
    cooldown_s: float = 30.0
    max_flips_per_min: int = 8
    kv_high: float = 0.9  # decode KV use that counts as TPOT pressure
    local_step: int = 64  # prompt tokens added to local_max per decision (taken back all at once)
    local_cap: int = 1024  # the most local_max grows to (0: the planner never prefills locally)
    prefill_use: float = 0.95  # the prefill pool's target utilization: sizes a flip batch

    def __post_init__(self):
        for name in ("ttft_s", "tpot_s", "interval_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"planner.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"planner.margin must be in [0, 1), got {self.margin}")
        if not 0 < self.prefill_use <= 1:
            raise ValueError(f"planner.prefill_use must be in (0, 1], got {self.prefill_use}")
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
    local_max: int = 0  # the local prefill bound now (planner/local_prefill.py)
    decode_wait_s: float = 0.0  # the longest wait in the router for decode KV blocks, now
    prompt_tokens_per_s: float = 0.0  # prompt tokens arriving for the prefill pool (0: unknown)
    itl_p50_s: float | None = None  # median gap between tokens of the streams now, in flight too


@dataclass(frozen=True)
class Decision:
    action: str
    reason: str
    count: int = 1  # flips: how many workers move, one after another


@dataclass
class Planner:
    config: PlannerConfig
    _streak: dict = field(default_factory=dict)  # action -> decisions in a row it was wanted
    _flips: deque = field(default_factory=deque)  # when each flip began (now), for the rate
    _last_flip: float = -float("inf")
    _last_batch: tuple = (NONE, 0)  # (direction, workers) of the last batch of flips
    flipping: bool = False  # a flip the owner carries out, until flip_done

    def pressures(self, s: Signals) -> tuple[float | None, float | None]:
        c = self.config
        ttft = s.ttft_p90_s / c.ttft_s if s.ttft_p90_s is not None else None
        if ttft is None:
            ttft = _queue_pressure(s, c)
        tpot = s.tpot_p90_s / c.tpot_s if s.tpot_p90_s is not None else None
        if s.itl_p50_s is not None:  # the streams' pace now: finished requests lag a surge
            tpot = max(tpot or 0.0, s.itl_p50_s / c.tpot_s)
        hi = 1 - c.margin / 2  # pressed: the p90 nears its SLO
        if s.decode_wait_s > hi * c.ttft_s:
            # A request has waited for decode KV blocks nearly the whole TTFT SLO: the decode
            # pool is short, and TTFT holds that wait, which more prefill workers would not
            # shorten; the prefill pool's own share is what its queue takes to drain.
            ttft = _queue_pressure(s, c)
            tpot = max(tpot or 0.0, 1 + c.margin)
        # KV use over kv_high with TPOT near its SLO: preemptions are near, so it counts as
        # pressed. Not with TPOT well inside it: a full KV pool alone is no reason to flip.
        if s.decode_kv_use > c.kv_high and tpot is not None and tpot > 1 - c.margin:
            tpot = max(tpot, hi + s.decode_kv_use - c.kv_high)
        return ttft, tpot

    def prefill_demand(self, s: Signals) -> float | None:
        """Prefill workers' worth of demand at prefill_use (None: unknown): the prompt tokens
        arriving per second for the prefill pool, plus its queue drained over one window, over
        what one worker computes per second."""
        c = self.config
        if not (s.prefill_tokens_per_s > 0 and s.prompt_tokens_per_s > 0):
            return None
        demand = s.prompt_tokens_per_s + s.prefill_queued_tokens / c.window_s
        return demand / (s.prefill_tokens_per_s * c.prefill_use)

    def prefill_need(self, s: Signals) -> int | None:
        """Prefill workers the demand needs (prefill_demand rounded up; None: unknown)."""
        demand = self.prefill_demand(s)
        return None if demand is None else max(1, math.ceil(demand))

    def decide(self, s: Signals) -> Decision:
        """What to do now (the module docstring); a flip it returns is under way until
        flip_done."""
        c = self.config
        need = self.prefill_need(s)
        ttft, tpot = self.pressures(s)
        say = f"ttft {_fmt(ttft)} x SLO, tpot {_fmt(tpot)} x SLO, {s.prefill_workers}P:{s.decode_workers}D"
        if need is not None:
            say += f", demand needs {need}P"
        want, why, nudge = self._want(s, ttft, tpot, need)
        if want == NONE and (tpot or 0) > 1 - c.margin and s.local_max > 0:
            want, why = LOCAL_LESS, "TPOT has no room: local prefills cost it"
        for action in ACTIONS:
            self._streak[action] = self._streak.get(action, 0) + 1 if action == want else 0
        if want == NONE:
            return Decision(NONE, f"{why} ({say})")
        if self._streak[want] < c.sustain:
            return Decision(NONE, f"{why}, {self._streak[want]} of {c.sustain} in a row ({say})")
        count = 1
        if want in (TO_PREFILL, TO_DECODE):
            sized = self._batch(s, want, why, need, ttft, tpot, nudge)
            if isinstance(sized, Decision):
                return dataclasses.replace(sized, reason=f"{sized.reason} ({say})")
            count, why = sized
        self._streak[want] = 0
        return Decision(want, f"{why} ({say})", count)

    def _want(
        self, s: Signals, ttft: float | None, tpot: float | None, need: int | None
    ) -> tuple[str, str, bool]:
        """The action the pressures ask for, why, and whether it is a nudge (a flip ahead of
        pressure: one worker, whatever the demand would move)."""
        lo, hi = 1 - self.config.margin, 1 - self.config.margin / 2
        if ttft is not None and ttft > hi and (tpot is None or tpot < lo):
            return (*self._ttft_pressed(s, ttft, tpot), False)
        if tpot is not None and tpot > hi and (ttft is None or ttft < lo):
            return (*self._tpot_pressed(s), False)
        if (ttft or 0) > hi or (tpot or 0) > hi:
            return (*self._both_pressed(s, ttft, tpot, need), False)
        if self._spare_prefill(s, ttft, tpot):
            # a worker moves before TPOT is pressed: once it is, the streams that decode worker
            # has already taken miss the SLO
            return TO_DECODE, "prefill has a worker to spare and TPOT is past half its room", True
        return NONE, "within the SLO's margins", False

    def _ttft_pressed(self, s: Signals, ttft: float, tpot: float | None) -> tuple[str, str]:
        """TTFT pressed while TPOT has room: a decode worker to prefill, else prefill locally."""
        c = self.config
        if s.decode_workers > 1 and self._decode_can_give(s, ttft, tpot, 1):
            return TO_PREFILL, "TTFT over its SLO while TPOT has room"
        if s.decode_workers > 1:
            return NONE, "TTFT over its SLO, but one decode worker fewer would be more pressed"
        if s.local_max < c.local_cap and (tpot is None or tpot < (1 - c.margin) / 2):
            # only onto a decode pool that is clearly idle: a local prompt stalls every stream
            # of its worker for its whole prefill, and finished requests show that cost late
            return LOCAL_MORE, "TTFT over its SLO, TPOT well under it, no decode worker to spare"
        return NONE, "within the SLO's margins"

    @staticmethod
    def _tpot_pressed(s: Signals) -> tuple[str, str]:
        """TPOT pressed while TTFT has room: a prefill worker to decode (which also stops local
        prefill: the owner sets the bound to 0), else less local prefill."""
        if s.prefill_workers > 1:
            return TO_DECODE, "TPOT over its SLO while TTFT has room"
        if s.local_max > 0:
            return LOCAL_LESS, "TPOT over its SLO: prefill less on the decode workers"
        return NONE, "TPOT over its SLO, but no prefill worker to spare and no local prefill"

    def _both_pressed(
        self, s: Signals, ttft: float | None, tpot: float | None, need: int | None
    ) -> tuple[str, str]:
        """Pressed, and the other side has no room either. TTFT also holds the wait for a full
        decode pool, so both rise together when decode is short: the prefill demand says which
        pool is short. Only a clear verdict counts, or the flips swing back and forth: the
        workers left after the flip cover the demand with the margin to spare, or the demand
        exceeds the pool by the margin; and the side flipped toward is the more pressed (a queue
        behind a full decode pool reads as prefill demand too)."""
        lo, margin = 1 - self.config.margin, self.config.margin
        demand = self.prefill_demand(s)
        p, t_in, t_out = s.prefill_workers, ttft or 0.0, tpot or 0.0
        if demand is not None and demand <= (p - 1) * lo and t_out > max(lo, t_in):
            return TO_DECODE, f"both near or over their SLOs; prefill needs {need}P"
        if demand is not None and demand >= p + margin and t_in > max(lo, t_out):
            if s.decode_workers > 1 and self._decode_can_give(s, ttft, tpot, 1):
                return TO_PREFILL, f"both near or over their SLOs; prefill needs {need}P"
            if s.decode_workers > 1:
                return NONE, (
                    f"both near or over their SLOs; prefill needs {need}P, but one decode "
                    "worker fewer would be more pressed"
                )
        return NONE, "both near or over their SLOs, and no clear prefill demand"

    def _batch(
        self,
        s: Signals,
        want: str,
        why: str,
        need: int | None,
        ttft: float | None,
        tpot: float | None,
        nudge: bool,
    ) -> tuple[int, str] | Decision:
        """How many workers a wanted flip moves (and its reason), recorded as begun; or the
        Decision (its reason without the signals) when it must not happen now."""
        c = self.config
        blocked = self._flip_blocked(s.now)
        if blocked:
            return Decision(NONE, f"{why}, but {blocked}")
        # a batch sized by the prefill demand, so one decision makes a big shift; within the
        # flips a minute allows, never a pool's last worker
        room = c.max_flips_per_min - len(self._flips)
        count = 1
        if need is not None and want == TO_PREFILL:
            if need <= s.prefill_workers:  # TTFT holds a backlog or decode waits
                return Decision(NONE, f"{why}, but {s.prefill_workers}P cover the prefill demand")
            count = min(need - s.prefill_workers, s.decode_workers - 1, room)
            while count > 1 and not self._decode_can_give(s, ttft, tpot, count):
                count -= 1
        elif need is not None:
            if need >= s.prefill_workers:
                why = f"{why}, but the prefill demand needs {need}P"
                if s.local_max > 0:
                    return Decision(LOCAL_LESS, f"{why}: no local prefill")
                return Decision(NONE, why)
            count = 1 if nudge else min(s.prefill_workers - need, s.prefill_workers - 1, room)
        count = max(1, count)
        last_way, last_count = self._last_batch
        if last_way not in (want, NONE) and s.now - self._last_flip < 3 * c.cooldown_s:
            # back the other way soon after a batch: that batch overshot, so this one moves at
            # most half as many, and a split between the two is tried before either again
            if count > max(1, last_count // 2):
                count = max(1, last_count // 2)
                why = f"{why}, {count} after a batch of {last_count} the other way"
        self._last_batch = (want, count)
        self._flips.extend([s.now] * count)
        self._last_flip, self.flipping = s.now, True
        return count, why

    @staticmethod
    def _decode_can_give(s: Signals, ttft: float | None, tpot: float | None, n: int) -> bool:
        """Whether n decode workers can go to prefill: the decode pool left, carrying the same
        streams (TPOT pressure x d / (d - n)), would be less pressed than prefill is now."""
        if tpot is None:
            return True
        d = s.decode_workers
        return n < d and tpot * d / (d - n) < (ttft or 0.0)

    def _spare_prefill(self, s: Signals, ttft: float | None, tpot: float | None) -> bool:
        """TTFT under half its room, TPOT over half its own, and the prefill workers but one
        cover the prefill demand with the margin to spare."""
        lo = 1 - self.config.margin
        if s.prefill_workers < 2 or ttft is None or tpot is None:
            return False
        if not (ttft < lo / 2 < tpot):
            return False
        demand = self.prefill_demand(s)
        return demand is not None and demand <= (s.prefill_workers - 1) * lo

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
        """The owner finished (or gave up) the flips decide asked for; the cooldown runs from
        now."""
        self.flipping = False
        self._last_flip = now

    def next_local_max(self, action: str, local_max: int) -> int:
        c = self.config
        if action == LOCAL_MORE:
            return min(c.local_cap, local_max + c.local_step)
        if action in (LOCAL_LESS, TO_DECODE):  # decode is pressed: local prefills stop at once
            return 0
        return local_max


def p90(xs) -> float | None:
    """The 90th percentile of `xs` (the nearest rank at or above it); None for none."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


def _queue_pressure(s: Signals, c: PlannerConfig) -> float | None:
    """The time the prefill pool's queued prompt tokens take to compute, over ttft_s."""
    if s.prefill_tokens_per_s > 0 and s.prefill_workers:
        return s.prefill_queued_tokens / (s.prefill_tokens_per_s * s.prefill_workers * c.ttft_s)
    return None


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"
