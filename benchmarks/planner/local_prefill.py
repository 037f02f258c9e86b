"""Local prefill alone, no flips (issue #27, must-show e): P95 TTFT of 1 prefill + 1 decode worker
near saturation on the azure_conv trace, with the router sending some prompts to their decode
worker (router.local_prefill) against always disaggregated, and TPOT P90 against the SLO.

  python -m benchmarks.planner.local_prefill                         # 3 runs per mode, ~12 minutes
  python -m benchmarks.planner.local_prefill --runs 1 --num-requests 60

One deployment of the embedded SmolLM2 (the README's example: one prefill and one decode worker,
one core each, `deploy.launcher.up()`); the router runs in this process, so the mode changes
between runs by replacing its Legs' LocalPrefill bound, nothing else. Each run is `pdserve bench`
in a process of its own: the first --num-requests of azure_conv (lengths x0.2, prompts <= 512,
outputs <= 64: the sizes of the SLO-validation runs in BENCHMARKS.md, where 1P+1D reaches 88%
attainment at 2 req/s) re-timed to Poisson at --rate, the same requests and prompts every run.
The modes alternate (off, local, off, local, ...) so a slow spell of the machine hits both. Per
run: P95 and P90 TTFT, P90 TPOT, SLO attainment, and how many prompts went local (the router's
pdserve:local_prefills_total). Writes benchmarks/results/local_prefill.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.bench_common import add_out_arg, log, run_and_write, script_parser
from benchmarks.chaos_harness import deployment, example_config


def bench_once(router: str, args, out_path: str, prompt_seed: int) -> dict:
    """One bench run: the same arrivals every time (seed 27), and prompts of their own
    (`prompt_seed`), so that no run finds an earlier run's prompts in a worker's prefix cache or
    in the router's view of it."""
    cmd = [sys.executable, "-m", "pdserve", "bench", "--router", router, "--trace", "azure_conv"]
    cmd += ["--scale", "0.2", "--max-prompt", "512", "--max-output", "64"]
    cmd += ["--num-requests", str(args.num_requests), "--rate", str(args.rate), "--seed", "27"]
    cmd += ["--prompt-seed", str(prompt_seed)]
    cmd += ["--slo", f"ttft={args.ttft_s}s,tpot={args.tpot_s}s", "--out", out_path]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
    with open(out_path) as f:
        result = json.load(f)
    rows = [r for r in result["requests"] if not r["error"] and r["ttft_s"] is not None]
    ttft = np.asarray([r["ttft_s"] for r in rows]) * 1e3
    tpot = np.asarray([r["tpot_s"] for r in rows if r.get("tpot_s") is not None]) * 1e3
    s = result["summary"]
    return {
        "completed": s["completed"],
        "failed": s["failed"],
        "p95_ttft_ms": round(float(np.percentile(ttft, 95)), 1),
        "p90_ttft_ms": round(float(np.percentile(ttft, 90)), 1),
        "median_ttft_ms": round(float(np.median(ttft)), 1),
        "p90_tpot_ms": round(float(np.percentile(tpot, 90)), 1),
        "slo_attainment": round(s["slo_attainment"], 3),
    }


def local_count(router) -> float:
    return router.metrics_registry.get_sample_value(
        "pdserve:local_prefills_total", {"model_name": router.servicer.options.model_id}
    )


def run(args) -> dict:
    from pdserve.planner.local_prefill import LocalPrefill

    policy = LocalPrefill(args.max_prompt_tokens, args.cost, args.hop_tokens)
    rows: list[dict] = []
    with deployment(example_config()) as (cluster, _):
        router = cluster.router
        legs = router.servicer.legs
        with tempfile.TemporaryDirectory() as tmp:
            bench_once(
                cluster.router_address,
                dataclasses.replace(args, num_requests=20),
                f"{tmp}/warm.json",
                prompt_seed=1000,
            )
            for k in range(2 * args.runs):
                mode = "local" if k % 2 else "disaggregated"
                legs.local_prefill = policy if mode == "local" else LocalPrefill()
                before = local_count(router)
                t0 = time.monotonic()
                row = {"run": k // 2 + 1, "mode": mode}
                row.update(
                    bench_once(
                        cluster.router_address,
                        args,
                        os.path.join(tmp, f"{k}.json"),
                        prompt_seed=1001 + k,
                    )
                )
                row["local_prefills"] = int(local_count(router) - before)
                row["took_s"] = round(time.monotonic() - t0, 1)
                rows.append(row)
                log(f"{mode}: {row}")
    out = {
        "setup": {
            "workers": "1P+1D (the README's example deployment)",
            "trace": "azure_conv x0.2, prompts <= 512, outputs <= 64",
            "num_requests": args.num_requests,
            "rate": args.rate,
            "slo": {"ttft_s": args.ttft_s, "tpot_s": args.tpot_s},
            "local_prefill": dataclasses.asdict(policy),
        },
        "runs": rows,
    }
    for mode in ("disaggregated", "local"):
        mine = [r for r in rows if r["mode"] == mode]
        out[mode] = {
            key: {
                "median": statistics.median(r[key] for r in mine),
                "min": min(r[key] for r in mine),
                "max": max(r[key] for r in mine),
            }
            for key in ("p95_ttft_ms", "p90_tpot_ms", "slo_attainment", "local_prefills")
        }
    base, local = (
        out["disaggregated"]["p95_ttft_ms"]["median"],
        out["local"]["p95_ttft_ms"]["median"],
    )
    out["p95_ttft_change"] = round(local / base - 1, 3) if base else None
    log(
        f"P95 TTFT median {base} ms -> {local} ms ({out['p95_ttft_change']:+.1%}); P90 TPOT "
        f"{out['disaggregated']['p90_tpot_ms']['median']} -> {out['local']['p90_tpot_ms']['median']} ms"
    )
    return out


@dataclasses.dataclass(frozen=True)
class Args:
    runs: int
    num_requests: int
    rate: float
    ttft_s: float
    tpot_s: float
    max_prompt_tokens: int
    cost: float
    hop_tokens: int


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--runs", type=int, default=3, help="runs per mode")
    p.add_argument("--num-requests", type=int, default=180)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--ttft-s", type=float, default=1.5)
    p.add_argument("--tpot-s", type=float, default=0.1)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--cost", type=float, default=2.0)
    p.add_argument("--hop-tokens", type=int, default=64)
    add_out_arg(p, "local_prefill.json")
    ns = p.parse_args(argv)
    args = Args(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(Args)})
    return run_and_write("benchmarks.planner.local_prefill", argv, ns.out, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
