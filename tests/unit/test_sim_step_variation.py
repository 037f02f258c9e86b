"""The simulator's step-time variation (step_noise, prompt_step_noise, step_speed traces, colocated
interference) on hand-made profiles, and the tuner's seeded goodput band built on it."""

from __future__ import annotations

import json

import pytest

from helpers.tuning import make_profile, one, toy_tune_argv
from pdserve import cli
from pdserve.tuning.perf_model import ProfileError, profile_from_dict
from pdserve.tuning.simulator import Placement, PoolSpec, Simulator, simulate
from pdserve.tuning.slo import SLO
from pdserve.tuning.tuner import Search
from pdserve.tuning.workload import synthetic


def test_seeded_goodput_band_spreads_with_step_noise_and_collapses_without(tmp_path, capsys):
    data = make_profile(prefill=(0.01, 1e-3, 0.0), decode=(0.02, 1e-3, 0.0), as_dict=True)
    workload, slo = synthetic(300, 1.0, 200, 20), SLO(2.0, 0.1)
    plain = Search(profile_from_dict(data), workload, slo)
    cand = plain.evaluate(Placement(PoolSpec(1), PoolSpec(1)))
    plain.band(cand, 3)
    assert cand.seeded == [cand.goodput] * 3  # no variation: every seed is the same run
    data["serving"] = {
        kind: {"1": {"step_noise": [0.6, 1.0, 1.8]}} for kind in ("prefill", "decode")
    }
    noisy = Search(profile_from_dict(data), workload, slo)
    cand = noisy.evaluate(Placement(PoolSpec(1), PoolSpec(1)))
    noisy.band(cand, 6)
    assert len(cand.seeded) == 6 and len(set(cand.seeded)) > 1 and min(cand.seeded) < cand.goodput
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    argv = toy_tune_argv(path, 2, "--seeds", "4")
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "seeded p10/p50/p90" in out and "one bisection per seed" in out
    path.write_text(json.dumps(make_profile(as_dict=True)))
    assert cli.main(argv) == 0
    assert "--seeds 4 skipped: the profile has no step-time variation" in capsys.readouterr().out
    assert cli.main(argv[:-1] + ["-1"]) == 2
    assert "--seeds must be >= 0" in capsys.readouterr().err


def test_step_noise_draws_a_multiplier_per_step_from_the_profile_with_a_seed():
    data = make_profile(as_dict=True)
    data["serving"] = {"colocated": {"1": {"step_noise": [0.5, 1.5]}}}
    prof = profile_from_dict(data)
    reqs = [one(100, 10)]
    pl = Placement(None, PoolSpec(1))
    steady = simulate(reqs, prof, pl).requests  # no seed: no noise
    assert steady == simulate(reqs, make_profile(), pl).requests
    noisy = [Simulator(prof, pl, seed=s).run(reqs).requests[0] for s in range(8)]
    assert noisy == [Simulator(prof, pl, seed=s).run(reqs).requests[0] for s in range(8)]
    assert len({r.e2e_s for r in noisy}) > 1
    # every step took 0.5x or 1.5x its modelled time: the E2E lies between the two extremes
    assert all(
        0.5 * steady[0].e2e_s - 1e-9 <= r.e2e_s <= 1.5 * steady[0].e2e_s + 1e-9 for r in noisy
    )
    with pytest.raises(ProfileError, match="step_noise"):
        data["serving"]["colocated"]["1"]["step_noise"] = [0.5, -1]
        profile_from_dict(data)


def test_steps_with_prompt_tokens_draw_from_prompt_step_noise():
    data = make_profile(as_dict=True)
    data["serving"] = {"colocated": {"1": {"step_noise": [1.0], "prompt_step_noise": [3.0]}}}
    reqs = [one(100, 10)]
    pl = Placement(None, PoolSpec(1))
    steady = simulate(reqs, make_profile(), pl).requests[0]
    noisy = Simulator(profile_from_dict(data), pl, seed=0).run(reqs).requests[0]
    # the prompt's step ran 3x its modelled time, the decode steps as modelled
    assert noisy.ttft_s == pytest.approx(3 * steady.ttft_s)
    assert noisy.e2e_s - noisy.ttft_s == pytest.approx(steady.e2e_s - steady.ttft_s)
    del data["serving"]["colocated"]["1"][
        "step_noise"
    ]  # without step_noise, decode steps are exact
    alone = Simulator(profile_from_dict(data), pl, seed=0).run(reqs).requests[0]
    assert (alone.ttft_s, alone.e2e_s) == pytest.approx((noisy.ttft_s, noisy.e2e_s))
    with pytest.raises(ProfileError, match="prompt_step_noise"):
        data["serving"]["colocated"]["1"]["prompt_step_noise"] = [0.0]
        profile_from_dict(data)


def test_step_speed_replays_one_trace_per_worker_from_a_random_window():
    data = make_profile(as_dict=True)
    # one window covers the whole run: each seed's worker runs every step at 1x or 3x
    data["serving"] = {
        "colocated": {"1": {"step_speed": {"window_s": 1000.0, "traces": [[1.0, 3.0]]}}}
    }
    prof = profile_from_dict(data)
    reqs = [one(100, 10)]
    pl = Placement(None, PoolSpec(1))
    steady = simulate(reqs, prof, pl).requests[0]  # no seed: no trace
    assert steady == simulate(reqs, make_profile(), pl).requests[0]
    runs = [Simulator(prof, pl, seed=s).run(reqs).requests[0] for s in range(12)]
    assert runs == [Simulator(prof, pl, seed=s).run(reqs).requests[0] for s in range(12)]
    ratios = sorted({round(r.e2e_s / steady.e2e_s, 9) for r in runs})
    assert ratios == [1.0, 3.0]
    # windows of 0.05 s: the speed changes along the run, so the E2E lies strictly between
    data["serving"]["colocated"]["1"]["step_speed"] = {"window_s": 0.05, "traces": [[1.0, 3.0]]}
    mixed = [Simulator(profile_from_dict(data), pl, seed=s).run(reqs).requests[0] for s in range(4)]
    assert all(steady.e2e_s * 1.2 < r.e2e_s < steady.e2e_s * 2.8 for r in mixed)
    for bad in (
        {"window_s": 0, "traces": [[1.0]]},
        {"window_s": 1.0, "traces": []},
        {"window_s": 1.0, "traces": [[1.0, -2.0]]},
        [1.0, 2.0],
    ):
        data["serving"]["colocated"]["1"]["step_speed"] = bad
        with pytest.raises(ProfileError, match="step_speed"):
            profile_from_dict(data)


def test_colocated_interference_stretches_steps_that_start_while_another_worker_computes():
    data = make_profile(as_dict=True)
    pl = Placement(None, PoolSpec(2))
    alone = [one(100, 10)]
    together = [one(100, 10), one(100, 10)]
    base = [simulate(r, profile_from_dict(data), pl).requests for r in (alone, together)]
    data["serving"] = {"interference": {"colocated_while_busy": 0.5}}
    slowed = [simulate(r, profile_from_dict(data), pl).requests for r in (alone, together)]
    assert slowed[0] == base[0]  # one worker computes: nothing to slow it
    assert slowed[1][1].e2e_s > base[1][1].e2e_s  # the second starts while the first computes
    assert sum(r.e2e_s for r in slowed[1]) <= 1.5 * sum(r.e2e_s for r in base[1]) + 1e-9
