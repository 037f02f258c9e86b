"""The planner in the simulator (tuning/sim_planner.py): without a planner it is the static
simulator exactly, a planner that never acts changes nothing, the planner follows a shift from
prefill-heavy to decode-heavy traffic by flipping workers, flips keep the cooldown and the rate
bound, never empty a pool, and the streams a flip moves still finish; plus the phased rate
scaling and the goodput bisection the evaluation and `pdserve tune --planner` share."""

from __future__ import annotations

import math
import re

import pytest

from helpers.tuning import DERIVED, make_profile
from pdserve.planner.policy import LOCAL_MORE, TO_DECODE, TO_PREFILL, PlannerConfig
from pdserve.tuning.perf_model import load_profile
from pdserve.tuning.shift_goodput import ShiftGoodput, bisect_rate, laid_end_to_end, scaled_phases
from pdserve.tuning.sim_planner import PlannerSimulator
from pdserve.tuning.simulator import Placement, PoolSpec, Simulator
from pdserve.tuning.slo import SLO
from pdserve.tuning.workload import RequestSpec, arrivals, load_trace, retime

# 1000 prompt tokens/s per prefill worker; a decode step of 20 ms + 1 ms per sequence
TOY = make_profile(bandwidth=1e9)
SHIFT_AT = 120.0
SLO_TOY = dict(ttft_s=1.0, tpot_s=0.03)


def shift(rate_a=5.0, rate_b=8.0, span=SHIFT_AT):
    """Prefill-heavy (400-token prompts, 2 tokens out: about 2 prefill workers' worth, a fraction
    of one decode worker's), then decode-heavy (20 in, 100 out: 3 decode workers meet 30 ms
    TPOT, 2 do not)."""
    a = [RequestSpec(t, 400, 2) for t in arrivals(int(rate_a * span * 2), rate_a, seed=1)]
    b = [RequestSpec(span + t, 20, 100) for t in arrivals(int(rate_b * span * 2), rate_b, seed=2)]
    return [r for r in a if r.arrival_s < span] + [r for r in b if r.arrival_s < 2 * span]


def same(a, b):
    return (a.requests, a.num_steps, a.num_preemptions) == (
        b.requests,
        b.num_steps,
        b.num_preemptions,
    )


# ---- the static path ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "placement",
    [
        Placement(PoolSpec(2, 1), PoolSpec(2, 1)),
        Placement(PoolSpec(1, 1), PoolSpec(3, 1, max_num_batched_tokens=256)),
        # a small KV pool: decode preempts, the router holds requests for blocks
        Placement(PoolSpec(2, 1), PoolSpec(1, 1, kv_capacity_tokens=3000)),
    ],
    ids=["2P2D", "1P3D-small-chunks", "tight-kv"],
)
def test_without_a_planner_it_is_the_static_simulator(placement):
    reqs = shift()
    want = Simulator(TOY, placement).run(reqs)
    got = PlannerSimulator(TOY, placement).run(reqs)
    assert same(want, got)
    assert got.flips == [] and got.timeline == []
    if placement.decode.kv_capacity_tokens:
        assert want.num_preemptions > 0  # the case covers preemption


def test_static_on_the_gpu_profile_and_with_early_stop_matches_too():
    prof = load_profile(DERIVED)
    reqs = retime(load_trace("azure_conv", max_requests=300), 15.0)
    pl = Placement(PoolSpec(1, 1), PoolSpec(1, 2))
    for kw in ({}, dict(max_missed=5, ttft_s=0.3, tpot_s=0.02)):
        want = Simulator(prof, pl).run(reqs, **kw)
        got = PlannerSimulator(prof, pl).run(reqs, **kw)
        assert same(want, got) and want.stopped_early == got.stopped_early


def test_a_planner_that_never_acts_changes_nothing():
    """The planner's ticks (signals, decisions) run through the whole trace, and the result is
    the static one."""
    reqs = shift()
    pl = Placement(PoolSpec(2, 1), PoolSpec(2, 1))
    idle = PlannerConfig(**SLO_TOY, sustain=10**9)
    got = PlannerSimulator(TOY, pl, idle).run(reqs)
    assert same(Simulator(TOY, pl).run(reqs), got)
    assert len(got.timeline) >= 2 * SHIFT_AT / idle.interval_s - 1 and got.flips == []


# ---- the planner --------------------------------------------------------------------------------
def test_the_planner_follows_a_shift_from_prefill_to_decode_heavy():
    reqs = shift()
    pl = Placement(PoolSpec(2, 1), PoolSpec(2, 1))
    res = PlannerSimulator(TOY, pl, PlannerConfig(**SLO_TOY)).run(reqs)
    static = Simulator(TOY, pl).run(reqs)
    flips = [(f.to_role, f.start_s) for f in res.flips]
    to_prefill = [t for role, t in flips if role == "prefill"]
    to_decode = [t for role, t in flips if role == "decode"]
    assert to_prefill and max(to_prefill) < SHIFT_AT, flips  # more prefill while prompts dominate
    assert len(to_decode) >= 2 and min(to_decode) > SHIFT_AT, flips  # then decode
    assert all(f.done_s is not None for f in res.flips)
    assert res.timeline[-1][1:3] == (1, 3)  # ends 1P:3D, the decode-heavy phase's best split
    assert res.attainment(**SLO_TOY) > static.attainment(**SLO_TOY) + 0.2
    acted = {a for _, a, _ in res.decisions}
    assert {TO_PREFILL, TO_DECODE} <= acted


@pytest.mark.parametrize("cooldown, per_min", [(0.0, 1), (25.0, 5)])
def test_flips_keep_the_cooldown_and_the_rate_bound(cooldown, per_min):
    """Prompts only, on a deployment with decode workers to spare: the planner wants a flip at
    every decision; the bounds alone space them."""
    reqs = [RequestSpec(t, 400, 2) for t in arrivals(3000, 6.0, seed=3) if t < 300]
    pl = Placement(PoolSpec(1, 1), PoolSpec(7, 1))
    cfg = PlannerConfig(**SLO_TOY, sustain=1, cooldown_s=cooldown, max_flips_per_min=per_min)
    res = PlannerSimulator(TOY, pl, cfg).run(reqs)
    starts = [f.start_s for f in res.flips]
    assert len(starts) >= 3, starts
    for prev, nxt in zip(res.flips, res.flips[1:]):
        # a batch's flips follow one another; the cooldown runs from the batch's flip_done
        assert nxt.start_s == prev.done_s or nxt.start_s >= prev.done_s + cooldown
    for t in starts:
        assert sum(1 for s in starts if t - 60.0 < s <= t) <= per_min
    if per_min == 1:
        assert min(b - a for a, b in zip(starts, starts[1:])) >= 60.0


def test_a_flip_never_empties_a_pool_and_then_the_planner_prefills_locally():
    reqs = [RequestSpec(t, 300, 4) for t in arrivals(3000, 8.0, seed=4) if t < 300]
    pl = Placement(PoolSpec(1, 1), PoolSpec(3, 1))
    # a TPOT SLO the one decode worker left keeps well under: it has time to prefill locally
    slo = dict(SLO_TOY, tpot_s=0.06)
    cfg = PlannerConfig(**slo, sustain=1, cooldown_s=0.0, max_flips_per_min=10)
    res = PlannerSimulator(TOY, pl, cfg).run(reqs)
    # while the traffic lasts (300 s), one batch of two (the demand wants 4P), 3P:1D, no further
    flips = [f for f in res.flips if f.start_s < 300]
    assert [f.to_role for f in flips] == ["prefill", "prefill"]
    assert flips[1].start_s == flips[0].done_s
    assert sum(1 for t, a, _ in res.decisions if a.startswith("flip") and t < 300) == 1
    assert min(row[2] for row in res.timeline) == 1 and min(row[1] for row in res.timeline) >= 1
    for prev, nxt in zip(res.flips, res.flips[1:]):  # one at a time: never two drained at once
        assert nxt.start_s >= prev.done_s
    assert LOCAL_MORE in {a for _, a, _ in res.decisions} and res.num_local > 0
    assert all(math.isfinite(r.e2e_s) for r in res.requests)


def test_streams_a_flip_moves_at_the_drain_bound_still_finish():
    """Long outputs on the decode worker that flips: the drain bound moves them (prompt plus the
    tokens so far, prefilled again) and each ends with all its tokens."""
    reqs = [RequestSpec(t, 400, 2) for t in arrivals(600, 5.0, seed=5) if t < 60]
    reqs += [RequestSpec(t * 0.1, 50, 2000) for t in range(20)]
    reqs.sort(key=lambda r: r.arrival_s)
    pl = Placement(PoolSpec(1, 1), PoolSpec(2, 1))
    cfg = PlannerConfig(ttft_s=1.0, tpot_s=1.0, sustain=1)
    res = PlannerSimulator(TOY, pl, cfg, drain_s=0.5).run(reqs)
    flip = res.flips[0] if res.flips else None
    assert flip and flip.to_role == "prefill" and flip.moved_streams > 0
    # drained at the bound (reservations still prefilling were reserved again elsewhere)
    assert 0.5 <= flip.drained_s - flip.start_s < 1.0
    assert all(math.isfinite(r.e2e_s) for r in res.requests)
    static = Simulator(TOY, pl).run(reqs)
    long = [
        (r, s) for spec, r, s in zip(reqs, res.requests, static.requests) if spec.output_len == 2000
    ]
    # a moved stream pays for its second prefill in TPOT, never again in TTFT
    assert [r.ttft_s for r, _ in long] == [s.ttft_s for _, s in long]
    assert max(r.ttft_s for r, _ in long) < flip.start_s


# ---- scaling and goodput ------------------------------------------------------------------------
def test_scaled_phases_keep_each_phase_and_scale_its_rate():
    reqs = shift()
    bounds = [("prefill", 0.0, SHIFT_AT), ("decode", SHIFT_AT, 2 * SHIFT_AT)]
    one = scaled_phases(reqs, bounds, 1.0)
    three = scaled_phases(reqs, bounds, 3.0, phase_s=60.0)
    assert [n for n, _ in three] == ["prefill", "decode"]
    for (_, a), (_, b) in zip(one, three):
        assert all(r.arrival_s < 60.0 for r in b)
        assert 0.7 * 1.5 * len(a) < len(b) < 1.3 * 1.5 * len(a)  # 3x the rate, half the time
        # the same lengths in the same order, gaps scaled by 1/3
        assert [(r.prompt_len, r.output_len) for r in b[:20]] == [
            (r.prompt_len, r.output_len) for r in a[:20]
        ]
        assert b[5].arrival_s == pytest.approx(a[5].arrival_s / 3)
    trace = laid_end_to_end(three, [60.0, 60.0])
    assert {r.prompt_len for r in trace if r.arrival_s < 60} == {400}
    assert {r.prompt_len for r in trace if r.arrival_s >= 60} == {20}


def test_bisect_finds_the_threshold_within_the_ratio():
    k, trials = bisect_rate(lambda k: k <= 3.3, 1.0, ratio=1.05)
    assert 3.3 / 1.05 <= k <= 3.3 and len(trials) < 15
    assert bisect_rate(lambda k: False, 1.0, give_up_below=0.9)[0] == 0.0


def test_the_oracle_is_at_least_every_split_per_phase():
    reqs = shift()
    bounds = [("prefill", 0.0, SHIFT_AT), ("decode", SHIFT_AT, 2 * SHIFT_AT)]
    ev = ShiftGoodput(TOY, reqs, bounds, SLO(1.0, 0.03, 0.5), phase_s=60.0)
    splits = [Placement(PoolSpec(p, 1), PoolSpec(4 - p, 1)) for p in (1, 2, 3)]
    att, picks = ev.oracle_at(splits, 1.0)
    assert picks == {"prefill": 2, "decode": 0}  # 3P:1D for prompts, 1P:3D for decodes
    for pl in splits:
        res = ev.simulate(pl, 1.0, False)
        assert att >= res.attainment(1.0, 0.03) - 1e-9


# ---- pdserve tune --planner ---------------------------------------------------------------------
def _shift_csv(path):
    from pdserve.tuning.shift_trace import ShiftRow, write_shift_trace

    rows = [ShiftRow(round(r.arrival_s, 6), r.prompt_len, r.output_len, "prompts") for r in shift()]
    rows = [r if r.arrived_at < SHIFT_AT else r._replace(phase="decodes") for r in rows]
    return str(write_shift_trace(rows, path))


def test_tune_reports_the_planner_against_its_static_pick(tmp_path, capsys):
    import json

    from pdserve import cli

    prof = tmp_path / "toy.json"
    prof.write_text(json.dumps(make_profile(bandwidth=1e9, as_dict=True)))
    argv = ["tune", "--profile", str(prof), "--workload", _shift_csv(tmp_path / "shift.csv")]
    argv += ["--slo", "ttft=1s,tpot=30ms", "--devices", "4", "--planner", "--planner-phase-s", "0"]
    argv += ["--num-requests", "100", "--max-requests", "600", "--max-verify-requests", "1000"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("planner (planner/policy.py"))
    assert "2 phase(s) kept (prompts, decodes" in line, line
    with_planner, static = (float(x) for x in re.findall(r"([\d.]+) req/s (?:with|static)", line))
    assert with_planner > 0 and static > 0
    verdict = next(x for x in out.splitlines() if x.startswith("planner: "))
    assert ("beats" in verdict) == (with_planner > static * 1.05), verdict
    bad = argv[:-6] + ["--planner-phase-s", "-1"]
    assert cli.main(bad) == 2


def test_the_oracle_fails_a_rate_that_no_split_serves():
    reqs = shift()
    bounds = [("prefill", 0.0, SHIFT_AT), ("decode", SHIFT_AT, 2 * SHIFT_AT)]
    ev = ShiftGoodput(TOY, reqs, bounds, SLO(1.0, 0.03, 0.9), phase_s=60.0)
    splits = [Placement(PoolSpec(p, 1), PoolSpec(4 - p, 1)) for p in (1, 2, 3)]
    att, _ = ev.oracle_at(splits, 3.0)
    assert att < 0.9
    k, _, picks = ev.oracle(splits, 0.5)
    assert 0 < k < 3.0 and set(picks) == {"prefill", "decode"}
    assert ev.oracle_at(splits, k)[0] >= 0.9
