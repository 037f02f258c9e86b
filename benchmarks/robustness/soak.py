"""A long run at a steady rate against a real deployment: does the memory of the router and of the
workers stay flat? (issue #26: the router's RSS rose about 1.5 MB per 1,000 requests.)

  python -m benchmarks.robustness.soak --minutes 60 --rate 1.5                 # the must-show run
  python -m benchmarks.robustness.soak --minutes 13 --tracemalloc 3,12.5 --out /tmp/soak_tm.json   # what grows

It starts `deploy/examples/local-cpu.yaml` with `deploy.launcher.up()` (what `pdserve up` runs) on
the embedded SmolLM2, one prefill and one decode worker; the router runs in this process, so its
RSS is this process's. One client process sends an open-loop Poisson stream of requests at
--rate: gRPC Generate streams and HTTP /v1/completions and /v1/chat/completions, half of the HTTP
ones streaming, a quarter of all of them (--cancel) cancelled by the client at a random point.
Every --sample-s seconds it reads the RSS (VmRSS and its anon/file/shmem parts), open fds and
threads of the router and of each worker from /proc, plus the router's malloc heap (mallinfo2)
and sizes of its long-lived maps. --tracemalloc M1,M2,... traces the router process's Python
allocations (from when the deployment is up) and compares the snapshots at those minutes by
line and by traceback. Writes benchmarks/results/soak.json: the RSS at minute --from-minute and
at the end, the largest deviation from the former, the peak of each 10 minutes, request counts
and errors, and the series.
"""

from __future__ import annotations

import ctypes
import gc
import os
import random
import sys
import threading
import time

from benchmarks.bench_common import REPO_ROOT, log, script_parser, write_result, write_timed
from benchmarks.chaos_harness import Child, cluster_report, deployment, example_config

KINDS = (  # (kind, weight)
    ("grpc", 0.4),
    ("completions", 0.15),
    ("completions_stream", 0.15),
    ("chat", 0.15),
    ("chat_stream", 0.15),
)
WORDS = (
    "the of and to in is for on that with as by at from this be are it an or was which not have "
    "data model server request token stream cache memory worker router decode prefill river "
    "mountain garden window letter number system question answer reason simple value"
).split()


# ---- the client process -------------------------------------------------------------------------
def one_grpc(stub, job: dict) -> str:
    """One Generate stream; its outcome: ok, cancelled or error:<code>."""
    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb

    sampling = pb.SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    if job["ids"] is not None:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=job["ids"]), sampling=sampling)
    else:
        request = pb.GenerateRequest(text=job["text"], sampling=sampling)
    call = stub.Generate(request, timeout=120.0)
    timer = None
    if job.get("cancel_delay_s") is not None:
        timer = threading.Timer(job["cancel_delay_s"], call.cancel)
        timer.start()
    tokens = 0
    try:
        for resp in call:
            if resp.HasField("delta"):
                tokens += len(resp.delta.token_ids)
                if job.get("cancel_after") is not None and tokens >= job["cancel_after"]:
                    call.cancel()
        return "ok"
    except grpc.RpcError as e:
        return "cancelled" if e.code() == grpc.StatusCode.CANCELLED else f"error:{e.code().name}"
    finally:
        if timer is not None:
            timer.cancel()


def one_http(host: str, port: int, model: str, job: dict) -> str:
    """One OpenAI request with http.client; a cancel closes the connection (after k stream
    chunks, or after a delay when the response is not streamed)."""
    import http.client
    import json

    stream = job["kind"].endswith("_stream")
    body = {"model": model, "max_tokens": job["max_tokens"], "temperature": 0.0, "stream": stream}
    if job["kind"].startswith("chat"):
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": job["text"]}]
    else:
        path, body["prompt"] = "/v1/completions", job["text"]
    cancel_delay = job.get("cancel_delay_s")
    conn = http.client.HTTPConnection(host, port, timeout=cancel_delay or 120.0)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            return f"error:http_{resp.status}"
        if not stream:
            resp.read()
            return "ok"
        chunks = 0
        for line in resp:
            if line.startswith(b"data: "):
                chunks += 1
                if job.get("cancel_after") is not None and chunks >= job["cancel_after"]:
                    return "cancelled"
        return "ok"
    except TimeoutError:
        return "cancelled" if cancel_delay is not None else "error:timeout"
    except OSError as e:
        return f"error:{type(e).__name__}"
    finally:
        conn.close()


def make_job(rng: random.Random, i: int, max_tokens: int, cancel: float) -> dict:
    kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
    n = rng.randint(16, 96)
    job = {"i": i, "kind": kind, "max_tokens": rng.randint(max(2, max_tokens // 3), max_tokens)}
    if kind == "grpc" and rng.random() < 0.5:
        job["ids"], job["text"] = [rng.randrange(100, 49000) for _ in range(n)], None
    else:
        job["ids"], job["text"] = None, " ".join(rng.choice(WORDS) for _ in range(n))
    if rng.random() < cancel:
        if rng.random() < 0.25 or kind in ("completions", "chat"):  # before the end, on a timer
            job["cancel_delay_s"] = rng.uniform(0.02, 0.6)
        else:
            job["cancel_after"] = rng.randint(1, max(1, job["max_tokens"] - 1))
    return job


def soak_client(
    grpc_address: str,
    http_url: str,
    rate: float,
    seconds: float,
    max_tokens: int,
    cancel: float,
    seed: int,
    progress,
    stop,
    conn,
) -> None:
    """Process body: an open-loop Poisson stream of jobs at `rate` per second for `seconds`, each
    on a thread of its own (at most 64 in flight: past that a job is counted as shed). Counts
    sent and finished jobs into `progress` (two shared ints); sends back the outcome counts."""
    import json
    import urllib.request
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc

    host, port = http_url.split("//", 1)[1].rsplit(":", 1)
    with urllib.request.urlopen(f"{http_url}/v1/models", timeout=30) as r:
        model = json.load(r)["data"][0]["id"]
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    by_kind: Counter = Counter()
    lock = threading.Lock()
    in_flight = [0]

    def run(job):
        try:
            if job["kind"] == "grpc":
                got = one_grpc(stub, job)
            else:
                got = one_http(host, int(port), model, job)
        except Exception as e:  # a client bug must not stop the soak; it is counted
            got = f"client_exception:{type(e).__name__}"
        with lock:
            outcomes[got] += 1
            by_kind[f"{job['kind']}:{got.split(':')[0]}"] += 1
            in_flight[0] -= 1
            progress[1] += 1

    with grpc.insecure_channel(grpc_address) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        with ThreadPoolExecutor(64) as pool:
            t0 = time.monotonic()
            due, i = t0, 0
            while not stop.is_set():
                due += rng.expovariate(rate)
                if due - t0 > seconds:
                    break
                stop.wait(max(0.0, due - time.monotonic()))
                job = make_job(rng, i, max_tokens, cancel)
                i += 1
                with lock:
                    if in_flight[0] >= 64:
                        outcomes["shed"] += 1
                        continue
                    in_flight[0] += 1
                    progress[0] += 1
                pool.submit(run, job)
    conn.send({"sent": i, "outcomes": dict(outcomes), "by_kind": dict(by_kind)})


# ---- what the bench reads of the processes ------------------------------------------------------
STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads")


def proc_sample(pid: int) -> dict:
    """VmRSS and its parts (KiB), threads, open fds and CPU seconds of process `pid`."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS_FIELDS:
                out[key] = int(value.split()[0])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    out["cpu_s"] = round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    return out


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mallinfo() -> dict | None:
    """This process's glibc heap summed over its arenas (KiB): in use, free inside the heaps, and
    mmapped chunks; None without glibc's mallinfo2."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    m = fn()
    return {
        "in_use_kb": m.uordblks // 1024,
        "free_kb": m.fordblks // 1024,
        "mmap_kb": m.hblkhd // 1024,
        "heap_kb": m.arena // 1024,
    }


def router_state(cluster, count_objects: bool = False) -> dict:
    """Sizes of the router's long-lived maps (those a leak would show in); with count_objects,
    the objects the garbage collector tracks too (a 3 MB list each time, which the RSS of the
    must-show run should not carry: diagnostic runs only)."""
    router = cluster.router
    out = {"inflight": router.servicer.num_inflight()}
    if count_objects:
        out["gc_objects"] = len(gc.get_objects())
    affinity = getattr(router.pool, "_affinity", None)
    if affinity is not None:
        out["affinity_hashes"] = len(affinity._holders)
    legs = getattr(router.servicer, "legs", None)
    open_legs = getattr(legs, "open", None)
    if open_legs is not None:
        out["open_legs"] = sum(len(s) for s in open_legs._open.values())
    return out


def worker_pids(cluster) -> dict[str, int]:
    import ray

    return {
        r.name: ray.get(r.actor.pid.remote(), timeout=30)
        for r in cluster.replicas
        if r.actor is not None
    }


# ---- tracemalloc ----------------------------------------------------------------------------------
def snapshot_filtered():
    import tracemalloc

    return tracemalloc.take_snapshot().filter_traces(
        (
            tracemalloc.Filter(False, tracemalloc.__file__),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap*"),
            tracemalloc.Filter(False, "<unknown>"),
        )
    )


def compare(first, last, top: int = 25) -> dict:
    """The allocations that grew most between two snapshots, by line and by traceback, and the
    growth of all of them together."""
    total = sum(stat.size_diff for stat in last.compare_to(first, "filename"))
    out = {"total_size_diff_kb": round(total / 1024, 1)}
    for key in ("lineno", "traceback"):
        rows = []
        for stat in last.compare_to(first, key)[:top]:
            rows.append(
                {
                    "size_diff_kb": round(stat.size_diff / 1024, 1),
                    "count_diff": stat.count_diff,
                    "size_kb": round(stat.size / 1024, 1),
                    "where": stat.traceback.format(limit=12 if key == "traceback" else 1),
                }
            )
        out[key] = rows
    return out


# ---- the run ------------------------------------------------------------------------------------
def deviation(series: list[dict], who: str, from_s: float, window_s: float = 600.0) -> dict:
    """RSS at the first sample at or after `from_s`, at the end, the largest deviation (%) of any
    later sample from the first, the largest rise and fall apart, and the peak of each
    `window_s` window from `from_s` on (a leak raises every window's peak; memory the allocator
    hands back and takes again only moves the samples between them)."""
    pts = [(s["t_s"], s["procs"][who]["VmRSS"]) for s in series if who in s["procs"]]
    after = [(t, v) for t, v in pts if t >= from_s]
    if not after:
        return {}
    base = after[0][1]
    dev = max(after, key=lambda p: abs(p[1] - base))
    peaks: dict[int, int] = {}
    for t, v in after:
        k = int((t - after[0][0]) // window_s)
        peaks[k] = max(peaks.get(k, 0), v)
    return {
        "rss_from_kb": base,
        "rss_from_at_s": after[0][0],
        "rss_end_kb": after[-1][1],
        "end_change_pct": round(100 * (after[-1][1] - base) / base, 2),
        "max_deviation_pct": round(100 * (dev[1] - base) / base, 2),
        "max_deviation_at_s": dev[0],
        "max_rise_pct": round(100 * (max(v for _, v in after) - base) / base, 2),
        "max_fall_pct": round(100 * (min(v for _, v in after) - base) / base, 2),
        "rss_min_kb": min(v for _, v in after),
        "rss_max_kb": max(v for _, v in after),
        "window_s": window_s,
        "window_peaks_kb": [peaks[k] for k in sorted(peaks)],
    }


def downsample(series: list[dict], keep: int) -> list[dict]:
    if len(series) <= keep:
        return series
    step = len(series) / keep
    picked = sorted({int(k * step) for k in range(keep)} | {len(series) - 1})
    return [series[i] for i in picked]


def run(args, report: dict) -> None:
    import tracemalloc

    marks = sorted(float(m) * 60 for m in args.tracemalloc.split(",")) if args.tracemalloc else []
    data = example_config()
    data["router"]["http_port"] = 0
    snapshots = {}
    with deployment(data) as (cluster, drops):
        pids = {"router": os.getpid(), **worker_pids(cluster)}
        report["pids"] = pids
        log(f"processes: {pids}")
        if marks:  # from here: what the deployment's start allocated is not traced (faster)
            tracemalloc.start(args.tracemalloc_frames)
        progress = Child.ctx.Array("q", 2)
        stop = Child.ctx.Event()
        client = Child(
            soak_client,
            cluster.router_address,
            cluster.http_url,
            args.rate,
            args.minutes * 60,
            args.max_tokens,
            args.cancel,
            args.seed,
            progress,
            stop=stop,
        )
        series: list[dict] = []
        t0 = time.monotonic()
        next_sample = t0
        while client.proc.is_alive() or not series:
            now = time.monotonic()
            if marks and now - t0 >= marks[0]:
                at = marks.pop(0)
                gc.collect()
                snapshots[at] = snapshot_filtered()
                log(f"tracemalloc snapshot at {at / 60:g} min")
            if now >= next_sample:
                sample = {
                    "t_s": round(now - t0, 1),
                    "sent": progress[0],
                    "done": progress[1],
                    "procs": {},
                }
                for who, pid in pids.items():
                    try:
                        sample["procs"][who] = proc_sample(pid)
                    except OSError:  # a worker died; the supervisor replaces it
                        report.setdefault("worker_deaths", []).append((sample["t_s"], who))
                sample["malloc"] = mallinfo()
                sample["router_state"] = router_state(cluster, tracemalloc.is_tracing())
                if tracemalloc.is_tracing():
                    sample["traced_kb"] = tracemalloc.get_traced_memory()[0] // 1024
                series.append(sample)
                log(
                    f"t={sample['t_s']:.0f}s sent {sample['sent']} done {sample['done']} RSS MB "
                    + ", ".join(f"{k} {v['VmRSS'] / 1024:.1f}" for k, v in sample["procs"].items())
                    + f" malloc in use {sample['malloc'] and sample['malloc']['in_use_kb'] // 1024}"
                    + f" state {sample['router_state']}"
                )
                next_sample += args.sample_s
                if len(series) % 10 == 0:
                    report["series_so_far"] = downsample(series, 60)
                    write_result(args.out, report)
            time.sleep(0.5)
        got = client.result(timeout=300)
        report.pop("series_so_far", None)
        report["workers_dropped"] = len(drops.dropped)
    report["requests"] = got
    report["series"] = downsample(series, args.keep_samples)
    from_s = args.from_minute * 60
    report["rss"] = {who: deviation(series, who, from_s) for who in pids}
    report["fds_threads"] = {
        who: {
            key: [series[0]["procs"][who][key], series[-1]["procs"][who][key]]
            for key in ("fds", "Threads")
        }
        for who in pids
        if who in series[0]["procs"] and who in series[-1]["procs"]
    }
    cpu = {}
    for who in pids:
        if who in series[0]["procs"] and who in series[-1]["procs"]:
            span = series[-1]["t_s"] - series[0]["t_s"]
            used = series[-1]["procs"][who]["cpu_s"] - series[0]["procs"][who]["cpu_s"]
            cpu[who] = round(used / span, 3) if span else None
    report["cpu_cores_used"] = cpu
    if len(snapshots) >= 2:
        first, last = min(snapshots), max(snapshots)
        report["tracemalloc"] = {
            "from_min": first / 60,
            "to_min": last / 60,
            **compare(snapshots[first], snapshots[last]),
        }
    for who, r in report["rss"].items():
        if r:
            log(
                f"{who}: RSS {r['rss_from_kb'] / 1024:.1f} MB at {r['rss_from_at_s']:.0f} s -> "
                f"{r['rss_end_kb'] / 1024:.1f} MB at the end; max deviation "
                f"{r['max_deviation_pct']}%"
            )
    log(f"requests: {got}")


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=24, help="each request asks for 1/3..all")
    p.add_argument("--cancel", type=float, default=0.25, help="fraction cancelled by the client")
    p.add_argument("--sample-s", type=float, default=30.0)
    p.add_argument("--from-minute", type=float, default=10.0, help="the deviation's baseline")
    p.add_argument("--keep-samples", type=int, default=240, help="series points in the JSON")
    p.add_argument("--tracemalloc", default="", help="minutes to snapshot at, e.g. 3,12")
    p.add_argument("--tracemalloc-frames", type=int, default=10)
    p.add_argument("--seed", type=int, default=26)
    p.add_argument(
        "--out",
        default=os.path.join(REPO_ROOT, "benchmarks", "results", "soak.json"),
        help="JSON results path (default benchmarks/results/soak.json)",
    )
    args = p.parse_args(argv)
    report = {
        **cluster_report("benchmarks.robustness.soak", argv),
        "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
    }
    t0 = time.perf_counter()
    run(args, report)
    write_timed(args.out, report, t0)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
