"""In-load calibrations of many stored runs pooled into one profile: on a machine whose speed
drifts between minutes, a profile fitted on every calibration of the same setup (step models,
each worker's step_speed trace, step_noise) predicts the machine as it behaves over time, where
one run's calibration is a snapshot. experiments/slo_pooled.py compares such predictions with the
stored measurements and writes the merged profile for `pdserve tune --profile`.

Runs are experiments/slo_validation.py's output folders: <dir>/slo_validation.json (its date and config)
with, beside it, slo_validation_<placement>_<workload>[_runN].json (measurements) and
slo_validation_<placement>_load_steps[_runN].json (in-load calibrations)."""

from __future__ import annotations

import datetime as _dt
import json
import pathlib

import numpy as np

from experiments.calibration import PLACEMENTS, fit_load, now, serving_entries

# the deployment and trace settings a run's sweeps and calibrations are taken under; a calibration
# also depends on its own rates and number of requests (its trace slice and seeds are fixed)
DEPLOYMENT = (
    "model",
    "conv_scale",
    "code_scale",
    "max_prompt",
    "max_output",
    "max_num_batched_tokens",
    "kv_cache_memory",
    "max_model_len",
)
CALIBRATION_SETUP = DEPLOYMENT + ("load_rates", "load_requests")
SAME_SETUP = DEPLOYMENT + ("num_requests", "slo")  # and the workload's rates


def first_send(path: pathlib.Path) -> float:
    """Unix time of the first request a load-generator JSON (one rate or a sweep) sent."""
    data = json.loads(path.read_text())
    runs = data["runs"] if "runs" in data else [data]
    return min(r["send_unix_ns"] for run in runs for r in run["requests"]) / 1e9


def utc(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.UTC).strftime("%Y-%m-%d %H:%M")


def find_runs(
    results_dir: pathlib.Path,
    wl: str,
    num_requests: int | None = None,
    rates: list[float] | None = None,
    as_of: float | None = None,
) -> tuple[list[dict], list[dict], dict]:
    """(measurements, calibrations, the setup's config) of every stored run: the setup is the newest
    run's config (the newest started before as_of, a unix time, when given), with num_requests and
    rates in place of its own when given."""
    outs = [
        p
        for p in [results_dir / "slo_validation.json", *results_dir.glob("*/slo_validation.json")]
        if p.is_file()
    ]
    if not outs:
        raise FileNotFoundError(f"no slo_validation.json in {results_dir} or its folders")
    started = {
        p: _dt.datetime.fromisoformat(json.loads(p.read_text())["date"]).timestamp() for p in outs
    }
    outs.sort(key=started.get)
    then = [p for p in outs if as_of is None or started[p] < as_of]
    if not then:
        raise FileNotFoundError(
            f"no slo_validation.json in {results_dir} or its folders started before {utc(as_of)}"
        )
    setup = json.loads(then[-1].read_text())["config"]
    if num_requests is not None:
        setup = {**setup, "num_requests": num_requests}
    if rates is not None:
        setup = {**setup, "rates": {**setup["rates"], wl: rates}}
    measurements, calibrations = [], []
    for out in outs:
        cfg = json.loads(out.read_text())["config"]
        # a run that does not record how it calibrated (load_rates, load_requests) pools with none
        calibrated = all(k in cfg and cfg[k] == setup.get(k) for k in CALIBRATION_SETUP)
        measured = (
            all(cfg.get(k) == setup.get(k) for k in SAME_SETUP)
            and cfg["rates"].get(wl) == setup["rates"][wl]
        )
        serving = out.parent / pathlib.Path(cfg["serving_profile"]).name
        for placement in PLACEMENTS:
            for path in (
                sorted(out.parent.glob(f"slo_validation_{placement}_{wl}*.json"))
                if measured
                else []
            ):
                suffix = path.stem[len(f"slo_validation_{placement}_{wl}") :]
                if suffix == "" or (suffix.startswith("_run") and suffix[4:].isdigit()):
                    t = first_send(path)
                    measurements.append(
                        {
                            "placement": placement,
                            "path": path,
                            "time": t,
                            "run": out.parent.name,
                            "label": f"{utc(t)[11:]} {out.parent.name}{suffix}",
                        }
                    )
            for path in (
                sorted(out.parent.glob(f"slo_validation_{placement}_load_steps*.json"))
                if calibrated
                else []
            ):
                suffix = path.stem[len(f"slo_validation_{placement}_load_steps") :]
                first_load = (
                    out.parent
                    / f"slo_validation_{placement}_load_{cfg['load_rates'][0]:g}{suffix}.json"
                )
                t = first_send(first_load) if first_load.is_file() else path.stat().st_mtime
                calibrations.append(
                    {
                        "placement": placement,
                        "path": path,
                        "time": t,
                        "serving": serving,
                        "run": out.parent.name,
                        "label": f"{utc(t)[11:]} {out.parent.name}{suffix}",
                    }
                )
    return measurements, calibrations, setup


def merge_serving(merged: dict, data: dict) -> None:
    """Adds one placement's pooled profile (its worker kinds, its interference factors) to
    `merged`, which starts empty and ends as one profile with every kind."""
    if not merged:
        merged.update(
            data,
            serving={
                "interference": {},
                "source": {"summary": data["serving"]["source"]["summary"], "calibrations": []},
            },
        )
    for key, value in data["serving"].items():
        if key == "interference":
            merged["serving"]["interference"].update(value)
        elif key == "source":
            merged["serving"]["source"]["calibrations"] += value["calibrations"]
        else:
            merged["serving"][key] = value


def pooled_profile(
    engine_path: pathlib.Path, calibrations: list[dict], window_s: float, interference: bool = True
):
    """The engine profile plus step models, step_speed and step_noise fitted per worker kind on
    the steps of all these in-load calibrations; each kind's first-token latency is the mean of
    the isolated calibrations' (their serving profiles). interference=False: no interference
    factors are fitted (the step models average over the calibrations' overlaps)."""
    from pdserve.tuning.perf_model import load_profile, profile_from_dict

    engine = load_profile(engine_path)
    workers, latency = {}, {}
    for k, c in enumerate(calibrations):
        for name, w in json.loads(c["path"].read_text())["workers"].items():
            workers[f"{k}:{name}"] = w
        if c["serving"].is_file():
            for kind, per_tp in json.loads(c["serving"].read_text())["serving"].items():
                value = (
                    per_tp.get("1", {}).get("first_token_latency_s")
                    if isinstance(per_tp, dict)
                    else None
                )
                if value is not None:
                    latency.setdefault(kind, []).append(value)
    fits = fit_load(engine, {"workers": workers}, window_s, interference)
    isolated = {
        kind: {"1": {"first_token_latency_s": float(np.mean(v))}} for kind, v in latency.items()
    }
    data = dict(engine.raw)
    data["serving"] = {
        **serving_entries(fits, isolated),
        "source": {
            "summary": "experiments/pooled.py: in-load calibrations pooled",
            "calibrations": [c["label"] for c in calibrations],
            "date": now(),
        },
    }
    return profile_from_dict(data, "pooled in-load profile"), data


def scaled(profile, factor: float):
    """The profile with every serving step model's coefficients times factor (a machine that much
    slower), for the sensitivity of attainment to step speed."""
    from pdserve.tuning.perf_model import profile_from_dict

    data = json.loads(json.dumps(profile.raw))
    for kind, per_tp in data["serving"].items():
        if kind in ("prefill", "decode", "colocated"):
            for entry in per_tp.values():
                for key in ("prefill", "decode"):
                    coef = entry[key]["coef"] if key in entry else getattr(profile.tp[1], key)
                    entry[key] = {"coef": [c * factor for c in coef]}
    return profile_from_dict(data, f"pooled profile x{factor:g}")
