"""Chaos part b (issue #26's must-show b): 25,000 slow or idle connections against the HTTP front
of a real deployment (`deploy.launcher.up()` of the embedded SmolLM2, as robustness/chaos.py),
while a normal client sends gRPC Generate and HTTP /v1/completions requests and a probe polls
/health, /metrics and gRPC health.

  python -m benchmarks.robustness.slowloris                     # ~5 min on 2 cores
  python -m benchmarks.robustness.slowloris --connections 5000 --attack-s 30

The attackers, the normal client and the probes are processes of their own (chaos_harness.Child,
so that their sockets and CPU are not the router's); each attacker has a source address of its own (127.0.0.2, ...,
so the ephemeral ports of one address are never short): a third of the connections are idle
(connect, send nothing), a third slowloris (a request line, then a header byte every --drip-s
seconds, never the blank line), a third POST headers with a Content-Length whose body never
comes. Each connection the server closes is opened again after --reconnect-s seconds, +-50%
(the slowloris tool re-opens its sockets every 15 s), so the pressure stays at --connections.
The run: a baseline with the normal client alone, then the attack, then a recovery window. What
it records: the normal client's latency per protocol and phase, the probes' failures, every byte
the router's process writes to stderr (its log; `pdserve up` logs there) during the run, the
router's file descriptors, the HTTP front's connection book and the GC's pauses over time, and
what the attackers saw. Writes benchmarks/results/chaos_slowloris.json; `part_b(args)`, for
benchmarks/robustness/chaos.py, takes the options `add_args` defines.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import resource
import sys
import tempfile
import threading
import time

from benchmarks.bench_common import add_out_arg, script_parser, write_result
from benchmarks.chaos_harness import (
    Child,
    cluster_report,
    deployment,
    example_config,
    one_stream,
    pct,
    serving,
)

IDLE, SLOW, BODY = "idle", "slowloris", "body"
KINDS = (IDLE, SLOW, BODY)
IP_BIND_ADDRESS_NO_PORT = 24  # Linux: bind() picks no port; connect() picks one per destination


def say(msg: str, fd: int = 2) -> None:
    """A progress line on `fd` (the terminal's stderr while fd 2 is the router's log file)."""
    os.write(fd, f"[chaos_slowloris {time.strftime('%H:%M:%S')}] {msg}\n".encode())


# ---- attackers ---------------------------------------------------------------------------------
def attacker(index: int, count: int, host: str, port: int, opts: dict, held, go, stop, conn):
    """Process body: `count` connections of the three kinds from 127.0.0.<2 + index>; each one the
    server closes is opened again after ~opts["reconnect_s"]. held[index] is how many are open
    (connected, not yet closed by the server). Sends back its totals when `stop` is set."""
    import errno
    import heapq
    import selectors
    import socket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    rng = random.Random(index)
    src = f"127.0.0.{2 + index}"
    path = "/v1/completions"
    first = {
        IDLE: b"",
        SLOW: f"GET /health HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode(),
        BODY: (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 100000\r\n\r\n"
        ).encode(),
    }
    sel = selectors.DefaultSelector()
    kinds = [KINDS[(index + i) % 3] for i in range(count)]
    socks: list = [None] * count
    state = [""] * count  # "", "connecting", "open"
    since = [0.0] * count
    due: list = []  # heap of (when, slot) to open
    got = {k: {"opened": 0, "closed_by_server": 0, "lifetimes": []} for k in KINDS}
    answers: dict[str, int] = {}
    connect_failures, connect_timeouts, max_held = 0, 0, 0
    open_now = 0
    per_tick = max(1, int(opts["open_per_s"] * 0.05))  # opens at most this many per 50 ms

    def close(i, by_server: bool, now: float):
        nonlocal open_now
        s = socks[i]
        try:
            sel.unregister(s)
        except (KeyError, ValueError):
            pass
        s.close()
        if state[i] == "open":
            open_now -= 1
            if by_server:
                got[kinds[i]]["closed_by_server"] += 1
                got[kinds[i]]["lifetimes"].append(now - since[i])
        socks[i], state[i] = None, ""
        heapq.heappush(due, (now + opts["reconnect_s"] * rng.uniform(0.5, 1.5), i))

    def open_one(i, now: float):
        nonlocal connect_failures
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        s.setblocking(False)
        try:
            s.bind((src, 0))
            err = s.connect_ex((host, port))
        except OSError as e:
            err = e.errno
        if err not in (0, errno.EINPROGRESS):
            s.close()
            connect_failures += 1
            heapq.heappush(due, (now + 1.0, i))
            return
        socks[i], state[i], since[i] = s, "connecting", now
        sel.register(s, selectors.EVENT_WRITE, i)

    def established(i, now: float):
        nonlocal open_now
        s = socks[i]
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            state[i] = "connecting"  # not counted open
            close(i, False, now)
            return
        if first[kinds[i]]:
            try:
                s.send(first[kinds[i]])
            except OSError:
                close(i, False, now)
                return
        state[i], since[i] = "open", now
        open_now += 1
        got[kinds[i]]["opened"] += 1
        sel.modify(s, selectors.EVENT_READ, i)

    go.wait()
    t0 = time.monotonic()
    due = [(t0 + i / opts["open_per_s"], i) for i in range(count)]  # sorted: a heap
    next_tick, next_scan, next_drip = t0, t0 + 1.0, t0 + opts["drip_s"]
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_tick:  # due (re)opens, paced; what the parent reads
            next_tick = now + 0.05
            opened = 0
            while due and due[0][0] <= now and opened < per_tick:
                open_one(heapq.heappop(due)[1], now)
                opened += 1
            held[index] = open_now
            max_held = max(max_held, open_now)
        for key, _ in sel.select(timeout=max(0.0, next_tick - time.monotonic())):
            i = key.data
            now = time.monotonic()
            if state[i] == "connecting":
                established(i, now)
                continue
            try:
                data = socks[i].recv(4096)
            except (ConnectionResetError, OSError):
                data = b""
            if data:
                status = data[9:12].decode("ascii", "replace") if data[:5] == b"HTTP/" else "?"
                answers[status] = answers.get(status, 0) + 1
            else:
                close(i, True, now)
        now = time.monotonic()
        if now >= next_scan:  # connects the server never took
            next_scan = now + 1.0
            for i in range(count):
                if state[i] == "connecting" and now - since[i] > 30:
                    connect_timeouts += 1
                    close(i, False, now)
        if now >= next_drip:
            next_drip = now + opts["drip_s"]
            for i in range(count):
                if kinds[i] == SLOW and state[i] == "open":
                    try:
                        socks[i].send(b"a")
                    except OSError:
                        close(i, True, now)
    for i in range(count):
        if socks[i] is not None:
            socks[i].close()
    held[index] = 0
    for k in KINDS:
        life = got[k].pop("lifetimes")
        got[k]["held_s_before_server_closed"] = {
            "p50": round(pct(life, 50), 2) if life else None,
            "p90": round(pct(life, 90), 2) if life else None,
            "max": round(max(life), 2) if life else None,
        }
    usage = resource.getrusage(resource.RUSAGE_SELF)
    conn.send(
        {
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "kinds": got,
            "server_answers": answers,
            "connect_failures": connect_failures,
            "connect_timeouts_30s": connect_timeouts,
            "max_held": max_held,
        }
    )


# ---- the normal client and the probes ----------------------------------------------------------
def run_together(*bodies) -> None:
    """Runs each of `bodies` on a thread of its own and returns once all have returned."""
    threads = [threading.Thread(target=f) for f in bodies]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def normal_client(grpc_address, http_address, model, prompts, max_tokens, pause_s, stop, conn):
    """Process body: one thread sends gRPC Generate, one HTTP /v1/completions (a fresh connection
    each), one request at a time each, `pause_s` apart; sends back (protocol, start, seconds,
    error or None, seconds to connect (HTTP)) for each."""
    import http.client

    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc

    rows = []
    host, _, port = http_address.rpartition(":")

    def grpc_loop():
        with grpc.insecure_channel(grpc_address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            n = 0
            while not stop.is_set():
                job = {"i": n, "prompt": prompts[n % len(prompts)], "max_tokens": max_tokens}
                t = time.monotonic()
                row = one_stream(stub, job)
                error = row["error"] or (None if len(row["tokens"]) == max_tokens else "short")
                rows.append(("grpc", t, time.monotonic() - t, error, None))
                n += 1
                stop.wait(pause_s)

    def http_loop():
        n = 0
        while not stop.is_set():
            body = {
                "model": model,
                "prompt": prompts[(n + 7) % len(prompts)],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            t = time.monotonic()
            error, connect_s = None, None
            try:
                c = http.client.HTTPConnection(host, int(port), timeout=60)
                c.connect()
                connect_s = time.monotonic() - t
                c.request(
                    "POST",
                    "/v1/completions",
                    json.dumps(body),
                    {"Content-Type": "application/json"},
                )
                resp = c.getresponse()
                data = resp.read()
                c.close()
                if resp.status != 200:
                    error = f"HTTP {resp.status}: {data[:120]!r}"
                elif json.loads(data)["usage"]["completion_tokens"] != max_tokens:
                    error = "short"
            except (OSError, http.client.HTTPException) as e:
                error = f"{type(e).__name__}: {e}"[:160]
            rows.append(("http", t, time.monotonic() - t, error, connect_s))
            n += 1
            stop.wait(pause_s)

    run_together(grpc_loop, http_loop)
    conn.send(rows)


def prober(grpc_address, http_address, interval_s, stop, conn):
    """Process body: GET /health every interval_s (and /metrics every 4th time) with a fresh
    connection and a 2 s timeout, gRPC health every interval_s; sends back (what, start,
    seconds or None when it failed)."""
    import http.client

    import grpc
    from grpc_health.v1 import health_pb2_grpc

    rows = []
    host, _, port = http_address.rpartition(":")

    def http_probe():
        n = 0
        while not stop.is_set():
            path = "/metrics" if n % 4 == 3 else "/health"
            t = time.monotonic()
            ok = False
            try:
                c = http.client.HTTPConnection(host, int(port), timeout=2.0)
                c.request("GET", path)
                resp = c.getresponse()
                resp.read()
                c.close()
                ok = resp.status == 200
            except (OSError, http.client.HTTPException):
                pass
            took = time.monotonic() - t
            rows.append((path, t, took if ok and took <= 2.0 else None))
            n += 1
            stop.wait(max(0.0, interval_s - took))

    def grpc_probe():
        with grpc.insecure_channel(grpc_address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                t = time.monotonic()
                ok = serving(stub)
                took = time.monotonic() - t
                rows.append(("grpc_health", t, took if ok else None))
                stop.wait(max(0.0, interval_s - took))

    run_together(http_probe, grpc_probe)
    conn.send(rows)


# ---- the part ----------------------------------------------------------------------------------
class GcPauses:
    """The cyclic GC's collections in this process (the router's) while installed: every thread
    of the process waits for one, so a full collection of a big heap is a stall of all of them."""

    def __init__(self):
        self.runs: list[tuple[int, float]] = []
        self._t = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.runs.append((info["generation"], time.perf_counter() - self._t))

    def summary(self) -> dict:
        out = {}
        for gen in (0, 1, 2):
            xs = [d for g, d in self.runs if g == gen]
            out[f"gen{gen}"] = {
                "collections": len(xs),
                "total_s": round(sum(xs), 2),
                "max_s": round(max(xs), 3) if xs else None,
            }
        return out


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def cpu_s(pid: int | None = None) -> float:
    """A process's user + system CPU seconds so far (this one's by default)."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_pids(cluster) -> dict:
    import ray

    return {
        r.name: ray.get(r.actor.pid.remote(), timeout=30)
        for r in cluster.replicas
        if r.actor is not None
    }


def latency_summary(rows: list, t0: float, t1: float) -> dict:
    """The normal client's rows started in [t0, t1), per protocol."""
    out = {}
    for proto in ("grpc", "http"):
        mine = [r for r in rows if r[0] == proto and t0 <= r[1] < t1]
        ok = [r[2] for r in mine if r[3] is None]
        errors: dict[str, int] = {}
        for r in mine:
            if r[3] is not None:
                kind = str(r[3])[:80]
                errors[kind] = errors.get(kind, 0) + 1
        out[proto] = {
            "requests": len(mine),
            "errors": sum(errors.values()),
            "error_kinds": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
            "p50_ms": round(pct(ok, 50) * 1000, 1) if ok else None,
            "p99_ms": round(pct(ok, 99) * 1000, 1) if ok else None,
            "max_ms": round(max(ok) * 1000, 1) if ok else None,
            # a failed request counts as slower than any: p99 over all of them
            "p99_all_ms": round(
                pct([r[2] if r[3] is None else float("inf") for r in mine], 99) * 1000, 1
            )
            if mine
            else None,
            "slowest": [
                {
                    "t": round(r[1] - t0, 1),
                    "s": round(r[2], 2),
                    **({"connect_s": round(r[4], 2)} if r[4] is not None else {}),
                }
                for r in sorted(mine, key=lambda r: -r[2])[:5]
            ],
        }
    return out


def probe_summary(rows: list, t0: float, t1: float) -> dict:
    out = {}
    for what in ("/health", "/metrics", "grpc_health"):
        mine = [r for r in rows if r[0] == what and t0 <= r[1] < t1]
        ok = [r[2] for r in mine if r[2] is not None]
        out[what] = {
            "probes": len(mine),
            "failures": len(mine) - len(ok),
            "p99_ms": round(pct(ok, 99) * 1000, 1) if ok else None,
            "max_ms": round(max(ok) * 1000, 1) if ok else None,
        }
    return out


def part_b(args) -> dict:
    """--connections slow or idle connections from --attackers processes for --attack-s seconds,
    between a --baseline-s window and a --recovery-s window of the normal client and the probes
    alone: the normal client's latency (gRPC and HTTP), the probes' failures, the router's log
    bytes and file descriptors, the HTTP front's connection book, and what the attackers saw."""
    rng = random.Random(26)
    prompts = [[rng.randrange(100, 49000) for _ in range(16)] for _ in range(256)]
    data = example_config()
    data["router"]["http_port"] = 0
    out = {
        "connections": args.connections,
        "attackers": args.attackers,
        "mix": "a third each: idle, slowloris (a header byte every drip_s), body never sent",
        "reconnect_s": args.reconnect_s,
        "drip_s": args.drip_s,
        "open_per_s_per_attacker": args.open_per_s,
        "max_tokens": args.max_tokens,
        "normal_pause_s": args.pause_s,
        "probe_interval_s": 0.5,
        "rlimit_nofile_before_up": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
    }
    with deployment(data) as (cluster, drops):
        router = cluster.router
        front = router.http
        grpc_address, http_address = cluster.router_address, router.http_address
        out["rlimit_nofile_router"] = list(resource.getrlimit(resource.RLIMIT_NOFILE))
        out["http_front"] = {
            "cap": front.book.cap,
            "header_timeout_s": front.settings.header_timeout_s,
            "body_timeout_s": front.settings.body_timeout_s,
        }
        model = router.servicer.options.model_id

        def normal(pause_s: float, stop) -> Child:
            """A normal client on this deployment, `pause_s` between its requests."""
            fixed = (grpc_address, http_address, model, prompts, args.max_tokens, pause_s)
            return Child(normal_client, *fixed, stop=stop)

        warm = normal(0.0, Child.ctx.Event())
        time.sleep(8)
        warm.result()
        stop, go, stop_attack = Child.ctx.Event(), Child.ctx.Event(), Child.ctx.Event()
        held = Child.ctx.Array("i", args.attackers)
        per = [args.connections // args.attackers] * args.attackers
        per[0] += args.connections - sum(per)
        opts = {
            "reconnect_s": args.reconnect_s,
            "drip_s": args.drip_s,
            "open_per_s": args.open_per_s,
        }
        host, _, port = http_address.rpartition(":")
        attackers = [
            Child(attacker, k, per[k], host, int(port), opts, held, go, stop=stop_attack)
            for k in range(args.attackers)
        ]
        client = normal(args.pause_s, stop)
        probe = Child(prober, grpc_address, http_address, 0.5, stop=stop)
        time.sleep(3)  # the children import and connect
        # from here on fd 2 (the router's log: `pdserve up` logs to stderr) goes to a file
        log_path = tempfile.mktemp(prefix="pdserve-router-log-", suffix=".txt")
        terminal = os.dup(2)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log_fd, 2)
        samples = []
        sampling = threading.Event()

        def sample():
            while not sampling.wait(1.0):
                samples.append(
                    {
                        "t": round(time.monotonic() - t_base, 1),
                        "router_fds": fd_count(),
                        "attackers_held": sum(held[:]),
                        "log_bytes": os.fstat(log_fd).st_size,
                        **{k: v for k, v in front.connection_stats().items() if k != "cap"},
                    }
                )

        workers = worker_pids(cluster)
        out["gc_frozen_objects"] = gc.get_freeze_count()  # Router.start froze its heap
        out["gc_tracked_objects_before_attack"] = len(gc.get_objects())
        pauses = GcPauses()
        try:
            t_base = time.monotonic()
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            say(f"baseline {args.baseline_s} s", terminal)
            time.sleep(args.baseline_s)
            t_attack = time.monotonic()
            http_tid = front._thread.native_id
            cpu0 = {
                "router": cpu_s(),
                "router_http_thread": thread_cpu_s(http_tid),
                **{k: cpu_s(pid) for k, pid in workers.items()},
            }
            gc.callbacks.append(pauses)
            go.set()
            say(f"attack: {args.connections} connections for {args.attack_s} s", terminal)
            while time.monotonic() - t_attack < args.attack_s:
                time.sleep(10)
                s = samples[-1] if samples else {}
                say(
                    f"  t={s.get('t')} held {s.get('attackers_held')} open {s.get('open')} "
                    f"fds {s.get('router_fds')} log {s.get('log_bytes')} B",
                    terminal,
                )
            t_end = time.monotonic()
            cpu1 = {
                "router": cpu_s(),
                "router_http_thread": thread_cpu_s(http_tid),
                **{k: cpu_s(pid) for k, pid in workers.items()},
            }
            gc.callbacks.remove(pauses)
            seen = [a.result(120) for a in attackers]
            t_recover = time.monotonic()
            say(f"recovery {args.recovery_s} s", terminal)
            time.sleep(args.recovery_s)
            t_done = time.monotonic()
            rows = client.result(300)
            probes = probe.result(60)
            sampling.set()
            sampler.join(5)
        finally:
            os.dup2(terminal, 2)
            os.close(terminal)
            os.close(log_fd)
        log_bytes = os.path.getsize(log_path)
        with open(log_path, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
        os.unlink(log_path)
        out["workers_dropped"] = len(drops.dropped)
        out["http_front"]["stats_at_end"] = front.connection_stats()
    phases = {
        "baseline": (t_base, t_attack),
        "attack": (t_attack, t_end),
        "recovery": (t_recover, t_done),
    }
    out["normal"] = {name: latency_summary(rows, *span) for name, span in phases.items()}
    out["probes"] = {name: probe_summary(probes, *span) for name, span in phases.items()}
    attack_samples = [s for s in samples if t_attack - t_base <= s["t"] <= t_end - t_base]
    out["router"] = {
        "log_bytes": log_bytes,
        "log_lines": len(lines),
        "log_head": [line[:240] for line in lines[:12]],
        "fds_max": max((s["router_fds"] for s in samples), default=None),
        "fds_baseline": samples[0]["router_fds"] if samples else None,
        "http_open_max": max((s["open"] for s in samples), default=None),
    }
    out["attackers_held"] = {
        "max": max((s["attackers_held"] for s in attack_samples), default=None),
        "median_during_attack": sorted(s["attackers_held"] for s in attack_samples)[
            len(attack_samples) // 2
        ]
        if attack_samples
        else None,
    }
    totals = {k: {"opened": 0, "closed_by_server": 0} for k in KINDS}
    answers: dict[str, int] = {}
    for a in seen:
        for k in KINDS:
            for field in ("opened", "closed_by_server"):
                totals[k][field] += a["kinds"][k][field]
        for status, n in a["server_answers"].items():
            answers[status] = answers.get(status, 0) + n
    out["attackers"] = {
        "per_kind": totals,
        "held_s_before_server_closed": {
            k: seen[0]["kinds"][k]["held_s_before_server_closed"] for k in KINDS
        },
        "server_answers": answers,
        "connect_failures": sum(a["connect_failures"] for a in seen),
        "connect_timeouts_30s": sum(a["connect_timeouts_30s"] for a in seen),
    }
    out["gc_during_attack"] = pauses.summary()
    window = t_end - t_attack
    out["cpu_cores_during_attack"] = {
        **{k: round((cpu1[k] - cpu0[k]) / window, 2) for k in cpu0},
        "attackers": round(sum(a["cpu_s"] for a in seen) / window, 2),  # incl. the ramp and stop
    }
    out["timeline"] = samples[:: max(1, len(samples) // 60)]
    a = out["normal"]["attack"]
    say(
        f"b: attack p99 gRPC {a['grpc']['p99_ms']} ms, HTTP {a['http']['p99_ms']} ms; errors "
        f"{a['grpc']['errors']}/{a['http']['errors']}; probes failed "
        f"{[v['failures'] for v in out['probes']['attack'].values()]}; log {log_bytes} B; "
        f"fds max {out['router']['fds_max']}; held max {out['attackers_held']['max']}"
    )
    return out


def add_args(p) -> None:
    p.add_argument("--connections", type=int, default=25_000)
    p.add_argument("--attackers", type=int, default=5)
    p.add_argument("--attack-s", type=float, default=120.0)
    p.add_argument("--baseline-s", type=float, default=20.0)
    p.add_argument("--recovery-s", type=float, default=15.0)
    p.add_argument("--reconnect-s", type=float, default=5.0)
    p.add_argument("--drip-s", type=float, default=5.0)
    p.add_argument("--open-per-s", type=float, default=1000.0, help="per attacker")
    p.add_argument("--pause-s", type=float, default=0.2, help="between a normal client's requests")
    p.add_argument("--max-tokens", type=int, default=8)


def main(argv=None) -> int:
    p = script_parser(__doc__)
    add_args(p)
    add_out_arg(p, "chaos_slowloris.json")
    args = p.parse_args(argv)
    up_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # pdserve up's
    report = cluster_report("benchmarks.robustness.slowloris", argv, up_format)
    logging.getLogger("pdserve.deploy").setLevel(logging.INFO)
    t0 = time.perf_counter()
    report["part_b"] = part_b(args)
    report["part_b"]["took_s"] = round(time.perf_counter() - t0, 1)
    write_result(args.out, report)
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
