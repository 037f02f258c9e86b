"""Issue #4 (a) on a machine whose speed drifts: one prediction from every in-load calibration of
the same setup, against every measurement of it (docs/experiments/slo-validation.md).

    python -m experiments.slo_pooled                          # every run under experiments/results
    python -m experiments.slo_pooled --since TIME             # only the runs taken after TIME (UTC)
    python -m experiments.slo_pooled --split TIME             # calibrations before TIME, measurements after
    python -m experiments.slo_pooled --write-profile pooled.json   # then: pdserve tune --profile pooled.json --seeds 10

One run of experiments/slo_validation.py predicts its sweeps from a calibration taken minutes
before, but this VM's step speed moves by 10-40% between minutes, so near the knee a snapshot
prediction can land tens of points away from a sweep. Here the step models, step-speed traces and
step noise are fitted on the calibrations of every stored run of the setup (experiments/pooled.py),
each point is simulated with --seeds seeds, and the mean and its 10-90th percentile band are
compared with every stored measurement. `main` says which runs count. Writes --out and a plot.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import pathlib
import sys

import numpy as np

from benchmarks.bench_common import script_parser
from experiments.calibration import PLACEMENTS, SPEED_WINDOW_S, now
from experiments.pooled import find_runs, merge_serving, pooled_profile, scaled
from experiments.slo_report import finish_attainment_axes, measured_rows
from experiments.slo_simulate import WORKLOAD_SEEDS, sim_placement
from pdserve.tuning import workload

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

RESULTS = REPO_ROOT / "experiments" / "results"
BAND = (10, 90)


def predict(profile, cfg: dict, placement: str, wl: str, seeds: int) -> list[dict]:
    """Per rate: the mean attainment over `seeds` simulations and its BAND percentiles."""
    from pdserve.tuning.simulator import Simulator

    args = argparse.Namespace(max_num_batched_tokens=cfg["max_num_batched_tokens"])
    slo = _slo(cfg)
    reqs = workload.load_trace(
        wl,
        scale=cfg["scale"][wl],
        max_prompt=cfg["max_prompt"],
        max_output=cfg["max_output"],
        max_requests=cfg["num_requests"],
    )
    sims = [
        Simulator(profile, sim_placement(args, profile, placement), seed=k) for k in range(seeds)
    ]
    rows = []
    for rate in cfg["rates"][wl]:
        timed = workload.retime(reqs, rate, 1.0, WORKLOAD_SEEDS[wl])
        att = [s.run(timed).attainment(slo["ttft"], slo["tpot"]) for s in sims]
        rows.append(
            {
                "rate": rate,
                "mean": float(np.mean(att)),
                "band": [float(np.percentile(att, q)) for q in BAND],
            }
        )
    return rows


def _slo(cfg: dict) -> dict:
    from pdserve.tuning.slo import latency_slos

    return latency_slos(cfg["slo"])


def compare(pred: list[dict], measurements: list[dict], cfg: dict, wl: str) -> list[dict]:
    """Per rate: every measurement's attainment, their mean, the prediction, and which runs fell
    in the band."""
    runs = [
        (m["label"], measured_rows(None, m["placement"], wl, _slo(cfg), m["path"]))
        for m in measurements
    ]
    out = []
    for k, p in enumerate(pred):
        meas = [
            (label, rows[k]["attainment"]) for label, rows in runs if rows[k]["rate"] == p["rate"]
        ]
        values = [v for _, v in meas]
        mean = float(np.mean(values)) if values else None
        out.append(
            {
                **p,
                "measured": meas,
                "measured_mean": mean,
                "diff_pp": None if mean is None else 100 * (p["mean"] - mean),
                "in_band": sum(p["band"][0] <= v <= p["band"][1] for v in values),
            }
        )
    return out


def plot(rows: dict, path: pathlib.Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), tight_layout=True)
    for i, placement in enumerate(PLACEMENTS):
        ax = fig.add_subplot(1, 2, i + 1)
        per = rows.get(placement)
        if not per:
            continue
        rates = [r["rate"] for r in per]
        for r in per:
            ax.plot(
                [r["rate"]] * len(r["measured"]),
                [100 * v for _, v in r["measured"]],
                "o",
                mfc="none",
                color="gray",
            )
        if per[0]["measured"]:
            ax.plot(
                rates,
                [100 * r["measured_mean"] for r in per],
                "o-",
                color="black",
                lw=2,
                label=f"measured: mean of {len(per[0]['measured'])} runs (circles: each run)",
            )
        ax.plot(
            rates, [100 * r["mean"] for r in per], "x-", color="tab:red", label="predicted: mean"
        )
        ax.fill_between(
            rates,
            [100 * r["band"][0] for r in per],
            [100 * r["band"][1] for r in per],
            color="tab:red",
            alpha=0.15,
            label=f"predicted: p{BAND[0]}-p{BAND[1]} of one run",
        )
        finish_attainment_axes(ax, f"{placement}: {title}")
    fig.savefig(path, dpi=100)


def print_table(rows: list[dict]) -> None:
    print(
        "| rate | measured, each run (%) | measured mean | predicted mean "
        f"[p{BAND[0]}-p{BAND[1]}] | pred - mean (pp) | runs in band | pp per 5% slower steps |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mean = "-" if r["measured_mean"] is None else f"{100 * r['measured_mean']:.1f}"
        diff = "-" if r["diff_pp"] is None else f"{r['diff_pp']:+.1f}"
        print(
            f"| {r['rate']:g} | {' / '.join(f'{100 * v:.1f}' for _, v in r['measured']) or '-'} | "
            f"{mean} | {100 * r['mean']:.1f} [{100 * r['band'][0]:.0f}-"
            f"{100 * r['band'][1]:.0f}] | {diff} | {r['in_band']} of {len(r['measured'])} | "
            f"{r['pp_per_5pct_slower']:+.1f} |"
        )


def utc_time(p: argparse.ArgumentParser, text: str | None, flag: str) -> float | None:
    if text is None:
        return None
    try:
        return _dt.datetime.fromisoformat(text).replace(tzinfo=_dt.UTC).timestamp()
    except ValueError:
        p.error(f"{flag}: expected a UTC time like YYYY-MM-DDTHH:MM, got {text!r}")


def main() -> int:
    """The command line. Runs are found as experiments/results/slo_validation.json and
    experiments/results/*/slo_validation.json (experiments/results/ is not kept in git; the runs of
    2026-11-23 are in its history: git checkout 88ca975 -- bench/results).

    A run's measurements count when its settings (model, scale, lengths, requests, rates, SLO,
    chunk, KV memory) equal the setup's: the newest run's, or the newest run's with --num-requests
    and --rates in place of its own; with --until or --split, the newest run started before that
    time. Its calibrations count when the settings they depend on are equal: all of those but the
    number of requests, the rates and the SLO, plus the in-load calibration's own rates and number
    of requests. With no measurement of the setup yet, the prediction alone is written: one to
    commit before the runs that will judge it. --split TIME uses only calibrations taken before
    TIME and compares only measurements taken after it (out of sample); --since TIME keeps only
    the runs taken after TIME. Each run is also predicted from the other runs' calibrations alone
    (leave one run out), and each point's sensitivity is given: how many points of attainment 5%
    slower steps cost."""
    p = script_parser(__doc__)
    p.add_argument("--results", default=str(RESULTS), help="where the runs are stored")
    p.add_argument(
        "--profile",
        default=str(RESULTS / "profile_cpu_smollm2_1thread.json"),
        help="the engine profile (for the KV transfer and capacity figures)",
    )
    p.add_argument("--workload", default="azure_conv")
    p.add_argument("--seeds", type=int, default=40)
    p.add_argument(
        "--window",
        type=float,
        default=SPEED_WINDOW_S,
        help="seconds per step_speed window; 0: independent step noise only",
    )
    p.add_argument(
        "--no-interference",
        action="store_true",
        help="fit no interference factors (for comparison)",
    )
    p.add_argument("--since", help="UTC time (YYYY-MM-DDTHH:MM): only runs taken after it")
    p.add_argument("--until", help="UTC time: only runs taken before it")
    p.add_argument("--split", help="UTC time: calibrations before it, measurements after it")
    p.add_argument(
        "--num-requests",
        type=int,
        help="the setup's number of requests per rate (default: the newest run's)",
    )
    p.add_argument("--rates", help="the setup's rates, e.g. 1,1.5,2 (default: the newest run's)")
    p.add_argument("--out", help="default: <results>/slo_pooled.json")
    p.add_argument(
        "--write-profile",
        help="also write the pooled profile of every placement's calibrations (all worker "
        "kinds together) here, for `pdserve tune --profile`",
    )
    args = p.parse_args()
    results_dir = pathlib.Path(args.results)
    from pdserve.tuning.metrics import parse_positive_list

    try:
        rates = parse_positive_list(args.rates, "--rates") if args.rates else None
    except ValueError as e:
        p.error(str(e))
    since, split = utc_time(p, args.since, "--since"), utc_time(p, args.split, "--split")
    until = utc_time(p, args.until, "--until")
    # the setup as it stood at the latest time the runs are taken up to (--until, or --split for
    # the calibrations): later runs may calibrate another way
    as_of = min((t for t in (until, split) if t is not None), default=None)
    try:
        measurements, calibrations, cfg = find_runs(
            results_dir, args.workload, args.num_requests, rates, as_of
        )
    except FileNotFoundError as e:
        p.error(str(e))
    if since is not None:
        calibrations = [c for c in calibrations if c["time"] > since]
        measurements = [m for m in measurements if m["time"] > since]
    if until is not None:
        calibrations = [c for c in calibrations if c["time"] < until]
        measurements = [m for m in measurements if m["time"] < until]
    if split is not None:
        calibrations = [c for c in calibrations if c["time"] < split]
        measurements = [m for m in measurements if m["time"] > split]
    if not calibrations:
        p.error(f"found no calibration to use under {results_dir}")
    if not measurements:
        print(
            f"no measurement of this setup ({cfg['num_requests']} requests per rate at "
            f"{', '.join(f'{r:g}' for r in cfg['rates'][args.workload])} req/s): the prediction alone"
        )
    out = pathlib.Path(args.out or results_dir / "slo_pooled.json")
    report = {
        "date": now(),
        "command": " ".join(["python", "-m", "experiments.slo_pooled", *sys.argv[1:]]),
        "workload": args.workload,
        "num_requests": cfg["num_requests"],
        "rates": cfg["rates"][args.workload],
        "since": args.since,
        "until": args.until,
        "split": args.split,
        "window_s": args.window,
        "seeds": args.seeds,
        "interference": not args.no_interference,
        "band_percentiles": BAND,
        "slo_s": _slo(cfg),
        "placements": {},
    }
    engine = pathlib.Path(args.profile)
    merged: dict = {}
    for placement in PLACEMENTS:
        cals = [c for c in calibrations if c["placement"] == placement]
        meas = [m for m in measurements if m["placement"] == placement]
        if not cals or (measurements and not meas):
            continue
        profile, data = pooled_profile(engine, cals, args.window or None, not args.no_interference)
        merge_serving(merged, data)
        rows = compare(
            predict(profile, cfg, placement, args.workload, args.seeds), meas, cfg, args.workload
        )
        # how far 5% slower steps move each point (the same seeds)
        slower = predict(scaled(profile, 1.05), cfg, placement, args.workload, args.seeds)
        for r, s in zip(rows, slower):
            r["pp_per_5pct_slower"] = 100 * (s["mean"] - r["mean"])
        # leave one run out: each run predicted from the calibrations of the other runs only
        loo = []
        for run in sorted({m["run"] for m in meas}):
            others = [c for c in cals if c["run"] != run]
            if not others:
                continue
            prof, _ = pooled_profile(engine, others, args.window or None, not args.no_interference)
            mine = [m for m in meas if m["run"] == run]
            for row in compare(
                predict(prof, cfg, placement, args.workload, args.seeds), mine, cfg, args.workload
            ):
                for label, value in row["measured"]:
                    loo.append(
                        {
                            "run": label,
                            "rate": row["rate"],
                            "measured": value,
                            "predicted": row["mean"],
                            "band": row["band"],
                            "diff_pp": 100 * (row["mean"] - value),
                        }
                    )
        report["placements"][placement] = {
            "calibrations": [c["label"] for c in cals],
            "measurements": [m["label"] for m in meas],
            "rows": rows,
            "leave_one_run_out": loo,
            "step_models": {k: v for k, v in data["serving"].items() if k != "source"},
        }
        print(
            f"\n{placement}: {len(cals)} calibrations ({', '.join(c['label'] for c in cals)}); "
            f"{len(meas)} measurements"
        )
        print_table(rows)
        if loo:
            print(
                f"\nleave one run out ({placement}): each run predicted from the other runs' calibrations"
            )
            print(
                "| run | rate | measured | predicted [band] | pred - meas (pp) |\n|---|---|---|---|---|"
            )
            for r in loo:
                print(
                    f"| {r['run']} | {r['rate']:g} | {100 * r['measured']:.1f} | {100 * r['predicted']:.1f} "
                    f"[{100 * r['band'][0]:.0f}-{100 * r['band'][1]:.0f}] | {r['diff_pp']:+.1f} |"
                )
    rows = {pl: v["rows"] for pl, v in report["placements"].items()}
    png = out.with_suffix(".png")
    plot(
        rows,
        png,
        f"{args.workload}, pooled prediction"
        + (f", since {args.since}" if args.since else "")
        + (f", until {args.until}" if args.until else "")
        + (f", split {args.split}" if args.split else ""),
    )
    report["plot"] = png.name
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out} and {png.name}")
    if args.write_profile:
        pathlib.Path(args.write_profile).write_text(json.dumps(merged, indent=1, default=str))
        print(f"wrote {args.write_profile} (pooled profile of {', '.join(report['placements'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
