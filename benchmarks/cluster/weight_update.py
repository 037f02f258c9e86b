"""How long a trainer's weight sync takes (router/weights.py): the embedded SmolLM2 in float32,
one process, no Ray.

    python -m benchmarks.cluster.weight_update            # ~2 min on 2 idle cores
    python -m benchmarks.cluster.weight_update --runs 2   # smoke run

Three figures, each the median of --runs:
  engine: one engine's update_weights from the checkpoint it serves (the same files, so the
      answers can be checked unchanged), split into reading the checkpoint into the dense
      weights and packing the linears again (ModelRunner.reload_weights' two halves); then the
      same tensors received from a trainer thread over a weight group (receive_weights), whole
      and its load alone;
  restart: building a new engine on the same checkpoint, what a sync by restarting a worker
      costs at least (no process start, no registration, no warm-up request counted);
  cluster: POST /update_weights_from_disk through a router in front of one prefill and one
      decode worker (both on this machine's cores), from the request to the answer, with the
      router idle (nothing to drain); then the same tensors sent by a trainer in this process
      over a weight group (engine/weight_sync.py WeightSender.update: the HTTP request and the
      broadcast to both workers' ranks, from the call to the answer; the trainer holds the
      checkpoint's tensors in memory, as a trainer holds its model), with each worker's receiving
      and loading timed apart; and, for the disk path's share on the trainer's side, how long
      writing those tensors as a safetensors file takes (to the local disk).
Writes benchmarks/results/weight_update.json.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

from benchmarks import bench_common as bc

ENGINE = dict(dtype="float32", max_model_len=2048, kv_cache_memory=128 << 20)


def _timed(obj, name: str, spent: list) -> None:
    """Wraps obj.name so each call's seconds are appended to `spent`."""
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t)

    setattr(obj, name, wrapper)


def engine_figures(model: str, runs: int) -> dict:
    from pdserve.engine import LLM, SamplingParams

    starts = []
    for _ in range(runs):
        t = time.perf_counter()
        llm = LLM(model, **ENGINE)
        starts.append(time.perf_counter() - t)
        llm.shutdown()
    llm = LLM(model, **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = "The capital of France is"
    before = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.engine.runner
    reads, packs, totals = [], [], []
    _timed(runner, "_load_weights", reads)
    _timed(runner.model, "prepare_linears", packs)
    try:
        for _ in range(runs):
            t = time.perf_counter()
            llm.engine.update_weights(model, "bench")
            totals.append(time.perf_counter() - t)
        after = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        group = engine_group_figures(llm, model, runs)
        after_group = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    return {
        "restart_s": round(bc.median(starts), 3),
        "update_s": round(bc.median(totals), 3),
        "read_s": round(bc.median(reads), 3),
        "pack_s": round(bc.median(packs), 3),
        "runs": {"restart": starts, "update": totals, "read": reads, "pack": packs},
        "same_answer_after": before == after,
        "group": group,
        "same_answer_after_group": before == after_group,
    }


def engine_group_figures(llm, model: str, runs: int) -> dict:
    """The same engine's receive_weights from a trainer thread of this process, rank 0 of a
    two-rank group: the whole update, and the load of the received tensors alone."""
    import threading

    from pdserve.engine.loader.safetensors_io import iter_safetensors
    from pdserve.engine.weight_sync import open_group, send, specs_of

    tensors = [(n, t.clone()) for n, t in iter_safetensors(model)]
    names = [n for n, _ in tensors]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
    shapes = [list(t.shape) for _, t in tensors]
    port = _free_port()
    opened: list = []
    opener = threading.Thread(
        target=lambda: opened.append(open_group("127.0.0.1", port, 0, 2, 120))
    )
    opener.start()
    llm.engine.join_weights_group("bench", "127.0.0.1", port, 1, 2, 120)
    opener.join()
    loads, totals = [], []
    _timed(llm.engine.runner, "_reload", loads)
    for i in range(runs):
        specs = specs_of(names, dtypes, shapes)
        sender = threading.Thread(
            target=send, args=(opened[0], [t for _, t in tensors], specs, f"t{i}")
        )
        sender.start()
        t = time.perf_counter()
        llm.engine.receive_weights("bench", names, dtypes, shapes, f"t{i}", f"g{i}")
        totals.append(time.perf_counter() - t)
        sender.join()
    llm.engine.leave_weights_group("bench")
    return {
        "update_s": round(bc.median(totals), 3),
        "load_s": round(bc.median(loads), 3),
        "runs": {"update": totals, "load": loads},
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_figures(model: str, runs: int) -> dict:
    from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
    from pdserve.prefill_worker.server import PrefillWorker, PrefillWorkerConfig
    from pdserve.router.server import Router, RouterConfig

    decode = DecodeWorker(
        DecodeWorkerConfig(model=model, worker_id="decode-0", engine_kwargs=dict(ENGINE))
    ).start()
    prefill = PrefillWorker(
        PrefillWorkerConfig(model=model, worker_id="prefill-0", engine_kwargs=dict(ENGINE))
    ).start()
    router = Router(
        RouterConfig(
            model=model,
            prefill_addresses=(prefill.address,),
            decode_addresses=(decode.address,),
            max_model_len=ENGINE["max_model_len"],
            http_port=0,
            weight_updates=True,
        )
    ).start()
    walls, answers = [], []
    try:
        for i in range(runs):
            body = json.dumps({"model_path": model, "weight_version": f"v{i}"}).encode()
            req = urllib.request.Request(
                f"http://{router.http_address}/update_weights_from_disk",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            t = time.perf_counter()
            with urllib.request.urlopen(req, timeout=600) as reply:
                answers.append(json.loads(reply.read()))
            walls.append(time.perf_counter() - t)
            bc.log(f"cluster update {i}: {walls[-1]:.2f} s")
        group = group_figures(router, model, runs)
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
    return {
        "update_s": round(bc.median(walls), 3),
        "runs": walls,
        "all_succeeded": all(a.get("success") for a in answers),
        "group": group,
    }


def group_figures(router, model: str, runs: int) -> dict:
    from pdserve.engine.loader.safetensors_io import iter_safetensors
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.weight_sync import WeightReceiver, WeightSender

    # both workers run in this process: each one's receive and load, timed
    receives, loads = [], []
    _timed(WeightReceiver, "receive", receives)
    _timed(ModelRunner, "_reload", loads)
    tensors = [(n, t.clone()) for n, t in iter_safetensors(model)]
    port = _free_port()
    # what the disk path costs the trainer before its request: writing the checkpoint (here to
    # the local disk's page cache)
    import tempfile

    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        save_file(dict(tensors), f"{tmp}/model.safetensors")
        save_s = time.perf_counter() - t
    sender = WeightSender(f"http://{router.http_address}", "127.0.0.1", port)
    t = time.perf_counter()
    sender.init()
    init_s = time.perf_counter() - t
    walls, answers = [], []
    for i in range(runs):
        t = time.perf_counter()
        answers.append(sender.update(tensors, version=f"g{i}"))
        walls.append(time.perf_counter() - t)
        bc.log(f"group update {i}: {walls[-1]:.2f} s")
    sender.destroy()
    return {
        "init_s": round(init_s, 3),
        "trainer_save_s": round(save_s, 3),
        "update_s": round(bc.median(walls), 3),
        "runs": walls,
        "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
        # per worker and update (both workers' calls together)
        "receive_s": round(bc.median(receives), 3),
        "load_s": round(bc.median(loads), 3),
        "all_succeeded": all(a.get("success") for a in answers),
    }


def main(argv: list[str] | None = None) -> int:
    p = bc.script_parser(__doc__)
    p.add_argument("--runs", type=int, default=5, help="repetitions of each figure (default 5)")
    bc.add_out_arg(p, "weight_update.json")
    args = p.parse_args(argv)
    os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")
    from pdserve.engine.loader import resolve_model

    model = str(resolve_model("smollm2"))

    def run() -> dict:
        out = {"engine_kwargs": ENGINE, "runs": args.runs}
        out["engine"] = engine_figures(model, args.runs)
        bc.log(f"engine: {out['engine']}")
        out["cluster"] = cluster_figures(model, args.runs)
        bc.log(f"cluster: {out['cluster']}")
        return out

    return bc.run_and_write("benchmarks.cluster.weight_update", argv, args.out, run)


if __name__ == "__main__":
    raise SystemExit(main())
