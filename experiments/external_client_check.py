"""Must-show b of issue #16: an external benchmark client, NVIDIA's aiperf, runs a short profile
against the router's OpenAI-compatible HTTP endpoint, `pdserve bench` runs the same load on the
gRPC API, and their median TTFT and ITL agree within 15%.

    python -m experiments.external_client_check                  # local cluster (experiments/http_cluster.py)
    python -m experiments.external_client_check --router HOST:PORT --http http://HOST:PORT

aiperf would move packages pdserve runs on, so it lives in its own virtual environment,
experiments/.venv (git-ignored):
    python -m venv experiments/.venv && experiments/.venv/bin/pip install aiperf==0.13.0
Both clients send the same load after the same warm-up, in rounds that alternate which goes
first; `compare` says what is compared and `main` how the load is made alike. Results:
experiments/results/external_client_check.json and BENCHMARKS.md, "Prometheus and an external
client against the HTTP front".
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from benchmarks.bench_common import (
    REPO_ROOT,
    TreeCpuMonitor,
    add_wait_idle_arg,
    log,
    run_header,
    script_parser,
    wait_for_idle_machine,
    write_result,
)
from experiments import http_cluster

VENV_AIPERF = os.path.join(REPO_ROOT, "experiments", ".venv", "bin", "aiperf")
TOLERANCE = 0.15


def run_pdserve_bench(args, router: str, workdir: str, k: int) -> dict:
    out = os.path.join(workdir, f"pdserve_bench_{k}.json")
    cmd = [
        sys.executable, "-m", "pdserve", "bench", "--router", router,
        "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
        "--num-requests", str(args.num_requests), "--rate", str(args.rate),
        "--burstiness", "1000", "--seed", str(args.seed + k), "--out", out,
    ]  # fmt: skip
    log("pdserve bench: " + " ".join(cmd[3:]))
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, env=dict(os.environ, PDSERVE_NO_PROGRESS="1"))
    with open(out) as f:
        result = json.load(f)
    done = [r for r in result["requests"] if not r["error"]]
    return {
        "ttft_s": [r["ttft_s"] for r in done],
        "itl_s": [r["tpot_s"] for r in done if r["tpot_s"] is not None],
        "gap_s": [g for r in done for g in r["itl_s"]],
        "failed": len(result["requests"]) - len(done),
        "prompt_tokens": sorted({r["prompt_len"] for r in done}),
        "output_tokens": sorted({r["output_tokens"] for r in done}),
    }


def run_aiperf(args, http: str, tokenizer: str, workdir: str, k: int) -> dict:
    outdir = os.path.join(workdir, f"aiperf_{k}")
    cmd = [
        args.aiperf, "profile", "--model", args.served_model, "--url", http,
        "--endpoint-type", "completions", "--streaming", "--tokenizer", tokenizer,
        "--use-server-token-count",
        "--prompt-input-tokens-mean", str(args.prompt_len), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(args.output_len), "--prompt-output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        "--request-rate", str(args.rate), "--arrival-pattern", "constant",
        "--request-count", str(args.num_requests),
        "--random-seed", str(args.seed + k), "--ui-type", "none", "--no-server-metrics",
        "--no-gpu-telemetry", "--no-auto-plot", "--workers-max", "1",
        "--record-processor-service-count", "1", "--export-level", "records",
        "--output-artifact-dir", outdir,
    ]  # fmt: skip
    log("aiperf: " + " ".join(cmd[1:]))
    subprocess.run(cmd, check=True, cwd=workdir, stdout=subprocess.DEVNULL)
    ttft, itl, gaps, isl, osl, failed = [], [], [], set(), set(), 0
    with open(os.path.join(outdir, "profile_export.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("metadata", {}).get("benchmark_phase", "profiling") != "profiling":
                continue
            m = rec.get("metrics", {})
            if rec.get("error") or "time_to_first_token" not in m:
                failed += 1
                continue
            ttft.append(_ms(m["time_to_first_token"]) / 1e3)
            if "inter_token_latency" in m:
                itl.append(_ms(m["inter_token_latency"]) / 1e3)
            gaps += [v / 1e3 for v in _values(m.get("inter_chunk_latency"))]
            isl.add(int(_ms(m.get("input_sequence_length", {"value": 0}))))
            osl.add(int(_ms(m.get("output_sequence_length", {"value": 0}))))
    with open(os.path.join(outdir, "profile_export_aiperf.json")) as f:
        summary = json.load(f)
    return {
        "ttft_s": ttft,
        "itl_s": itl,
        "gap_s": gaps,
        "failed": failed,
        "prompt_tokens": sorted(isl),
        "output_tokens": sorted(osl),
        "aiperf_p50_ms": {
            k: summary.get(k, {}).get("p50")
            for k in ("time_to_first_token", "inter_token_latency", "inter_chunk_latency")
        },
    }


def _ms(metric) -> float:
    return float(metric["value"] if isinstance(metric, dict) else metric)


def _values(metric) -> list[float]:
    if metric is None:
        return []
    value = metric["value"] if isinstance(metric, dict) else metric
    return [float(v) for v in value] if isinstance(value, list) else [float(value)]


def warm_up(router: str, args) -> None:
    from pdserve.tuning import loadgen, workload

    card = loadgen.model_card(router)
    args.served_model = card.id
    reqs = [workload.RequestSpec(0.0, args.prompt_len, args.output_len)] * args.warmup
    loadgen.run_load(router, reqs, workload.build_prompts(reqs, card.vocab_size, 12345))


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children (a client run and what it waited for)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def median_ms(xs: list[float]) -> float | None:
    return statistics.median(xs) * 1e3 if xs else None


def compare(sides: dict) -> dict:
    """Pooled medians of each side over all its rounds, and the median over rounds of the
    per-round ratio (aiperf / pdserve bench): the two clients ran back to back in each round.
    Defined alike on both sides:
      ttft  request sent -> first token received (aiperf: first SSE chunk with text)
      itl   per request (e2e - TTFT) / (output tokens - 1), the median over requests: aiperf's
            "inter_token_latency"; pdserve bench's TPOT (its median_tpot_ms)
      gap   for reference, the median gap between token events (aiperf "inter_chunk_latency",
            pdserve bench median_itl_ms)"""
    out = {}
    for metric in ("ttft", "itl", "gap"):
        a = median_ms([x for r in sides["aiperf"] for x in r[f"{metric}_s"]])
        b = median_ms([x for r in sides["pdserve_bench"] for x in r[f"{metric}_s"]])
        diff = (a - b) / b if a is not None and b else None
        ratios = [
            median_ms(x[f"{metric}_s"]) / median_ms(y[f"{metric}_s"])
            for x, y in zip(sides["aiperf"], sides["pdserve_bench"])
            if x[f"{metric}_s"] and y[f"{metric}_s"]
        ]
        out[metric] = {
            "aiperf_median_ms": a,
            "pdserve_bench_median_ms": b,
            "relative_difference": diff,
            "per_round_ratios": ratios,
            "median_per_round_ratio": statistics.median(ratios) if ratios else None,
            "pass": diff is not None and abs(diff) <= TOLERANCE,
        }
    out["gap"]["note"] = "reference only: the median gap between token events"
    return out


def main(argv=None) -> int:
    """The command line and the run. The same load on both sides: --num-requests requests of
    --prompt-len prompt tokens and exactly --output-len output tokens (greedy, ignore_eos),
    arriving at --rate req/s at even intervals (aiperf --arrival-pattern constant; pdserve bench
    --burstiness 1000, gamma gaps within 3% of even), streaming. aiperf reads the model's own
    tokenizer from its local directory (no network) to make prompts of exactly --prompt-len
    tokens, and counts output tokens from the server's usage (--use-server-token-count), as
    pdserve bench counts token ids. Rounds alternate which client goes first, because the
    machine's speed drifts between minutes and other processes come and go; each run records the
    CPU they took."""
    ap = script_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--router", help="a running router's gRPC address (else: a local cluster)")
    ap.add_argument("--http", help="its HTTP front, e.g. http://127.0.0.1:8000 (with --router)")
    ap.add_argument("--tokenizer", help="aiperf's tokenizer (default: the model's directory)")
    ap.add_argument(
        "--aiperf",
        default=VENV_AIPERF if os.path.exists(VENV_AIPERF) else "aiperf",
        help="the aiperf command (default: experiments/.venv/bin/aiperf when present)",
    )
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=20, help="per run")
    ap.add_argument("--rate", type=float, default=1.0, help="req/s at even intervals")
    ap.add_argument("--rounds", type=int, default=4, help="each client runs once per round")
    add_wait_idle_arg(ap, "each run")
    args = http_cluster.parse_args(ap, argv, "external_client_check.json")
    if shutil.which(args.aiperf) is None:
        ap.error(f"{args.aiperf} not found: see this script's docstring to install aiperf")
    tokenizer = args.tokenizer
    if tokenizer is None:
        from pdserve.engine.loader import resolve_model

        tokenizer = os.fspath(resolve_model(args.model))
    report = run_header("experiments.external_client_check", argv)
    report["load"] = {
        k: getattr(args, k)
        for k in ("prompt_len", "output_len", "num_requests", "rate", "rounds", "seed")
    }
    version = subprocess.run([args.aiperf, "--version"], capture_output=True, text=True)
    report["aiperf_version"] = (version.stdout or version.stderr).strip().splitlines()[-1]
    cluster = None
    workdir = tempfile.mkdtemp(prefix="pdext")
    sides: dict[str, list] = {"aiperf": [], "pdserve_bench": []}
    try:
        cluster, router, http, report["cluster"] = http_cluster.open_cluster(args)
        warm_up(router, args)
        for k in range(args.rounds):
            order = ("pdserve_bench", "aiperf") if k % 2 == 0 else ("aiperf", "pdserve_bench")
            for side in order:
                if args.wait_idle > 0:
                    wait_for_idle_machine(args.wait_idle)
                mon = TreeCpuMonitor()  # this script's tree: the cluster and both clients
                children = _children_cpu_s()
                if side == "aiperf":
                    run = run_aiperf(args, http, tokenizer, workdir, k)
                else:
                    run = run_pdserve_bench(args, router, workdir, k)
                run["foreign_cores_avg"] = mon.stop().get("foreign_cores_avg")
                run["client_cpu_s"] = _children_cpu_s() - children
                sides[side].append(run)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    report["comparison"] = compare(sides)
    report["per_round"] = {
        side: [
            {
                "ttft_median_ms": median_ms(r["ttft_s"]),
                "itl_median_ms": median_ms(r["itl_s"]),
                "gap_median_ms": median_ms(r["gap_s"]),
                "failed": r["failed"],
                "other_processes_cores_avg": r["foreign_cores_avg"],
                "client_cpu_s": r["client_cpu_s"],
                "prompt_tokens": r["prompt_tokens"],
                "output_tokens": r["output_tokens"],
                **({"aiperf_p50_ms": r["aiperf_p50_ms"]} if "aiperf_p50_ms" in r else {}),
            }
            for r in runs
        ]
        for side, runs in sides.items()
    }
    c = report["comparison"]
    report["pass"] = c["ttft"]["pass"] and c["itl"]["pass"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_result(args.out, report)
    print(json.dumps({"comparison": c, "per_round": report["per_round"]}, indent=1))
    log(f"{'PASS' if report['pass'] else 'FAIL'}; written to {args.out}")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
