"""KV transfer benchmark: each backend between two processes, beside the raw ceilings, in one run.

    python bench/kv_transfer_bench.py             # full run (~1-2 min on 2 cores)
    python bench/kv_transfer_bench.py --quick     # smoke run

Workload: SmolLM2-135M's KV shape (30 layers, 3 kv heads, head dim 64, fp32, block size 16 on both
sides), 16 MiB of KV per request (364 prompt tokens), sent layer by layer as the prefill engine does
(one "kv" frame per layer, then a "commit"). The prefill process has its chunks read out of its
paged cache beforehand (read_chunk is the engine's cost, not the transport's); the decode process
runs a real KVReceiver per request, so the KV lands in its paged cache (a shared-memory pool for
shm). Requests go back to back; throughput = KV bytes / (last commit DONE on the decode side - first
send on the prefill side), on the system-wide monotonic clock.

Ceilings, measured in the same run with the same process pair layout and message sizes:
  tcp     a plain TCP socket on 127.0.0.1: sendall of each layer's bytes, recv_into a buffer
          (the ceiling of grpc and torch)
  memcpy  the prefill process copies each layer's bytes into a shared-memory file the decode
          process mapped, then notifies it over a pipe (the ceiling of shm: one copy into shared
          memory, which is what shm does, but without the paged scatter)
Targets: grpc and torch >= 50% of tcp, shm >= 50% of memcpy.

Each measurement: 1 warm-up trial (it also faults in every page of the pools), then --trials
trials of --requests requests; the table shows the median trial. Both processes run with
torch.set_num_threads(1), one core each. The machine may be shared: each measurement records the
CPU that other processes used meanwhile (from /proc/stat) and the table warns above 0.2 cores.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import multiprocessing as mp
import os
import platform
import shlex
import socket
import statistics
import sys
import time
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
DTYPE_BYTES = 4
TOKEN_BYTES = 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE_BYTES * NUM_LAYERS          # 46,080
POOL_SLOTS = 4                     # requests' worth of blocks in the decode pool, used in turn
TARGET_RATIO = 0.5
CEILING_OF = {"grpc": "tcp", "torch": "tcp", "shm": "memcpy"}
CONTENTION_WARN_CORES = 0.2
DEFAULT_OUT = os.path.join("bench", "results", "kv_transfer.json")


def log(msg: str) -> None:
    print(f"[kv-bench] {msg}", file=sys.stderr, flush=True)


def busy_cpu_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def minor_faults() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def wait_idle(max_wait_s: float, threshold_cores: float = 0.15, window_s: float = 1.0) -> float | None:
    """Wait (up to max_wait_s) for a window in which other processes use < threshold_cores; returns
    the busy cores of the last window seen."""
    deadline = time.monotonic() + max_wait_s
    busy = None
    while True:
        b0, t0 = busy_cpu_s(), time.monotonic()
        time.sleep(window_s)
        b1 = busy_cpu_s()
        if b0 is None or b1 is None:
            return None
        busy = (b1 - b0) / (time.monotonic() - t0)
        if busy < threshold_cores or time.monotonic() >= deadline:
            return busy


def shape_for(tokens: int) -> tuple[int, tuple[int, ...]]:
    blocks_per_request = math.ceil(tokens / BLOCK_SIZE)
    return blocks_per_request, (NUM_LAYERS, 2, blocks_per_request * POOL_SLOTS, BLOCK_SIZE,
                                NUM_KV_HEADS, HEAD_DIM)


def layout(block_size: int = BLOCK_SIZE):
    from kvtransfer.layout import KVLayout
    return KVLayout("smollm2-135m", "float32", NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, block_size)


def slot_block_ids(slot: int, blocks_per_request: int) -> list[int]:
    """A request's blocks in the pool: its slot's blocks, in a shuffled (but fixed) order."""
    ids = list(range(slot * blocks_per_request, (slot + 1) * blocks_per_request))
    return ids[1::2] + ids[0::2]


# ---- decode process ---------------------------------------------------------------------------
def decode_main(kind: str, conn, notify, cfg: dict) -> None:
    try:
        import torch
        torch.set_num_threads(1)
        _decode(kind, conn, notify, cfg)
    except BaseException:   # noqa: BLE001 - the parent must hear why
        conn.send({"error": traceback.format_exc()})


def _decode(kind: str, conn, notify, cfg: dict) -> None:
    import threading

    import torch

    from kvtransfer.backends import create_shared_kv_cache, remove_shared_kv_cache, serve
    from kvtransfer.receiver import KVReceiver
    from kvtransfer.state import TransferState

    tokens, n = cfg["tokens"], cfg["requests"]
    blocks_per_request, shape = shape_for(tokens)
    request_bytes = tokens * TOKEN_BYTES
    path = None
    if kind in ("shm", "memcpy"):
        cache, path = create_shared_kv_cache(shape, torch.float32)
    else:
        cache = torch.zeros(shape)
    try:
        done_times: dict[str, float] = {}
        all_done = threading.Event()
        receivers: dict[str, KVReceiver] = {}

        def handler(header, payload):
            if cfg.get("null_handler"):   # transport only: drop the KV, finish on the commit
                if header.kind == "commit":
                    done_times[header.request_id] = time.perf_counter()
                    if len(done_times) == n:
                        all_done.set()
                return
            rx = receivers[header.request_id]
            if rx.on_frame(header, payload) in (TransferState.DONE, TransferState.FAILED):
                done_times[header.request_id] = time.perf_counter()
                if rx.state == TransferState.FAILED:
                    log(f"{kind}: request {header.request_id} failed: {rx.error}")
                if len(done_times) == n:
                    all_done.set()

        server = sock = listener = None
        if kind in ("grpc", "shm", "torch"):
            opts = dict(kv_cache=cache, kv_path=path) if kind == "shm" else {}
            server = serve(kind, handler, **opts, **cfg.get("server_opts", {}).get(kind, {}))
            conn.send({"address": server.address})
        elif kind == "tcp":
            listener = socket.create_server(("127.0.0.1", 0))
            conn.send({"address": f"127.0.0.1:{listener.getsockname()[1]}"})
            listener.settimeout(60)
            sock, _ = listener.accept()
            sock.settimeout(60)
        else:   # memcpy
            conn.send({"address": path})
        while True:
            msg = conn.recv()
            if msg == "stop":
                break
            receivers.clear()
            done_times.clear()
            all_done.clear()
            for i in range(n):
                rid = f"t{msg}-r{i}"
                receivers[rid] = KVReceiver(rid, cache, layout(), slot_block_ids(i % POOL_SLOTS, blocks_per_request),
                                            0, tokens)
            cpu0, faults0 = time.process_time(), minor_faults()
            conn.send("ready")
            if kind == "tcp":
                # each request lands in its pool slot, viewed as bytes (no scatter: a raw ceiling)
                flat = cache.view(-1).view(torch.uint8).numpy()
                view = memoryview(flat)
                chunk = request_bytes // NUM_LAYERS
                for i in range(n):
                    base = (i % POOL_SLOTS) * request_bytes
                    for layer in range(NUM_LAYERS):
                        off, end = base + layer * chunk, base + (layer + 1) * chunk
                        while off < end:
                            got = sock.recv_into(view[off:end])
                            if not got:
                                raise ConnectionError("the sender closed the socket")
                            off += got
                    done_times[f"t{msg}-r{i}"] = time.perf_counter()
            elif kind == "memcpy":
                for i in range(n):
                    if not notify.poll(60):
                        raise TimeoutError("no notification from the sender")
                    notify.recv()
                    done_times[f"t{msg}-r{i}"] = time.perf_counter()
            elif not all_done.wait(120):
                raise TimeoutError(f"only {len(done_times)} of {n} requests finished")
            failed = [r for r, rx in receivers.items() if kind in ("grpc", "shm", "torch")
                      and rx.state != TransferState.DONE and not cfg.get("null_handler")]
            conn.send({"done_times": list(done_times.values()), "failed": failed,
                       "cpu_s": time.process_time() - cpu0, "faults": minor_faults() - faults0})
        if server is not None:
            server.stop()
        for s in (sock, listener):
            if s is not None:
                s.close()
    finally:
        if path is not None:
            remove_shared_kv_cache(path)


# ---- prefill process --------------------------------------------------------------------------
def prefill_main(kind: str, conn, notify, cfg: dict) -> None:
    try:
        import torch
        torch.set_num_threads(1)
        _prefill(kind, conn, notify, cfg)
    except BaseException:   # noqa: BLE001
        conn.send({"error": traceback.format_exc()})


def _prefill(kind: str, conn, notify, cfg: dict) -> None:
    import dataclasses

    import torch

    from kvtransfer.backends import connect
    from kvtransfer.backends.shm_backend import map_shared_kv_cache
    from kvtransfer.reshard import read_chunk
    from kvtransfer.transport import Destination
    from kvtransfer.wire import ChunkHeader

    tokens, n = cfg["tokens"], cfg["requests"]
    blocks_per_request, dst_shape = shape_for(tokens)
    src_layout, dst_layout = layout(), layout()
    # the prefill side's own paged cache, one request's worth of blocks (shuffled)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(NUM_LAYERS, 2, blocks_per_request, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g)
    src_blocks = list(reversed(range(blocks_per_request)))
    chunks = [read_chunk(src[layer], src_layout, "x", layer, src_blocks, 0, tokens) for layer in range(NUM_LAYERS)]
    address = conn.recv()
    transport = sock = shared = None
    if kind in ("grpc", "shm", "torch"):
        transport = connect(kind, address, timeout=60.0, **cfg.get("connect_opts", {}).get(kind, {}))
    elif kind == "tcp":
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=60)
    else:
        shared = map_shared_kv_cache(address, dst_shape, torch.float32).view(-1)
    layer_bytes = [memoryview(d.view(-1).view(torch.uint8).numpy()) for _, d in chunks]
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        cpu0, faults0 = time.process_time(), minor_faults()
        starts = []
        for i in range(n):
            rid = f"t{msg}-r{i}"
            starts.append(time.perf_counter())
            if transport is not None:
                dest = Destination(slot_block_ids(i % POOL_SLOTS, blocks_per_request), dst_layout)
                for header, data in chunks:
                    transport.send(dataclasses.replace(header, request_id=rid), data, dest)
                transport.send(ChunkHeader(rid, src_layout.fingerprint, kind="commit", first_token=1), None, dest)
            elif sock is not None:
                for piece in layer_bytes:
                    sock.sendall(piece)
            else:
                base = (i % POOL_SLOTS) * tokens * TOKEN_BYTES // DTYPE_BYTES
                for _, data in chunks:
                    flat = data.view(-1)
                    shared[base:base + flat.numel()].copy_(flat)
                    base += flat.numel()
                notify.send(i)
        if transport is not None:
            transport.flush(120.0)
        conn.send({"starts": starts, "cpu_s": time.process_time() - cpu0, "faults": minor_faults() - faults0})
    if transport is not None:
        transport.close()
    if sock is not None:
        sock.close()


# ---- parent -----------------------------------------------------------------------------------
def _recv(conn, what: str, timeout: float = 180.0):
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer from the {what} process within {timeout}s")
    msg = conn.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise RuntimeError(f"the {what} process failed:\n{msg['error']}")
    return msg


def measure(kind: str, cfg: dict, trials: int) -> dict:
    ctx = mp.get_context("spawn")
    rx_conn, rx_child = ctx.Pipe()
    tx_conn, tx_child = ctx.Pipe()
    notify_rx, notify_tx = ctx.Pipe(duplex=False)
    decode = ctx.Process(target=decode_main, args=(kind, rx_child, notify_rx, cfg), name=f"decode-{kind}")
    prefill = ctx.Process(target=prefill_main, args=(kind, tx_child, notify_tx, cfg), name=f"prefill-{kind}")
    decode.start()
    prefill.start()
    request_bytes = cfg["tokens"] * TOKEN_BYTES
    out = {"trials": []}
    try:
        tx_conn.send(_recv(rx_conn, "decode")["address"])
        for trial in range(trials + 1):      # trial 0 warms up
            if cfg.get("wait_idle"):
                busy = wait_idle(cfg["wait_idle"])
                if busy is not None and busy >= 0.15:
                    log(f"{kind}: the machine stayed busy ({busy:.2f} cores) for {cfg['wait_idle']} s; measuring anyway")
            rx_conn.send(trial)
            assert _recv(rx_conn, "decode") == "ready"
            busy0, own0, t0 = busy_cpu_s(), os.times(), time.perf_counter()
            tx_conn.send(trial)
            sent = _recv(tx_conn, "prefill")
            got = _recv(rx_conn, "decode")
            wall = time.perf_counter() - t0
            if got["failed"]:
                raise RuntimeError(f"{len(got['failed'])} requests failed")
            elapsed = max(got["done_times"]) - min(sent["starts"])
            own = got["cpu_s"] + sent["cpu_s"] + (os.times().user + os.times().system - own0.user - own0.system)
            busy1 = busy_cpu_s()
            foreign = None if busy0 is None or busy1 is None else max(0.0, busy1 - busy0 - own) / wall
            latencies = sorted(d - s for d, s in zip(got["done_times"], sent["starts"]))
            row = {"gbps": cfg["requests"] * request_bytes / elapsed / 1e9, "elapsed_s": elapsed,
                   "median_request_latency_ms": 1e3 * statistics.median(latencies),
                   "prefill_cpu_s": sent["cpu_s"], "decode_cpu_s": got["cpu_s"],
                   "prefill_page_faults": sent["faults"], "decode_page_faults": got["faults"],
                   "foreign_cores_avg": foreign}
            if trial:
                out["trials"].append(row)
            log(f"{kind}: {'trial ' + str(trial) if trial else 'warm-up'}: {row['gbps']:.2f} GB/s in "
                f"{elapsed:.3f} s, cpu prefill {sent['cpu_s']:.3f} s decode {got['cpu_s']:.3f} s, "
                f"page faults {sent['faults']}/{got['faults']}, "
                f"other processes {foreign if foreign is None else round(foreign, 2)} cores")
        rx_conn.send("stop")
        tx_conn.send("stop")
    finally:
        for p in (prefill, decode):
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    best = statistics.median_high([t["gbps"] for t in out["trials"]])
    pick = next(t for t in out["trials"] if t["gbps"] == best)
    out.update(gbps=pick["gbps"], median_request_latency_ms=pick["median_request_latency_ms"],
               foreign_cores_avg=max((t["foreign_cores_avg"] or 0.0) for t in out["trials"]))
    return out


def machine() -> dict:
    import grpc
    import torch
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "grpcio": grpc.__version__, "platform": platform.platform()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=24, help="requests per trial")
    ap.add_argument("--trials", type=int, default=3, help="measured trials per backend (after 1 warm-up)")
    ap.add_argument("--mib", type=float, default=16.0, help="MiB of KV per request")
    ap.add_argument("--backends", default="grpc,shm,torch")
    ap.add_argument("--quick", action="store_true", help="smoke run: 6 requests, 1 trial")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="before each trial, wait up to SECONDS for a quiet machine (< 0.15 busy cores)")
    ap.add_argument("--null-handler", action="store_true",
                    help="diagnosis: the decode side drops the KV instead of running a KVReceiver")
    ap.add_argument("--server-opts", default="{}", metavar="JSON",
                    help='tuning: {"grpc": {"max_backlog_bytes": 8388608}, ...} passed to serve()')
    ap.add_argument("--connect-opts", default="{}", metavar="JSON", help="tuning: passed to connect()")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.trials = 6, 1
    tokens = int(args.mib * (1 << 20)) // TOKEN_BYTES
    cfg = {"tokens": tokens, "requests": args.requests, "null_handler": args.null_handler,
           "wait_idle": args.wait_idle, "server_opts": json.loads(args.server_opts),
           "connect_opts": json.loads(args.connect_opts)}
    backends = [b for b in args.backends.split(",") if b]
    kinds = sorted({CEILING_OF[b] for b in backends}) + backends
    results = {"command": shlex.join([sys.executable] + sys.argv), "date": _dt.datetime.now().astimezone().isoformat(),
               "machine": machine(),
               "config": {"model_shape": {"num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS,
                                          "head_dim": HEAD_DIM, "dtype": "float32", "block_size": BLOCK_SIZE},
                          "tokens_per_request": tokens, "kv_bytes_per_request": tokens * TOKEN_BYTES,
                          "frames_per_request": NUM_LAYERS + 1, "requests_per_trial": args.requests,
                          "trials": args.trials, "torch_threads_per_process": 1,
                          "server_opts": cfg["server_opts"], "connect_opts": cfg["connect_opts"],
                          "decode_handler": "null (diagnosis)" if args.null_handler else "KVReceiver"},
               "measurements": {}}
    status = 0
    for kind in kinds:
        log(f"measuring {kind} ...")
        try:
            results["measurements"][kind] = measure(kind, cfg, args.trials)
        except Exception as e:   # noqa: BLE001 - the other measurements still run
            results["measurements"][kind] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{kind} FAILED: {e}")
            status = 1
    rows = []
    print(f"\nKV transfer, {tokens} tokens x {NUM_LAYERS} layers = {tokens * TOKEN_BYTES / (1 << 20):.2f} MiB "
          f"per request, {args.requests} requests per trial, median of {args.trials} trials\n")
    print("| backend | GB/s | ceiling | ceiling GB/s | ratio | target | result | median request latency | other procs (cores) |")
    print("|---|---|---|---|---|---|---|---|---|")
    ms = results["measurements"]
    for kind in kinds:
        m = ms[kind]
        if kind in CEILING_OF:
            c = ms[CEILING_OF[kind]]
            ratio = m["gbps"] / c["gbps"] if "gbps" in m and "gbps" in c else None
            verdict = "ERROR" if ratio is None else ("PASS" if ratio >= TARGET_RATIO else "FAIL")
            rows.append({"backend": kind, "gbps": m.get("gbps"), "ceiling": CEILING_OF[kind],
                         "ceiling_gbps": c.get("gbps"), "ratio": ratio, "target": TARGET_RATIO, "result": verdict})
            ceiling_txt, cg = CEILING_OF[kind], c.get("gbps")
        else:
            ratio, verdict, ceiling_txt, cg = None, "(ceiling)", "-", None
        fmt = lambda x, f=".2f": "-" if x is None else format(x, f)
        busy = m.get("foreign_cores_avg")
        warn = " (busy!)" if busy is not None and busy > CONTENTION_WARN_CORES else ""
        print(f"| {kind} | {fmt(m.get('gbps'))} | {ceiling_txt} | {fmt(cg)} | {fmt(ratio, '.0%')} | "
              f">= {TARGET_RATIO:.0%} | {verdict} | {fmt(m.get('median_request_latency_ms'), '.1f')} ms | "
              f"{fmt(busy)}{warn} |")
    results["table"] = rows
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
