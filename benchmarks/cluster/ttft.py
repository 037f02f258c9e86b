"""Cluster benchmark: TTFT of a 512-token prompt through the whole disaggregated cluster (router ->
prefill -> layer-pipelined KV transfer -> decode, launched by deploy.launcher.up on a local Ray)
against the engine alone, per KV backend, and how much transfer time layer pipelining hides.

    python -m benchmarks.cluster.ttft                  # full run, ~4-5 min on the 2-core machine
    python -m benchmarks.cluster.ttft --quick          # smoke run (fewer prompts, one backend)
    python -m benchmarks.cluster.ttft --wait-idle 60   # wait up to 60 s for a quiet CPU per section
    python -m benchmarks.cluster.ttft --backends shm,nixl  # nixl where its extra is installed

One run starts the engine alone in a spawned process (EngineAlone), then, per backend, a cluster
that serves fresh prompts alternating with the engine alone (run_cluster, timed by `generate`),
then the pipelining trials (pipeline_side). Every prompt is distinct random
token ids, so nothing hits a prefix cache (checked: cached tokens), and each section records the
CPU that processes outside this benchmark's process tree used meanwhile. The result is in
BENCHMARKS.md, "TTFT through the cluster vs the engine alone".

The two in-process sides run in spawned processes of their own: engine_side (the engine alone,
the workers' engine settings, measuring on "measure" commands from a pipe so the parent can
interleave its batches with the cluster runs and both see the same machine minutes) and
pipeline_side (a real DecodeWorker in a child process, and the prefill engine with the
prefill_worker hand-off and the backend's transport in this one, exactly what a prefill worker's
Prefill runs without the gRPC service and Ray around it); pipeline_side says what each trial
times.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback

from benchmarks.bench_common import (
    CONTENTION_WARN_CORES,
    REPO_ROOT,
    TreeCpuMonitor,
    add_wait_idle_arg,
    fmt,
    git_head,
    log,
    machine_info,
    random_prompts,
    script_parser,
    wait_for_idle_machine,
    write_result,
)
from benchmarks.chaos_harness import deployment
from pdserve.tuning.loadgen import PATH_STAMPS


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
            grant=res.endpoint.write_grant,  # nixl's; empty on the other backends
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


DEFAULT_OUT = os.path.join("benchmarks", "results", "cluster_bench.json")
TARGET_RATIO = 1.15
BACKENDS = ("grpc", "shm", "torch")  # the default run
CHOICES = (*BACKENDS, "nixl")  # nixl where its extra is installed
SEED_ENGINE, SEED_CLUSTER, SEED_PIPELINE = 7000, 8000, 9000
SEGMENTS = (  # (key, label, start field, end field); "sent"/"client_first" are the client's stamps
    ("client_to_router", "client -> router", "sent", "queued_unix_ns"),
    (
        "router_before_prefill",
        "router and prefill queue (Reserve, Stream, Prefill RPC, the prefill worker's queue)",
        "queued_unix_ns",
        "prefill_start_unix_ns",
    ),
    (
        "prefill",
        "prefill compute (+ per-layer pushes)",
        "prefill_start_unix_ns",
        "prefill_end_unix_ns",
    ),
    (
        "handoff_first_token",
        "commit -> decode's first token",
        "prefill_end_unix_ns",
        "first_token_unix_ns",
    ),
    ("delivery", "decode -> router -> client", "first_token_unix_ns", "client_first"),
)


def pool_config(args, role: str) -> dict:
    threads = args.prefill_threads if role == "prefill" else args.decode_threads
    return {
        "replicas": 1,
        "tp": 1,
        "resources": {"num_cpus": 1},
        "num_threads": threads,
        "kv_cache_memory": args.kv_cache_memory,
        "max_model_len": args.max_model_len,
    }


def deploy_dict(args, backend: str) -> dict:
    return {
        "model": args.model,
        "kvtransfer": {"backend": backend},
        "router": {"port": 0},
        "pools": {"prefill": pool_config(args, "prefill"), "decode": pool_config(args, "decode")},
    }


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))]


def stats_ms(xs_s: list[float]) -> dict:
    ms = [x * 1000 for x in xs_s]
    return {
        "median_ms": statistics.median(ms),
        "p90_ms": pct(ms, 90),
        "min_ms": min(ms),
        "max_ms": max(ms),
        "n": len(ms),
        "runs_ms": [round(x, 2) for x in ms],
    }


# ---- engine alone -------------------------------------------------------------------------------
class EngineAlone:
    """The engine alone: an LLMEngine in a spawned process with --prefill-threads torch threads and
    the workers' engine settings (DeployConfig.engine_kwargs of the prefill pool: block size,
    max_num_batched_tokens, prefix caching on, KV budget, max_model_len). After a warm-up prompt it
    waits for requests on a pipe. TTFT = add_request -> the step output with the first token."""

    def __init__(self, args, engine_kwargs: dict):
        self.proc, self.conn = start(engine_side, args.model, engine_kwargs, args.prefill_threads)
        self.info = self._recv(600)
        self.length = args.prompt_len

    def _recv(self, timeout: float) -> dict:
        if not self.conn.poll(timeout):
            raise TimeoutError("the engine-alone process did not answer")
        got = self.conn.recv()
        if "error" in got:
            raise RuntimeError(f"engine-alone process failed:\n{got['error']}")
        return got

    def measure(self, seed: int, n: int) -> dict:
        self.conn.send(("measure", seed, n, self.length))
        return self._recv(600)

    def warmup(self, seed: int) -> None:
        self.measure(seed, 1)

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(30)


# ---- the cluster --------------------------------------------------------------------------------
def generate(stub, prompt: list[int], max_tokens: int) -> dict:
    """One request through the cluster. TTFT at the client: time.time_ns() before calling
    PDServe.Generate -> the first TokenDelta. The breakdown comes from Finish.timings (unix ns, one
    machine clock) and telescopes to the TTFT: client->router (queued - sent), router and prefill
    queue (prefill_start - queued), prefill compute (prefill_end - prefill_start, per-layer pushes
    included), hand-off to the first token (first_token - prefill_end; "exposed transfer"
    transfer_end - prefill_end overlaps its start), delivery (first TokenDelta at the client -
    first_token)."""
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb

    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    sent = time.time_ns()
    first, finish, tokens = None, None, []
    for resp in stub.Generate(request, timeout=120):
        if resp.HasField("delta"):
            if first is None and resp.delta.token_ids:
                first = time.time_ns()
            tokens += list(resp.delta.token_ids)
        else:
            finish = resp.finish
    if first is None or finish is None:
        raise RuntimeError(f"stream ended without a token or a finish: {finish}")
    t = finish.timings
    stamps = {"sent": sent, "client_first": first}
    for field in PATH_STAMPS:
        stamps[field] = getattr(t, field)
    row = {
        "ttft_s": (first - sent) / 1e9,
        "tokens": tokens,
        "finish_reason": finish.finish_reason,
        "cached_prompt_tokens": finish.usage.cached_prompt_tokens,
        "stamps": stamps,
    }
    for key, _, a, b in SEGMENTS:
        row[key + "_s"] = (stamps[b] - stamps[a]) / 1e9
    row["exposed_transfer_s"] = (
        stamps["transfer_end_unix_ns"] - stamps["prefill_end_unix_ns"]
    ) / 1e9
    return row


def run_cluster(args, backend: str, alone: EngineAlone) -> dict:
    """chaos_harness.deployment({...}) (up(), block=False) on one local Ray (num_cpus 2) -> 2 warm-up requests
    -> --requests rounds of [one fresh 512-token prompt on the engine alone, then one through the
    cluster] (max_tokens 2, greedy, one request at a time) -> cluster.stop(). Alternating request
    by request pairs the two sides in time: this VM's speed drifts by tens of percent between
    minutes, which a batch-then-batch order would fold into the ratio. The idle cluster's own
    background (heartbeats, health checks) is counted in the section's CPU and stays in the
    engine-alone numbers."""
    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc

    config_dict = deploy_dict(args, backend)
    out = {"config": config_dict}
    b = CHOICES.index(backend)
    times: dict = {}
    with deployment(config_dict, "cluster_bench", times) as (cluster, _):
        out["up_s"] = times["up_s"]
        with grpc.insecure_channel(cluster.router_address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            prompts = random_prompts(
                SEED_CLUSTER + 100 * b, args.requests + args.cluster_warmup, args.prompt_len
            )
            for p in prompts[: args.cluster_warmup]:
                generate(stub, p, args.max_tokens)
            mon = TreeCpuMonitor()
            rows, engine = [], []
            for i, p in enumerate(prompts[args.cluster_warmup :]):
                engine.append(alone.measure(SEED_ENGINE + 100 * b + i, 1))
                rows.append(generate(stub, p, args.max_tokens))
            out["cpu"] = mon.stop()
    out["stop_s"] = times["stop_s"]
    out["requests"] = rows
    out["engine_alone_ttft_s"] = [e["ttft_s"][0] for e in engine]
    out["engine_alone_cached_tokens"] = [e["cached_tokens"][0] for e in engine]
    out["ttft"] = stats_ms([r["ttft_s"] for r in rows])
    out["engine_alone"] = stats_ms(out["engine_alone_ttft_s"])
    out["breakdown_median_ms"] = {
        k: statistics.median(r[k + "_s"] for r in rows) * 1000
        for k in [s[0] for s in SEGMENTS] + ["exposed_transfer"]
    }
    bad = [
        r
        for r in rows
        if r["cached_prompt_tokens"]
        or r["finish_reason"] != "length"
        or len(r["tokens"]) != args.max_tokens
    ]
    if bad or any(out["engine_alone_cached_tokens"]):
        out["warning"] = (
            f"{len(bad)} cluster requests hit a prefix cache or ended early; engine "
            f"cached tokens {out['engine_alone_cached_tokens']}"
        )
    log(
        f"cluster {backend}: TTFT ms {out['ttft']['runs_ms']} (up {out['up_s']:.1f} s); engine alone "
        f"meanwhile {out['engine_alone']['runs_ms']}; breakdown "
        f"{ {k: round(v, 1) for k, v in out['breakdown_median_ms'].items()} }; other processes "
        f"{fmt(out['cpu'].get('foreign_cores_avg'), '.2f')} cores"
    )
    return out


# ---- report -------------------------------------------------------------------------------------
def combine(args, report: dict) -> None:
    alone = [t for c in report["cluster"].values() for t in c.get("engine_alone_ttft_s", [])]
    if alone:
        report["engine_alone"]["ttft"] = stats_ms(alone)
    for backend in report["backends_run"]:
        c = report["cluster"].get(backend, {})
        if "ttft" not in c:
            continue
        pairs = [r["ttft_s"] / e for r, e in zip(c["requests"], c["engine_alone_ttft_s"])]
        c["ratio"] = c["ttft"]["median_ms"] / c["engine_alone"]["median_ms"]
        c["ratio_median_of_pairs"] = statistics.median(pairs)
        c["ratio_vs_all_engine"] = (
            c["ttft"]["median_ms"] / report["engine_alone"]["ttft"]["median_ms"]
        )
        c["pass"] = c["ratio"] <= TARGET_RATIO


def render(report: dict) -> str:
    m, cfg = report["machine"], report["config"]
    ea = report["engine_alone"].get("ttft")
    lines = [
        f"- command: `{report['command']}`",
        f"- date (UTC): {m.get('date_utc')}; machine: {m.get('cpu_model')} ({m.get('cpu_count')} cpus), "
        f"torch {m.get('torch')}, python {m.get('python')}; git {str(report.get('git_head'))[:10]}",
        f"- pools: prefill num_cpus 1, num_threads {cfg['prefill_threads']}; decode num_cpus 1, "
        f"num_threads {cfg['decode_threads']}; Ray num_cpus 2; KV {cfg['kv_cache_memory'] >> 20} MiB, "
        f"max_model_len {cfg['max_model_len']}, block 16, max_num_batched_tokens 2048, prefix caching on",
        "",
        f"| backend | cluster TTFT median ms | p90 ms | engine alone, interleaved: median ms | p90 ms "
        f"| cluster / engine (medians) | median of per-pair ratios | target <= {TARGET_RATIO}x |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for backend in report["backends_run"]:
        c = report["cluster"].get(backend, {})
        if "ttft" not in c:
            lines.append(f"| {backend} | ERROR | | | | | | |")
            continue
        t, e = c["ttft"], c["engine_alone"]
        lines.append(
            f"| {backend} | {t['median_ms']:.1f} | {t['p90_ms']:.1f} | {e['median_ms']:.1f} "
            f"| {e['p90_ms']:.1f} | {c['ratio']:.3f}x | {c['ratio_median_of_pairs']:.3f}x "
            f"| {'PASS' if c['pass'] else 'FAIL'} |"
        )
    if ea:
        lines.append(
            f"| (engine alone, all {ea['n']} prompts) | - | - | {ea['median_ms']:.1f} "
            f"| {ea['p90_ms']:.1f} | - | - | - |"
        )
    lines += [
        "",
        "Where the cluster's time goes (medians of the requests, ms; the segments telescope "
        "to each request's TTFT, their medians need not sum exactly):",
        "",
        "| backend | "
        + " | ".join(s[1] for s in SEGMENTS)
        + " | exposed transfer (prefill_end -> transfer_end) |",
        "|---|" + "---|" * (len(SEGMENTS) + 1),
    ]
    for backend in report["backends_run"]:
        b = report["cluster"].get(backend, {}).get("breakdown_median_ms")
        if b:
            lines.append(
                f"| {backend} | "
                + " | ".join(f"{b[s[0]]:.1f}" for s in SEGMENTS)
                + f" | {b['exposed_transfer']:.1f} |"
            )
    pipe = report.get("pipeline", {})
    if pipe.get("backends"):
        lines += [
            "",
            "Transfer hidden by layer pipelining (in-process: prefill engine + PushSink + "
            "transport -> a DecodeWorker process; medians, ms):",
            "",
            "| backend | KV MiB | T_compute | T_transfer (after compute) | T_pipelined (per-layer "
            "pushes) | of which after the compute | compute slowed by the pushes (median of "
            "trials) | hidden = (Tc+Tt-Tp)/Tt | hidden, not counting the slowdown = 1 - "
            "after/Tt | T_deferred (pushed after the last layer) | deferred - compute "
            "(median of trials) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for backend, r in pipe["backends"].items():
            s = r.get("summary")
            if not s:
                lines.append(f"| {backend} | ERROR |" + " |" * 10)
                continue
            ms = lambda v: f"{v * 1000:.1f}"  # noqa: E731
            lines.append(
                f"| {backend} | {s['bytes'] / 2**20:.1f} | {ms(s['compute_s'])} "
                f"| {ms(s['transfer_s'])} | {ms(s['pipelined_s'])} | {ms(s['exposed_s'])} "
                f"| {s['inflation_compute_median_of_trials_s'] * 1000:+.1f} "
                f"| {s['hidden_of_medians'] * 100:.0f}% "
                f"| {(1 - s['exposed_s'] / s['transfer_s']) * 100:.0f}% "
                f"| {ms(s['deferred_s'])} "
                f"| {s['deferred_inflation_median_of_trials_s'] * 1000:+.1f} |"
            )
    contention = []
    for backend in report["backends_run"]:
        cpu = report["cluster"].get(backend, {}).get("cpu")
        if cpu:
            contention.append(f"cluster+engine {backend} {cpu.get('foreign_cores_avg') or 0:.2f}")
    for backend, r in pipe.get("backends", {}).items():
        if r.get("cpu"):
            contention.append(f"pipeline {backend} {r['cpu'].get('foreign_cores_avg') or 0:.2f}")
    worst = max((float(x.rsplit(" ", 1)[1]) for x in contention), default=0.0)
    lines += [
        "",
        f"- CPU used by processes outside this benchmark during each measured section "
        f"(avg cores): {', '.join(contention)}"
        + (
            " -- WARNING: the machine was shared, timings are disturbed"
            if worst >= CONTENTION_WARN_CORES
            else ""
        ),
    ]
    for backend in report["backends_run"]:
        c = report["cluster"].get(backend, {})
        if "error" in c or "warning" in c:
            lines.append(f"- {backend}: {c.get('error', '').splitlines()[-1:] or c.get('warning')}")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = script_parser(__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 3 prompts per section, grpc only"
    )
    ap.add_argument("--out", default=None, help=f"JSON results path (default {DEFAULT_OUT})")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument(
        "--requests", type=int, default=None, help="measured cluster requests per backend (10)"
    )
    ap.add_argument("--cluster-warmup", type=int, default=2)
    ap.add_argument("--pipeline-trials", type=int, default=None, help="trials per backend (8)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--prefill-threads", type=int, default=2)
    ap.add_argument("--decode-threads", type=int, default=1)
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--skip-pipeline", action="store_true")
    add_wait_idle_arg(ap, "each section")
    args = ap.parse_args(argv)
    if args.quick:
        args.backends = args.backends if "--backends" in (argv or sys.argv) else "grpc"
    args.requests = args.requests or (3 if args.quick else 10)
    args.pipeline_trials = args.pipeline_trials or (2 if args.quick else 20)
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = set(args.backends) - set(CHOICES)
    if unknown:
        ap.error(f"--backends: unknown {sorted(unknown)}; choose from {CHOICES}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")
    import ray

    from pdserve.deploy.config.load import validate_config

    command = shlex.join(["python", "-m", "benchmarks.cluster.ttft", *sys.argv[1:]])
    config = validate_config(deploy_dict(args, args.backends[0]))
    engine_kwargs = config.engine_kwargs(
        config.pools.prefill
    )  # exactly what the prefill worker gets
    report = {
        "command": command,
        "git_head": git_head(),
        "machine": machine_info(args.prefill_threads),
        "config": {**{k: v for k, v in vars(args).items()}, "engine_kwargs": engine_kwargs},
        "backends_run": args.backends,
        "cluster": {},
        "engine_alone": {},
    }
    t_start = time.perf_counter()
    idle = lambda: wait_for_idle_machine(args.wait_idle) if args.wait_idle > 0 else None  # noqa: E731
    alone = EngineAlone(args, engine_kwargs)
    report["engine_alone"]["info"] = alone.info
    tmp = tempfile.mkdtemp(prefix="pdcb")  # short: Ray's socket paths live under it
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
    try:
        alone.warmup(SEED_ENGINE + 99)
        for backend in args.backends:
            idle()
            try:
                report["cluster"][backend] = run_cluster(args, backend, alone)
            except Exception as e:  # noqa: BLE001 - the other backends still run
                report["cluster"][backend] = {"error": traceback.format_exc()}
                log(f"cluster {backend} FAILED: {type(e).__name__}: {e}")
    finally:
        alone.close()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    if not args.skip_pipeline:
        idle()
        proc, conn = start(
            pipeline_side,
            args.model,
            engine_kwargs,
            args.prefill_threads,
            args.decode_threads,
            args.backends,
            args.pipeline_trials,
            SEED_PIPELINE,
            args.prompt_len,
        )
        report["pipeline"] = conn.recv() if conn.poll(900) else {"error": "no answer in 900 s"}
        proc.join(60)
        for backend, r in report["pipeline"].get("backends", {}).items():
            if "summary" in r:
                s = r["summary"]
                log(
                    f"pipeline {backend}: compute {s['compute_s'] * 1000:.1f} ms, transfer "
                    f"{s['transfer_s'] * 1000:.1f} ms, pipelined {s['pipelined_s'] * 1000:.1f} ms, "
                    f"hidden {s['hidden_of_medians'] * 100:.0f}%"
                )
            elif "error" in r:
                log(f"pipeline {backend} FAILED:\n{r['error']}")
    combine(args, report)
    report["wall_s"] = time.perf_counter() - t_start
    table = render(report)
    report["table_markdown"] = table
    out = args.out or os.path.join(REPO_ROOT, DEFAULT_OUT)
    write_result(out, report, "benchmarks.cluster.ttft", argv)
    print(table)
    print(f"\nwall {report['wall_s']:.0f} s; results written to {out}")
    failed = [b for b in args.backends if "ttft" not in report["cluster"].get(b, {})]
    return 1 if failed or "error" in report.get("pipeline", {}) else 0


if __name__ == "__main__":
    sys.exit(main())
