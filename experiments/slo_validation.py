"""SLO validation (issue #4, "Must show" a, b, c): measured vs simulated joint SLO attainment on
this machine's 2 cores, the tuner's pick vs the measured best placement, and disaggregated vs
colocated. Setup, method and results: docs/experiments/slo-validation.md.

    python -m experiments.slo_validation --reprofile          # profile + measure + simulate + tune (~12 min
                                                        #   of machine time, plus waits for quiet)
    python -m experiments.slo_validation --simulate-only      # re-fit, re-simulate, re-tune the stored runs
    python -m experiments.slo_validation --remeasure --placements colocated [--workloads azure_code]

Per placement (1 prefill + 1 decode worker, or 2 colocated workers, one torch thread each), a run
waits for a quiet machine, brings the deployment up, calibrates it and sweeps each workload's
rates (experiments/slo_measure.py). It then simulates the very same requests under several
profiles (experiments/slo_simulate.py; `main` lists them), runs the tuner (experiments/slo_tune.py)
and reports (experiments/slo_report.py). Results land in experiments/results/, with the CPU that
processes outside the run used during every sweep.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import platform
import subprocess
import sys

from benchmarks.bench_common import TreeCpuMonitor, add_wait_idle_arg, script_parser
from experiments.calibration import (
    LOAD_RATES,
    LOAD_REQUESTS,
    PLACEMENTS,
    calibrate_child,
    now,
)
from experiments.slo_measure import log, measure, run_child, wait_quiet
from experiments.slo_report import report
from experiments.slo_simulate import (
    SIM_SEEDS,
    check_steps,
    load_profile_from_fits,
    oracle_per_rate,
    serving_profile,
    simulate_all,
)
from experiments.slo_tune import run_tuner, slice_csv
from pdserve.tuning import metrics
from pdserve.tuning.slo import latency_slos

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

RESULTS = REPO_ROOT / "experiments" / "results"


def main() -> int:
    """The command line (or, with --calibrate-router, the calibration's child process).

    Both placements get the same trace slice, seed and rates, so they see the same requests at the
    same times (prompt ids: seed + k for the k-th rate; the two workloads use different seeds, so
    no prompt of one is a prefix of the other's). The simulations of the measured requests are
    kept side by side in the result under "simulations"/<label>:
      original       the simulator before this validation (exact router view), engine profile
      engine         the current simulator (the colocated router's 0.5 s stale view), engine profile
      serving-steps  + the serving-path step models, without the interference factors
      serving        + the interference factors: the full serving profile
      in-load        the in-load profile, each point simulated with SIM_SEEDS seeds of step speed
                     and noise (mean attainment; percentiles over all their requests)
      sweep-steps    the oracle, not a prediction: each point on step models fitted from the steps
                     that ran during it (every kept run, also the earlier ones of --remeasure)
    Finally `pdserve tune --devices 2 --colocated` runs with the engine, serving and in-load
    profiles on the measured trace slice, and with the serving and in-load ones on the whole
    trace."""
    p = script_parser(__doc__)
    p.add_argument(
        "--profile",
        default=str(RESULTS / "profile_cpu_smollm2_1thread.json"),
        help="the engine profile (pdserve profile --threads-per-rank 1)",
    )
    p.add_argument(
        "--reprofile",
        action="store_true",
        help="first re-measure --profile with `pdserve profile --quick --threads-per-rank 1`",
    )
    p.add_argument(
        "--serving-profile",
        default=str(RESULTS / "profile_cpu_smollm2_1thread_serving.json"),
        help="where the engine profile + the calibrated serving-path models go",
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--placements", default=",".join(PLACEMENTS))
    p.add_argument("--workloads", default="azure_conv,azure_code")
    p.add_argument("--conv-scale", type=float, default=0.2)
    p.add_argument("--code-scale", type=float, default=0.1)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--conv-rates", default="1.5,3,4.5")
    p.add_argument("--code-rates", default="1.5,3,4.5")
    p.add_argument(
        "--slo", default="ttft=1.5s,tpot=100ms", help="the joint SLO (tuning/slo.py's grammar)"
    )
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--ray-temp-dir", default="/tmp/pdsv_ray")
    add_wait_idle_arg(p, "each deployment, load sweep and profile run", "a quiet CPU", 600.0)
    p.add_argument(
        "--simulate-only",
        action="store_true",
        help="re-simulate (and re-fit, re-tune) from the runs stored beside --out",
    )
    p.add_argument("--no-tune", action="store_true")
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="measure a sweep again when others disturbed it, at most this often (default 2)",
    )
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="measure --placements again into the results stored at --out (same config)",
    )
    p.add_argument("--out", default=str(RESULTS / "slo_validation.json"))
    p.add_argument("--calibrate-router", default=None, help=argparse.SUPPRESS)
    p.add_argument("--calibrate-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--calibrate-placement", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.calibrate_router:
        return calibrate_child(args.calibrate_router, args.calibrate_out, args.calibrate_placement)
    args.out = pathlib.Path(args.out).resolve()
    args.workloads_given = "--workloads" in sys.argv
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.scale = {"azure_conv": args.conv_scale, "azure_code": args.code_scale}
    args.rates = {
        "azure_conv": metrics.parse_positive_list(args.conv_rates, "--conv-rates"),
        "azure_code": metrics.parse_positive_list(args.code_rates, "--code-rates"),
    }
    args.slo_text = args.slo
    args.load_rates, args.load_requests = list(LOAD_RATES), LOAD_REQUESTS
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )

    if args.simulate_only or args.remeasure:
        # the stored run's settings, so that what is simulated or measured again is the same
        results = json.loads(args.out.read_text())
        cfg = results["config"]
        for k in (
            "conv_scale",
            "code_scale",
            "max_prompt",
            "max_output",
            "num_requests",
            "max_num_batched_tokens",
            "kv_cache_memory",
            "max_model_len",
            "model",
            "slo",
            "profile",
            "serving_profile",
        ):
            setattr(args, k, cfg[k])
        only = (
            [w for w in args.workloads if w in cfg["workloads"]] if args.workloads_given else None
        )
        args.workloads = cfg["workloads"]
        args.scale = {"azure_conv": cfg["conv_scale"], "azure_code": cfg["code_scale"]}
        args.rates = {k: v for k, v in cfg["rates"].items()}
        args.slo_text = cfg["slo"]
        if "load_rates" not in cfg or "load_requests" not in cfg:
            raise SystemExit(
                f"{args.out} does not record its in-load calibration's load_rates and "
                f"load_requests (an older run): run it again without --simulate-only/--remeasure"
            )
        args.load_rates, args.load_requests = cfg["load_rates"], cfg["load_requests"]
    if args.remeasure:
        # measure these placements (and workloads) again into the stored results; the earlier
        # files are kept with a _run<N> suffix and their measured entries under "earlier"
        for placement in [x for x in args.placements.split(",") if x]:
            old = results["measured"].get(placement)
            if old is None:
                continue
            k = len(results.setdefault("earlier", {}).setdefault(placement, [])) + 1
            pattern = (
                [f"slo_validation_{placement}_{w}" for w in only]
                if only
                else [f"slo_validation_{placement}_"]
            )
            for f in list(args.out.parent.glob(f"slo_validation_{placement}_*")):
                if (
                    "_run" not in f.stem
                    and "_disturbed" not in f.stem
                    and any(f.stem.startswith(p) for p in pattern)
                ):
                    f.rename(f.with_name(f"{f.stem}_run{k}{f.suffix}"))
            kept = {
                w: old[w] for w in (only or [w for w in ("azure_conv", "azure_code") if w in old])
            }
            results["earlier"][placement].append(
                {**({} if only else old), **kept, "files_suffix": f"_run{k}"}
            )
            if not only:
                results["measured"].pop(placement)
            results.setdefault("remeasured", []).append(
                {
                    "placement": placement,
                    "workloads": only,
                    "date": now(),
                    "command": " ".join(
                        ["python", "-m", "experiments.slo_validation", *sys.argv[1:]]
                    ),
                }
            )
            measure(args, placement, results, workloads=only, calibrate_it=not only)
            args.out.write_text(json.dumps(results, indent=1))
    elif not args.simulate_only:
        if not args.reprofile and not pathlib.Path(args.profile).is_file():
            # experiments/results/ is not in git (a fresh clone has no engine profile): measure it first
            print(
                f"no engine profile at {args.profile}: measuring it first (--reprofile)", flush=True
            )
            args.reprofile = True
        import torch

        results = {
            "schema": "pdserve-slo-validation/1",
            "date": now(),
            "command": " ".join(["python", "-m", "experiments.slo_validation", *sys.argv[1:]]),
            "machine": {
                "cpu_count": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "platform": platform.platform(),
            },
            "working_tree": subprocess.run(
                ["git", "status", "--short"], cwd=REPO_ROOT, capture_output=True, text=True
            ).stdout.splitlines(),
            "config": {
                k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
            },
            "slo_s": latency_slos(args.slo),
            "measured": {},
        }
        if args.reprofile:
            results["profile_wait"] = wait_quiet(args.wait_idle)
            mon = TreeCpuMonitor()
            cmd = [
                sys.executable,
                "-m",
                "pdserve",
                "profile",
                "--model",
                args.model,
                "--tp",
                "1",
                "--threads-per-rank",
                "1",
                "--quick",
                "--kv-cache-memory",
                str(args.kv_cache_memory),
                "--backends",
                "grpc",
                "--out",
                str(args.profile),
            ]
            rc, out = run_child(cmd, 600)
            results["profile_run"] = {
                "command": " ".join(["pdserve"] + cmd[3:]),
                "rc": rc,
                "cpu": mon.stop(),
            }
            if rc:
                return 1
        for placement in [x for x in args.placements.split(",") if x]:
            measure(args, placement, results)
            args.out.write_text(json.dumps(results, indent=1))
    results["slo_s"] = latency_slos(args.slo_text)
    profiles = {"engine": args.profile}
    serving = serving_profile(args, results)
    sims = dict(profiles)
    if serving is not None:
        from pdserve.tuning.perf_model import profile_from_dict

        profiles["serving"] = serving
        data = json.loads(serving.read_text())
        data["serving"].pop("interference", None)
        data["_label"] = f"{serving} without serving.interference"
        sims = {
            "engine": args.profile,
            "serving-steps": profile_from_dict(data),
            "serving": serving,
        }
    results["simulations"] = {}
    # the simulator as it was (an exact router view for colocated picks) on the engine profile
    simulate_all(args, results, "original", args.profile, router_stats_s=0.0)
    for label, path in sims.items():
        simulate_all(args, results, label, path)
    inload = load_profile_from_fits(args, serving)
    if inload is not None:
        profiles["in-load"] = inload
        simulate_all(args, results, "in-load", inload, seeds=SIM_SEEDS)
        results["step_model_check"] = check_steps(args, inload)
    oracle_per_rate(args, results, serving)
    if not args.no_tune:
        results["tuner"] = {}
        for wl in args.workloads:
            trace = str(slice_csv(args, wl))
            for label, path in profiles.items():
                t = run_tuner(args, wl, path, trace)
                results["tuner"][f"{wl}/{label}/slice"] = t
                log(f"tuner {wl} {label} slice:\n{t['stdout']}")
            for label in ("serving", "in-load"):
                if label in profiles:
                    t = run_tuner(args, wl, profiles[label], wl)
                    results["tuner"][f"{wl}/{label}/full"] = t
                    log(f"tuner {wl} {label} full trace:\n{t['stdout']}")
    report(args, results)
    args.out.write_text(json.dumps(results, indent=1))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
