"""The planner live on this machine against each static split, and the simulator's prediction of
the same runs (issue #27, must-shows c and d).

  python -m benchmarks.planner.live                     # 3 runs of 3 modes, ~45 min on 2 cores
  python -m benchmarks.planner.live --sim-only --k 0.2,0.3,0.4   # pick a rate: the simulator only
  python -m benchmarks.planner.live --runs 1 --phase-s 40        # a quick look
  python -m benchmarks.planner.live --modes planner --keep-runs old.json   # rerun one mode

Workload: a workload-shift trace (--trace, default the shipped shift_code_conv_reason: code
completion, then conversation, then short prompts with long answers), each phase retimed to
Poisson at --k times its own mean rate for --phase-s seconds, its lengths x--scale and capped
(prompts <= --max-prompt, outputs <= --max-output) for SmolLM2 on 2 cores, as the other live
benchmarks size azure_conv. The very same requests and prompt ids go to every run; the file is
written once (tuning/shift_trace.py's format) and replayed with its own arrival times by
`pdserve bench` in a process of its own.

Deployments: 3 workers of the embedded SmolLM2 (the README's example deployment, one core each,
grpc KV), brought up fresh for every run by deploy.launcher.up(), as `pdserve up` does. Modes:
static 1P+2D, static 2P+1D, and the planner (the YAML's `planner:` section, enabled with the
SLO below and --window-s/--cooldown-s; phases last minutes here, not the trace's 10) starting
from --planner-start. The modes take turns (1P2D, 2P1D, planner, 1P2D, ...) so a slow spell of
the machine hits each. Per run: SLO attainment over the trace and per phase, TTFT/TPOT p90, failed
requests, the flips the planner made (when, which way, its reason), attainment per 10 s of
arrivals, and every 2 s each worker's role, running sequences and KV blocks in use.

Prediction (d): the simulator of `pdserve tune` with the planner in the loop
(tuning/sim_planner.py, the same policy code) runs the same requests on each mode's starting
split with a profile of this machine (`pdserve profile --quick`, measured by this script before
the live runs unless --profile names one; stored in the result). The profile times one engine
alone on a core; here 3 workers, the router and the load generator share 2 cores, so every step
time is multiplied by --slowdown (default 1.5 = 3 workers / 2 cores), fixed before the runs. Writes
benchmarks/results/planner_live.json.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.bench_common import add_out_arg, log, run_header, script_parser, write_result

ALL_MODES = ("1P2D", "2P1D", "planner")
BULKY = ("planner_log", "timeline", "workers")  # a run's fields kept out of the progress log


def live_trace(args, path: str) -> tuple[list, list[tuple[str, float, float]]]:
    """Write the run's requests (the shift trace scaled in rate and length) to `path` as a
    shift trace; return them and their phases' (name, start_s, end_s)."""
    from pdserve.tuning.shift_goodput import laid_end_to_end, scaled_phases, trace_phases
    from pdserve.tuning.shift_trace import ShiftRow, phase_boundaries, write_shift_trace
    from pdserve.tuning.workload import load_trace

    reqs = load_trace(args.trace, scale=args.scale, max_prompt=args.max_prompt)
    outs = load_trace(args.trace, scale=args.output_scale, max_output=args.max_output)
    reqs = [dataclasses.replace(r, output_len=o.output_len) for r, o in zip(reqs, outs)]
    phases = scaled_phases(reqs, trace_phases(args.trace, reqs), args.k, phase_s=args.phase_s)
    spans = [args.phase_s] * len(phases)
    rows, offset = [], 0.0
    for (name, mine), span in zip(phases, spans):
        rows += [
            ShiftRow(round(r.arrival_s + offset, 6), r.prompt_len, r.output_len, name) for r in mine
        ]
        offset += span
    write_shift_trace(rows, path)
    return laid_end_to_end(phases, spans), phase_boundaries(path)


def phase_of(arrival_s: float, bounds) -> str:
    name = bounds[0][0]
    for n, start, _ in bounds:
        if arrival_s >= start - 1e-9:
            name = n
    return name


def attainment(rows, bounds, ttft_s: float, tpot_s: float) -> dict:
    """rows: (arrival_s, ttft_s or None, tpot_s or None, ok). A request meets the SLO when it
    ended without error within both bounds (one output token: TPOT is not defined, TTFT alone)."""

    def good(r) -> bool:
        _, ttft, tpot, ok = r
        return ok and ttft is not None and ttft <= ttft_s and (tpot is None or tpot <= tpot_s)

    per = {}
    for name, _, _ in bounds:
        mine = [r for r in rows if phase_of(r[0], bounds) == name]
        per[name] = round(sum(map(good, mine)) / len(mine), 4) if mine else None
    return {"attainment": round(sum(map(good, rows)) / len(rows), 4), "per_phase": per}


def p90(xs) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else None


def deploy_config(args, mode: str) -> dict:
    from benchmarks.chaos_harness import example_config

    start = args.planner_start if mode == "planner" else mode
    data = example_config(prefill=int(start[0]), decode=int(start[2]))
    if mode == "planner":
        data["planner"] = {"enabled": True, **planner_settings(args)}
    return data


def planner_settings(args) -> dict:
    """The planner's settings, the same live (the YAML) and in the prediction."""
    keys = ("ttft_s", "tpot_s", "interval_s", "window_s", "cooldown_s")
    return {k: getattr(args, k) for k in keys}


class PlannerLog(logging.Handler):
    """The planner's acting decisions (INFO lines of planner/live.py), timed."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.restart()

    def emit(self, record):
        self.lines.append((round(record.created - self.t0_wall, 1), record.getMessage()))

    def restart(self):
        self.t0_wall = time.time()
        self.lines = []


class Sampler:
    """Every `every_s`, the pools as the router sees them: per worker its role and state, the
    sequences it runs and the KV blocks it holds, and the requests waiting for decode KV. The
    run's `workers` timeline, to see where a phase's requests went (not used by the planner)."""

    def __init__(self, router, every_s: float = 2.0):
        self.router, self.every_s, self.rows = router, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)

    def _run(self):
        pool, legs = self.router.pool, self.router.servicer.legs
        while not self._stop.wait(self.every_s):
            workers = []
            for role, name, stats, _, state in sorted(pool.snapshot(), key=lambda x: x[1]):
                used = stats.num_total_blocks - stats.num_free_blocks if stats else None
                run = stats.num_running if stats else None
                workers.append(
                    f"{name[-4:]}:{role[0]}{'' if state == 'serving' else '*'}:{run}:{used}"
                )
            t = round(time.monotonic() - self.t0, 1)
            self.rows.append((t, legs.decode_queue.waiting(), " ".join(workers)))


def timeline(rows, ttft_s: float, tpot_s: float, bucket_s: float = 10.0) -> list:
    """Per `bucket_s` of arrivals: (start_s, requests, met the SLO, failed)."""
    out = {}
    for arrival, ttft, tpot, ok in rows:
        b = out.setdefault(int(arrival // bucket_s) * bucket_s, [0, 0, 0])
        b[0] += 1
        b[1] += ok and ttft is not None and ttft <= ttft_s and (tpot is None or tpot <= tpot_s)
        b[2] += not ok
    return [(k, *v) for k, v in sorted(out.items())]


def flips_done(router) -> int:
    reg, model = router.metrics_registry, router.servicer.options.model_id
    return int(
        sum(
            reg.get_sample_value(
                "pdserve:role_flips_total",
                {"model_name": model, "from_role": a, "to_role": b, "outcome": "done"},
            )
            or 0
            for a, b in (("prefill", "decode"), ("decode", "prefill"))
        )
    )


def bench(router_address: str, trace: str, n: int, args, out_path: str) -> dict:
    cmd = [sys.executable, "-m", "pdserve", "bench", "--router", router_address, "--trace", trace]
    cmd += ["--num-requests", str(n), "--seed", "27", "--out", out_path]
    cmd += ["--slo", f"ttft={args.ttft_s}s,tpot={args.tpot_s}s"]
    env = dict(os.environ, PDSERVE_NO_PROGRESS="1")
    subprocess.run(cmd, check=True, capture_output=True, timeout=3600, env=env)
    with open(out_path) as f:
        return json.load(f)


def run_once(args, mode: str, trace: str, n: int, bounds, tmp: str) -> dict:
    from benchmarks.chaos_harness import deployment

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    plan_log = PlannerLog()
    # the loop's decisions, and the router actuator's flips and bound changes
    loggers = [
        logging.getLogger(f"pdserve.{m}") for m in ("planner.live", "router.planner_actuator")
    ]
    for logger in loggers:
        logger.addHandler(plan_log)
    # --planner-debug: every decision with its signals, "nothing to do" included
    level = logging.DEBUG if args.planner_debug else logging.INFO
    for logger in loggers:
        logger.setLevel(level)
    plan_log.setLevel(level)
    try:
        with deployment(deploy_config(args, mode)) as (cluster, _):
            warm = os.path.join(tmp, "warm.csv")
            with open(trace) as f:  # the trace's first 10 requests, back to back
                head = [next(f) for _ in range(11)]
            with open(warm, "w") as f:
                f.writelines(
                    h if i == 0 else "0.0," + h.split(",", 1)[1] for i, h in enumerate(head)
                )
            bench(cluster.router_address, warm, 10, args, os.path.join(tmp, "warm.json"))
            plan_log.restart()
            t0 = time.monotonic()
            with Sampler(cluster.router) as sampler:
                run_json = os.path.join(tmp, "run.json")
                result = bench(cluster.router_address, trace, n, args, run_json)
            took = time.monotonic() - t0
            flips = flips_done(cluster.router)
    finally:
        for logger in loggers:
            logger.removeHandler(plan_log)
    recs = result["requests"]
    rows = [(r["arrival_s"], r["ttft_s"], r["tpot_s"], not r["error"]) for r in recs]
    row = {"mode": mode, "started": started, **attainment(rows, bounds, args.ttft_s, args.tpot_s)}
    row.update(
        requests=len(recs),
        failed=sum(1 for r in recs if r["error"]),
        errors=sorted({f"{r['error']}: {r['error_message'][:160]}" for r in recs if r["error"]}),
        ttft_p90_s=p90(r["ttft_s"] for r in recs),
        tpot_p90_s=p90(r["tpot_s"] for r in recs),
        flips=flips,
        planner_log=plan_log.lines,
        timeline=timeline(rows, args.ttft_s, args.tpot_s),
        workers=sampler.rows,
        took_s=round(took, 1),
    )
    return row


def measure_profile(path: str) -> dict:
    cmd = [sys.executable, "-m", "pdserve", "profile", "--model", "smollm2", "--tp", "1"]
    # the decode pool's KV memory in the README's example deployment (deploy/examples)
    cmd += ["--quick", "--backends", "grpc", "--kv-cache-memory", "536870912", "--out", path]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
    with open(path) as f:
        return json.load(f)


def simulate(args, profile_dict: dict, reqs, bounds) -> dict:
    """Each mode's predicted attainment on the same requests (the module docstring)."""
    from pdserve.planner.policy import PlannerConfig
    from pdserve.tuning.perf_model import profile_from_dict
    from pdserve.tuning.sim_planner import PlannerSimulator
    from pdserve.tuning.simulator import Placement, PoolSpec

    slowed = json.loads(json.dumps(profile_dict))
    for kind in ("prefill", "decode"):  # 3 workers share 2 cores: every step takes longer
        model = slowed["tp"]["1"][kind]
        model["coef"] = [c * args.slowdown for c in model["coef"]]
    profile = profile_from_dict(slowed)
    out = {}
    for mode in ALL_MODES:
        start = args.planner_start if mode == "planner" else mode
        placement = Placement(PoolSpec(int(start[0])), PoolSpec(int(start[2])), backend="grpc")
        config = PlannerConfig(**planner_settings(args)) if mode == "planner" else None
        res = PlannerSimulator(profile, placement, config).run(
            reqs, ttft_s=args.ttft_s, tpot_s=args.tpot_s
        )
        rows = [
            (q.arrival_s, r.ttft_s, r.tpot_s if q.output_len > 1 else None, True)
            for q, r in zip(reqs, res.requests)
        ]
        out[mode] = attainment(rows, bounds, args.ttft_s, args.tpot_s)
        out[mode]["flips"] = [(round(f.start_s, 1), f.to_role) for f in getattr(res, "flips", [])]
    return out


def keep_runs(args, setup: dict, reqs) -> list[dict]:
    """The runs of the modes not run now from an earlier result of this very setup (the same
    trace, rate, lengths, SLO and planner settings), each marked with the commit it ran."""
    with open(args.keep_runs) as f:
        old = json.load(f)
    same = ("trace", "k", "phase_s", "scale", "max_prompt", "output_scale", "max_output")
    same += ("ttft_s", "tpot_s", "interval_s", "window_s", "cooldown_s", "planner_start")
    differ = [k for k in same if old["setup"].get(k) != setup.get(k)]
    if differ or old["setup"]["requests"] != len(reqs):
        raise SystemExit(f"--keep-runs {args.keep_runs}: another setup ({differ or 'requests'})")
    now = set(args.modes.split(","))
    kept = [
        dict(r, commit=r.get("commit", old["commit"])) for r in old["runs"] if r["mode"] not in now
    ]
    log(f"kept {len(kept)} runs of {sorted({r['mode'] for r in kept})} from {args.keep_runs}")
    return kept


def spread(rows: list[dict], key) -> dict:
    xs = [key(r) for r in rows]
    xs = [x for x in xs if x is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {}


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--trace", default="shift_code_conv_reason")
    p.add_argument("--k", default="0.35", help="rate multiplier (comma list with --sim-only)")
    p.add_argument("--phase-s", type=float, default=90.0)
    p.add_argument("--scale", type=float, default=0.2)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-scale", type=float, default=1.0)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--ttft-s", type=float, default=1.5)
    p.add_argument("--tpot-s", type=float, default=0.1)
    p.add_argument("--interval-s", type=float, default=2.0)
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--cooldown-s", type=float, default=10.0)
    p.add_argument("--planner-start", choices=("1P2D", "2P1D"), default="1P2D")
    p.add_argument("--runs", type=int, default=3, help="runs per mode")
    p.add_argument(
        "--modes", default=",".join(ALL_MODES), help="a comma list of " + ", ".join(ALL_MODES)
    )
    p.add_argument(
        "--slowdown",
        type=float,
        default=1.5,
        help="the prediction's step times x this (default 1.5: 3 workers on 2 cores)",
    )
    p.add_argument("--profile", help="a `pdserve profile` JSON of this machine (default: measure)")
    p.add_argument("--sim-only", action="store_true", help="predict only; no live runs")
    p.add_argument(
        "--planner-debug", action="store_true", help="log every decision, not only the actions"
    )
    p.add_argument("--keep-runs", help="an earlier result: keep its runs of the modes not run now")
    add_out_arg(p, "planner_live.json")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    out = run_header("benchmarks.planner.live", argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:
            with open(args.profile) as f:
                profile = json.load(f)
        else:
            log("measuring this machine's profile (pdserve profile --quick)")
            profile = measure_profile(os.path.join(tmp, "profile.json"))
        ks = [float(k) for k in args.k.split(",")]
        if args.sim_only:
            for k in ks:
                reqs, bounds = live_trace(_with_k(args, k), os.path.join(tmp, "t.csv"))
                predicted = json.dumps(simulate(args, profile, reqs, bounds))
                log(f"k={k:g}: {len(reqs)} requests; predicted {predicted}")
            return 0
        args.k = ks[0]
        trace = os.path.join(tmp, "live_trace.csv")
        reqs, bounds = live_trace(args, trace)
        log(f"{len(reqs)} requests, phases {bounds}")
        out["setup"] = {
            k: v for k, v in vars(args).items() if k not in ("out", "sim_only", "profile")
        }
        out["setup"]["requests"] = len(reqs)
        out["setup"]["phases"] = bounds
        out["predicted"] = simulate(args, profile, reqs, bounds)
        log(f"predicted: {json.dumps(out['predicted'])}")
        runs = keep_runs(args, out["setup"], reqs) if args.keep_runs else []
        for i in range(args.runs):
            for mode in args.modes.split(","):
                row = {"run": i + 1, **run_once(args, mode, trace, len(reqs), bounds, tmp)}
                runs.append(row)
                log(json.dumps({k: v for k, v in row.items() if k not in BULKY}))
                out["runs"] = runs
                write_result(args.out, out)  # a partial result survives a crash
    out["runs"] = runs
    out["summary"] = {}
    for mode in sorted({r["mode"] for r in runs}, key=ALL_MODES.index):
        mine = [r for r in runs if r["mode"] == mode]
        out["summary"][mode] = {
            "attainment": spread(mine, lambda r: r["attainment"]),
            "per_phase": {
                name: spread(mine, lambda r, n=name: r["per_phase"][n]) for name, _, _ in bounds
            },
            "failed": sum(r["failed"] for r in mine),
            "flips": spread(mine, lambda r: r["flips"]),
            "predicted": out["predicted"][mode]["attainment"],
        }
    out["profile"] = profile
    out["took_s"] = round(time.perf_counter() - t0, 1)
    write_result(args.out, out)
    log(f"wrote {args.out}: {json.dumps(out['summary'])}")
    return 0


def _with_k(args, k: float):
    import argparse

    return argparse.Namespace(**{**vars(args), "k": k})


if __name__ == "__main__":
    sys.exit(main())
