"""Memory per rank under pipeline parallelism (issue #53, must-show c).

  python -m benchmarks.engine.pp_memory                # SmolLM2 float32, PP 1, 2 and 3 (~2 min)
  python -m benchmarks.engine.pp_memory --stages 1,2 --kv-mib 128

For each pipeline size, in a fresh process, one engine (LLM("smollm2", dtype float32, no quantization, no
speculation, kv_cache_memory --kv-mib MiB per rank, max_model_len 2048) is built in this process (rank 0, the first
stage) with its other stages in their spawned processes; once it has answered one greedy request,
the resident memory (VmRSS) of every rank's process is read from /proc, and rank 0's own
weight bytes (parameters, buffers and packed linears) and KV bytes are counted. Each rank's RSS includes its Python and torch runtime, so a
spawned process that imports torch and does nothing is measured too ("idle_process_rss_mib") and
subtracted for the "above_idle" figures. The same kv_cache_memory per rank means more blocks per
stage under PP (each block holds fewer layers): the KV bytes per rank stay, the tokens grow.

Writes benchmarks/results/pp_memory.json (--out): the header (command, date, commit, CPU model,
count and ISA flags) and one entry per pipeline size.
"""

from __future__ import annotations

import multiprocessing as mp
import time

from benchmarks.bench_common import add_out_arg, log, proc_status_kb, run_and_write, script_parser


def _idle(conn) -> None:
    import torch  # noqa: F401 - what every rank's process has loaded before its model

    conn.send(proc_status_kb("VmRSS"))
    conn.recv()


def idle_process_rss_kb() -> int:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_idle, args=(child,))
    p.start()
    rss = parent.recv()
    parent.send(None)
    p.join(timeout=30)
    return rss


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def model_bytes(model) -> int:
    """The bytes of every tensor the model holds: parameters and buffers, and the packed or
    quantized weights its linears keep as plain attributes (each storage counted once: a tied
    head shares the embedding's)."""
    import torch

    seen: dict[int, int] = {}

    def add(t) -> None:
        if not isinstance(t, torch.Tensor) or not t.numel():
            return
        if t.is_mkldnn:  # oneDNN's packed layout: no storage to share, its own bytes
            seen[id(t)] = t.numel() * t.element_size()
        else:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for module in model.modules():
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            add(t)
        for value in vars(module).values():
            add(value)
            for inner in getattr(value, "__dict__", {}).values():  # a quantized weight's parts
                add(inner)
    return sum(seen.values())


def _measure_child(conn, pp: int, kv_mib: int) -> None:
    try:
        conn.send(measure(pp, kv_mib))
    except BaseException as e:  # the parent reports it
        conn.send({"error": repr(e)})


def measure_in_process(pp: int, kv_mib: int) -> dict:
    """measure() in a fresh process, so that no earlier engine's memory is in rank 0's RSS."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_measure_child, args=(child, pp, kv_mib))
    p.start()
    out = parent.recv()
    p.join(timeout=60)
    return out


def measure(pp: int, kv_mib: int) -> dict:
    import os

    import torch

    from pdserve.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        "smollm2",
        dtype="float32",
        quantization=None,
        speculative_config=None,
        pipeline_parallel_size=pp,
        kv_cache_memory=kv_mib << 20,
        max_model_len=2048,
    )
    try:
        load_s = time.perf_counter() - t0
        out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
        eng = llm.engine
        runner = eng.runner
        weight_bytes = model_bytes(runner.model)
        kv = runner.kv_cache
        pids = [os.getpid()] + ([p.pid for p in eng.tp.procs] if eng.tp is not None else [])
        return {
            "pipeline_parallel_size": pp,
            "load_s": round(load_s, 1),
            "answer": out[0].outputs[0].text,
            "rank0_layers": int(kv.shape[0]),
            "rank0_weight_mib": round(weight_bytes / 2**20, 1),
            "rank0_kv_mib": round(kv.numel() * kv.element_size() / 2**20, 1),
            "kv_blocks": runner.num_blocks,
            "rss_mib_per_rank": [round((rss_kb(p) or 0) / 1024, 1) for p in pids],
            "torch_threads": torch.get_num_threads(),
        }
    finally:
        llm.shutdown()


def main(argv=None) -> int:
    ap = script_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="1,2,3", help="pipeline sizes, comma-separated")
    ap.add_argument("--kv-mib", type=int, default=256, help="kv_cache_memory per rank, MiB")
    add_out_arg(ap, "pp_memory.json")
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]

    def run() -> dict:
        idle = idle_process_rss_kb() / 1024
        runs = []
        for pp in stages:
            log(f"pipeline_parallel_size={pp}")
            r = measure_in_process(pp, args.kv_mib)
            if "error" in r:
                raise RuntimeError(f"pipeline_parallel_size={pp}: {r['error']}")
            r["rss_above_idle_mib_per_rank"] = [round(x - idle, 1) for x in r["rss_mib_per_rank"]]
            log(f"  {r}")
            runs.append(r)
        return {
            "kv_cache_mib_per_rank": args.kv_mib,
            "idle_process_rss_mib": round(idle, 1),
            "runs": runs,
        }

    return run_and_write("benchmarks.engine.pp_memory", argv, args.out, run)


if __name__ == "__main__":
    raise SystemExit(main())
