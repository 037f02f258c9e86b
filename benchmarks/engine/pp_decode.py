"""Decode under pipeline parallelism at equal cores (issue #53: does decode in stages pay?).

  python -m benchmarks.engine.pp_decode                        # 1, 8 and 32 streams
  python -m benchmarks.engine.pp_decode --quick                # a smoke run: 1 and 8, 16 tokens
  python -m benchmarks.engine.pp_decode --streams 1,8,32 --layouts pp1,pp2,tp2 --wait-idle 120

For each layout (pp1: one rank with every core; pp2: two pipeline stages; tp2: two tensor-parallel
ranks; each rank of a layout gets the cores divided by its ranks, as engine/tp.py sets them, the
split of benchmarks/engine/pp_prefill.py), in a fresh process, one engine (dtype float32, no
quantization, no speculation, no prefix cache) answers a warm-up, then for each stream count N
decodes N concurrent streams together: prompts of --prompt-len random tokens, --new-tokens new
tokens each, greedy, ignore_eos. It reports decode tokens per second from the moment every stream
has its first token to the end (the prefill excluded), as benchmarks/engine/bench.py measures
pdserve's decode-only tok/s from the time around each engine step; the median time of a step that
decodes every stream; each rank's CPU seconds over the decode phase (`rank_cpu_s`, rank order);
and, for pp2 and tp2, how many of the N streams' greedy tokens equal pp1's.

What a decode step does in stages (engine/model_runner.py): `_micro_batches` cuts only a step
that prefills one sequence's chunk of 256 tokens or more; a decode step (N sequences of one token
each, or one sequence's one token) runs whole through `_forward`. It samples, so `_wants_final`
holds: the first stage runs its layers, hands the hidden states on and waits for the last stage's
final hidden states, computes the logits and samples, and only then can the engine plan the next
step, whose tokens are the ones just sampled. The stages take turns, never overlap: each stage
idles while the other computes, and a token pays every stage's layers in sequence plus two
hand-offs, each stage on its share of the cores. So PP=2 runs the same layers' work as PP=1,
one half after the other, each half on half the cores, and pays the hand-offs and the idle
halves: it can beat PP=1 only where a layer runs faster on half the cores than on all of them
(small decode matrices whose threads cost more than they share). TP=2 runs both halves of every
layer at once and pays an all-reduce after each layer's attention and MLP instead. This is what
deploy/config/schema.py's refusal of `pp > 1` on decode and colocated pools rests on.

SmolLM2's 9 heads of 64 cannot be split between two tensor-parallel ranks, so the default
`--model twelve-heads` runs every layout on pp_prefill's random-weight model of SmolLM2's shape
with 12 heads of 48 (4 KV heads): the same weights' bytes and FLOPs per token. Its greedy tokens
are those of random weights, where near ties are common, so tp2 (whose all-reduce adds the
partial sums in another order) may part from pp1 where pp2 (the same additions in the same order)
does not. `--model smollm2` runs the real model (tp2 is then refused, and reported as such).

Writes benchmarks/results/pp_decode.json (--out): the header (command, date, commit, CPU model,
count and ISA flags) and one entry per layout and stream count.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from benchmarks.bench_common import (
    SEED_DECODE,
    add_out_arg,
    add_wait_idle_arg,
    count_new_tokens,
    log,
    median,
    random_prompts,
    run_and_write,
    script_parser,
    wait_for_idle_machine,
)
from benchmarks.engine.pp_prefill import LAYOUTS, layouts_and_model

SEED_WARMUP = 53


def measure(
    pp: int, tp: int, streams: list[int], prompt_len: int, new_tokens: int, model: str
) -> dict:
    """One layout's runs, in this process: per stream count, its figures and its streams' greedy
    tokens (`tokens`, which the parent compares across layouts and leaves out of the file)."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="float32",
        quantization=None,
        speculative_config=None,
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        enable_prefix_caching=False,
        max_model_len=prompt_len + new_tokens,
        max_num_seqs=max(streams),
    )
    try:
        eng = llm.engine
        # a warm-up of two streams, prompts of the measured length (within max_model_len)
        warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        llm.generate(random_prompts(SEED_WARMUP, 2, prompt_len), warm, use_tqdm=False)
        ranks = [os.getpid()] + [p.pid for p in (eng.tp.procs if eng.tp else [])]
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        runs = []
        for n in streams:
            prompts = random_prompts(SEED_DECODE + n, n, prompt_len)
            run = _decode(eng, params, prompts, ranks, f"n{n}")
            fit = eng.runner.thread_fit  # (engine/threads.py: rank 0's count, refitted)
            run["rank0_threads_after"] = fit.threads if fit is not None else None
            runs.append({"streams": n, **run})
        return {"pipeline_parallel_size": pp, "tensor_parallel_size": tp, "runs": runs}
    finally:
        llm.shutdown()


def _decode(eng, params, prompts: list[list[int]], ranks: list[int], tag: str) -> dict:
    """Runs the prompts together to their end, stepping the engine, as bench.py's decode_steps:
    the decode phase starts after the step that gave the last stream its first token."""
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        eng.add_request(rid, p, params)
    got = dict.fromkeys(rids, 0)
    final: dict = {}
    steps = []  # (end, duration, tokens produced), after every stream had its first token
    cpu0 = t_first_all = None
    t_prev = time.perf_counter()
    while len(final) < len(rids):
        outs = eng.step()
        t_now = time.perf_counter()
        produced = count_new_tokens(outs, got, final)
        if t_first_all is not None:
            steps.append((t_now, t_now - t_prev, produced))
        elif all(got.values()):
            t_first_all, cpu0 = t_now, [_cpu_s(pid) for pid in ranks]
        t_prev = t_now
        if not outs and not eng.has_unfinished_requests() and len(final) < len(rids):
            raise RuntimeError("engine went idle before every stream finished")
    cpu = [round(b - a, 2) for a, b in zip(cpu0, (_cpu_s(pid) for pid in ranks))]
    tokens = [list(final[r].outputs[0].token_ids) for r in rids]
    if any(len(t) != params.max_tokens for t in tokens):
        raise RuntimeError("a stream did not produce exactly new_tokens")
    decode_tokens = sum(s[2] for s in steps)
    decode_time = steps[-1][0] - t_first_all if steps else 0.0
    full = [s[1] for s in steps if s[2] == len(rids)]  # steps that decode every stream
    return {
        "decode_tokens": decode_tokens,
        "decode_time_s": round(decode_time, 3),
        "decode_tok_s": round(decode_tokens / decode_time, 1) if decode_time > 0 else None,
        "median_step_s": round(median(full), 5) if full else None,
        "decode_steps": len(steps),
        # each rank's CPU seconds (user + system) over the decode phase, rank order: a stage
        # that waits for the other does not use its cores
        "rank_cpu_s": cpu,
        "tokens": tokens,
    }


def _cpu_s(pid: int) -> float:
    """Process `pid`'s CPU seconds (user + system, every thread) so far."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _child(conn, *args) -> None:
    try:
        conn.send(measure(*args))
    except BaseException as e:  # the parent reports it
        conn.send({"error": repr(e)})


def measure_in_process(*args) -> dict:
    """`measure(*args)` in a fresh process (its engine, its ranks, its threads)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(child, *args))
    p.start()
    out = parent.recv()
    p.join(timeout=60)
    return out


def same_streams(results: dict) -> dict:
    """Per layout other than pp1: per stream count, how many streams' greedy tokens equal pp1's.
    Drops every run's tokens from `results` (they do not go into the file)."""
    base = results.get("pp1", {})
    out = {}
    for name, r in results.items():
        if "error" in r or name == "pp1" or "error" in base or not base:
            continue
        ref = {b["streams"]: b["tokens"] for b in base["runs"]}
        out[name] = {
            str(run["streams"]): sum(a == b for a, b in zip(run["tokens"], ref[run["streams"]]))
            for run in r["runs"]
            if run["streams"] in ref
        }
    for r in results.values():
        for run in r.get("runs", []):
            run.pop("tokens", None)
    return out


def main(argv=None) -> int:
    ap = script_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,8,32", help="stream counts, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=128, help="each stream's prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=128, help="each stream's new tokens")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: --streams 1,8 --new-tokens 16 (the figures mean little)",
    )
    ap.add_argument("--layouts", default="pp1,pp2,tp2", help=f"of {', '.join(LAYOUTS)}")
    ap.add_argument(
        "--model",
        default="twelve-heads",
        choices=("smollm2", "twelve-heads"),
        help="twelve-heads (default): SmolLM2's shape in 12 heads of 48, which TP=2 can split",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="twelve-heads only: this many decoder layers of its shape instead of 30 (faster)",
    )
    add_wait_idle_arg(ap, "each layout")
    add_out_arg(ap, "pp_decode.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.streams, args.new_tokens = "1,8", 16
    streams = [int(x) for x in args.streams.split(",")]
    if min(streams) < 1 or args.prompt_len < 1 or args.new_tokens < 2:
        ap.error("streams and --prompt-len must be >= 1, --new-tokens >= 2 (a decode step)")
    layouts, model = layouts_and_model(ap, args)

    def run() -> dict:
        results = {}
        for name in layouts:
            if args.wait_idle:
                wait_for_idle_machine(args.wait_idle)
            log(name)
            r = measure_in_process(*LAYOUTS[name], streams, args.prompt_len, args.new_tokens, model)
            for run in r.get("runs", []):
                shown = {k: v for k, v in run.items() if k != "tokens"}
                log(f"  {shown}")
            if "error" in r:  # a layout the model refuses (TP=2 of SmolLM2's 9 heads) says why
                log(f"  {r}")
            results[name] = r
        identical = same_streams(results)
        ratios = {}
        if "pp1" in results and "error" not in results["pp1"]:
            for name, r in results.items():
                if "error" in r:
                    continue
                ratios[f"{name}/pp1 decode_tok_s"] = [
                    round(a["decode_tok_s"] / b["decode_tok_s"], 3)
                    if a["decode_tok_s"] and b["decode_tok_s"]
                    else None
                    for a, b in zip(r["runs"], results["pp1"]["runs"])
                ]
        return {
            "model": args.model,
            "layers": args.layers,
            "streams": streams,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "layouts": results,
            # per layout, per stream count: the streams whose greedy tokens equal pp1's
            "identical_streams_vs_pp1": identical,
            "ratios": ratios,
        }

    return run_and_write("benchmarks.engine.pp_decode", argv, args.out, run)


if __name__ == "__main__":
    raise SystemExit(main())
