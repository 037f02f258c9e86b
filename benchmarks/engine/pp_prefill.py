"""Prefill under pipeline parallelism at equal cores (issue #53, must-show d).

  python -m benchmarks.engine.pp_prefill                       # 2,048 and 8,000 tokens (~4 min)
  python -m benchmarks.engine.pp_prefill --lengths 2048,4096,8000 --layouts pp1,pp2,tp2
  python -m benchmarks.engine.pp_prefill --model twelve-heads --handoff --layouts pp1,pp2
  python -m benchmarks.engine.pp_prefill --model twelve-heads --layers 4 --handoff --layouts pp2 \
      --kv-backend nixl --out /tmp/pp_nixl.json  # another KV backend (--kv-backend)

For each layout (pp1: one rank with every core; pp2: two pipeline stages; tp2: two tensor-parallel
ranks; each rank of a layout gets the cores divided by its ranks, as engine/tp.py sets them), in a
fresh process, one engine (LLM("smollm2", dtype float32, no quantization, no speculation, no
prefix cache) answers one warm-up prompt, then for each length one fresh random prompt with
max_tokens=1: its time to first token, and prompt tokens per second. A prefill step of one
sequence runs in micro-batches through the stages (engine/model_runner.py `_micro_batches`), so
PP=2's stages overlap except for the pipeline's fill and drain, the bubble this reports against
PP=1: `pp2 / pp1` TTFT. Each step of a long prompt holds at most max_num_batched_tokens (2048),
and prefill_step_target_s (0.5 s) cuts one longer than that into chunks of about half a second
each, a few dozen tokens deep into 8,000; the chunks before the last pipeline across steps
(engine/model_runner.py `_hand_on`). Each run records the torch thread count rank 0 had after it
(`rank0_threads_after`): one rank's engine refits it to the cores that are free
(engine/threads.py), so on a busy machine PP=1 may run on fewer threads than it started with,
and each rank's CPU seconds during it (`rank_cpu_s`, rank order: a stage that waits for the other
does not use its core, and the work done does not depend on how the ranks overlap).

SmolLM2's 9 heads of 64 (3 KV heads) cannot be split between two tensor-parallel ranks, so
`--model twelve-heads` runs every layout on a random-weight model of SmolLM2's shape with its
attention cut into 12 heads of 48 (4 KV heads): the same hidden size, projections, layers and
vocabulary, so the same weights' bytes and the same FLOPs per token, and TP=2 splits it. A
prefill's time does not depend on the weights' values.

`--handoff` measures a prefill worker instead of an engine: in the layout's process a decode
worker of one rank (the shm KV backend, or `--kv-backend`'s) and a prefill worker whose engine
has the layout's ranks, both in-process, and per prompt Reserve on the decode worker then Prefill
on the prefill worker (the prompt's KV handed off layer by layer, each later stage pushing its
own: engine/kv_publish.py): `ttft_s` is from the Reserve to the Prefill's reply (first token
sampled, every frame flushed), `prefill_s` the prefill worker's own span of it (its arrival to
its transfer end), `tail_s` the part of that after the first token was sampled (the commit and
the last frames handed over).

Writes benchmarks/results/pp_prefill.json (--out; with --handoff pp_prefill_handoff.json): the header (command, date, commit, CPU model,
count and ISA flags) and one entry per layout and length.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from benchmarks.bench_common import (
    add_out_arg,
    add_wait_idle_arg,
    log,
    random_llama,
    random_prompts,
    run_and_write,
    script_parser,
    wait_for_idle_machine,
)

LAYOUTS = {"pp1": (1, 1), "pp2": (2, 1), "tp2": (1, 2)}  # name: (pipeline, tensor) sizes
SEED = 53


def twelve_heads_model(layers: int | None = None) -> str:
    """SmolLM2's shape with 12 attention heads of 48 and 4 KV heads, random weights, written once
    into the pdserve cache (with SmolLM2's tokenizer files); its folder. `layers`: that many
    decoder layers of the same shape instead of SmolLM2's 30 (a shorter run to iterate on)."""
    from transformers import AutoConfig

    from pdserve.engine.loader import resolve_model

    config = AutoConfig.from_pretrained(resolve_model("smollm2"))
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 12, 4, 48
    if layers:
        config.num_hidden_layers = layers
    name = "smollm2-shape-12-heads" + (f"-{layers}-layers" if layers else "")
    return random_llama(name, config, SEED)


def layouts_and_model(ap, args) -> tuple[list[str], object]:
    """--layouts checked against LAYOUTS, and the model --model and --layers name (this script's
    and pp_decode.py's options); argparse's error for a bad one."""
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        ap.error(f"--layouts: unknown {unknown}; choose from {list(LAYOUTS)}")
    if args.layers is not None and (args.model != "twelve-heads" or args.layers < 2):
        ap.error("--layers needs --model twelve-heads and at least 2 layers (one a stage)")
    return layouts, twelve_heads_model(args.layers) if args.model == "twelve-heads" else "smollm2"


def measure(
    pp: int, tp: int, lengths: list[int], model: str = "smollm2", step_target_s: float = 0.5
) -> dict:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="float32",
        quantization=None,
        speculative_config=None,
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        enable_prefix_caching=False,
        max_model_len=max(lengths) + 1,  # (one token to answer)
        prefill_step_target_s=step_target_s,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=1)
        llm.generate([random_prompts(SEED - 1, 1, 256)[0]], params, use_tqdm=False)  # warm-up
        runs = []
        ranks = [os.getpid()] + [p.pid for p in (llm.engine.tp.procs if llm.engine.tp else [])]
        for n in lengths:
            prompt = random_prompts(SEED, 1, n)[0]
            cpu0 = [_cpu_s(pid) for pid in ranks]
            start_mono = time.monotonic()
            t0 = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            ttft = time.perf_counter() - t0
            cpu = [round(b - a, 2) for a, b in zip(cpu0, (_cpu_s(pid) for pid in ranks))]
            steps = sum(1 for r in llm.engine.step_trace if r.start >= start_mono)
            fit = llm.engine.runner.thread_fit  # (engine/threads.py: rank 0's count, refitted)
            runs.append(
                {
                    "prompt_tokens": n,
                    "ttft_s": round(ttft, 3),
                    "tok_s": round(n / ttft, 1),
                    "rank0_threads_after": fit.threads if fit is not None else None,
                    # each rank's CPU seconds (user + system) during the prompt, rank order
                    "rank_cpu_s": cpu,
                    "steps": steps,  # the engine steps the prompt took (its chunks)
                }
            )
        return {"pipeline_parallel_size": pp, "tensor_parallel_size": tp, "runs": runs}
    finally:
        llm.shutdown()


def measure_handoff(
    pp: int,
    tp: int,
    lengths: list[int],
    model: str = "smollm2",
    step_target_s: float = 0.5,
    kv_backend: str = "shm",
) -> dict:
    """`measure`'s runs through a prefill worker of the layout handing off to a decode worker
    (see --handoff in the module docstring)."""
    import grpc

    from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
    from pdserve.prefill_worker.server import PrefillWorker, PrefillWorkerConfig
    from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc

    engine = dict(
        dtype="float32",
        quantization=None,
        speculative_config=None,
        enable_prefix_caching=False,
        max_model_len=max(lengths) + 1,
        kv_cache_memory=768 << 20,
    )
    decode = DecodeWorker(
        DecodeWorkerConfig(model=model, worker_id="d0", engine_kwargs=engine, kv_backend=kv_backend)
    ).start()
    staged = dict(pipeline_parallel_size=pp, tensor_parallel_size=tp)
    try:
        prefill = PrefillWorker(
            PrefillWorkerConfig(
                model=model,
                worker_id="p0",
                engine_kwargs=dict(engine, prefill_step_target_s=step_target_s, **staged),
                prefill_timeout_s=900.0,
            )
        ).start()
    except BaseException:
        decode.stop()
        raise
    channels = [grpc.insecure_channel(w.address) for w in (decode, prefill)]
    d = worker_pb2_grpc.DecodeWorkerStub(channels[0])
    p = worker_pb2_grpc.PrefillWorkerStub(channels[1])
    sampling = pdserve_pb2.SamplingParams(temperature=0, max_tokens=1)

    def handoff(rid: str, prompt: list[int]):
        t0 = time.perf_counter()
        res = d.Reserve(
            worker_pb2.ReserveRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling, lease_ms=120_000
            ),
            timeout=60,
        )
        reply = p.Prefill(
            worker_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling, reservation=res
            ),
            timeout=900,
        )
        ttft = time.perf_counter() - t0
        list(d.Stream(worker_pb2.StreamRequest(request_id=rid), timeout=60))
        return ttft, reply

    try:
        engine_ = prefill.loop.engine
        handoff("warm-up", random_prompts(SEED - 1, 1, 256)[0])
        runs = []
        ranks = [os.getpid()] + [p.pid for p in (engine_.tp.procs if engine_.tp else [])]
        for n in lengths:
            prompt = random_prompts(SEED, 1, n)[0]
            cpu0 = [_cpu_s(pid) for pid in ranks]
            start_mono = time.monotonic()
            ttft, reply = handoff(f"prompt-{n}", prompt)
            cpu = [round(b - a, 2) for a, b in zip(cpu0, (_cpu_s(pid) for pid in ranks))]
            t = reply.timings
            runs.append(
                {
                    "prompt_tokens": n,
                    "ttft_s": round(ttft, 3),
                    "tok_s": round(n / ttft, 1),
                    "prefill_s": round(
                        (t.transfer_end_unix_ns - t.prefill_arrival_unix_ns) / 1e9, 3
                    ),
                    "tail_s": round((t.transfer_end_unix_ns - t.prefill_end_unix_ns) / 1e9, 4),
                    "bytes_sent": reply.bytes_sent,
                    # every CPU second of this process (both workers' rank 0 and the decode
                    # side's receiving) and each follower rank's, rank order
                    "rank_cpu_s": cpu,
                    "steps": sum(1 for r in engine_.step_trace if r.start >= start_mono),
                }
            )
        return {"pipeline_parallel_size": pp, "tensor_parallel_size": tp, "runs": runs}
    finally:
        for c in channels:
            c.close()
        prefill.stop()
        decode.stop()


def _cpu_s(pid: int) -> float:
    """Process `pid`'s CPU seconds (user + system, every thread) so far."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _child(
    conn,
    pp: int,
    tp: int,
    lengths: list[int],
    model: str,
    target: float,
    handoff: bool,
    kv_backend: str = "shm",
) -> None:
    try:
        if handoff:
            conn.send(measure_handoff(pp, tp, lengths, model, target, kv_backend))
        else:
            conn.send(measure(pp, tp, lengths, model, target))
    except BaseException as e:  # the parent reports it
        conn.send({"error": repr(e)})


def measure_in_process(
    pp: int,
    tp: int,
    lengths: list[int],
    model: str = "smollm2",
    step_target_s: float = 0.5,
    handoff: bool = False,
    kv_backend: str = "shm",
) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(
        target=_child,
        args=(child, pp, tp, lengths, model, step_target_s, handoff, kv_backend),
    )
    p.start()
    out = parent.recv()
    p.join(timeout=60)
    return out


def main(argv=None) -> int:
    ap = script_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,8000", help="prompt lengths, comma-separated")
    ap.add_argument("--layouts", default="pp1,pp2,tp2", help=f"of {', '.join(LAYOUTS)}")
    ap.add_argument(
        "--model",
        default="smollm2",
        choices=("smollm2", "twelve-heads"),
        help="twelve-heads: SmolLM2's shape in 12 heads of 48, which TP=2 can split",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="twelve-heads only: this many decoder layers of its shape instead of 30 (faster)",
    )
    ap.add_argument(
        "--prefill-step-target-s",
        type=float,
        default=0.5,
        help="the engine's prefill_step_target_s (default 0.5, its default; 0: every chunk of a "
        "long prompt takes the whole token budget)",
    )
    ap.add_argument(
        "--handoff",
        action="store_true",
        help="a prefill worker of each layout handing off to a decode worker (module docstring)",
    )
    ap.add_argument(
        "--kv-backend",
        default="shm",
        choices=("shm", "grpc", "torch", "nixl"),
        help="--handoff only: the decode worker's KV backend, which every stage pushes over "
        "(default shm)",
    )
    add_wait_idle_arg(ap, "each layout")
    add_out_arg(ap, "pp_prefill.json")
    args = ap.parse_args(argv)
    if args.handoff and args.out == ap.get_default("out"):  # (the engine-only figures stay)
        args.out = args.out.replace("pp_prefill.json", "pp_prefill_handoff.json")
    lengths = [int(x) for x in args.lengths.split(",")]
    layouts, model = layouts_and_model(ap, args)

    def run() -> dict:
        results = {}
        for name in layouts:
            if args.wait_idle:
                wait_for_idle_machine(args.wait_idle)
            log(f"{name}")
            r = measure_in_process(
                *LAYOUTS[name],
                lengths,
                model,
                args.prefill_step_target_s,
                args.handoff,
                args.kv_backend,
            )
            log(f"  {r}")  # a layout the model refuses (TP=2 of SmolLM2's 9 heads) says why
            results[name] = r
        ratios = {}
        if "pp1" in results:
            for name, r in results.items():
                if "error" in r:
                    continue
                ratios[f"{name}/pp1 ttft"] = [
                    round(a["ttft_s"] / b["ttft_s"], 3)
                    for a, b in zip(r["runs"], results["pp1"]["runs"])
                ]
        return {
            "model": args.model,
            "layers": args.layers,
            "prefill_step_target_s": args.prefill_step_target_s,
            "handoff": args.handoff,
            "kv_backend": args.kv_backend if args.handoff else None,
            "lengths": lengths,
            "layouts": results,
            "ratios": ratios,
        }

    return run_and_write("benchmarks.engine.pp_prefill", argv, args.out, run)


if __name__ == "__main__":
    raise SystemExit(main())
