"""Goodput over a workload-shift trace: its rate scaled with its phases kept, DistServe's goodput
search over that scale, and the comparisons issue #27 asks for (the best static placement, a
fixed split, the per-phase oracle, the planner in the loop of tuning/sim_planner.py).

`pdserve tune --planner` (tuning/tune_cmd.py) and benchmarks/planner/sim.py use it: each phase of
the trace gets Poisson arrivals at k times its own rate over its own length (`scaled_phases`),
the phases are laid end to end, and `bisect_rate` finds the largest k at which the SLO's
attainment holds. Scaling the whole trace at once, as the tuner's retime does, would mix the
phases.
"""

from __future__ import annotations

import dataclasses
import math
import time

from pdserve.planner.local_prefill import LocalPrefill
from pdserve.planner.policy import PlannerConfig
from pdserve.tuning.perf_model import Profile
from pdserve.tuning.sim_planner import DRAIN_S, SWITCH_DELAY_S, PlannerSimulator
from pdserve.tuning.simulator import INF, Placement
from pdserve.tuning.slo import SLO
from pdserve.tuning.workload import RequestSpec, arrivals


# ---- a trace's rate, scaled with its phases kept ------------------------------------------------
def trace_phases(name_or_path: str, requests: list[RequestSpec]) -> list[tuple[str, float, float]]:
    """The shift trace's phases (tuning/shift_trace.py), or one phase over the whole trace when
    it has none."""
    from pdserve.tuning.shift_trace import phase_boundaries

    try:
        return phase_boundaries(name_or_path)
    except (ValueError, OSError, KeyError):
        return [("all", requests[0].arrival_s, requests[-1].arrival_s)]


def scaled_phases(
    requests: list[RequestSpec],
    boundaries: list[tuple[str, float, float]],
    multiplier: float,
    *,
    phase_s: float | None = None,
    seed: int = 0,
) -> list[tuple[str, list[RequestSpec]]]:
    """Each phase at `multiplier` times its own mean rate, the phases' time structure kept: phase
    i lasts its own span (or `phase_s` seconds, a shorter run of the same trace) and holds
    Poisson arrivals at multiplier x (its requests / its span), its requests' lengths in order
    (repeated from its first when more are needed). The tuner's retime does this for a whole
    trace (tuning/workload.py), which would mix the phases; here each phase is retimed alone.
    Arrival times count from the phase's own start. The same seed at another multiplier gives
    the same sequence of lengths and gaps scaled by 1/multiplier."""
    from pdserve.tuning.shift_trace import split_by_phase

    if not multiplier > 0:
        raise ValueError(f"multiplier must be > 0, got {multiplier}")
    parts = split_by_phase(requests, boundaries)
    out = []
    for i, (name, start, end) in enumerate(boundaries):
        mine = parts[name]
        span = end - start
        if not mine:
            continue
        duration = phase_s if phase_s is not None else span
        rate = multiplier * len(mine) / span if span > 0 else multiplier * len(mine)
        n = max(16, math.ceil(duration * rate * 1.2) + 16)
        while True:
            times = arrivals(n, rate, seed=seed + i)
            if times[-1] >= duration:
                break
            n *= 2
        times = [t for t in times if t < duration]
        out.append(
            (
                name,
                [
                    dataclasses.replace(mine[k % len(mine)], arrival_s=t)
                    for k, t in enumerate(times)
                ],
            )
        )
    return out


def laid_end_to_end(phases: list[tuple[str, list[RequestSpec]]], phase_s: list[float]):
    """One trace of the phases, phase i starting at the sum of the durations before it."""
    out, offset = [], 0.0
    for (_, reqs), span in zip(phases, phase_s):
        out += [dataclasses.replace(r, arrival_s=r.arrival_s + offset) for r in reqs]
        offset += span
    return out


def bisect_rate(
    passes, start: float, *, ratio: float = 1.05, give_up_below: float = 0.0, top: float = INF
) -> tuple[float, list[tuple[float, bool]]]:
    """The highest multiplier at which `passes(multiplier)` holds, found as the tuner's _bisect
    does: up by 1.5x from `start` until it fails (or down until it passes), then bisected in
    geometric steps until the failing rate is within `ratio` of the passing one. Returns (0 when
    none passed) and the trials. give_up_below: a failure at or below it ends the search (it
    cannot beat that)."""
    trials: list[tuple[float, bool]] = []
    good, bad = 0.0, None

    def trial(k: float) -> bool:
        nonlocal good, bad
        ok = passes(k)
        trials.append((k, ok))
        if ok:
            good = max(good, k)
        elif bad is None or k < bad:
            bad = k
        return ok

    k = min(start, top)
    if trial(k):
        for _ in range(12):
            if k >= top:
                break
            k = min(k * 1.5, top)
            if not trial(k):
                break
    else:
        for _ in range(14):
            if k <= give_up_below:
                break
            k = max(k / 1.5, give_up_below)
            if trial(k):
                break
    while good > 0 and bad is not None and bad / good > ratio and bad >= give_up_below:
        trial(math.sqrt(good * bad))
    return good, trials


# ---- goodput over a scaled trace, its phases kept -----------------------------------------------
class ShiftGoodput:
    """DistServe's goodput of placements on one trace scaled with its phases kept
    (scaled_phases): the highest rate multiplier at which at least slo.attainment of the requests
    meet both SLOs, statically, with the planner in the loop, or for the per-phase oracle (each
    phase simulated alone on its own best split, switching for free). A multiplier's trace and a
    (placement, multiplier, planner) trial are computed once; a trial stops as soon as too many
    requests missed the SLO, as the tuner's do."""

    def __init__(
        self,
        profile: Profile,
        requests: list[RequestSpec],
        boundaries: list[tuple[str, float, float]],
        slo,
        *,
        phase_s: float | None = None,
        seed: int = 0,
        ratio: float = 1.05,
        planner: PlannerConfig | None = None,
        local_prefill: LocalPrefill | None = None,
        drain_s: float = DRAIN_S,
        switch_delay_s: float = SWITCH_DELAY_S,
    ):
        self.profile, self.requests, self.boundaries, self.slo = profile, requests, boundaries, slo
        self.phase_s, self.seed, self.ratio = phase_s, seed, ratio
        self.planner = planner or PlannerConfig(ttft_s=slo.ttft_s, tpot_s=slo.tpot_s)
        self.sim_args = dict(
            local_prefill=local_prefill, drain_s=drain_s, switch_delay_s=switch_delay_s
        )
        self.spans = [
            phase_s if phase_s is not None else end - start for _, start, end in boundaries
        ]
        one = scaled_phases(requests, boundaries, 1.0, phase_s=phase_s, seed=seed)
        self.base_rate = sum(len(r) for _, r in one) / sum(self.spans)  # req/s at multiplier 1
        self._phases: dict[float, list] = {}
        self._trials: dict[tuple, bool] = {}
        self.num_sims = 0
        self.sim_s = 0.0

    def phases(self, k: float) -> list[tuple[str, list[RequestSpec]]]:
        if k not in self._phases:
            if len(self._phases) >= 6:
                self._phases.pop(next(iter(self._phases)))
            self._phases[k] = scaled_phases(
                self.requests, self.boundaries, k, phase_s=self.phase_s, seed=self.seed
            )
        return self._phases[k]

    def trace(self, k: float) -> list[RequestSpec]:
        return laid_end_to_end(self.phases(k), self.spans)

    def simulate(
        self, placement: Placement, k: float, planner: bool, requests=None, max_missed=None
    ):
        import time

        t0 = time.perf_counter()
        sim = PlannerSimulator(
            self.profile, placement, self.planner if planner else None, **self.sim_args
        )
        res = sim.run(
            self.trace(k) if requests is None else requests,
            max_missed=max_missed,
            ttft_s=self.slo.ttft_s,
            tpot_s=self.slo.tpot_s,
        )
        self.num_sims += 1
        self.sim_s += time.perf_counter() - t0
        return res

    def good(self, res) -> int:
        t, p = self.slo.ttft_s, self.slo.tpot_s
        return sum(1 for r in res.requests if r.ttft_s <= t and r.tpot_s <= p)

    def passes(self, placement: Placement, k: float, planner: bool = False) -> bool:
        key = (placement, k, planner)
        if key not in self._trials:
            reqs = self.trace(k)
            allowed = int(math.floor((1 - self.slo.attainment) * len(reqs) + 1e-9))
            res = self.simulate(placement, k, planner, reqs, allowed)
            self._trials[key] = self.good(res) >= self.slo.attainment * len(reqs) - 1e-9
        return self._trials[key]

    def goodput(
        self, placement: Placement, start: float, *, planner: bool = False, give_up_below=0.0
    ) -> tuple[float, list]:
        return bisect_rate(
            lambda k: self.passes(placement, k, planner),
            start,
            ratio=self.ratio,
            give_up_below=give_up_below,
        )

    def oracle_at(self, splits: list[Placement], k: float, hint: dict | None = None):
        """(attainment over the whole trace, {phase: index of its best split}) at multiplier k,
        each phase simulated alone on each split (the split that meets the SLO for the most of
        its requests). Splits are tried from `hint`'s pick outward; a trial stops once it missed
        more than the best split so far, or more than the whole trace may miss (then k fails:
        the attainment returned is below the SLO's and the picks are partial)."""
        hint = hint or {}
        phases = self.phases(k)
        total = sum(len(reqs) for _, reqs in phases)
        allowed = int(math.floor((1 - self.slo.attainment) * total + 1e-9))
        missed_total = 0
        picks = {}
        for name, reqs in phases:
            n = len(reqs)
            start = hint.get(name, len(splits) // 2)
            order = sorted(range(len(splits)), key=lambda i: (abs(i - start), i))
            best_i, best_missed = None, None
            for i in order:
                cap = allowed - missed_total  # more than this: the trace misses its attainment
                if best_missed is not None:
                    cap = min(cap, best_missed - 1)  # must beat the best split so far
                res = self.simulate(splits[i], k, False, reqs, cap)
                if res.stopped_early:
                    continue
                m = n - self.good(res)
                if m <= cap and (best_missed is None or m < best_missed):
                    best_i, best_missed = i, m
                if best_missed == 0:
                    break  # nothing beats every request served
            if best_i is None:
                return (total - allowed - 1) / total, picks
            picks[name] = best_i
            missed_total += best_missed
        return (total - missed_total) / total, picks

    def oracle(self, splits: list[Placement], start: float) -> tuple[float, list, dict]:
        """The per-phase oracle's goodput multiplier, its trials and its picks at that rate."""
        picks: dict = {}
        seen: dict[float, tuple] = {}

        def passes(k: float) -> bool:
            seen[k] = self.oracle_at(splits, k, picks)
            if seen[k][0] >= self.slo.attainment - 1e-9:
                picks.update(seen[k][1])
            return seen[k][0] >= self.slo.attainment - 1e-9

        k, trials = bisect_rate(passes, start, ratio=self.ratio)
        return k, trials, (seen[k][1] if k in seen else {})


# ---- pdserve tune --planner ---------------------------------------------------------------------
def planner_report(args, profile: Profile, workload: list[RequestSpec], slo: SLO, cands, unit):
    """--planner: the best disaggregated pick's goodput with and without the planner in the loop
    (tuning/sim_planner.py), on the workload with its phases kept (scaled_phases: each phase at k
    times its own rate for --planner-phase-s seconds), bisected on k as the search bisects."""
    from pdserve.planner.policy import PlannerConfig
    from pdserve.tuning.tuner import BISECT_RATIO

    pick = next(
        (
            c
            for c in cands
            if not c.placement.colocated
            and c.placement.prefill.pp == 1  # workers in stages never flip roles
            and c.status not in ("no-rate", "dropped")
            and c.score > 0
        ),
        None,
    )
    if pick is None:
        print(
            "\nplanner: no disaggregated placement with one-stage workers (those in stages "
            "never flip roles) meets the SLO to start it from"
        )
        return
    t0 = time.perf_counter()
    bounds = trace_phases(args.workload, workload)
    config = PlannerConfig(ttft_s=slo.ttft_s, tpot_s=slo.tpot_s)

    def evaluator(bounds):
        return ShiftGoodput(
            profile,
            workload,
            bounds,
            slo,
            phase_s=args.planner_phase_s or None,
            seed=args.seed,
            ratio=BISECT_RATIO,
            planner=config,
        )

    try:
        ev = evaluator(bounds)
    except ValueError:  # phases that do not cover the requests as loaded: one phase
        bounds = [("all", workload[0].arrival_s, workload[-1].arrival_s)]
        ev = evaluator(bounds)
    pl = pick.placement
    start = max(pick.score / ev.base_rate, 1e-3)
    k_static, _ = ev.goodput(pl, start)
    k_plan, _ = ev.goodput(pl, max(k_static, start), planner=True)
    flips = ev.simulate(pl, k_plan, True).flips if k_plan > 0 else []
    rate = ev.base_rate
    names = ", ".join(name for name, _, _ in bounds)
    spans = f"{args.planner_phase_s:g} s each" if args.planner_phase_s else "their whole spans"
    print(
        f"\nplanner (planner/policy.py in the simulator, default settings at the SLO) from "
        f"{pl.label()}, on {args.workload} with its {len(bounds)} phase(s) kept ({names}; "
        f"{spans}, rates scaled together): "
        f"{k_plan * rate:.3g} req/s with the planner ({len(flips)} flips at that rate) vs "
        f"{k_static * rate:.3g} req/s static"
    )
    if k_static <= 0 and k_plan <= 0:
        verdict = "neither meets the SLO at any rate tried on the phased workload"
    elif k_static <= 0:
        verdict = "the planner meets the SLO where the static pick does not at any rate tried"
    elif k_plan > k_static * BISECT_RATIO:
        verdict = f"the planner beats the static pick ({k_plan / max(k_static, 1e-12):.2f}x)"
    elif k_plan * BISECT_RATIO < k_static:
        verdict = f"the planner does worse than the static pick ({k_plan / k_static:.2f}x)"
    else:
        verdict = "no difference within the search's precision"
    print(
        f"planner: {verdict} ({ev.num_sims} simulations in {time.perf_counter() - t0:.1f} s; "
        f"goodput per {unit}: {k_plan * rate / pl.num_devices:.3g} vs "
        f"{k_static * rate / pl.num_devices:.3g})"
    )
