"""Engine benchmark: pdserve's LLMEngine vs HF transformers, same model, same prompts, same CPU.

    python -m benchmarks.engine_bench            # full run (both sides, ~5 min on 2 cores)
    python -m benchmarks.engine_bench --quick    # smoke run: 8 requests, 32 new tokens

The default mode runs `--side hf` and then `--side pdserve` as separate subprocesses (so each
side's peak RSS is its own, and neither warms the other's caches), collects one JSON line from
each, prints a markdown table and writes the combined results to --out. Prompts are deterministic
random token ids, so every length is exact and both sides see identical inputs. It measures the
decode throughput of N concurrent requests, the TTFT of a fresh 512-token prompt, the TTFT of a
cached 512-token prefix plus 32 fresh tokens, and each side's peak RSS; benchmarks/README.md says
how each side times them. engine_bench_report.py renders the report, engine_bench_hf.py and
engine_bench_pdserve.py are the two sides, and bench_common.py holds what they share.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

from benchmarks.bench_common import (
    REPO_ROOT,
    add_wait_idle_arg,
    log,
    script_parser,
    wait_for_idle_machine,
)
from benchmarks.engine_bench_hf import run_hf
from benchmarks.engine_bench_pdserve import run_pdserve
from benchmarks.engine_bench_report import (
    combine,
    modes_summary,
    render,
    render_modes,
)

RESULT_PREFIX = "@@ENGINE_BENCH_RESULT "
DEFAULT_OUT = os.path.join("benchmarks", "results", "engine_bench.json")


# ---- orchestration ----------------------------------------------------------------------------
def side_argv(args, side: str) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "benchmarks.engine_bench",
        "--side",
        side,
        "--num-requests",
        str(args.num_requests),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--ttft-len",
        str(args.ttft_len),
        "--prefix-len",
        str(args.prefix_len),
        "--suffix-len",
        str(args.suffix_len),
        "--repeats",
        str(args.repeats),
        "--prefill-repeats",
        str(args.prefill_repeats),
        "--threads",
        str(args.threads),
        "--model",
        args.model,
    ]
    if args.kv_cache_memory is not None:
        argv += ["--kv-cache-memory", str(args.kv_cache_memory)]
    return argv + [
        "--dtype",
        args.dtype,
        "--quantization",
        args.quantization,
        "--kv-cache-dtype",
        args.kv_cache_dtype,
    ]


def run_side_subprocess(args, side: str) -> dict:
    argv = side_argv(args, side)
    idle = wait_for_idle_machine(args.wait_idle) if args.wait_idle > 0 else None
    env = dict(
        os.environ,
        PDSERVE_NO_PROGRESS="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    log(f"running {side}: {shlex.join(argv)}")
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
        elif line.strip():
            print(line, file=sys.stderr)
    if result is None:
        result = {"side": side, "error": f"subprocess exited {proc.returncode} without a result"}
    result["subprocess"] = {
        "argv": argv,
        "returncode": proc.returncode,
        "wall_s": wall,
        "wait_idle": idle,
    }
    log(f"{side} finished in {wall:.1f} s (rc={proc.returncode})")
    return result


# --modes name -> (--dtype, --quantization, --kv-cache-dtype) of the pdserve side
MODES = {
    "float32": ("float32", "none", "auto"),
    "bfloat16": ("bfloat16", "none", "auto"),
    "int8": ("float32", "int8", "auto"),
    "int8-kvbf16": ("float32", "int8", "bfloat16"),  # int8 weights, a bf16 KV cache
    "int4": ("float32", "int4", "auto"),
    "auto": ("auto", "none", "auto"),
}


def parse_args(argv=None):
    ap = script_parser(__doc__.split("\n\n")[0])
    ap.add_argument(
        "--side",
        choices=["both", "hf", "pdserve", "llamacpp"],
        default="both",
        help="hf / pdserve / llamacpp: run one side in this process and print one JSON "
        "line; both (default): run each side in its own subprocess and report",
    )
    ap.add_argument("--dtype", default="float32", help="pdserve side: the engine's dtype")
    ap.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8", "int4", "auto"],
        help="pdserve side: the engine's quantization",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="pdserve side: the KV cache's dtype (auto: the activations')",
    )
    ap.add_argument(
        "--modes",
        default="float32",
        help="comma-separated pdserve modes to run against the one HF run, each in its "
        "own process: float32, bfloat16, int8, int8-kvbf16, int4, auto (dtype auto); more than "
        "float32 adds the modes table and llama.cpp's one stream",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 requests, 32 new tokens")
    ap.add_argument("--out", default=None, help=f"JSON results path (default {DEFAULT_OUT})")
    ap.add_argument(
        "--num-requests", type=int, default=None, help="concurrent requests (32; quick 8)"
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument(
        "--new-tokens", type=int, default=None, help="new tokens per request (128; quick 32)"
    )
    ap.add_argument("--ttft-len", type=int, default=512)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of each TTFT measurement")
    ap.add_argument(
        "--prefill-repeats",
        type=int,
        default=2,
        help="HF prefill-only generate runs (median is subtracted)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="pdserve KV bytes (default: the engine default, 1 GiB on CPU)",
    )
    add_wait_idle_arg(ap, "each side")
    args = ap.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 8 if args.quick else 32
    if args.new_tokens is None:
        args.new_tokens = 32 if args.quick else 128
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode-only throughput needs a decode step)")
    for name in (
        "num_requests",
        "prompt_len",
        "ttft_len",
        "prefix_len",
        "suffix_len",
        "repeats",
        "prefill_repeats",
        "threads",
    ):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.side != "both":
        if args.side == "llamacpp":
            from benchmarks.engine_bench_llamacpp import run_llamacpp

            res = run_llamacpp(args)
        else:
            res = run_hf(args) if args.side == "hf" else run_pdserve(args)
        print(RESULT_PREFIX + json.dumps(res), flush=True)
        return 0
    command = shlex.join(["python", "-m", "benchmarks.engine_bench", *sys.argv[1:]])
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: each of {sorted(MODES)}")
    hf = run_side_subprocess(args, "hf")
    runs = {}
    for m in modes:
        args.dtype, args.quantization, args.kv_cache_dtype = MODES[m]
        runs[m] = run_side_subprocess(args, "pdserve")
    pd = runs[modes[0]]
    report = combine(args, hf, pd, command)
    report["config"]["dtype"] = modes[0]
    table = render(report)
    if len(modes) > 1:
        from benchmarks.engine_bench_llamacpp import LLAMA_CPP_VERSION  # noqa: F401 (import check)

        lc = run_side_subprocess(args, "llamacpp")
        report["modes"] = modes_summary(hf, runs, lc)
        report["llamacpp"] = lc
        table += "\n\n" + render_modes(report["modes"], args)
    report["table_markdown"] = table
    out = args.out or os.path.join(REPO_ROOT, DEFAULT_OUT)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(table)
    print(f"\nresults written to {out}")
    failed = [k for k in ("decode", "ttft512", "prefix") if report["summary"][k]["pass"] is None]
    return 1 if failed or hf.get("error") or pd.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
