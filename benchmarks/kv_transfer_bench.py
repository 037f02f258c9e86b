"""KV transfer benchmark: each backend between two processes, beside the raw ceilings, in one run.

    python -m benchmarks.kv_transfer_bench                 # full run (~1-2 min on 2 cores)
    python -m benchmarks.kv_transfer_bench --quick         # smoke run
    python -m benchmarks.kv_transfer_bench --wait-idle 60  # wait for a quiet machine before each trial

Each request is SmolLM2-135M's KV of 364 prompt tokens (16 MiB, fp32), sent layer by layer as the
prefill engine sends it, and --requests requests go back to back. Each backend runs in two modes:
transport (the decode handler drops the frames) and kvreceiver (a KVReceiver writes each chunk
into the decode paged cache, as a decode worker does). The ceilings are a plain TCP socket (for
grpc and torch) and a copy into shared memory (for shm); the targets are 50% of the ceiling in
transport mode. `main` says how rounds are run and timed; the result is in BENCHMARKS.md, "KV
transfer per backend". This file is the CLI and the parent; kv_transfer_sides.py holds the two
processes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import sys
import time

from benchmarks.bench_common import (
    add_wait_idle_arg,
    cpu_model,
    machine_busy_cpu_s as busy_cpu_s,
    stop_children,
)
from benchmarks.kv_transfer_sides import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    TOKEN_BYTES,
    decode_main,
    prefill_main,
)

TARGET_RATIO = 0.5
CEILING_OF = {"grpc": "tcp", "torch": "tcp", "shm": "memcpy"}
MODES = {
    "transport": "the decode handler drops the frames (shm: the KV is already in the paged pool)",
    "kvreceiver": "a KVReceiver writes the KV into the decode paged cache and takes the commit",
}
CONTENTION_WARN_CORES = 0.2
DEFAULT_OUT = os.path.join("benchmarks", "results", "kv_transfer.json")


def log(msg: str) -> None:
    print(f"[kv-bench] {msg}", file=sys.stderr, flush=True)


def wait_idle(
    max_wait_s: float, threshold_cores: float = 0.15, window_s: float = 1.0
) -> float | None:
    """Wait (up to max_wait_s) for a window in which the machine uses < threshold_cores; returns
    the busy cores of the last window seen."""
    deadline = time.monotonic() + max_wait_s
    while True:
        b0, t0 = busy_cpu_s(), time.monotonic()
        time.sleep(window_s)
        b1 = busy_cpu_s()
        if b0 is None or b1 is None:
            return None
        busy = (b1 - b0) / (time.monotonic() - t0)
        if busy < threshold_cores or time.monotonic() >= deadline:
            return busy


# ---- parent -----------------------------------------------------------------------------------
def _recv(conn, what: str, timeout: float = 180.0):
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer from the {what} process within {timeout}s")
    msg = conn.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise RuntimeError(f"the {what} process failed:\n{msg['error']}")
    return msg


class Pair:
    """A prefill process and a decode process of one kind, alive for the whole run."""

    def __init__(self, kind: str, cfg: dict):
        ctx = mp.get_context("spawn")
        self.kind, self.cfg = kind, cfg
        self.rx, rx_child = ctx.Pipe()
        self.tx, tx_child = ctx.Pipe()
        notify_rx, notify_tx = ctx.Pipe(duplex=False)
        self.procs = [
            ctx.Process(
                target=decode_main, args=(kind, rx_child, notify_rx, cfg), name=f"decode-{kind}"
            ),
            ctx.Process(
                target=prefill_main, args=(kind, tx_child, notify_tx, cfg), name=f"prefill-{kind}"
            ),
        ]
        for p in self.procs:
            p.start()

    def connect(self) -> None:
        self.tx.send(_recv(self.rx, f"{self.kind} decode")["address"])

    def trial(self, trial: int, mode: str | None) -> dict:
        self.rx.send({"trial": trial, "mode": mode})
        assert _recv(self.rx, f"{self.kind} decode") == "ready"
        busy0, own0, t0 = busy_cpu_s(), os.times(), time.perf_counter()
        self.tx.send({"trial": trial})
        sent = _recv(self.tx, f"{self.kind} prefill")
        got = _recv(self.rx, f"{self.kind} decode")
        wall = time.perf_counter() - t0
        if got["failed"]:
            raise RuntimeError(f"{len(got['failed'])} requests failed, e.g. {got['failed'][0]}")
        elapsed = max(got["done_times"]) - min(sent["starts"])
        own1 = os.times()
        own = got["cpu_s"] + sent["cpu_s"] + (own1.user + own1.system - own0.user - own0.system)
        busy1 = busy_cpu_s()
        foreign = None if busy0 is None or busy1 is None else max(0.0, busy1 - busy0 - own) / wall
        latencies = [d - s for d, s in zip(got["done_times"], sent["starts"])]
        return {
            "gbps": self.cfg["requests"] * self.cfg["tokens"] * TOKEN_BYTES / elapsed / 1e9,
            "elapsed_s": elapsed,
            "median_request_latency_ms": 1e3 * statistics.median(latencies),
            "prefill_cpu_s": sent["cpu_s"],
            "decode_cpu_s": got["cpu_s"],
            "prefill_page_faults": sent["faults"],
            "decode_page_faults": got["faults"],
            "foreign_cores_avg": foreign,
        }

    def stop(self) -> None:
        stop_children([self.rx, self.tx], self.procs, kill=True)


def machine() -> dict:
    import grpc
    import torch

    cpu = cpu_model()
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "platform": platform.platform(),
    }


def summarize(runs, trials: dict, ceiling_of_key: dict) -> list[dict]:
    rows = []
    for key in runs:
        kind, _, mode = key.partition("/")
        good = [t for t in trials[key] if "gbps" in t]
        row = {
            "backend": kind,
            "mode": mode or "raw",
            "rounds": len(good),
            "gbps": statistics.median(t["gbps"] for t in good) if good else None,
            "median_request_latency_ms": statistics.median(
                t["median_request_latency_ms"] for t in good
            )
            if good
            else None,
            "foreign_cores_max": max((t["foreign_cores_avg"] or 0.0) for t in good)
            if good
            else None,
            "ceiling": ceiling_of_key.get(key),
            "ceiling_gbps": None,
            "ratio": None,
            "result": "(ceiling)",
        }
        if row["ceiling"]:
            c = ceiling_of_key[key]
            ratios = [
                t["gbps"] / ct["gbps"]
                for t, ct in zip(trials[key], trials[c])
                if "gbps" in t and "gbps" in ct
            ]
            cg = [t["gbps"] for t in trials[c] if "gbps" in t]
            row["ceiling_gbps"] = statistics.median(cg) if cg else None
            row["ratio"] = statistics.median(ratios) if ratios else None
            if row["ratio"] is None:
                row["result"] = "ERROR"
            elif mode == "transport":
                row["result"] = "PASS" if row["ratio"] >= TARGET_RATIO else "FAIL"
            else:
                row["result"] = "(info)"
        rows.append(row)
    return rows


def main(argv=None) -> int:
    """The command line and the run.

    Workload: SmolLM2-135M's KV shape (30 layers, 3 kv heads, head dim 64, fp32, block size 16 on
    both sides), one "kv" frame per layer, then a "commit". The prefill process reads its chunks
    out of its paged cache beforehand (read_chunk is the engine's cost, not the transport's); each
    request lands in its own reservation of the decode pool (shuffled block ids). Throughput = KV
    bytes / (last commit handled on the decode side - first send on the prefill side), both on
    the system-wide monotonic clock. Ceilings, with the same process pair layout and message
    sizes: tcp sends each layer's bytes with sendall and receives them into the pool with
    recv_into; memcpy copies each layer's bytes into a shared-memory pool the decode process
    mapped, then tells it over a pipe (the one copy shm makes, without its paged scatter).

    All process pairs start once; then a warm-up round (it also faults in every page of the pools)
    and --rounds measured rounds, each running every ceiling and backend once, interleaved, so
    that a backend and its ceiling see the same machine. The table shows medians over rounds:
    throughput, and the ratio of each round's backend to the same round's ceiling. Every process
    runs with torch.set_num_threads(1) and (unless --no-malloc-tune)
    kvtransfer.backends.tune_malloc(). Each trial records the CPU other processes used meanwhile
    (/proc/stat minus ours), and the table warns above CONTENTION_WARN_CORES."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=24, help="requests per trial")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (after 1 warm-up round)")
    ap.add_argument("--mib", type=float, default=16.0, help="MiB of KV per request")
    ap.add_argument("--backends", default="grpc,shm,torch")
    ap.add_argument("--modes", default="transport,kvreceiver", help=f"of {sorted(MODES)}")
    ap.add_argument(
        "--no-malloc-tune",
        action="store_true",
        help="leave glibc malloc's thresholds alone (default: every process calls "
        "kvtransfer.backends.tune_malloc(), as the workers should)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 6 requests, 1 round")
    add_wait_idle_arg(ap, "each trial", quiet="a quiet machine, < 0.15 busy cores")
    ap.add_argument(
        "--server-opts",
        default="{}",
        metavar="JSON",
        help='tuning, e.g. {"grpc": {"max_backlog_bytes": 8388608}}: passed to serve()',
    )
    ap.add_argument(
        "--connect-opts", default="{}", metavar="JSON", help="tuning: passed to connect()"
    )
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.rounds = 6, 1
    tokens = int(args.mib * (1 << 20)) // TOKEN_BYTES
    modes = [m for m in args.modes.split(",") if m]
    backends = [b for b in args.backends.split(",") if b]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: {m!r} is not one of {sorted(MODES)}")
    for b in backends:
        if b not in CEILING_OF:
            ap.error(f"--backends: {b!r} is not one of {sorted(CEILING_OF)}")
    cfg = {
        "tokens": tokens,
        "requests": args.requests,
        "tune_malloc": not args.no_malloc_tune,
        "server_opts": json.loads(args.server_opts),
        "connect_opts": json.loads(args.connect_opts),
    }
    kinds = sorted({CEILING_OF[b] for b in backends}) + backends
    runs, ceiling_of_key = [], {}  # one round, in order: each ceiling, then its backends
    for ceiling in sorted({CEILING_OF[b] for b in backends}):
        runs.append(ceiling)
        for b in backends:
            if CEILING_OF[b] == ceiling:
                for m in modes:
                    runs.append(f"{b}/{m}")
                    ceiling_of_key[f"{b}/{m}"] = ceiling
    results = {
        "command": shlex.join(["python", "-m", "benchmarks.kv_transfer_bench", *sys.argv[1:]]),
        "date": _dt.datetime.now().astimezone().isoformat(),
        "machine": machine(),
        "config": {
            "model_shape": {
                "num_layers": NUM_LAYERS,
                "num_kv_heads": NUM_KV_HEADS,
                "head_dim": HEAD_DIM,
                "dtype": "float32",
                "block_size": BLOCK_SIZE,
            },
            "tokens_per_request": tokens,
            "kv_bytes_per_request": tokens * TOKEN_BYTES,
            "frames_per_request": NUM_LAYERS + 1,
            "requests_per_trial": args.requests,
            "rounds": args.rounds,
            "torch_threads_per_process": 1,
            "malloc_tuned": cfg["tune_malloc"],
            "modes": {m: MODES[m] for m in modes},
            "server_opts": cfg["server_opts"],
            "connect_opts": cfg["connect_opts"],
        },
        "trials": {key: [] for key in runs},
    }
    status = 0
    pairs = {kind: Pair(kind, cfg) for kind in kinds}
    try:
        for pair in pairs.values():
            pair.connect()
        for rnd in range(args.rounds + 1):  # round 0 warms up
            for trial, key in enumerate(runs):
                kind, _, mode = key.partition("/")
                if args.wait_idle:
                    busy = wait_idle(args.wait_idle)
                    if busy is not None and busy >= 0.15:
                        log(
                            f"the machine stayed busy ({busy:.2f} cores) for {args.wait_idle} s; measuring anyway"
                        )
                try:
                    row = pairs[kind].trial(rnd * 100 + trial, mode or None)
                except Exception as e:  # noqa: BLE001 - the report must say what broke
                    row = {"error": f"{type(e).__name__}: {e}"}
                    status = 1
                    log(f"round {rnd} {key}: FAILED {row['error']}")
                else:
                    log(
                        f"round {rnd} {key}: {row['gbps']:.2f} GB/s, cpu prefill {row['prefill_cpu_s']:.3f} s "
                        f"decode {row['decode_cpu_s']:.3f} s, other processes {row['foreign_cores_avg'] or 0:.2f} cores"
                    )
                if rnd:
                    results["trials"][key].append(row)
    finally:
        for pair in pairs.values():
            pair.stop()
    rows = summarize(runs, results["trials"], ceiling_of_key)
    results["table"] = rows
    fmt = lambda x, f=".2f": "-" if x is None else format(x, f)  # noqa: E731
    print(
        f"\nKV transfer between two processes: {tokens} tokens x {NUM_LAYERS} layers = "
        f"{tokens * TOKEN_BYTES / (1 << 20):.2f} MiB per request in {NUM_LAYERS + 1} frames, "
        f"{args.requests} requests back to back per trial, medians of {args.rounds} rounds, "
        f"malloc {'tuned' if cfg['tune_malloc'] else 'default'}\n"
    )
    print(
        "| backend | mode | GB/s | ceiling | ceiling GB/s | ratio | target | result | median request latency | other procs (max cores) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        busy = r["foreign_cores_max"]
        warn = " (busy!)" if busy is not None and busy > CONTENTION_WARN_CORES else ""
        print(
            f"| {r['backend']} | {r['mode']} | {fmt(r['gbps'])} | {r['ceiling'] or '-'} | {fmt(r['ceiling_gbps'])} | "
            f"{fmt(r['ratio'], '.0%')} | {'>= 50%' if r['mode'] == 'transport' else '-'} | {r['result']} | "
            f"{fmt(r['median_request_latency_ms'], '.1f')} ms | {fmt(busy)}{warn} |"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
