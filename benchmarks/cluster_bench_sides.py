"""The two in-process sides of benchmarks/cluster_bench.py, each run in its own spawned process:

  engine_side    the engine alone (LLMEngine, the workers' engine settings): waits for "measure"
                 commands on a pipe, so the parent can interleave its batches with the cluster runs
                 and both see the same machine minutes
  pipeline_side  how much KV-transfer time layer pipelining hides under prefill compute, per
                 backend: a real DecodeWorker (decode_worker/server.py) in a child process, and in
                 this process the prefill engine + prefill_worker.handoff.PushSink + the backend's
                 kvtransfer transport, exactly what a prefill worker's Prefill runs (without the
                 gRPC service and Ray around it)

`pipeline_side` says what each trial times.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import statistics
import time
import traceback

from benchmarks.bench_common import TreeCpuMonitor, random_prompts


def _threads(n: int) -> int:
    import torch

    torch.set_num_threads(n)
    return torch.get_num_threads()


def _engine(model: str, engine_kwargs: dict):
    from pdserve.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=model, **engine_kwargs))


def _run_until_first_token(engine, request_id: str) -> int:
    """Steps until the request's first token; returns it (the request is alone in the engine)."""
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.outputs[0].token_ids:
                while engine.has_unfinished_requests():  # a prefill-only request is done already
                    engine.step()
                return out.outputs[0].token_ids[0]


# ---- the engine alone ---------------------------------------------------------------------------
def engine_side(conn, model: str, engine_kwargs: dict, threads: int) -> None:
    """Commands: ("measure", seed, n) -> {"ttft_s": [...], "cached_tokens": [...], "cpu": ...};
    None -> exit."""
    try:
        from pdserve.engine import SamplingParams

        num_threads = _threads(threads)
        t0 = time.perf_counter()
        engine = _engine(model, engine_kwargs)
        conn.send({"ready": True, "load_s": time.perf_counter() - t0, "torch_threads": num_threads})
        params = SamplingParams(temperature=0.0, max_tokens=1)
        count = 0
        while True:
            cmd = conn.recv()
            if cmd is None:
                return
            _, seed, n, length = cmd
            mon = TreeCpuMonitor()
            ttfts, cached = [], []
            for prompt in random_prompts(seed, n, length):
                rid = f"alone-{count}"
                count += 1
                t = time.perf_counter()
                engine.add_request(rid, prompt, params)
                while True:
                    outs = [
                        o for o in engine.step() if o.request_id == rid and o.outputs[0].token_ids
                    ]
                    if outs:
                        break
                ttfts.append(time.perf_counter() - t)
                cached.append(outs[0].num_cached_tokens)
                while engine.has_unfinished_requests():
                    engine.step()
            conn.send({"ttft_s": ttfts, "cached_tokens": cached, "cpu": mon.stop()})
    except BaseException:  # noqa: BLE001 - the parent must hear why
        conn.send({"error": traceback.format_exc()})


# ---- layer pipelining ---------------------------------------------------------------------------
def _decode_child(conn, model: str, engine_kwargs: dict, backend: str, threads: int) -> None:
    try:
        _threads(threads)
        from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig

        worker = DecodeWorker(
            DecodeWorkerConfig(model=model, engine_kwargs=engine_kwargs, kv_backend=backend)
        ).start()
        conn.send({"address": worker.address})
        conn.recv()
        worker.stop()
    except BaseException:  # noqa: BLE001
        conn.send({"error": traceback.format_exc()})


class _RecordingSink:
    """Takes the engine's per-layer calls without sending, to replay them after the compute."""

    def __init__(self):
        self.calls = []

    def on_layer(self, layer, layer_kv, block_ids, start, end) -> None:
        self.calls.append((layer, list(block_ids), start, end))


class _Pipeline:
    """One backend: a decode worker child, one transport to it, trials."""

    def __init__(
        self, engine, layout, model: str, engine_kwargs: dict, backend: str, decode_threads: int
    ):
        import grpc

        from pdserve.protos.pdserve.v1 import worker_pb2_grpc

        self.engine, self.layout, self.backend = engine, layout, backend
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_decode_child,
            args=(child, model, engine_kwargs, backend, decode_threads),
            daemon=True,
        )
        self.proc.start()
        if not self.conn.poll(300):
            raise TimeoutError("the decode worker did not start in 300 s")
        got = self.conn.recv()
        if "error" in got:
            raise RuntimeError(f"decode worker failed:\n{got['error']}")
        self.channel = grpc.insecure_channel(got["address"])
        self.stub = worker_pb2_grpc.DecodeWorkerStub(self.channel)
        self.transport = None
        self.count = 0

    def _reserve(self, prompt):
        from pdserve.kvtransfer.backends import connect
        from pdserve.kvtransfer.transport import Destination
        from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2

        rid = f"pipe-{self.backend}-{self.count}"
        self.count += 1
        res = self.stub.Reserve(
            worker_pb2.ReserveRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                lease_ms=60_000,
                sampling=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=1),
            ),
            timeout=30,
        )
        if self.transport is None:
            self.transport = connect(res.endpoint.backend, res.endpoint.address, timeout=30)
        dest = Destination(
            list(res.block_ids),
            dataclasses.replace(
                self.layout, block_size=res.block_size, tp_size=max(1, res.endpoint.tp_size)
            ),
        )
        return rid, res, dest

    def _check_committed(self, rid: str, first: int) -> None:
        """The decode worker took the KV and the commit: its stream ends with the first token."""
        from pdserve.protos.pdserve.v1 import worker_pb2

        tokens, reason = [], None
        for event in self.stub.Stream(worker_pb2.StreamRequest(request_id=rid), timeout=30):
            tokens += list(event.token_ids)
            if event.HasField("finish_reason"):
                reason = event.finish_reason
        if tokens != [first] or reason != "length":
            raise RuntimeError(
                f"{rid}: the decode worker ended with {tokens} {reason!r}, "
                f"expected [{first}] 'length' (the transfer did not land)"
            )

    def _prefill(self, rid: str, prompt, kv_sink) -> int:
        """Prefills `prompt` alone with its KV going to kv_sink; returns the first token."""
        from pdserve.engine import SamplingParams

        self.engine.add_request(
            rid,
            prompt,
            SamplingParams(temperature=0.0, max_tokens=1),
            prefill_only=True,
            kv_sink=kv_sink,
        )
        return _run_until_first_token(self.engine, rid)

    def _commit(self, rid: str, sink, first: int) -> float:
        """Commits the hand-off, waits for it to land and checks it did; returns the time it had
        landed (time.perf_counter)."""
        sink.commit([first])
        self.transport.flush(30.0)
        t2 = time.perf_counter()
        self._check_committed(rid, first)
        return t2

    def pipelined(self, prompt, overlap: bool = True) -> dict:
        """overlap True: the normal per-layer pushes; False: PushSink's deferred mode (a step's
        layers pushed after its last layer, what it picks when the compute takes every core)."""
        from pdserve.prefill_worker.handoff import PushSink

        rid, res, dest = self._reserve(prompt)
        sink = PushSink(
            rid, self.layout, self.transport, dest, res.num_cached_tokens, overlap=overlap
        )
        t0 = time.perf_counter()
        first = self._prefill(rid, prompt, sink)
        t1 = time.perf_counter()
        t2 = self._commit(rid, sink, first)
        return {
            "pipelined_s": t2 - t0,
            "pipelined_compute_s": t1 - t0,
            "exposed_s": t2 - t1,
            "bytes": sink.bytes_sent,
        }

    def sequential(self, prompt) -> dict:
        from pdserve.prefill_worker.handoff import PushSink

        rid, res, dest = self._reserve(prompt)
        recorder = _RecordingSink()
        t0 = time.perf_counter()
        first = self._prefill(rid, prompt, recorder)
        t1 = time.perf_counter()
        # the request finished, its blocks are free but keep their KV until reused (nothing ran since)
        sink = PushSink(rid, self.layout, self.transport, dest, res.num_cached_tokens, overlap=True)
        kv = self.engine.kv_cache
        for layer, block_ids, start, end in recorder.calls:
            sink.on_layer(layer, kv[layer], block_ids, start, end)
        t2 = self._commit(rid, sink, first)
        return {
            "compute_s": t1 - t0,
            "transfer_s": t2 - t1,
            "bytes": sink.bytes_sent,
            "num_layer_calls": len(recorder.calls),
        }

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.channel.close()
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def pipeline_side(
    conn,
    model: str,
    engine_kwargs: dict,
    prefill_threads: int,
    decode_threads: int,
    backends: list[str],
    num_trials: int,
    seed: int,
    length: int,
) -> None:
    """Sends {"backends": {name: {...}}, ...} once every backend ran (or {"error": ...}).

    Timed per trial (each its own fresh prompt and its own reservation on the decode worker):
      T_pipelined  add_request(prefill_only, kv_sink=PushSink) -> step until the first token ->
                   commit frame -> transport.flush() returned (every frame handed to the decode
                   side)
      T_compute    the same prefill with a sink that only records the layer calls (no transfer)
      T_transfer   right after that compute: the recorded per-layer pushes replayed through a
                   PushSink (read_chunk + send, as in the step), commit, flush
      hidden       (T_compute + T_transfer - T_pipelined) / T_transfer
      T_deferred   as T_pipelined with PushSink(overlap=False): the step's layers pushed after its
                   last layer (what PushSink picks by itself when the compute takes every core)
    The kinds of trial rotate their order."""
    try:
        from pdserve.kvtransfer.backends import tune_malloc
        from pdserve.kvtransfer.layout import KVLayout

        tune_malloc()  # as the prefill worker does at start
        num_threads = _threads(prefill_threads)
        engine = _engine(model, engine_kwargs)
        layout = KVLayout(**engine.kv_layout_spec())
        results = {"torch_threads": num_threads, "backends": {}}
        for b, backend in enumerate(backends):
            out = results["backends"][backend] = {}
            try:
                pipe = _Pipeline(engine, layout, model, engine_kwargs, backend, decode_threads)
            except Exception:  # noqa: BLE001
                out["error"] = traceback.format_exc()
                continue
            try:
                prompts = random_prompts(seed + 100 * b, 3 * num_trials + 3, length)
                pipe.pipelined(prompts[0])  # warm-up: the channel's first frames, the decode pages
                pipe.sequential(prompts[1])
                pipe.pipelined(prompts[2], overlap=False)
                mon = TreeCpuMonitor()
                trials = []
                for i in range(num_trials):  # rotate which mode goes first: drift cancels
                    a, b_, c = prompts[3 + 3 * i : 6 + 3 * i]
                    runs = [
                        lambda: pipe.pipelined(a),
                        lambda: pipe.sequential(b_),
                        lambda: {
                            "deferred_" + k: v for k, v in pipe.pipelined(c, overlap=False).items()
                        },
                    ]
                    t = {}
                    for j in range(3):
                        t.update(runs[(i + j) % 3]())
                    t["hidden"] = (t["compute_s"] + t["transfer_s"] - t["pipelined_s"]) / t[
                        "transfer_s"
                    ]
                    trials.append(t)
                out["cpu"] = mon.stop()
                out["trials"] = trials
                out["summary"] = summarize_pipeline(trials)
            except Exception:  # noqa: BLE001
                out["error"] = traceback.format_exc()
            finally:
                pipe.close()
        conn.send(results)
    except BaseException:  # noqa: BLE001
        conn.send({"error": traceback.format_exc()})


def med_diff(trials: list[dict], a: str, b: str) -> float:
    return statistics.median(t[a] - t[b] for t in trials)


def summarize_pipeline(trials: list[dict]) -> dict:
    med = lambda k: statistics.median(t[k] for t in trials)  # noqa: E731
    t_c, t_t, t_p = med("compute_s"), med("transfer_s"), med("pipelined_s")
    return {
        "compute_s": t_c,
        "transfer_s": t_t,
        "pipelined_s": t_p,
        "pipelined_compute_s": med("pipelined_compute_s"),
        "exposed_s": med("exposed_s"),
        "deferred_s": med("deferred_pipelined_s"),
        "deferred_exposed_s": med("deferred_exposed_s"),
        "inflation_median_of_trials_s": med_diff(trials, "pipelined_s", "compute_s"),
        "inflation_compute_median_of_trials_s": med_diff(
            trials, "pipelined_compute_s", "compute_s"
        ),
        "deferred_inflation_median_of_trials_s": med_diff(
            trials, "deferred_pipelined_s", "compute_s"
        ),
        "hidden_of_medians": (t_c + t_t - t_p) / t_t if t_t > 0 else None,
        "hidden_median_of_trials": med("hidden"),
        "bytes": trials[0]["bytes"],
        "num_trials": len(trials),
    }


def start(target, *args):
    """Runs target(conn, *args) in a spawned process; returns (process, the parent's end)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    env_before = os.environ.get("PDSERVE_NO_PROGRESS")
    os.environ["PDSERVE_NO_PROGRESS"] = "1"
    try:
        proc = ctx.Process(target=target, args=(child, *args), daemon=False)
        proc.start()
    finally:
        if env_before is None:
            os.environ.pop("PDSERVE_NO_PROGRESS", None)
    return proc, parent
