"""The deployment and client side of benchmarks/robustness/chaos.py (and benchmarks/cluster/first_request.py): the README's
example deployment started with `deploy.launcher.up()`, what the bench reads of it (Stats through
the cluster secret, worker replacements, the router's drop-outs), and the client bodies that run
in spawned processes of their own (streams that cancel themselves, a looping load, a health
probe). The cluster benchmarks (benchmarks/robustness/*, benchmarks/engine/moe.py and
spec_served.py) share from here the report's opening (cluster_report), one health check
(serving), the counts that open an analysis of streamed tokens (stream_counts) and the start and
failed-run cleanup of a `pdserve up` child (start_up, fail_up, stop_up). It keeps no state."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.bench_common import REPO_ROOT, log, run_header

EXAMPLE = os.path.join(REPO_ROOT, "deploy", "examples", "local-cpu.yaml")
RPC_TIMEOUT = 120.0
MODEL = "SmolLM2-135M-Instruct (embedded GGUF), deploy/examples/local-cpu.yaml"
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def cluster_report(module: str, argv: list[str] | None, log_format: str = LOG_FORMAT) -> dict:
    """Readies this process for a run on the example deployment (WARNING logs in `log_format`, no
    download progress bars) and returns the report's opening fields: run_header's and the model."""
    logging.basicConfig(level=logging.WARNING, format=log_format)
    os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")
    return {**run_header(module, argv), "model": MODEL}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))] if s else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the deployment -----------------------------------------------------------------------------
def example_config(
    port: int = 0, prefill: int = 1, decode: int = 1, prefix_caching: bool = True
) -> dict:
    """The README's example deployment; runs that replay a clean run's prompts turn prefix
    caching off, so the replay does the same work as the clean run."""
    import yaml

    with open(EXAMPLE) as f:
        data = yaml.safe_load(f)
    data["router"]["port"] = port
    for pool in data["pools"].values():
        pool["enable_prefix_caching"] = prefix_caching
    data["pools"]["prefill"]["replicas"] = prefill
    data["pools"]["decode"]["replicas"] = decode
    data["ray"] = {
        "num_cpus": max(2, prefill + decode),
        "temp_dir": tempfile.mkdtemp(prefix="pdray"),
    }
    return data


class DropCounter(logging.Handler):
    """Counts the router pool's "dropped out" warnings and its registrations."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.dropped: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "dropped out" in msg:
            self.dropped.append(msg)


@contextlib.contextmanager
def deployment(data: dict, source: str = "bench/chaos", times: dict | None = None, **up_kwargs):
    """The deployment of the YAML data `data` (validated as `source`), started in this process with
    deploy.launcher.up(), as `pdserve up` starts it: yields (cluster, the router's DropCounter) and
    stops it on the way out. `times`, when given, gets how long the start and the stop took
    (up_s, stop_s)."""
    from pdserve.deploy.config.load import validate_config
    from pdserve.deploy.launcher import up

    times = {} if times is None else times
    drops = DropCounter()
    logging.getLogger("router").addHandler(drops)
    t0 = time.perf_counter()
    cluster = up(validate_config(data, source), block=False, **up_kwargs)
    times["up_s"] = time.perf_counter() - t0
    log(f"deployment up in {times['up_s']:.1f} s on {cluster.router_address}")
    try:
        yield cluster, drops
    finally:
        t1 = time.perf_counter()
        cluster.stop()
        times["stop_s"] = time.perf_counter() - t1
        logging.getLogger("router").removeHandler(drops)


def kv_state(cluster) -> dict:
    """Every worker's Stats through the cluster secret: free/total blocks, running, reserved."""
    from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

    out = {}
    for r in cluster.replicas:
        if not r.address:
            continue
        stub = (
            worker_pb2_grpc.DecodeWorkerStub
            if r.role == "decode"
            else worker_pb2_grpc.PrefillWorkerStub
        )
        with cluster.security.channel(r.address) as ch:
            s = stub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)
        out[r.name] = {
            "free": s.num_free_blocks,
            "total": s.num_total_blocks,
            "running": s.num_running,
            "reserved": s.num_reserved,
        }
    return out


def wait_kv_free(cluster, timeout_s: float = 10.0) -> tuple[bool, float, dict]:
    t0 = time.perf_counter()
    while True:
        state = kv_state(cluster)
        free = all(
            s["free"] == s["total"] and not s["running"] and not s["reserved"]
            for s in state.values()
        )
        if free or time.perf_counter() - t0 > timeout_s:
            return free, time.perf_counter() - t0, state
        time.sleep(0.05)


def wait_replaced(
    cluster, replica, old_actor, role: str, members: int, timeout_s: float = 180.0
) -> float:
    """Seconds until the supervisor has replaced `replica`'s dead `old_actor` with a new one that
    serves and is registered with the router (the pool has `members` of `role` again)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        workers = getattr(cluster.router.pool, role)
        if (
            replica.actor is not None
            and replica.actor is not old_actor
            and replica.address
            and len(workers) == members
            and any(w.address == replica.address for w in workers)
        ):
            return time.perf_counter() - t0
        time.sleep(0.02)
    raise RuntimeError(f"{replica.name} was not replaced within {timeout_s:.0f} s")


# ---- client processes ---------------------------------------------------------------------------
def one_stream(stub, job: dict) -> dict:
    """job: prompt, max_tokens, and optionally cancel_after (tokens) or cancel_delay_s."""
    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb

    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=job["prompt"]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True),
    )
    sent = time.perf_counter()
    call = stub.Generate(request, timeout=RPC_TIMEOUT)
    timer = None
    if job.get("cancel_delay_s") is not None:
        timer = threading.Timer(job["cancel_delay_s"], call.cancel)
        timer.start()
    tokens, finish, first, error = [], None, None, None
    try:
        for resp in call:
            if resp.HasField("delta"):
                if first is None and resp.delta.token_ids:
                    first = time.perf_counter() - sent
                tokens += list(resp.delta.token_ids)
                if job.get("cancel_after") is not None and len(tokens) >= job["cancel_after"]:
                    call.cancel()
            else:
                finish = resp.finish.finish_reason
    except grpc.RpcError as e:
        error = (e.code().name, e.details())
    finally:
        if timer is not None:
            timer.cancel()
    return {
        "i": job["i"],
        "tokens": tokens,
        "finish": finish,
        "error": error,
        "ttft_s": first,
        "cancelled": error is not None and error[0] == "CANCELLED",
    }


def run_streams(address: str, jobs: list[dict], concurrency: int, conn) -> None:
    """Process body: every job through `concurrency` threads; sends back the rows."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        with ThreadPoolExecutor(concurrency) as pool:
            rows = list(pool.map(lambda j: one_stream(stub, j), jobs))
    conn.send(rows)


def loop_streams(address: str, jobs: list[dict], concurrency: int, stop, conn) -> None:
    """Process body: each thread cycles through its jobs until `stop`; sends back every row with
    its start time (perf_counter of this machine's monotonic clock)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc

    rows = []

    def worker(k):
        n = 0
        while not stop.is_set():
            job = jobs[(k + n * concurrency) % len(jobs)]
            t = time.monotonic()
            row = one_stream(stub, job)
            row["t"], row["took_s"] = t, time.monotonic() - t
            rows.append(row)
            n += 1
            if row["error"]:
                time.sleep(0.1)

    with grpc.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(worker, range(concurrency)))
    conn.send(rows)


def serving(stub) -> bool:
    """One grpc.health.v1 Check on `stub` (a HealthStub) with a 2 s deadline: True where the
    server answers SERVING, False on any other status or an RPC error."""
    import grpc
    from grpc_health.v1 import health_pb2

    try:
        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0).status
    except grpc.RpcError:
        return False
    return status == health_pb2.HealthCheckResponse.SERVING


def probe_health(address: str, interval_s: float, stop, conn) -> None:
    """Process body: grpc.health.v1 Check every interval_s; sends back (latency ms | None) each."""
    import grpc
    from grpc_health.v1 import health_pb2_grpc

    out = []
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            t = time.perf_counter()
            ok = serving(stub)
            took = (time.perf_counter() - t) * 1000
            out.append(round(took, 2) if ok else None)
            time.sleep(max(0.0, interval_s - took / 1000))
    conn.send(out)


class Child:
    """A spawned process running one of the bodies above; `result()` waits for what it sends."""

    ctx = mp.get_context("spawn")

    def __init__(self, target, *args, stop=None):
        self.stop = stop
        self.parent, child = self.ctx.Pipe()
        extra = (stop,) if stop is not None else ()
        self.proc = self.ctx.Process(target=target, args=(*args, *extra, child), daemon=True)
        self.proc.start()

    def result(self, timeout: float = 1800.0):
        if self.stop is not None:
            self.stop.set()
        if not self.parent.poll(timeout):
            raise TimeoutError(f"{self.proc} sent nothing within {timeout}s")
        got = self.parent.recv()
        self.proc.join(30)
        return got


def stream_counts(rows: list[dict], want: list[list[int]]) -> tuple[list[dict], dict]:
    """The streams (rows of timed loops: i, tokens, error) that finished with tokens other than
    `want[i]`, and the counts every analysis of such rows opens with."""
    errors = [r["error"] for r in rows if r["error"]]
    changed = [r for r in rows if not r["error"] and r["tokens"] != want[r["i"]]]
    return changed, {
        "streams": len(rows),
        "errors": len(errors),
        "first_errors": errors[:5],
        "token_identical": len(rows) - len(errors) - len(changed),
    }


def jobs_for(prompts, max_tokens: int, cancel: dict[int, dict] | None = None) -> list[dict]:
    return [
        {"i": i, "prompt": p, "max_tokens": max_tokens, **(cancel or {}).get(i, {})}
        for i, p in enumerate(prompts)
    ]


# ---- `pdserve up` as a child process: the CLI's own start and stop ---------------------------
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0


def popen_up(command: list[str], err) -> subprocess.Popen:
    """`pdserve up` as a child of this checkout, stdout piped (its start table and "ready"),
    stderr to the open file `err`, no API key inherited from the caller's environment."""
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO_ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_API_KEY")},
    )  # fmt: skip


def start_up(command: list[str], work: str) -> tuple[subprocess.Popen, str]:
    """popen_up(command) with its stderr in `work`/up.err; the process and that file's path."""
    err_path = os.path.join(work, "up.err")
    with open(err_path, "w") as err:
        return popen_up(command, err), err_path


def fail_up(proc: subprocess.Popen, err_path: str, label: str) -> None:
    """On a failed run: stops `proc` and logs the tail of its stderr file, led by `label`."""
    stop_up(proc)
    with open(err_path) as f:
        log(f"{label}: `pdserve up` stderr (tail):\n{f.read()[-4000:]}")


def router_address(proc: subprocess.Popen, timeout_s: float) -> str:
    """Reads `proc`'s stdout on a thread of its own until `ready`; the router address it printed.
    The thread keeps draining stdout afterwards (the start table), so the child never blocks."""
    return router_addresses(proc, timeout_s)[0]


def router_addresses(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str | None]:
    """router_address's, with the HTTP front's base URL it printed (`http://host:port/v1`; None
    without an HTTP front)."""
    seen, found = threading.Event(), {}

    def read():
        for line in proc.stdout:
            for key, pattern in (
                ("grpc", r"router on (\S+)"),
                ("http", r"OpenAI-compatible HTTP on (\S+)"),
            ):
                match = re.fullmatch(pattern, line.strip())
                if match:
                    found.setdefault(key, match[1])
            if line.strip() == "ready":
                seen.set()
        seen.set()  # stdout closed: the child exited

    threading.Thread(target=read, daemon=True).start()
    seen.wait(timeout_s)
    if "grpc" not in found or proc.poll() is not None:
        state = f"exited {proc.poll()}" if proc.poll() is not None else "still starting"
        raise RuntimeError(f"`pdserve up` printed no 'ready' within {timeout_s:.0f}s ({state})")
    return found["grpc"], found.get("http")


def stop_up(proc: subprocess.Popen) -> int | None:
    """SIGTERM (`up` stops its deployment and its local Ray), then a kill past STOP_TIMEOUT_S."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@contextlib.contextmanager
def up_child(config: dict, label: str, report: dict, args: tuple[str, ...] = ()):
    """`pdserve up` of the deployment `config` (example_config's dict, written to a YAML file in a
    temporary folder) as a child process, with `args` after the file: yields its router's (gRPC
    address, HTTP base URL or None) once ready. Records the command and the exit status of its
    stop in `report`; on a failure logs the tail of its stderr, led by `label`; at the end
    removes the folder and the deployment's Ray folder."""
    import yaml

    work = tempfile.mkdtemp(prefix=f"{label}-")
    path = os.path.join(work, "deploy.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    command = [sys.executable, "-m", "pdserve", "up", path, *args]
    report["command"] = " ".join(command[1:])
    up, err_path = start_up(command, work)
    try:
        yield router_addresses(up, START_TIMEOUT_S)
    except BaseException:
        fail_up(up, err_path, label)
        raise
    finally:
        report["stop_returncode"] = stop_up(up)
        shutil.rmtree(config["ray"]["temp_dir"], ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def decode_rate(deltas: list[list[tuple[float, list[int]]]], t_start: float) -> dict:
    """The client's decode measure over every request's deltas ([(arrival time, token ids)] per
    streamed delta), as close to an engine's measure as a client gets: t_all = the moment the
    last request received its first token (every request then has one); decode tok/s = the tokens
    received after t_all / (the last token's arrival - t_all). It includes the router, the KV
    hand-off, gRPC streaming and the client's threads, so it is a served figure."""
    t_all = max(d[0][0] for d in deltas)
    t_last = max(d[-1][0] for d in deltas)
    after = sum(len(toks) for d in deltas for t, toks in d if t > t_all)
    return {
        "t_all_first_token_s": t_all - t_start,
        "t_total_s": t_last - t_start,
        "ttft_s": sorted(d[0][0] - t_start for d in deltas),
        "decode_tokens": after,
        "decode_time_s": t_last - t_all,
        "decode_tok_s": after / (t_last - t_all) if t_last > t_all else None,
    }
