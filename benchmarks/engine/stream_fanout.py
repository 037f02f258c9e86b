"""What a decode worker's streams cost beside its engine (issue #45: many streams on one worker).

  python -m benchmarks.engine.stream_fanout                      # 32 and 256 streams
  python -m benchmarks.engine.stream_fanout --streams 256 --new-tokens 300 --wait-idle 30
  python -m benchmarks.engine.stream_fanout --device cuda --tokenizer-dir .gpu/smollm2  # a GPU
  python -m benchmarks.engine.stream_fanout --streams 256 --modes engine,router_grpc,router_http \
      --stream-interval 1,8          # router.stream_interval: the worker sends k tokens a time

A decode step of a small model on a GPU is short, so at many streams the host's work per stream
decides a worker's pace. This measures it on any machine with a model whose step is short: SmolLM2's
tokenizer over a random two-layer llama 64 wide with a 512-token vocabulary (written once into
the pdserve cache), one torch thread. For each stream count N it runs, each in a fresh process:

- the engine alone (LLMEngine.step in a loop, with the settings a decode worker gives its
  requests: outputs that carry only what is new, no text);
- a DecodeWorker serving the same N requests colocated (Reserve with run_prefill), N client
  threads in this process reading their events as the router does, all on one Streams call
  (router/decode_streams.py: `worker`), and each on a Stream call of its own
  (`worker_stream_each`, how the router read them before);
- a colocated Router in a process of its own in front of that worker, the N streams its
  clients' Generate calls (`router_grpc`: all on one grpc.aio event loop of this process) or
  streamed /v1/completions over its HTTP front (`router_http`: a thread of this process each).

Each takes tokens per second between a quarter and three quarters of all the tokens (the prompts'
steps and the last stragglers left out), and the worker's CPU seconds over that window from /proc
(its process alone; the router's and the clients' are counted apart). A step's time is the
window over the tokens each stream received in it. The router modes also give the clients' tokens
per message (the whole run's): a stream interval's groups, or what the router joined when it fell
behind. With --stream-interval the worker and router modes run once per interval k (named
`worker_intervalk` and so on for k > 1). With --device cuda the engines run on the GPU, as a GPU
worker's do (decode graphs, bursts of greedy steps); scripts/gpu_checks.sh runs that as its
`fanout` part. Writes benchmarks/results/stream_fanout.json (--out): the header (command, date,
commit, CPU model and flags) and one entry per stream count.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import threading
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

MODES = ("engine", "worker", "worker_stream_each", "router_grpc", "router_http")
PROMPT_LEN = 32
SEED = 59
VOCAB = 512  # the random prompts' ids stay below it; the worker makes no text from them


def small_model(tokenizer_dir: str | None = None) -> str:
    """A random two-layer llama 64 wide (SmolLM2's tokenizer files, from `tokenizer_dir` where
    given; a 512-token vocabulary), written once into the pdserve cache; its folder."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    return random_llama("llama-2-layers-64-wide", config, SEED, tokenizer_dir)


def _engine_kwargs(streams: int, new_tokens: int, device: str) -> dict:
    return dict(
        device=device,
        kv_cache_memory=1 << 30,
        max_num_seqs=streams,
        max_model_len=PROMPT_LEN + new_tokens + 64,
        speculative_config=None,
        quantization=None,
        dtype="float32",
    )


def _prompts(streams: int) -> list[list[int]]:
    return [[t % VOCAB for t in p] for p in random_prompts(SEED, streams, PROMPT_LEN)]


def _window(total: int, count, cpus: dict) -> dict:
    """Waits for the tokens between a quarter and three quarters of `total` (count() so far);
    their seconds, their tokens, and under each name of `cpus` the CPU seconds its clock says
    went by meanwhile."""
    while count() < total // 4:
        time.sleep(0.002)
    t0, c0 = time.perf_counter(), count()
    s0 = {name: clock() for name, clock in cpus.items()}
    while count() < 3 * total // 4:
        time.sleep(0.002)
    out = {"s": time.perf_counter() - t0, "tokens": count() - c0}
    return out | {name: clock() - s0[name] for name, clock in cpus.items()}


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _engine_alone(conn, model: str, streams: int, new_tokens: int, device: str) -> None:
    import torch

    from pdserve.engine import LLM, RequestOutputKind, SamplingParams

    torch.set_num_threads(1)
    engine = LLM(model, **_engine_kwargs(streams, new_tokens, device)).engine
    # as a worker does once started (worker_common/process.py): the cyclic GC's passes over the
    # startup heap would otherwise count against the engine alone and not against the worker
    gc.collect()
    gc.freeze()
    params = SamplingParams(
        temperature=0,
        max_tokens=new_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
    )
    for i, p in enumerate(_prompts(streams)):
        engine.add_request(f"e{i}", p, params)
    got = [0]
    result = {}

    def step_all():
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[0] += sum(len(c.token_ids) for c in out.outputs)

    stepper = threading.Thread(target=step_all)
    stepper.start()
    result = _window(streams * new_tokens, lambda: got[0], {"cpu_s": _self_cpu})
    stepper.join()
    conn.send(result)


def _worker(conn, model: str, streams: int, new_tokens: int, device: str) -> None:
    import torch

    from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig

    torch.set_num_threads(1)
    config = DecodeWorkerConfig(
        model=model, worker_id="fanout", engine_kwargs=_engine_kwargs(streams, new_tokens, device)
    )
    worker = DecodeWorker(config).start()
    conn.send(worker.address)
    conn.recv()  # the clients are done
    worker.stop()


def _router(conn, model: str, worker_address: str, streams: int, interval: int) -> None:
    from pdserve.router.server import Router, RouterConfig

    router = Router(
        RouterConfig(
            model=model,
            decode_addresses=(worker_address,),
            colocated=True,
            max_inflight=streams,
            http_port=0,
            stream_interval=interval,
        )
    ).start()
    conn.send((router.address, router.http_address))
    conn.recv()  # the clients are done
    router.stop()


def _grpc_clients(
    address: str, new_tokens: int, prompts: list[list[int]], counts: list[int], msgs: list[int]
):
    """One thread whose event loop streams every prompt's tokens through the router's Generate
    at once (grpc.aio: cheaper per message than a thread a call, as a client elsewhere would
    be), adding each response's token count to counts[i] and one to msgs[i]."""
    import asyncio

    import grpc.aio

    from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

    sampling = pdserve_pb2.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def one(stub, i: int, prompt: list[int]) -> None:
        request = pdserve_pb2.GenerateRequest(
            token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=sampling
        )
        async for response in stub.Generate(request):
            if response.delta.token_ids:
                counts[i] += len(response.delta.token_ids)
                msgs[i] += 1

    async def all_of_them() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            await asyncio.gather(*(one(stub, i, p) for i, p in enumerate(prompts)))

    return threading.Thread(target=asyncio.run, args=(all_of_them(),))


def _http_client(address: str, new_tokens: int):
    """The same over the HTTP front: a streamed /v1/completions per prompt, its tokens counted
    from each chunk's token_ids (vLLM's return_token_ids), and its chunks that carry some."""
    import http.client
    import json

    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", "/v1/models")
    model_id = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()

    def one(i: int, prompt: list[int], counts: list[int], msgs: list[int]) -> None:
        body = {
            "model": model_id,
            "prompt": prompt,
            "max_tokens": new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        client = http.client.HTTPConnection(host, int(port), timeout=600)
        client.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = client.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        for line in response:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if choice.get("token_ids"):
                        counts[i] += len(choice["token_ids"])
                        msgs[i] += 1
        client.close()

    return one


def _through_router(
    model: str, streams: int, new_tokens: int, via: str, device: str, interval: int
) -> dict:
    """A colocated router (router.stream_interval `interval`) in front of a worker, each in a
    process of its own; the streams' clients are threads of this one."""
    ours, theirs = mp.Pipe()
    ctx = mp.get_context("spawn")
    worker = ctx.Process(target=_worker, args=(theirs, model, streams, new_tokens, device))
    worker.start()
    r_ours, r_theirs = mp.Pipe()
    router = ctx.Process(target=_router, args=(r_theirs, model, ours.recv(), streams, interval))
    router.start()
    try:
        grpc_address, http_address = r_ours.recv()
        counts, msgs = [0] * streams, [0] * streams
        if via == "grpc":
            clients = [_grpc_clients(grpc_address, new_tokens, _prompts(streams), counts, msgs)]
        else:
            one = _http_client(http_address, new_tokens)
            clients = [
                threading.Thread(target=one, args=(i, p, counts, msgs))
                for i, p in enumerate(_prompts(streams))
            ]
        for t in clients:
            t.start()
        cpus = {
            "cpu_s": lambda: _proc_cpu_s(worker.pid),
            "router_cpu_s": lambda: _proc_cpu_s(router.pid),
            "client_cpu_s": _self_cpu,
        }
        result = _window(streams * new_tokens, lambda: sum(counts), cpus)
        for t in clients:
            t.join()
        return result | {"tokens_per_message": round(sum(counts) / max(1, sum(msgs)), 2)}
    finally:
        for conn, proc in ((r_ours, router), (ours, worker)):
            conn.send("done")
            proc.join(60)
            if proc.is_alive():
                proc.kill()


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _through_worker(
    model: str, streams: int, new_tokens: int, via: str, device: str, interval: int = 1
) -> dict:
    """A DecodeWorker in a process of its own, the streams read by threads of this one, their
    Reserves with ReserveRequest.stream_interval `interval`."""
    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc
    from pdserve.router.decode_streams import DecodeStreams

    ours, theirs = mp.Pipe()
    proc = mp.get_context("spawn").Process(
        target=_worker, args=(theirs, model, streams, new_tokens, device)
    )
    proc.start()
    try:
        stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(ours.recv()))
        shared = DecodeStreams(stub, "fanout")  # the router's way: one call for every stream
        counts = [0] * streams
        sampling = pdserve_pb2.SamplingParams(
            max_tokens=new_tokens, temperature=0.0, ignore_eos=True
        )

        def one(i: int, prompt: list[int]) -> None:
            rid = f"s{i}"
            stub.Reserve(
                worker_pb2.ReserveRequest(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    run_prefill=True,
                    sampling=sampling,
                    stream_interval=interval,
                )
            )
            if via == "streams":
                events = shared.open(rid, None)
            else:  # a call of its own
                events = stub.Stream(worker_pb2.StreamRequest(request_id=rid))
            for event in events:
                counts[i] += len(event.token_ids)

        clients = [
            threading.Thread(target=one, args=(i, p)) for i, p in enumerate(_prompts(streams))
        ]
        for t in clients:
            t.start()
        cpus = {"cpu_s": lambda: _proc_cpu_s(proc.pid), "client_cpu_s": _self_cpu}
        result = _window(streams * new_tokens, lambda: sum(counts), cpus)
        for t in clients:
            t.join()
        return result
    finally:
        ours.send("done")
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def _in_process(fn, *args) -> dict:
    ours, theirs = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=fn, args=(theirs, *args))
    proc.start()
    result = ours.recv()
    proc.join(60)
    return result


def _shape(r: dict, streams: int) -> dict:
    """Per step: the window's seconds and CPU over the steps it held (tokens / streams)."""
    steps = r["tokens"] / streams
    out = {
        "tok_s": round(r["tokens"] / r["s"], 1),
        "ms_per_step": round(r["s"] / steps * 1e3, 2),
    }
    for key in ("cpu_s", "router_cpu_s", "client_cpu_s"):  # the worker's, the router's, ours
        if key in r:
            out[f"{key[:-2]}_ms_per_step"] = round(r[key] / steps * 1e3, 2)
    if "tokens_per_message" in r:  # the clients' (the whole run's, not the window's)
        out["tokens_per_message"] = r["tokens_per_message"]
    return out


def main(argv=None) -> int:
    ap = script_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="32,256", help="stream counts, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=300, help="each stream's new tokens")
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the engines run (cuda: the decode graphs and bursts a GPU worker takes)",
    )
    ap.add_argument(
        "--tokenizer-dir",
        help="SmolLM2's tokenizer files (default: the embedded GGUF's; scripts/gpu_bundle.sh "
        "makes them for a machine without it)",
    )
    ap.add_argument(
        "--modes", default=",".join(MODES), help=f"which of {', '.join(MODES)}, comma-separated"
    )
    ap.add_argument(
        "--stream-interval",
        default="1",
        help="the worker and router modes' stream interval (router.stream_interval: the worker "
        "sends a stream's tokens k at a time), comma-separated to compare several (k other "
        "than 1 adds worker_intervalk, router_grpc_intervalk and router_http_intervalk)",
    )
    add_wait_idle_arg(ap, "each run")
    add_out_arg(ap, "stream_fanout.json")
    args = ap.parse_args(argv)
    streams = [int(x) for x in args.streams.split(",")]
    if min(streams) < 1 or args.new_tokens < 8:
        ap.error("stream counts must be >= 1 and --new-tokens >= 8")
    modes = args.modes.split(",")
    intervals = [int(x) for x in args.stream_interval.split(",")]
    if min(intervals) < 1:
        ap.error("--stream-interval: each interval must be >= 1")
    if "engine" not in modes or not set(modes) <= set(MODES):
        ap.error(f"--modes: the engine and any of {', '.join(MODES[1:])}")

    def run() -> dict:
        model = small_model(args.tokenizer_dir)
        runs = []
        for n in streams:
            entry = {"streams": n, "new_tokens": args.new_tokens}
            for name, measure in (
                (
                    "engine",
                    lambda: _in_process(_engine_alone, model, n, args.new_tokens, args.device),
                ),
                *(
                    (
                        f"worker{'' if k == 1 else f'_interval{k}'}",
                        lambda k=k: _through_worker(
                            model, n, args.new_tokens, "streams", args.device, k
                        ),
                    )
                    for k in intervals
                ),
                (
                    "worker_stream_each",
                    lambda: _through_worker(model, n, args.new_tokens, "stream", args.device),
                ),
                *(
                    (
                        f"{mode}{'' if k == 1 else f'_interval{k}'}",
                        lambda via=via, k=k: _through_router(
                            model, n, args.new_tokens, via, args.device, k
                        ),
                    )
                    for mode, via in (("router_grpc", "grpc"), ("router_http", "http"))
                    for k in intervals
                ),
            ):
                if name.split("_interval")[0] not in modes:
                    continue
                if args.wait_idle:
                    wait_for_idle_machine(args.wait_idle)
                entry[name] = _shape(measure(), n)
                log(f"{n} streams, {name}: {entry[name]}")
            measured = [m for m in entry if m != "engine" and m.split("_interval")[0] in modes]
            for name in measured:
                entry[f"{name}_over_engine"] = round(
                    entry[name]["ms_per_step"] / entry["engine"]["ms_per_step"], 2
                )
            runs.append(entry)
        return {
            "model": "random llama, 2 layers, 64 wide, 512-token vocabulary",
            "device": args.device,
            "runs": runs,
        }

    return run_and_write("benchmarks.engine.stream_fanout", argv, args.out, run)


if __name__ == "__main__":
    raise SystemExit(main())
