"""experiments/pooled.py, which experiments/slo_pooled.py runs on: which stored runs it takes
(measurements of the setup only, calibrations of every run calibrated the same way, also the
earlier ones of --remeasure, never the step or disturbed files), and the pooled profile made from
their calibration steps."""

from __future__ import annotations

import datetime
import json

import pytest

from experiments.pooled import find_runs, merge_serving, pooled_profile, scaled
from helpers.tuning import toy_engine_profile_dict

CONFIG = {
    "model": "smollm2",
    "conv_scale": 0.2,
    "code_scale": 0.1,
    "max_prompt": 512,
    "max_output": 64,
    "num_requests": 2,
    "slo": "ttft=1.5s,tpot=100ms",
    "max_num_batched_tokens": 512,
    "load_rates": [2.0, 4.0],
    "load_requests": 100,
    "kv_cache_memory": 1 << 29,
    "max_model_len": 1024,
    "rates": {"azure_conv": [1.5, 3.0]},
    "serving_profile": "/elsewhere/profile_serving.json",
}
T0 = 1_800_000_000.0
# the same setup, calibrated at other loads
OTHER_LOADS = {**CONFIG, "load_rates": [2.0], "load_requests": 150}


def bench_file(path, t: float) -> None:
    reqs = [{"send_unix_ns": int((t + k) * 1e9)} for k in range(2)]
    path.write_text(
        json.dumps({"runs": [{"rate": 1.5, "requests": reqs}, {"rate": 3.0, "requests": reqs}]})
    )


def decode_steps(t: float, n: int = 40, step_s: float = 0.03) -> list[dict]:
    return [
        {
            "start": t + k * step_s,
            "end": t + (k + 1) * step_s - 0.0005,
            "tokens": 1 + k % 4,
            "prefill_pairs": 0,
            "num_decode": 1 + k % 4,
            "decode_context": 50 * (1 + k % 7),
        }
        for k in range(n)
    ]


def a_run(folder, date: str, t: float, config=None, suffixes=("",)) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "slo_validation.json").write_text(
        json.dumps({"date": date, "config": config or CONFIG})
    )
    (folder / "profile_serving.json").write_text(
        json.dumps(
            {"serving": {"decode": {"1": {"first_token_latency_s": 0.01 * (1 + len(suffixes))}}}}
        )
    )
    for k, suffix in enumerate(suffixes):
        bench_file(folder / f"slo_validation_disaggregated_azure_conv{suffix}.json", t + 100 * k)
        (folder / f"slo_validation_disaggregated_azure_conv_steps{suffix}.json").write_text("{}")
        (folder / f"slo_validation_disaggregated_load_2{suffix}.json").write_text(
            json.dumps({"requests": [{"send_unix_ns": int((t + 100 * k - 50) * 1e9)}]})
        )  # one rate, no sweep
        (folder / f"slo_validation_disaggregated_load_steps{suffix}.json").write_text(
            json.dumps(
                {
                    "workers": {
                        "decode-0": {"kind": "decode", "steps": decode_steps(t + 100 * k - 50)}
                    }
                }
            )
        )
    bench_file(folder / "slo_validation_disaggregated_azure_conv_disturbed1.json", t - 500)


def test_find_runs_takes_the_setups_measurements_and_every_compatible_calibration(tmp_path):
    a_run(tmp_path, "2026-11-23T00:31:00+00:00", T0, suffixes=("", "_run1"))
    a_run(tmp_path / "run_b", "2026-11-23T02:20:00+00:00", T0 + 1000)
    # other requests a rate: its sweep is another setup, its calibration the same procedure
    a_run(
        tmp_path / "other_requests",
        "2026-11-23T01:00:00+00:00",
        T0 + 2000,
        config={**CONFIG, "num_requests": 60},
    )
    # another prompt cap: calibrated on other requests, so neither counts
    a_run(
        tmp_path / "other_prompts",
        "2026-11-23T01:30:00+00:00",
        T0 + 3000,
        config={**CONFIG, "max_prompt": 256},
    )
    # the same sweep, calibrated at other loads: its measurement counts, its calibration does not
    a_run(tmp_path / "other_load", "2026-11-23T01:45:00+00:00", T0 + 4000, config=OTHER_LOADS)
    measurements, calibrations, cfg = find_runs(tmp_path, "azure_conv")
    assert cfg == CONFIG
    assert sorted((m["time"], m["run"]) for m in measurements) == [
        (T0, tmp_path.name),
        (T0 + 100, tmp_path.name),
        (T0 + 1000, "run_b"),
        (T0 + 4000, "other_load"),
    ]
    assert sorted((c["time"], c["run"]) for c in calibrations) == [
        (T0 - 50, tmp_path.name),
        (T0 + 50, tmp_path.name),
        (T0 + 950, "run_b"),
        (T0 + 1950, "other_requests"),
    ]
    assert all(
        c["serving"].name == "profile_serving.json" and c["serving"].is_file() for c in calibrations
    )


def test_find_runs_for_another_setup_measures_only_that_one(tmp_path):
    a_run(tmp_path / "run_a", "2026-11-23T00:31:00+00:00", T0)
    a_run(
        tmp_path / "run_b",
        "2026-11-23T01:00:00+00:00",
        T0 + 2000,
        config={**CONFIG, "num_requests": 60},
    )
    measurements, calibrations, cfg = find_runs(tmp_path, "azure_conv", num_requests=2)
    assert cfg["num_requests"] == 2 and [m["run"] for m in measurements] == ["run_a"]
    assert sorted(c["run"] for c in calibrations) == ["run_a", "run_b"]
    # a setup nobody measured yet: every compatible calibration, no measurement (a prediction alone)
    measurements, calibrations, cfg = find_runs(
        tmp_path, "azure_conv", num_requests=2, rates=[1.0, 2.0]
    )
    assert cfg["rates"]["azure_conv"] == [1.0, 2.0] and measurements == []
    assert len(calibrations) == 2
    # the newest run calibrated at other loads: only its own calibration counts
    a_run(tmp_path / "run_c", "2026-11-23T02:00:00+00:00", T0 + 4000, config=OTHER_LOADS)
    measurements, calibrations, cfg = find_runs(tmp_path, "azure_conv")
    assert [c["run"] for c in calibrations] == ["run_c"] and cfg["load_rates"] == [2.0]
    assert sorted(m["run"] for m in measurements) == ["run_a", "run_c"]
    # ... but as the setup stood before it started, the earlier calibrations count
    as_of = datetime.datetime(2026, 11, 23, 1, 30, tzinfo=datetime.UTC).timestamp()
    _, calibrations, cfg = find_runs(tmp_path, "azure_conv", as_of=as_of)
    assert sorted(c["run"] for c in calibrations) == ["run_a", "run_b"] and cfg["load_rates"] == [
        2.0,
        4.0,
    ]


def test_pooled_profile_fits_every_calibration_and_replays_each_workers_speed(tmp_path):
    a_run(tmp_path, "2026-11-23T00:31:00+00:00", T0, suffixes=("", "_run1"))
    a_run(tmp_path / "run_b", "2026-11-23T02:20:00+00:00", T0 + 1000)
    _, calibrations, _ = find_runs(tmp_path, "azure_conv")
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps(toy_engine_profile_dict()))
    profile, data = pooled_profile(engine, calibrations, 0.5)
    model = profile.step_model(1, "decode")
    assert len(model.speed_traces) == 3  # one per calibrated worker
    assert model.speed_window_s == 0.5
    # first-token latency: the mean over the runs' serving profiles (0.03 twice, 0.02 once)
    assert model.first_token_latency_s == pytest.approx((0.03 + 0.03 + 0.02) / 3)
    assert len(data["serving"]["source"]["calibrations"]) == 3
    slow = scaled(profile, 1.1).step_model(1, "decode")
    assert slow.decode == pytest.approx(tuple(1.1 * c for c in model.decode))
    assert slow.prefill == pytest.approx(tuple(1.1 * c for c in model.prefill))


def test_merged_pooled_profile_holds_every_placements_kinds_for_the_tuner():
    base = {"schema": "x", "tp": {}}
    disagg = {
        **base,
        "serving": {
            "prefill": {"1": {"step_noise": [1.0]}},
            "decode": {"1": {"step_noise": [1.1]}},
            "interference": {"decode_while_prefill": 0.2},
            "source": {"summary": "pooled", "calibrations": ["a", "b"]},
        },
    }
    coloc = {
        **base,
        "serving": {
            "colocated": {"1": {"step_noise": [1.2]}},
            "interference": {"colocated_while_busy": 0.1},
            "source": {"summary": "pooled", "calibrations": ["c"]},
        },
    }
    merged: dict = {}
    merge_serving(merged, disagg)
    merge_serving(merged, coloc)
    serving = merged["serving"]
    assert {k for k in serving if k not in ("interference", "source")} == {
        "prefill",
        "decode",
        "colocated",
    }
    assert serving["interference"] == {"decode_while_prefill": 0.2, "colocated_while_busy": 0.1}
    assert serving["source"]["calibrations"] == ["a", "b", "c"]
    assert "colocated" not in disagg["serving"] and disagg["serving"]["interference"] == {
        "decode_while_prefill": 0.2
    }
