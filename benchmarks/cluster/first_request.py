"""The first request after `ready` against the ones after it, through the default deployment.

  python -m benchmarks.cluster.first_request                 # 2 deployments on the cache, 2 on an empty one
  python -m benchmarks.cluster.first_request --deployments 1 --later 3 --caches warm

Each deployment is `deploy/examples/local-cpu.yaml` started with `deploy.launcher.up()` (what
`pdserve up` runs; it returns once every worker has registered, which is when `pdserve up` prints
"ready"). At once, one client sends a fresh 128-token prompt for 64 greedy tokens, then `--later`
more the same way, one at a time; per request it records the TTFT at the client and the decode
tok/s. The figures are the first request's over the median of the later ones, and the later
ones' decode speed over HF transformers' float32 decoding one sequence in-process, measured in
the same run. "warm" deployments use pdserve's cache as it is; "fresh" ones an empty
PDSERVE_CACHE_DIR, so the GGUF is converted and the CPU decode kernel compiled again. Writes
benchmarks/results/first_request.json (with the CPU model and flags).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks import bench_common as bc
from benchmarks.chaos_harness import deployment, example_config


def one(stub, prompt: list[int], max_tokens: int) -> dict:
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb

    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    sent = time.perf_counter()
    first = last = None
    n = 0
    for resp in stub.Generate(request, timeout=300):
        if resp.HasField("delta") and resp.delta.token_ids:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            n += len(resp.delta.token_ids)
    return {
        "ttft_ms": (first - sent) * 1000,
        "tokens": n,
        "decode_tok_s": (n - 1) / (last - first) if n > 1 and last > first else None,
    }


def run_deployment(args, index: int, cache: str) -> dict:
    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc

    prompts = bc.random_prompts(11000 + 100 * index, args.later + 1, args.prompt_len)
    before = os.environ.get("PDSERVE_CACHE_DIR")
    empty = tempfile.mkdtemp(prefix="pdcache") if cache == "fresh" else None
    if empty:  # up() starts a fresh local Ray, whose workers inherit this environment
        os.environ["PDSERVE_CACHE_DIR"] = empty
    try:
        t0 = time.perf_counter()
        config = example_config()
        if args.decode_threads:  # a layout to compare: the decode worker's compute threads
            config["pools"]["decode"]["num_threads"] = args.decode_threads
        with deployment(config) as (cluster, _):
            up_s = time.perf_counter() - t0
            with grpc.insecure_channel(cluster.router_address) as channel:
                stub = pdserve_pb2_grpc.PDServeStub(channel)
                rows = [one(stub, p, args.max_tokens) for p in prompts]
    finally:
        if empty:
            shutil.rmtree(empty, ignore_errors=True)
            if before is None:
                os.environ.pop("PDSERVE_CACHE_DIR", None)
            else:
                os.environ["PDSERVE_CACHE_DIR"] = before
    first, later = rows[0], rows[1:]
    out = {
        "cache": cache,
        "decode_threads": args.decode_threads,
        "up_s": round(up_s, 1),
        "first": first,
        "later": later,
        "later_median_ttft_ms": statistics.median(r["ttft_ms"] for r in later),
        "later_median_decode_tok_s": statistics.median(r["decode_tok_s"] for r in later),
    }
    out["first_ttft_over_later"] = round(first["ttft_ms"] / out["later_median_ttft_ms"], 3)
    out["later_decode_over_first"] = round(
        out["later_median_decode_tok_s"] / first["decode_tok_s"], 3
    )
    bc.log(
        f"deployment {index} ({cache} cache, up in {up_s:.0f} s): first TTFT {first['ttft_ms']:.0f} ms, decode {first['decode_tok_s']:.1f} "
        f"tok/s; later median {out['later_median_ttft_ms']:.0f} ms, "
        f"{out['later_median_decode_tok_s']:.1f} tok/s"
    )
    return out


def hf_one_stream(args) -> dict:
    """HF transformers float32 decoding one sequence in this process, 2 threads (the machine's
    cores), the same prompt length and new tokens: tok/s after the first token, best of 2 runs;
    in a subprocess so its threads and memory leave with it."""
    import json
    import subprocess

    code = (
        "import json; from benchmarks.engine.bench import one_stream_tok_s; "
        f"print(json.dumps(one_stream_tok_s('smollm2', 2, {args.prompt_len:d}, {args.max_tokens:d})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=bc.REPO_ROOT, capture_output=True, text=True, check=True
    )
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    bc.log(f"HF float32 one stream in-process: {runs} tok/s")
    return {"decode_tok_s": max(runs), "runs_tok_s": runs, "threads": 2}


def main(argv=None) -> int:
    p = bc.script_parser(__doc__)
    p.add_argument("--deployments", type=int, default=2, help="per cache kind")
    p.add_argument("--caches", default="warm,fresh")
    p.add_argument("--later", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--decode-threads",
        type=int,
        help="the decode worker's num_threads (default: the example config's)",
    )
    p.add_argument(
        "--no-hf",
        dest="hf",
        action="store_false",
        help="skip HF's in-process one stream (the baseline of 'one stream vs HF')",
    )
    bc.add_out_arg(p, "first_request.json")
    args = p.parse_args(argv)
    os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")
    hf = hf_one_stream(args) if args.hf else None
    report = {
        **bc.run_header("benchmarks.cluster.first_request", argv),
        "hf_one_stream": hf,
        "deployments": [
            run_deployment(args, i, cache)
            for cache in args.caches.split(",")
            for i in range(args.deployments)
        ],
    }
    if hf:
        for d in report["deployments"]:
            d["later_decode_over_hf"] = round(
                d["later_median_decode_tok_s"] / hf["decode_tok_s"], 3
            )
            bc.log(
                f"{d['cache']} cache: one stream through the cluster {d['later_median_decode_tok_s']:.1f} "
                f"tok/s = {d['later_decode_over_hf']:.2f}x HF float32 in-process ({hf['decode_tok_s']:.1f})"
            )
    bc.write_result(args.out, report)
    bc.log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
