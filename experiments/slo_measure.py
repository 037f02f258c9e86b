"""The measured side of experiments/slo_validation.py: waiting for a quiet machine (the CPU other
processes use), bringing each placement up with deploy.launcher.up, the warm-up, the serving-path
and in-load calibrations (the workers' engine step traces), and the `pdserve bench --sweep-rates`
runs in child processes, a sweep disturbed by others set aside and measured again."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

from benchmarks.bench_common import CpuBreakdown, TreeCpuMonitor
from experiments.calibration import LOAD_SEED, LOAD_TRACE, LOAD_TRACE_START_S
from experiments.slo_simulate import WORKLOAD_SEEDS

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
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
    return [sys.executable, "-m", "pdserve", "bench", "--router", router, *extra]


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
    from pdserve.deploy.config.load import validate_config
    from pdserve.deploy.launcher import up

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


# ---- serving-path calibration (the requests and the fits: experiments/calibration.py) -----
def calibrate(args, placement: str, router: str, entry: dict) -> None:
    path = args.out.with_name(f"slo_validation_{placement}_calibration.json")
    rc, out = run_child(
        [
            sys.executable,
            "-m",
            "experiments.slo_validation",
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
    experiments/calibration.fit_load."""
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
