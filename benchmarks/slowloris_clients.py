"""The processes of the slowloris benchmark (benchmarks/chaos_slowloris.py): the attackers, the
normal client and the probes. Each is the body of a process of its own (benchmarks/chaos_harness.py's
Child), so that their sockets and CPU are not the router's.

An attacker holds its share of the connections from a source address of its own (127.0.0.2, ...,
so the ephemeral ports of one address are never short): idle ones send nothing, slowloris ones a
header byte every drip_s seconds, body ones POST headers whose body never comes; each closed
connection is opened again after reconnect_s, +-50%. The normal client sends one gRPC Generate
and one HTTP completion at a time and times them; the prober polls /health, /metrics and gRPC
health. Each sends its rows back on its pipe when told to stop.
"""

from __future__ import annotations

import json
import os
import random
import resource
import threading
import time

from benchmarks.chaos_harness import one_stream, pct

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

    threads = [threading.Thread(target=f) for f in (grpc_loop, http_loop)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    conn.send(rows)


def prober(grpc_address, http_address, interval_s, stop, conn):
    """Process body: GET /health every interval_s (and /metrics every 4th time) with a fresh
    connection and a 2 s timeout, gRPC health every interval_s; sends back (what, start,
    seconds or None when it failed)."""
    import http.client

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

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
                try:
                    ok = (
                        stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0).status
                        == health_pb2.HealthCheckResponse.SERVING
                    )
                except grpc.RpcError:
                    ok = False
                took = time.monotonic() - t
                rows.append(("grpc_health", t, took if ok else None))
                stop.wait(max(0.0, interval_s - took))

    threads = [threading.Thread(target=f) for f in (http_probe, grpc_probe)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    conn.send(rows)
