"""Where a sequence's KV blocks lie in memory, and what that costs decode (issue #48).

The decode attention kernel (engine/kernels/paged_decode_cpu.cpp) reads each sequence's blocks in
the order of its block table. A block of SmolLM2's bf16 KV is 6 KiB per layer for K and as much
for V, and memory serves blocks that follow each other at up to twice the rate of blocks spread
over the cache. Two parts, both on the machine at hand:

- kernel: the compiled kernel alone over 30 layers of SmolLM2-shaped bf16 KV, --sequences
  sequences of each --contexts length, block tables consecutive, in runs of 4 blocks, and
  scattered one by one (best of --repeats per layout).
- engine: the embedded SmolLM2 in the default mode (what `pdserve up` serves), a KV pool of
  --pool-mib. First a churn: --churn requests of random lengths, at most 8 at a time, each
  replaced as it ends, until the free queue is in the order real traffic leaves it. Then
  --sequences prompts of --prompt tokens decode --new tokens together: decode tok/s from the step
  times after every first token, and the shares of neighbouring blocks in their tables that are
  the next or the previous block in memory. Twice, each in a process of its own, alternated
  --rounds times:
  "runs", the allocator as built (BlockManager.allocate: ascending order, a sequence continuing
  its run), and "queue", the free queue's order as it was before (this script patches that in).

  python -m benchmarks.engine.kv_locality
  python -m benchmarks.engine.kv_locality --parts kernel --contexts 192 1024

Writes benchmarks/results/kv_locality.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

from benchmarks.bench_common import (
    add_out_arg,
    add_wait_idle_arg,
    count_new_tokens,
    log,
    run_and_write,
    script_parser,
    wait_for_idle_machine,
)

LAYERS, KV_HEADS, HEAD_DIM, Q_HEADS, BLOCK = 30, 3, 64, 9, 16  # SmolLM2-135M
LAYOUTS = {"consecutive": None, "runs of 4": 4, "scattered": 1}


def _tables(n: int, blocks: int, pool: int, run: int | None, seed: int):
    """n block tables of `blocks` entries each: one stretch of consecutive blocks (run None), or
    runs of `run` consecutive blocks each placed at random."""
    import torch

    if run is None:
        ids = torch.arange(n * blocks)
    else:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randperm(pool // run, generator=g)[: -(-n * blocks // run)] * run
        ids = (starts[:, None] + torch.arange(run)[None, :]).flatten()[: n * blocks]
    return ids.view(n, blocks).to(torch.int64).contiguous()


def kernel_part(args) -> dict:
    import torch

    from pdserve.engine.kernels import cpu_paged_decode

    attend = cpu_paged_decode()
    if attend is None:
        return {"error": "the compiled kernel is not available here"}
    out = {"threads": torch.get_num_threads(), "sequences": args.sequences, "by_context": {}}
    for ctx in args.contexts:
        blocks = -(-ctx // BLOCK)
        pool = max(2 * args.sequences * blocks, 2912)
        kv = torch.empty(LAYERS, 2, pool, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16).normal_()
        q = torch.randn(args.sequences, Q_HEADS, HEAD_DIM)
        lens = torch.full((args.sequences,), ctx, dtype=torch.int64)
        row = {}
        for name, run in LAYOUTS.items():
            bt = _tables(args.sequences, blocks, pool, run, seed=ctx)
            times = []
            for rep in range(args.repeats + 1):
                t = time.perf_counter()
                for layer in range(LAYERS):
                    attend(q, kv[layer], bt, lens, HEAD_DIM**-0.5)
                if (
                    rep
                ):  # the first pass warms the code, not the data (30 layers outgrow the caches)
                    times.append(time.perf_counter() - t)
            gb = args.sequences * ctx * KV_HEADS * HEAD_DIM * 2 * 2 * LAYERS / 1e9
            row[name] = {
                "best_ms": round(min(times) * 1e3, 2),
                "median_ms": round(statistics.median(times) * 1e3, 2),
                "read_gb_s": round(gb / min(times), 1),
            }
        log(f"kernel, {args.sequences} x {ctx} tokens: {row}")
        out["by_context"][str(ctx)] = row
        del kv
    return out


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def _neighbour_shares(tables: list[list[int]]) -> tuple[float, float]:
    """Of the pairs of blocks next to each other in the tables: the share that are the next block
    in memory, and the share that are the block before (a run read backwards)."""
    pairs = [(a, b) for t in tables for a, b in zip(t, t[1:])]
    n = max(1, len(pairs))
    return sum(b == a + 1 for a, b in pairs) / n, sum(b == a - 1 for a, b in pairs) / n


def engine_child(args) -> dict:
    """One engine, one allocator (args.child), measured as the module docstring says."""
    from pdserve.engine import LLM, SamplingParams

    if args.child == "queue":
        import pdserve.engine.block_manager as bm_mod
        import pdserve.engine.scheduler as sched_mod

        bm_mod._in_memory_order = list  # the queue's own order
        sched_mod._run_end = lambda block_ids: None  # no run to continue
    llm = LLM("smollm2", kv_cache_memory=args.pool_mib << 20, max_num_seqs=64, max_model_len=2048)
    eng = llm.engine
    rng = random.Random(args.seed)
    # churn: staggered requests of random lengths until the free queue is well stirred
    left, live, n = args.churn, set(), 0
    t0 = time.perf_counter()
    while left or live:
        while left and len(live) < 8:
            rid = f"churn-{n}"
            n += 1
            left -= 1
            eng.add_request(
                rid,
                _prompt(rng, rng.randrange(64, args.prompt)),
                SamplingParams(temperature=0, max_tokens=rng.randrange(8, 160), ignore_eos=True),
            )
            live.add(rid)
        for o in eng.step():
            if o.finished:
                live.discard(o.request_id)
    churn_s = time.perf_counter() - t0
    # the measured batch
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    rids = [f"m-{i}" for i in range(args.sequences)]
    for rid in rids:
        eng.add_request(rid, _prompt(rng, args.prompt), params)
    counts = dict.fromkeys(rids, 0)
    steps, tables = [], None
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        made = count_new_tokens(outs, counts)
        if all(counts.values()):
            steps.append((dt, made))
            if tables is None and len(steps) == args.new // 2:
                tables = [list(s.block_ids) for s in eng.scheduler.running]
    decode = steps[1:]  # (the step that gave the last first token is not a decode step)
    tok_s = sum(m for _, m in decode) / sum(d for d, _ in decode)
    llm.shutdown()
    forward, backward = _neighbour_shares(tables or [])
    return {
        "allocator": args.child,
        "churn_requests": args.churn,
        "churn_s": round(churn_s, 1),
        "decode_tok_s": round(tok_s, 1),
        "next_in_memory_share": round(forward, 3),
        "previous_in_memory_share": round(backward, 3),
        "mode": eng.mode_note.split(":")[0],
    }


def engine_part(args) -> dict:
    runs = []
    for r in range(args.rounds):
        for alloc in ("queue", "runs") if r % 2 == 0 else ("runs", "queue"):
            waited = wait_for_idle_machine(args.wait_idle) if args.wait_idle else None
            cmd = [sys.executable, "-m", "benchmarks.engine.kv_locality", "--child", alloc]
            cmd += ["--sequences", str(args.sequences), "--prompt", str(args.prompt)]
            cmd += ["--new", str(args.new), "--churn", str(args.churn)]
            cmd += ["--pool-mib", str(args.pool_mib), "--seed", str(args.seed)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            res = json.loads(done.stdout.strip().splitlines()[-1])
            res["waited_for_idle"] = waited
            log(f"engine round {r}: {res}")
            runs.append(res)
    summary = {}
    for alloc in ("queue", "runs"):
        mine = [x for x in runs if x["allocator"] == alloc]
        summary[alloc] = {
            "decode_tok_s": [x["decode_tok_s"] for x in mine],
            "next_in_memory_share": [x["next_in_memory_share"] for x in mine],
            "previous_in_memory_share": [x["previous_in_memory_share"] for x in mine],
        }
    q, r = (statistics.median(summary[a]["decode_tok_s"]) for a in ("queue", "runs"))
    summary["runs_over_queue"] = round(r / q, 3)
    return {"runs": runs, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument(
        "--parts", nargs="+", default=["kernel", "engine"], choices=["kernel", "engine"]
    )
    ap.add_argument("--sequences", type=int, default=16, help="sequences decoding together")
    ap.add_argument("--contexts", type=int, nargs="+", default=[192, 1024], help="kernel part")
    ap.add_argument("--repeats", type=int, default=10, help="kernel part: passes per layout")
    ap.add_argument("--prompt", type=int, default=768, help="engine part: prompt tokens")
    ap.add_argument("--new", type=int, default=96, help="engine part: new tokens each")
    ap.add_argument("--churn", type=int, default=48, help="engine part: requests before")
    ap.add_argument("--pool-mib", type=int, default=512, help="engine part: KV pool")
    ap.add_argument("--rounds", type=int, default=2, help="engine part: runs of each allocator")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", choices=["queue", "runs"], help=argparse.SUPPRESS)
    add_wait_idle_arg(ap, "each part and engine run")
    add_out_arg(ap, "kv_locality.json")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(engine_child(args)))
        return 0

    def run() -> dict:
        out = {}
        if "kernel" in args.parts:
            waited = wait_for_idle_machine(args.wait_idle) if args.wait_idle else None
            out["kernel"] = {**kernel_part(args), "waited_for_idle": waited}
        if "engine" in args.parts:
            out["engine"] = engine_part(args)
        return out

    return run_and_write("benchmarks.engine.kv_locality", argv, args.out, run)


if __name__ == "__main__":
    raise SystemExit(main())
