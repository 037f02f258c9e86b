"""SLO validation (issue #4, "Must show" a, b, c): measured vs simulated joint SLO attainment on this
machine's 2 cores, the tuner's pick vs the measured best placement, and disaggregated vs colocated.

    python bench/slo_validation.py --reprofile          # profile + measure + simulate + tune (~12 min
                                                        #   of machine time, plus waits for quiet)
    python bench/slo_validation.py --simulate-only      # re-fit, re-simulate, re-tune the stored runs
    python bench/slo_validation.py --remeasure --placements colocated [--workloads azure_code]
                                                        # measure again; earlier files kept as _run<N>

Placements of the 2 cores (each launched by deploy.launcher.up(validate_config({...}), block=False)
on a local Ray with num_cpus 2, model smollm2, every worker num_cpus 1 and ONE torch thread):
  disaggregated  1 prefill + 1 decode worker, grpc KV transfer
  colocated      2 workers that prefill and decode (chunked prefill in continuous batching)
Same pool settings for both: kv_cache_memory, max_model_len, max_num_batched_tokens (the chunk);
the router's max_inflight is raised so that no request is refused.

Per placement: wait for a quiet machine -> up() -> a warm-up run (its own prompt seed) -> the
serving-path calibration and the in-load calibration (below) -> per workload one
`pdserve bench --sweep-rates` in a subprocess
(the load generator runs in its own process, so it does not share the router's GIL in this driver
process) -> stop(). The sweep writes its JSON (every request) and its PNGs (attainment vs rate,
TTFT and TPOT CDFs) under bench/results/. The same trace slice, seed and rates for both placements,
so both get the same requests at the same times (prompt token ids: seed + k for the k-th rate; the
two workloads use different seeds so no prompt of one is a prefix of the other's). A sweep during
which processes outside this run used more than DISTURBED_CORES is set aside and measured again.

Calibration (a child process, like the load generator): isolated prompts of 32..512 tokens one at
a time (TTFT through the whole path), batches of 1, 4 and 16 requests sent together (the step time
while all of a worker's requests decode), and, disaggregated, a decode batch with prompts prefilled
beside it (how much each side slows while the other computes). Fitted into "serving-path" step
models for the profile (deploy/tuning/perf_model.py), written as --serving-profile.

In-load calibration: open-loop conv traffic from a later part of the trace than the measured
slice (LOAD_TRACE_START_S on, own seeds) at LOAD_RATES (2 req/s, 150 requests), while every worker's
engine records its steps (engine.step_trace: start, end and shape of each step). Fitted per worker
kind (deploy/tuning/calibration.fit_load) on the time each step held the engine loop, so the steps carry
what really slows them in a loaded deployment (the other worker on the same host, gRPC threads,
KV pushes and receives, token streaming), with an interference factor per kind (how much slower
its steps run when another worker is in a step as they start); the residuals become the profile's
step_speed (their mean per worker and 0.5 s window, in time order: the machine's slow and fast
spells) and step_noise (what is left within a window). Written beside --serving-profile as *_inload.json. Every measured sweep's steps are kept too
(*_<workload>_steps.json), only to check the models against them ("step_model_check").

Simulations of the very same RequestSpecs, kept side by side under "simulations"/<label>:
  original       the simulator before this validation (exact router view) on the engine profile
  engine         the current simulator (the colocated router's 0.5 s stale view) on the engine profile
  serving-steps  + the serving-path step models, without the interference factors
  serving        + the interference factors: the full serving profile
  in-load        the in-load profile, each point simulated with SIM_SEEDS seeds of step speed and noise
                 (mean attainment; percentiles over all their requests)
  sweep-steps (oracle)  not a prediction: each point on step models fitted from the steps that
                 ran during it (every kept run, also the earlier ones of --remeasure)
bench/slo_pooled.py predicts from every stored calibration of the same setup at once and compares
with every stored measurement.
Finally `pdserve tune --devices 2 --colocated` with the engine, serving and in-load profiles on
the measured trace slice (and the serving and in-load profiles on the whole trace).

CPU used by processes outside this script's process tree (Ray and its workers are inside it) is
recorded for every measured sweep, with a per-component breakdown: another engineer may be
benchmarking on the same machine.

The code: this file runs the deployments, the calibrations, the sweeps and the tuner;
deploy/tuning/calibration.py holds the calibration requests and fits, bench/slo_simulate.py the
profiles and simulations, bench/slo_report.py the tables, plots and printed summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.bench_common import (  # noqa: E402
    CpuBreakdown,
    TreeCpuMonitor,
    add_wait_idle_arg,
    script_parser,
)
from bench.slo_report import report  # noqa: E402
from bench.slo_simulate import (  # noqa: E402
    SIM_SEEDS,
    WORKLOAD_SEEDS,
    check_steps,
    load_profile_from_fits,
    oracle_per_rate,
    serving_profile,
    simulate_all,
)
from deploy.tuning import metrics, workload  # noqa: E402
from deploy.tuning.calibration import (  # noqa: E402
    LOAD_RATES,
    LOAD_REQUESTS,
    LOAD_SEED,
    LOAD_TRACE,
    LOAD_TRACE_START_S,
    PLACEMENTS,
    calibrate_child,
    now,
)

RESULTS = REPO_ROOT / "bench" / "results"
WARMUP_SEED = 1000
QUIET_CORES = 0.1  # other processes' CPU (cores, 3 s average) below which the machine is quiet
DISTURBED_CORES = 0.15  # a sweep during which others used more (average cores) is measured again


def log(msg: str) -> None:
    print(f"[slo_validation {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- CPU used by others -------------------------------------------------------------------------
def worker_pids(cluster) -> dict[int, str]:
    """pid -> "prefill worker" / "decode worker" / "colocated worker 0" ... of a running cluster."""
    import ray

    out = {}
    for r in cluster.replicas:
        try:
            pid = ray.get(r.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        except Exception as e:  # noqa: BLE001 - the breakdown is informative only
            log(f"no pid for {r.name}: {e}")
            continue
        out[pid] = f"{r.key} worker" + (f" {r.index}" if r.key == "colocated" else "")
    return out


def other_python_cpu() -> list[str]:
    """`top -bn1` lines of python processes outside this tree that use CPU right now."""
    mine = set()
    todo = [os.getpid()]
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(
                        int(name)
                    )
            except OSError:
                pass
    while todo:
        pid = todo.pop()
        mine.add(pid)
        todo += kids.get(pid, [])
    out = subprocess.run(["top", "-bn1"], capture_output=True, text=True).stdout.splitlines()
    busy = []
    for line in out[7:]:
        f = line.split()
        if (
            len(f) >= 12
            and f[0].isdigit()
            and int(f[0]) not in mine
            and "python" in f[11]
            and float(f[8].replace(",", ".")) > 5.0
        ):
            busy.append(line.strip())
    return busy


def wait_quiet(max_wait_s: float, poll_s: float = 20.0) -> dict:
    """Until no python process outside this tree uses CPU and others use < QUIET_CORES over 3 s,
    polling every poll_s, at most max_wait_s; returns what was waited and seen."""
    t0 = time.perf_counter()
    while True:
        mon = TreeCpuMonitor()
        time.sleep(3)
        foreign = mon.stop()["foreign_cores_avg"]
        busy = other_python_cpu()
        waited = time.perf_counter() - t0
        if (foreign < QUIET_CORES and not busy) or waited >= max_wait_s:
            if foreign >= QUIET_CORES or busy:
                log(
                    f"machine still busy after {waited:.0f} s (others: {foreign:.2f} cores; {busy}); going on"
                )
            return {
                "waited_s": round(waited, 1),
                "foreign_cores_avg_3s": foreign,
                "busy_python": busy,
                "quiet": foreign < QUIET_CORES and not busy,
            }
        log(f"waiting for a quiet machine: others use {foreign:.2f} cores; {busy} ({waited:.0f} s)")
        time.sleep(max(0.0, poll_s - 3))


# ---- the deployments ----------------------------------------------------------------------------
def pool_dict(args) -> dict:
    return {
        "replicas": 1,
        "tp": 1,
        "resources": {"num_cpus": 1},
        "num_threads": 1,
        "kv_cache_memory": args.kv_cache_memory,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }


def deploy_dict(args, placement: str) -> dict:
    base = {
        "model": args.model,
        "router": {"host": "127.0.0.1", "port": 0, "max_inflight": 1024},
        "ray": {"address": None, "num_cpus": 2, "temp_dir": args.ray_temp_dir},
    }
    if placement == "disaggregated":
        return {
            **base,
            "kvtransfer": {"backend": "grpc"},
            "pools": {"prefill": pool_dict(args), "decode": pool_dict(args)},
        }
    return {**base, "pools": {"colocated": {**pool_dict(args), "replicas": 2}}}


def length_args(args, wl: str) -> list[str]:
    """The trace's length scale and caps, as `pdserve bench` and `pdserve tune` take them."""
    scale = f"{args.scale[wl]:g}"
    return [
        "--scale",
        scale,
        "--max-prompt",
        str(args.max_prompt),
        "--max-output",
        str(args.max_output),
    ]


def trace_args(args, wl: str) -> list[str]:
    return ["--trace", wl, *length_args(args, wl), "--num-requests", str(args.num_requests)]


def bench_cmd(router: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "deploy.cli", "bench", "--router", router, *extra]


def run_child(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    env = dict(os.environ, PDSERVE_NO_PROGRESS="1")
    log("$ " + " ".join(cmd))
    p = subprocess.run(
        cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    if p.returncode:
        log(f"exit {p.returncode}: {p.stderr[-2000:]}")
    return p.returncode, p.stdout + ("\n" + p.stderr if p.returncode else "")


def measure(
    args,
    placement: str,
    results: dict,
    workloads: list[str] | None = None,
    calibrate_it: bool = True,
) -> None:
    """Up, warm-up, calibration, one sweep per workload, down. A sweep during which processes
    outside this run used more than DISTURBED_CORES on average is kept aside (renamed
    *_disturbed<k>) and run again after waiting for a quiet machine, up to --retries times."""
    from deploy.config import validate_config
    from deploy.launcher import up

    entry = results["measured"].setdefault(placement, {})
    entry["config"] = deploy_dict(args, placement)
    entry["wait_before"] = wait_quiet(args.wait_idle)
    t0 = time.perf_counter()
    cluster = up(validate_config(entry["config"], f"<{placement}>"), block=False)
    entry["startup_s"] = round(time.perf_counter() - t0, 1)
    router = cluster.router_address
    log(f"{placement}: up in {entry['startup_s']} s, router {router}")
    try:
        rc, out = run_child(
            bench_cmd(
                router,
                [
                    "--prompt-len",
                    "128",
                    "--output-len",
                    "16",
                    "--rate",
                    "4",
                    "--num-requests",
                    "12",
                    "--seed",
                    str(WARMUP_SEED),
                ],
            ),
            300,
        )
        entry["warmup_rc"] = rc
        pids = worker_pids(cluster)
        entry["worker_pids"] = {str(k): v for k, v in pids.items()}
        if calibrate_it:
            calibrate(args, placement, router, entry)
            load_calibrate(args, placement, router, cluster, entry)
        for wl in workloads or args.workloads:
            name = f"slo_validation_{placement}_{wl}.json"
            rates = ",".join(f"{r:g}" for r in args.rates[wl])
            disturbed = []
            for attempt in range(args.retries + 1):
                wait = wait_quiet(args.wait_idle)
                take_step_traces(cluster)  # only this sweep's steps go to its _steps file
                mon, parts = TreeCpuMonitor(), CpuBreakdown(pids)
                rc, out = run_child(
                    bench_cmd(
                        router,
                        trace_args(args, wl)
                        + [
                            "--seed",
                            str(WORKLOAD_SEEDS[wl]),
                            "--sweep-rates",
                            rates,
                            "--slo",
                            args.slo_text,
                            "--out",
                            str(args.out.with_name(name)),
                            "--request-timeout",
                            "300",
                        ],
                    ),
                    1800,
                )
                breakdown, cpu = parts.stop(), mon.stop()
                # the engine steps the sweep ran: for checking the step models, never fitted
                args.out.with_name(f"slo_validation_{placement}_{wl}_steps.json").write_text(
                    json.dumps(
                        {
                            "workers": take_step_traces(cluster),
                            "unix_minus_monotonic": time.time() - time.monotonic(),
                        }
                    )
                )
                log(
                    f"{placement} {wl}: sweep rc {rc} in {cpu['wall_s']:.0f} s; others used "
                    f"{cpu['foreign_cores_avg']:.2f} cores on average; cores by component: "
                    f"{breakdown['cores_avg']}\n{out}"
                )
                record = {
                    "bench_json": name,
                    "rc": rc,
                    "stdout": out,
                    "wait_before": wait,
                    "cpu": cpu,
                    "cpu_by_component": breakdown,
                }
                if cpu["foreign_cores_avg"] <= DISTURBED_CORES or attempt == args.retries:
                    break
                aside = args.out.with_name(
                    f"slo_validation_{placement}_{wl}_disturbed{len(disturbed) + 1}.json"
                )
                args.out.with_name(name).rename(aside)
                for png in args.out.parent.glob(f"slo_validation_{placement}_{wl}_*.png"):
                    if "_disturbed" not in png.stem and "_run" not in png.stem:
                        png.rename(png.with_name(f"{png.stem}_disturbed{len(disturbed) + 1}.png"))
                record["bench_json"] = aside.name
                disturbed.append(record)
                log(
                    f"{placement} {wl}: disturbed by other processes ({cpu['foreign_cores_avg']:.2f} "
                    f"cores); kept as {aside.name}, measuring again"
                )
            entry[wl] = {**record, "disturbed_attempts": disturbed}
    finally:
        cluster.stop()
        time.sleep(2)


# ---- serving-path calibration (the requests and the fits: deploy/tuning/calibration.py) -----
def calibrate(args, placement: str, router: str, entry: dict) -> None:
    path = args.out.with_name(f"slo_validation_{placement}_calibration.json")
    rc, out = run_child(
        [
            sys.executable,
            str(pathlib.Path(__file__).resolve()),
            "--calibrate-router",
            router,
            "--calibrate-out",
            str(path),
            "--calibrate-placement",
            placement,
        ],
        600,
    )
    entry["calibration"] = {"rc": rc, "raw_json": path.name}


def take_step_traces(cluster) -> dict[str, dict]:
    """Each worker's engine steps since the last take: name -> {kind, steps: [StepRecord dicts]}."""
    import dataclasses

    import ray

    out = {}
    for r in cluster.replicas:
        steps = ray.get(
            r.actor.__ray_call__.remote(
                lambda self: [dataclasses.asdict(x) for x in self.worker.loop.take_step_trace()]
            ),
            timeout=60,
        )
        out[f"{r.key}-{r.index}"] = {"kind": r.key, "steps": steps}
    return out


def load_calibrate(args, placement: str, router: str, cluster, entry: dict) -> None:
    """The in-load calibration: open-loop runs on a later part of the conv trace than the one
    measured (LOAD_TRACE_START_S on, its own seeds) at args.load_rates (LOAD_RATES, or a stored
    run's own), and every engine step the workers ran meanwhile (their step traces), for
    deploy/tuning/calibration.fit_load."""
    take_step_traces(cluster)  # drop the steps of the warm-up and the isolated calibration
    mon = TreeCpuMonitor()
    runs = []
    for k, rate in enumerate(args.load_rates):
        name = f"slo_validation_{placement}_load_{rate:g}.json"
        rc, _ = run_child(
            bench_cmd(
                router,
                [
                    "--trace",
                    LOAD_TRACE,
                    "--trace-start",
                    f"{LOAD_TRACE_START_S:g}",
                    "--scale",
                    f"{args.scale[LOAD_TRACE]:g}",
                    "--max-prompt",
                    str(args.max_prompt),
                    "--max-output",
                    str(args.max_output),
                    "--num-requests",
                    str(args.load_requests),
                    "--rate",
                    f"{rate:g}",
                    "--seed",
                    str(LOAD_SEED + k),
                    "--out",
                    str(args.out.with_name(name)),
                ],
            ),
            900,
        )
        runs.append({"rate": rate, "rc": rc, "bench_json": name})
    raw = {"runs": runs, "workers": take_step_traces(cluster), "cpu": mon.stop()}
    path = args.out.with_name(f"slo_validation_{placement}_load_steps.json")
    path.write_text(json.dumps(raw))
    entry["load_calibration"] = {
        "runs": runs,
        "raw_json": path.name,
        "cpu": raw["cpu"],
        "num_steps": {k: len(w["steps"]) for k, w in raw["workers"].items()},
    }
    log(f"{placement}: load calibration {runs}; steps {entry['load_calibration']['num_steps']}")


# ---- the tuner ----------------------------------------------------------------------------------
def slice_csv(args, wl: str) -> pathlib.Path:
    """The measured slice of the trace (its first --num-requests rows, unscaled) as a trace file,
    so the tuner sees exactly the requests that were measured."""
    path = args.out.with_name(f"slo_validation_{wl}_slice.csv")
    src = workload.resolve_trace(wl)
    with open(src) as f:
        lines = f.read().splitlines()
    path.write_text("\n".join(lines[: 1 + args.num_requests]) + "\n")
    return path


def run_tuner(args, wl: str, profile_path, trace: str) -> dict:
    slo = args.slo_text + ",attainment=0.9"
    tag = f"{pathlib.Path(profile_path).stem}_{'slice' if trace != wl else 'full'}"
    plot = args.out.parent / f"slo_validation_tune_{wl}_{tag}.png"
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "tune",
        "--profile",
        str(profile_path),
        "--workload",
        trace,
        *length_args(args, wl),
        "--slo",
        slo,
        "--devices",
        "2",
        "--colocated",
        "--tp",
        "1",
        "--backend",
        "grpc",
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--seed",
        str(WORKLOAD_SEEDS[wl]),
        "--plot",
        str(plot),
    ]
    log("$ " + " ".join(cmd))
    p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    m = re.search(r"^best: (.+?): ([0-9.e+-]+) req/s", p.stdout, re.M)
    ranking = re.findall(
        r"^\s+\d+\s+(.+?)\s{2,}\d+\s+([0-9.e+-]+)\s+([0-9.e+-]+|-)", p.stdout, re.M
    )
    return {
        "command": " ".join(
            ["pdserve"]
            + [
                str(pathlib.Path(c).relative_to(REPO_ROOT))
                if str(c).startswith(str(REPO_ROOT))
                else c
                for c in cmd[3:]
            ]
        ),
        "profile": str(profile_path),
        "workload": trace,
        "rc": p.returncode,
        "stdout": out,
        "best": m.group(1) if m else None,
        "best_goodput": float(m.group(2)) if m else None,
        "ranking": [
            {
                "placement": a.strip(),
                "estimate": float(b),
                "simulated": None if c == "-" else float(c),
            }
            for a, b, c in ranking
        ],
        "plot": plot.name,
    }


def main() -> int:
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
        "--slo", default="ttft=1.5s,tpot=100ms", help="the joint SLO (metrics.parse_slo syntax)"
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
                    "command": " ".join(["python"] + sys.argv),
                }
            )
            measure(args, placement, results, workloads=only, calibrate_it=not only)
            args.out.write_text(json.dumps(results, indent=1))
    elif not args.simulate_only:
        if not args.reprofile and not pathlib.Path(args.profile).is_file():
            # bench/results/ is not in git (a fresh clone has no engine profile): measure it first
            print(
                f"no engine profile at {args.profile}: measuring it first (--reprofile)", flush=True
            )
            args.reprofile = True
        import torch

        results = {
            "schema": "pdserve-slo-validation/1",
            "date": now(),
            "command": " ".join(["python"] + sys.argv),
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
            "slo_s": metrics.parse_slo(args.slo),
            "measured": {},
        }
        if args.reprofile:
            results["profile_wait"] = wait_quiet(args.wait_idle)
            mon = TreeCpuMonitor()
            cmd = [
                sys.executable,
                "-m",
                "deploy.cli",
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
    results["slo_s"] = metrics.parse_slo(args.slo_text)
    profiles = {"engine": args.profile}
    serving = serving_profile(args, results)
    sims = dict(profiles)
    if serving is not None:
        from deploy.tuning.perf_model import profile_from_dict

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
