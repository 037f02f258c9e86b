"""The simulation side of experiments/slo_validation.py: the profiles fitted from a run's calibrations
(serving_profile: isolated requests; load_profile_from_fits: the in-load steps), the simulations of
the measured sweeps' very requests (simulate_all, one profile for every point; oracle_per_rate,
each point on the steps it ran) and the step check. Everything here reads the files a run left
beside --out and runs no deployment."""

from __future__ import annotations

import json
import math
import pathlib
import time

import numpy as np

from experiments.calibration import (  # noqa: F401
    PLACEMENTS,
    SPEED_WINDOW_S,
    fit_load,
    fit_serving,
    now,
    serving_entries,
    step_model_check,
)
from pdserve.tuning import workload
from pdserve.tuning.perf_model import Profile

WORKLOAD_SEEDS = {"azure_conv": 0, "azure_code": 100}  # prompt seeds seed+k never overlap
SIM_SEEDS = 20  # simulations with step noise per point (the in-load profile)


# ---- profiles fitted from a run's calibrations -------------------------------------------------
def load_profile_from_fits(args, serving_path) -> pathlib.Path | None:
    """The engine profile plus the step models fitted from the placements' in-load calibration
    steps (and their step noise), written beside --serving-profile as *_inload.json."""
    from pdserve.tuning.perf_model import load_profile

    engine = load_profile(args.profile)
    isolated = json.loads(pathlib.Path(serving_path).read_text())["serving"] if serving_path else {}
    serving, fits = {}, {}
    for placement in PLACEMENTS:
        path = args.out.with_name(f"slo_validation_{placement}_load_steps.json")
        if not path.is_file():
            continue
        placement_fits = fit_load(engine, json.loads(path.read_text()), SPEED_WINDOW_S)
        fits.update(placement_fits)
        entries = serving_entries(placement_fits, isolated)
        interference = {**serving.get("interference", {}), **entries.pop("interference", {})}
        serving.update(entries)
        if interference:
            serving["interference"] = interference
    if not serving:
        return None
    return write_profile(
        args,
        serving,
        fits,
        pathlib.Path(args.serving_profile).with_name(
            pathlib.Path(args.serving_profile).stem.replace("_serving", "_inload") + ".json"
        ),
        "step models fitted by experiments/slo_validation.py from the engine steps of loaded deployments "
        "(open-loop conv traffic), with their speed over time (step_speed) and step noise; first-token "
        "latency from the isolated calibration",
    )


def write_profile(args, serving: dict, fits: dict, out: pathlib.Path, summary: str) -> pathlib.Path:
    """The engine profile (--profile) with these "serving" entries, checked and written to out."""
    from pdserve.tuning.perf_model import profile_from_dict

    data = json.loads(pathlib.Path(args.profile).read_text())
    data["serving"] = {
        **serving,
        "source": {
            "summary": summary,
            "engine_profile": str(args.profile),
            "date": now(),
            "fits": fits,
        },
    }
    profile_from_dict(data, str(out))
    out.write_text(json.dumps(data, indent=1) + "\n")
    return out


def check_steps(args, profile_path) -> dict:
    """The in-load step models against the steps each measured sweep ran (experiments/calibration.
    step_model_check): measured / modelled step time per worker kind."""
    from pdserve.tuning.perf_model import load_profile

    profile = load_profile(profile_path)
    out = {}
    for placement in PLACEMENTS:
        for wl in args.workloads:
            path = args.out.with_name(f"slo_validation_{placement}_{wl}_steps.json")
            if path.is_file():
                out.setdefault(placement, {})[wl] = step_model_check(
                    profile, json.loads(path.read_text())
                )
    return out


def serving_profile(args, results: dict) -> pathlib.Path | None:
    """The engine profile plus the serving-path models fitted from each placement's calibration."""
    from pdserve.tuning.perf_model import load_profile

    engine = load_profile(args.profile)
    serving: dict = {}
    fits = {}
    for placement in PLACEMENTS:
        path = args.out.with_name(f"slo_validation_{placement}_calibration.json")
        if not path.is_file():
            continue
        fit = fit_serving(engine, placement, json.loads(path.read_text()))
        fits[placement] = {k: v for k, v in fit.items() if k != "kinds"}
        for kind, entry in fit["kinds"].items():
            serving[kind] = {"1": entry}
        factors = {
            k: fit["interference"][k]
            for k in ("decode_while_prefill", "prefill_while_decode")
            if k in fit["interference"]
        }
        if factors:
            serving["interference"] = factors
    if not serving:
        return None
    out = write_profile(
        args,
        serving,
        fits,
        pathlib.Path(args.serving_profile),
        "serving-path step models fitted by experiments/slo_validation.py from requests "
        "through a running deployment (isolated prompts; concurrent decode batches), "
        "engine attention coefficients kept",
    )
    results["serving_fits"] = fits
    return out


# ---- simulation ---------------------------------------------------------------------------------
def requests_for(args, wl: str) -> list[workload.RequestSpec]:
    return workload.load_trace(
        wl,
        scale=args.scale[wl],
        max_prompt=args.max_prompt,
        max_output=args.max_output,
        max_requests=args.num_requests,
    )


def sim_placement(args, profile, placement: str):
    from pdserve.tuning.simulator import Placement, PoolSpec

    cap = profile.tp[1].kv_capacity_tokens
    pool = lambda n: PoolSpec(n, 1, args.max_num_batched_tokens, 128, cap)  # noqa: E731
    if placement == "disaggregated":
        return Placement(pool(1), pool(1), "grpc")
    return Placement(None, pool(2))


def pct(values: list[float], q: float) -> float | None:
    """Percentile (numpy's linear); an unfinished or failed request (inf) ranks above every other."""
    if not values:
        return None
    ranked = sorted(values)
    pos = q / 100 * (len(ranked) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    if math.isinf(ranked[hi]):  # the percentile reaches an unfinished request
        return math.inf
    return ranked[lo] + (ranked[hi] - ranked[lo]) * (pos - lo)


def stats(ttft: list[float], tpot: list[float]) -> dict:
    out = {}
    for name, vals in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90, 99):
            v = pct(vals, q)
            out[f"p{q}_{name}_ms"] = None if v is None else v * 1e3
    return out


def simulate_all(
    args,
    results: dict,
    label: str,
    profile_path,
    router_stats_s: float | None = None,
    seeds: int = 0,
) -> None:
    """Simulates every placement, workload and rate; with seeds, each point that many times with
    step noise (seeds 0..seeds-1): its attainment is their mean (and min/max), its percentiles are
    those of all the runs' requests together."""
    from pdserve.tuning.perf_model import load_profile
    from pdserve.tuning.simulator import Simulator

    profile = profile_path if isinstance(profile_path, Profile) else load_profile(profile_path)
    if isinstance(profile_path, Profile):
        profile_path = profile_path.raw.get("_label", "in-memory profile")
    slo = results["slo_s"]
    block = {
        "profile": str(profile_path),
        "date": now(),
        "runs": {},
        "seeds": seeds,
        "router_stats_s": "simulator default" if router_stats_s is None else router_stats_s,
    }
    for placement in PLACEMENTS:
        kw = {} if router_stats_s is None else {"router_stats_s": router_stats_s}
        sims = [
            Simulator(profile, sim_placement(args, profile, placement), seed=k, **kw)
            for k in (range(seeds) if seeds else [None])
        ]
        for wl in args.workloads:
            reqs = requests_for(args, wl)
            rows = []
            for rate in args.rates[wl]:
                rows.append(
                    sim_row(sims, workload.retime(reqs, rate, 1.0, WORKLOAD_SEEDS[wl]), rate, slo)
                )
            block["runs"].setdefault(placement, {})[wl] = rows
    results.setdefault("simulations", {})[label] = block


def sim_row(sims, timed: list[workload.RequestSpec], rate: float, slo: dict) -> dict:
    """One simulated point: the requests run through each simulator (one per seed)."""
    t0 = time.perf_counter()
    results_k = [sim.run(timed) for sim in sims]
    atts = [res.attainment(slo["ttft"], slo["tpot"]) for res in results_k]
    done = [r for res in results_k for r in res.requests]
    ttft = [r.ttft_s for r in done]
    tpot = [r.tpot_s for res in results_k for r, q in zip(res.requests, timed) if q.output_len >= 2]
    return {
        "rate": rate,
        "attainment": float(np.mean(atts)),
        "attainment_min_max": [min(atts), max(atts)],
        **stats(ttft, tpot),
        "ttft_ok": float(np.mean([t <= slo["ttft"] for t in ttft])),
        "tpot_ok": float(np.mean([r.tpot_s <= slo["tpot"] for r in done])),
        "num_preemptions": sum(res.num_preemptions for res in results_k),
        "seconds": time.perf_counter() - t0,
    }


def oracle_per_rate(args, results: dict, serving_path) -> None:
    """Not a prediction: every measured point simulated on step models fitted from the steps the
    workers ran during that very run (from its first request's send to its last token). It takes
    the machine's speed at the time out of the comparison and leaves the simulator's own error
    (queues, batching, routing, transfer)."""
    from pdserve.tuning.perf_model import load_profile, profile_from_dict
    from pdserve.tuning.simulator import Simulator

    engine = load_profile(args.profile)
    isolated = json.loads(pathlib.Path(serving_path).read_text())["serving"] if serving_path else {}
    slo = results["slo_s"]
    runs: dict = {}
    earlier = []
    suffixes = [""] + sorted(
        {e["files_suffix"] for per in results.get("earlier", {}).values() for e in per}
    )
    for placement, wl, suffix in [
        (p, w, x) for p in PLACEMENTS for w in args.workloads for x in suffixes
    ]:
        steps_path = args.out.with_name(f"slo_validation_{placement}_{wl}_steps{suffix}.json")
        bench_path = args.out.with_name(f"slo_validation_{placement}_{wl}{suffix}.json")
        if not (steps_path.is_file() and bench_path.is_file()):
            continue
        raw, bench = json.loads(steps_path.read_text()), json.loads(bench_path.read_text())
        # steps carry time.monotonic(), requests unix times; both clocks of this machine
        offset = raw.get("unix_minus_monotonic", time.time() - time.monotonic())
        reqs, rows = requests_for(args, wl), []
        for run in bench["runs"]:
            sent = [r["send_unix_ns"] / 1e9 - offset for r in run["requests"]]
            begin = min(sent)
            end = max(t + (r["e2e_s"] or 0.0) for t, r in zip(sent, run["requests"]))
            part = {
                "workers": {
                    name: {
                        "kind": w["kind"],
                        "steps": [s for s in w["steps"] if begin <= s["start"] <= end],
                    }
                    for name, w in raw["workers"].items()
                }
            }
            data = dict(engine.raw)
            data["serving"] = serving_entries(fit_load(engine, part, SPEED_WINDOW_S), isolated)
            profile = profile_from_dict(data, f"{placement} {wl} {run['rate']:g} req/s steps")
            sims = [
                Simulator(profile, sim_placement(args, profile, placement), seed=k)
                for k in range(SIM_SEEDS)
            ]
            rows.append(
                sim_row(
                    sims,
                    workload.retime(reqs, run["rate"], 1.0, WORKLOAD_SEEDS[wl]),
                    run["rate"],
                    slo,
                )
            )
        if suffix:
            earlier.append({"placement": placement, "workload": wl, "suffix": suffix, "rows": rows})
        else:
            runs.setdefault(placement, {})[wl] = rows
    results["oracle_earlier"] = earlier
    if runs:
        results["simulations"]["sweep-steps (oracle)"] = {
            "profile": "per measured point: step models fitted from its own steps",
            "date": now(),
            "seeds": SIM_SEEDS,
            "runs": runs,
        }
