"""The in-load calibration's fits (experiments/calibration.py) on synthetic engine steps: the time a
step holds the loop, the per-kind step models recovered from it, and the step check."""

from __future__ import annotations

import random

import numpy as np
import pytest

from experiments.calibration import (
    effective_steps,
    fit_load,
    modelled_s,
    others_busy,
    speed_traces,
    step_model_check,
)
from helpers.tuning import toy_engine_profile_dict
from pdserve.tuning.perf_model import StepModel, profile_from_dict

ENGINE = profile_from_dict(toy_engine_profile_dict())
TRUE = StepModel((0.03, 0.0012, 1e-6), (0.025, 0.0015, 7e-6), 100_000)
GAP = 0.0005  # the loop's time between back-to-back steps


def synthetic_steps(n: int, seed: int = 0, noise: float = 0.0) -> list[dict]:
    """A colocated worker's steps, back to back (with an idle pause now and then), timed by TRUE."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        b = rng.randint(1, 20)
        ctx = b * rng.randint(50, 400)
        if i % 4 == 0:  # a mixed step: a prompt chunk beside the decode rows
            chunk, start = rng.randint(16, 400), rng.choice([0, 0, 128])
            step = dict(
                tokens=chunk + b,
                prefill_pairs=chunk * (start + chunk),
                num_decode=b,
                decode_context=ctx,
            )
        else:
            step = dict(tokens=b, prefill_pairs=0, num_decode=b, decode_context=ctx)
        dur = (modelled_s(TRUE, step) - GAP) * (1 + noise * rng.uniform(-1, 1))
        out.append({**step, "start": t, "end": t + dur})
        t += dur + (GAP if i % 50 else 1.0)  # every 50th step the loop idles for a second
    return out


def test_effective_steps_count_the_loop_time_between_back_to_back_steps():
    steps = synthetic_steps(200)
    eff = effective_steps(steps)
    for s, e in zip(steps, eff):
        assert e["eff_s"] == pytest.approx(s["end"] - s["start"] + GAP)  # idle or not


def test_fit_load_recovers_the_step_models_of_each_kind():
    raw = {
        "workers": {
            "colocated-0": {"kind": "colocated", "steps": synthetic_steps(400, 1)},
            "colocated-1": {"kind": "colocated", "steps": synthetic_steps(400, 2)},
        }
    }
    fit = fit_load(ENGINE, raw)["colocated"]
    assert fit["num_steps"] == 800 and fit["num_prefill_steps"] == 200
    assert fit["decode"]["coef"] == pytest.approx(TRUE.decode, rel=1e-3)
    assert fit["prefill"]["coef"] == pytest.approx(TRUE.prefill, rel=1e-3)
    assert fit["step_noise"] == pytest.approx([1.0] * len(fit["step_noise"]), abs=1e-3)


def test_step_noise_spans_the_measured_spread_and_the_check_reads_it():
    raw = {
        "workers": {
            "decode-0": {
                "kind": "decode",
                "steps": [s for s in synthetic_steps(600, 3, noise=0.2) if s["prefill_pairs"] == 0],
            }
        }
    }
    fit = fit_load(ENGINE, raw)["decode"]
    assert "prefill" not in fit  # no prompt steps: the engine's prefill model stays
    noise = fit["step_noise"]
    assert noise == sorted(noise) and noise[0] < 0.9 and noise[-1] > 1.1
    assert noise[len(noise) // 2] == pytest.approx(1.0, abs=0.05)
    data = dict(ENGINE.raw, serving={"decode": {"1": {"decode": {"coef": list(TRUE.decode)}}}})
    check = step_model_check(profile_from_dict(data), raw)["decode"]
    assert check["num_steps"] == len(raw["workers"]["decode-0"]["steps"])
    assert check["ratio_p50"] == pytest.approx(1.0, abs=0.05)
    assert 0 < check["busy_share"] <= 1


def test_step_speed_keeps_a_slow_spell_and_step_noise_what_is_left_within_a_window():
    """A decode worker whose steps ran 1.5x slower from 10 s to 20 s into its run: with windows,
    the spell is in its speed trace (in time order) and the step noise is flat; without, it is all
    step noise."""
    rng = random.Random(4)
    t, steps = 0.0, []
    while t < 30.0:
        b = rng.randint(1, 20)
        step = dict(
            tokens=b, prefill_pairs=0, num_decode=b, decode_context=b * rng.randint(50, 400)
        )
        dur = modelled_s(TRUE, step) * (1.5 if 10.0 <= t < 20.0 else 1.0) - GAP
        steps.append({**step, "start": t, "end": t + dur})
        t += dur + GAP
    raw = {"workers": {"decode-0": {"kind": "decode", "steps": steps}}}
    plain = fit_load(ENGINE, raw)["decode"]
    assert "step_speed" not in plain and plain["step_noise"][-1] / plain["step_noise"][0] > 1.3
    fit = fit_load(ENGINE, raw, speed_window_s=1.0)["decode"]
    assert fit["step_speed"]["window_s"] == 1.0 and len(fit["step_speed"]["traces"]) == 1
    trace = fit["step_speed"]["traces"][0]
    assert len(trace) == 30 and max(trace) / min(trace) == pytest.approx(1.5, rel=0.03)
    assert [k for k, v in enumerate(trace) if v > 1.2 * min(trace)] == list(range(10, 20))
    assert fit["step_noise"] == pytest.approx([1.0] * len(fit["step_noise"]), abs=0.03)


def test_speed_traces_are_per_worker_and_weigh_each_step_by_its_time():
    steps = [{"start": t, "worker": w} for w in ("a", "b") for t in (0.0, 0.1, 0.6, 1.2)]
    ratios = np.array([1.0, 1.0, 2.0, 4.0, 3.0, 3.0, 3.0, 3.0])
    speed, fast = speed_traces(steps, ratios, np.full(8, 0.1), 0.5)
    assert speed == {"window_s": 0.5, "traces": [[1.0, 2.0, 4.0], [3.0, 3.0, 3.0]]}
    assert list(fast) == pytest.approx([1.0] * 8)
    # a window of a 0.3 s step at 1x and a 0.1 s step at 3x ran 0.6 s of 0.4 s modelled: 1.5x
    ratios[:2] = [1.0, 3.0]
    modelled = np.array([0.3, 0.1] + [0.1] * 6)
    speed, fast = speed_traces(steps, ratios, modelled, 0.5)
    assert speed["traces"][0] == [1.5, 2.0, 4.0]
    assert list(fast[:2]) == pytest.approx([1 / 1.5, 3 / 1.5])


def test_steps_with_prompt_tokens_keep_their_own_step_noise():
    """Short decode-only steps jitter by up to 30%, the long mixed steps beside them by 3%: each
    kind of step keeps its own spread, so the simulator does not lend the decode jitter to the
    long steps. With too few steps of one kind, one step_noise holds them all."""
    rng = random.Random(6)
    steps = []
    for s in synthetic_steps(800, 7):
        jitter = 0.03 if s["prefill_pairs"] else 0.3
        steps.append(
            {**s, "end": s["start"] + (s["end"] - s["start"]) * (1 + jitter * rng.uniform(-1, 1))}
        )
    fit = fit_load(ENGINE, {"workers": {"colocated-0": {"kind": "colocated", "steps": steps}}})[
        "colocated"
    ]
    decode, prompt = fit["step_noise"], fit["prompt_step_noise"]
    assert decode[-1] / decode[0] > 1.4
    assert 0.95 < prompt[0] and prompt[-1] < 1.05
    few = [s for i, s in enumerate(steps) if not s["prefill_pairs"] or i < 100]  # 25 prompt steps
    fit = fit_load(ENGINE, {"workers": {"colocated-0": {"kind": "colocated", "steps": few}}})[
        "colocated"
    ]
    assert "prompt_step_noise" not in fit and fit["step_noise"][-1] / fit["step_noise"][0] > 1.4


def test_fit_load_finds_how_much_slower_a_kind_runs_while_another_worker_computes():
    """A prefill worker computes for the first 30 s; the decode worker's steps that start meanwhile
    take 1.3x their model. The fit recovers 0.3 and the models of a step alone on the host; the
    prefill worker, never alone, gets no factor."""
    rng = random.Random(5)
    prefill, t = [], 0.0
    while t < 30.0:
        n = rng.randint(32, 512)
        step = dict(tokens=n, prefill_pairs=n * n, num_decode=0, decode_context=0)
        dur = modelled_s(TRUE, step) - GAP
        prefill.append({**step, "start": t, "end": t + dur})
        t += dur + GAP
    spans = [(s["start"], s["end"]) for s in prefill]
    decode, t = [], 0.0
    while t < 60.0:
        b = rng.randint(1, 20)
        step = dict(
            tokens=b, prefill_pairs=0, num_decode=b, decode_context=b * rng.randint(50, 400)
        )
        busy = any(a <= t < e for a, e in spans)
        dur = modelled_s(TRUE, step) * (1.3 if busy else 1.0) - GAP
        decode.append({**step, "start": t, "end": t + dur})
        t += dur + GAP
    raw = {
        "workers": {
            "decode-0": {"kind": "decode", "steps": decode},
            "prefill-0": {"kind": "prefill", "steps": prefill},
        }
    }
    fits = fit_load(ENGINE, raw)
    assert fits["decode"]["interference"] == pytest.approx(0.3)
    assert fits["decode"]["decode"]["coef"] == pytest.approx(TRUE.decode, rel=1e-2)
    assert fits["decode"]["step_noise"] == pytest.approx(
        [1.0] * len(fits["decode"]["step_noise"]), abs=0.01
    )
    assert "interference" not in fits["prefill"]
    assert fits["prefill"]["prefill"]["coef"] == pytest.approx(TRUE.prefill, rel=1e-3)


def test_others_busy_compares_workers_of_the_same_run_only():
    steps = lambda *spans: [{"start": a, "end": b} for a, b in spans]  # noqa: E731
    raw = {
        "workers": {
            "r1:a": {"steps": steps((0.0, 1.0), (2.0, 3.0))},
            "r1:b": {"steps": steps((0.5, 2.5))},
            "r2:c": {"steps": steps((2.9, 3.0))},
        }
    }
    assert others_busy(raw) == {"r1:a": [False, True], "r1:b": [True], "r2:c": [False]}
