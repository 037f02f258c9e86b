"""KV transfer benchmark: each backend between two processes, beside the raw ceilings, in one run.

    python -m benchmarks.transfer.kv_transfer                 # full run (~1-2 min on 2 cores)
    python -m benchmarks.transfer.kv_transfer --quick         # smoke run
    python -m benchmarks.transfer.kv_transfer --wait-idle 60  # wait for a quiet machine first
    python -m benchmarks.transfer.kv_transfer --device cuda --dtype bfloat16  # caches on the GPU

Each request is SmolLM2-135M's KV of 364 prompt tokens (16 MiB, fp32), sent layer by layer as the
prefill engine sends it, and --requests requests go back to back. Each backend runs in two modes:
transport (the decode handler drops the frames) and kvreceiver (a KVReceiver writes each chunk
into the decode paged cache, as a decode worker does; the decode side then checks the cache
against the sent KV byte for byte, and a difference fails the trial). The ceilings are a plain
TCP socket (for grpc and torch) and a copy into shared memory (for shm and nixl: both write into
the decode pool from the prefill process); the targets are 50% of the ceiling in transport mode.
Each reservation's blocks come shuffled, no two adjacent in the pool (the default: a backend that
moves a run of adjacent blocks as one piece gets one piece per block), or with --blocks runs in
pool order (what the engine's allocator hands out on a quiet pool), or with --blocks churn in runs
of 30 blocks out of order (about what it hands out under churn); the prefill side's pool follows
the same order. --tokens sets the prompt length instead of --mib (2k-8k-token prompts: the issue-50
runs), and each row's median request latency is one prompt's whole hand-off, from its first layer
sent to its commit handled: the TTFT a hand-off adds when no layer of it overlaps the prefill.

nixl and shm: the decode process issues a write grant per reservation (as a decode worker's Reserve
does) and hands the grants to the prefill process through the parent with its "ready". `main` says how rounds are run and timed; the result is in
BENCHMARKS.md, "KV transfer per backend".

A pair is two processes started with the spawn context (decode_main, prefill_main): the decode
side serves or listens and times each request's commit, the prefill side reads its KV chunks and
sends them. Both share the workload's KV shape (SmolLM2-135M, block size 16) and the decode
pool's layout, and the decode side checks, byte for byte, that its pool holds what was sent.

--device cuda puts both sides' paged caches of grpc and torch on the GPU, two processes on the
one GPU: the sender's chunks are CUDA tensors that each transport copies to the host through
pinned memory (kvtransfer.backends.frames.host_copy), and the KVReceiver writes into a CUDA pool.
shm is left out (it maps a host file, never a CUDA cache), and the table adds the ceiling of a
hand-off between CUDA caches: a device-to-device copy of the same bytes (D2D_COUNTING).
--backends cuda_ipc (--device cuda only) has the prefill process open the decode pool by CUDA IPC
and write each chunk into it device to device; its "of d2d" column is the issue-45 ratio (goal
0.5), e.g. --device cuda --dtype bfloat16 --backends cuda_ipc,grpc --tokens 8192.
"""

from __future__ import annotations

import argparse
import contextlib
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

from benchmarks.bench_common import (
    add_wait_idle_arg,
    cpu_model,
    machine_busy_cpu_s as busy_cpu_s,
    stop_children,
    write_result,
)

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
POOL_SLOTS = 4  # requests' worth of blocks in the decode pool, used in turn
# the kinds that run a transport backend (the rest: ceilings); nixl runs where NIXL is installed
BACKENDS = ("grpc", "shm", "torch", "nixl", "cuda_ipc")
DTYPES = {"float32": 4, "bfloat16": 2}  # the KV dtypes the benchmark runs, and their sizes
DEVICE_KINDS = ("grpc", "torch", "cuda_ipc")  # the kinds whose caches live on cfg["device"]
CUDA_IPC_ON_CPU = "cuda_ipc writes into a CUDA pool: run it with --device cuda"
SHM_ON_CUDA = (
    "the shm backend maps the decode pool from a shared file in host memory and cannot map a "
    "CUDA cache"
)
SOURCE_SEED = 0  # The seed of the prefill side's KV, which the decode side regenerates.
D2D_WINDOWS, D2D_COPIES = 5, 10
D2D_COUNTING = (
    "d2d: a copy_ between two CUDA tensors of one trial's KV bytes (requests x KV bytes per "
    "request) on the same GPU, in the parent process. GB/s counts those bytes once (the copy "
    f"reads and writes each, so the memory traffic is twice that); the median of {D2D_WINDOWS} "
    f"windows of {D2D_COPIES} back-to-back copies, each window timed between two "
    "torch.cuda.synchronize() calls"
)


def token_bytes(dtype: str = "float32") -> int:
    """The KV bytes of one token over all layers (46,080 in float32)."""
    return 2 * NUM_KV_HEADS * HEAD_DIM * DTYPES[dtype] * NUM_LAYERS


def kv_device(kind: str, cfg: dict) -> str:
    """Where `kind`'s paged caches live: cfg["device"] for the backends that can send from and
    write into a CUDA cache, the host for the raw ceilings and shm (which maps a host file)."""
    return cfg["device"] if kind in DEVICE_KINDS else "cpu"


def minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _used_since(cpu0: float, faults0: int) -> dict:
    """This process's CPU time and minor page faults since process_time() was cpu0 and
    minor_faults() was faults0."""
    return {"cpu_s": time.process_time() - cpu0, "faults": minor_faults() - faults0}


def pool_shape(tokens: int) -> tuple[int, tuple[int, ...]]:
    blocks_per_request = math.ceil(tokens / BLOCK_SIZE)
    return blocks_per_request, (
        NUM_LAYERS,
        2,
        blocks_per_request * POOL_SLOTS,
        BLOCK_SIZE,
        NUM_KV_HEADS,
        HEAD_DIM,
    )


def make_layout(dtype: str = "float32"):
    from pdserve.kvtransfer.layout import KVLayout

    return KVLayout("smollm2-135m", dtype, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)


CHURN_RUN = 30  # blocks per run in --blocks churn


def in_order(ids: list[int], order: str, offset: int = 0) -> list[int]:
    """`ids` (consecutive pool blocks) in a reservation's order: "runs" as they are; "churn" in
    runs of CHURN_RUN blocks (from `offset` blocks into the first), the runs taken from last to
    first, so that no two continue each other; "shuffled" (the default) no two blocks adjacent
    in the pool: odd positions first, then even."""
    if order == "runs":
        return ids
    if order == "churn":
        cuts = list(range(offset % CHURN_RUN, len(ids), CHURN_RUN))
        runs = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True) if b > a]
        return [b for run in reversed(runs) for b in run]
    return ids[1::2] + ids[0::2]


def slot_block_ids(slot: int, blocks_per_request: int, order: str = "shuffled") -> list[int]:
    """A request's reservation: its slot's blocks in a shuffled (fixed) order, no two consecutive
    blocks of the request adjacent in the pool (the worst case for a backend that moves each run
    of adjacent blocks as one piece), with order "runs" in pool order (what a quiet pool's
    allocator hands out: engine/block_manager.py keeps a sequence's blocks consecutive where it
    can), or with order "churn" in runs of 30 (about what it hands out under churn)."""
    ids = list(range(slot * blocks_per_request, (slot + 1) * blocks_per_request))
    return in_order(ids, order)


def source_pool(tokens: int, dtype: str, device: str, order: str = "shuffled"):
    """The prefill side's own paged cache: one request's worth of blocks, random values of a
    fixed seed (drawn on the CPU in float32, so that every device and dtype sees the same values,
    then converted), and the request's block ids in it: in reverse order, no two continuing each
    other, or with order "runs" or "churn" as a reservation's (slot_block_ids; the churn's runs
    cut at other places than the decode side's)."""
    import torch

    blocks_per_request, _ = pool_shape(tokens)
    shape = (NUM_LAYERS, 2, blocks_per_request, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    src = torch.randn(shape, generator=torch.Generator().manual_seed(SOURCE_SEED))
    src = src.to(device=device, dtype=getattr(torch, dtype))
    ids = list(range(blocks_per_request))
    return src, ids[::-1] if order == "shuffled" else in_order(ids, order, offset=CHURN_RUN // 2)


def source_chunks(tokens: int, dtype: str, device: str, order: str = "shuffled") -> list:
    """The prefill side's KV chunks, one (header, data) per layer, read out of its own paged
    cache (source_pool) beforehand."""
    from pdserve.kvtransfer.reshard import read_chunk

    src, src_blocks = source_pool(tokens, dtype, device, order)
    layout = make_layout(dtype)
    return [
        read_chunk(src[layer], layout, "x", layer, src_blocks, 0, tokens)
        for layer in range(NUM_LAYERS)
    ]


def check_pool(
    cache, chunks: list, tokens: int, requests: int, dtype: str, order: str = "shuffled"
) -> str | None:
    """None when every pool slot the trial's requests used holds `chunks` byte for byte (each
    request sends the same KV; a slot holds the last request that used it), else what differs."""
    import torch

    from pdserve.kvtransfer.reshard import read_chunk

    blocks_per_request, _ = pool_shape(tokens)
    layout = make_layout(dtype)
    for slot in range(min(requests, POOL_SLOTS)):
        ids = slot_block_ids(slot, blocks_per_request, order)
        for layer, (_, sent) in enumerate(chunks):
            _, held = read_chunk(cache[layer], layout, "check", layer, ids, 0, tokens)
            want, got = sent.reshape(-1).view(torch.uint8), held.reshape(-1).view(torch.uint8)
            if not torch.equal(want, got):
                return (
                    f"pool slot {slot} (the last request that used it), layer {layer}: "
                    f"{int((want != got).sum())} of {want.numel()} bytes differ from what the "
                    f"prefill side sent"
                )
    return None


def _child(body, kind: str, conn, notify, cfg: dict) -> None:
    try:
        if cfg["tune_malloc"]:
            from pdserve.kvtransfer.backends import tune_malloc

            tune_malloc()
        import torch

        torch.set_num_threads(1)
        body(kind, conn, notify, cfg)
    except BaseException:  # noqa: BLE001 - the parent must hear why
        conn.send({"error": traceback.format_exc()})


# ---- the CUDA ceiling, in the parent process --------------------------------------------------
class DeviceCopy:
    """The ceiling of a hand-off between two CUDA caches (--device cuda): a device-to-device copy
    of one trial's KV bytes on the same GPU, in the parent process (D2D_COUNTING says how it is
    timed and counted). It stands where a Pair does in a round."""

    def __init__(self, nbytes: int):
        import torch

        self.nbytes = nbytes
        self.src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        self.dst = torch.empty_like(self.src)

    def connect(self) -> None:
        import torch

        self.dst.copy_(self.src)  # The first copy loads the kernel, so it is not timed.
        torch.cuda.synchronize()

    def trial(self, trial: int, mode: str | None) -> dict:
        import torch

        windows = []
        self.dst.zero_()  # The check below then sees this trial's copies.
        for _ in range(D2D_WINDOWS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(D2D_COPIES):
                self.dst.copy_(self.src)
            torch.cuda.synchronize()
            windows.append((time.perf_counter() - t0) / D2D_COPIES)
        elapsed = statistics.median(windows)
        if not torch.equal(self.dst, self.src):
            raise RuntimeError("the device-to-device copy does not hold its source's bytes")
        return {
            "gbps": self.nbytes / elapsed / 1e9,
            "elapsed_s": elapsed,
            "window_gbps": [self.nbytes / w / 1e9 for w in windows],
            "median_request_latency_ms": None,
            "foreign_cores_avg": None,
        }

    def stop(self) -> None:
        self.src = self.dst = None


def add_d2d(rows: list[dict], trials: dict) -> None:
    """--device cuda: each row's d2d ceiling, and its median ratio to the same round's d2d."""
    d2d = [t.get("gbps") for t in trials["d2d"]]
    good = [g for g in d2d if g is not None]
    for row in rows:
        key = row["backend"] + ("" if row["mode"] == "raw" else f"/{row['mode']}")
        ratios = [t["gbps"] / c for t, c in zip(trials[key], d2d) if "gbps" in t and c is not None]
        row["d2d_gbps"] = statistics.median(good) if good else None
        row["of_d2d"] = statistics.median(ratios) if ratios and key != "d2d" else None


# ---- decode process ---------------------------------------------------------------------------
def decode_main(kind: str, conn, notify, cfg: dict) -> None:
    _child(_decode, kind, conn, notify, cfg)


def _decode(kind: str, conn, notify, cfg: dict) -> None:
    import threading

    import torch

    from pdserve.kvpool import new_private_pool
    from pdserve.kvtransfer.backends import create_shared_kv_cache, remove_shared_kv_cache, serve
    from pdserve.kvtransfer.receiver import KVReceiver
    from pdserve.kvtransfer.state import TransferState

    tokens, n = cfg["tokens"], cfg["requests"]
    dtype_str = cfg["dtype"]
    dtype, device = getattr(torch, dtype_str), kv_device(kind, cfg)
    on_cuda = device != "cpu"
    blocks_per_request, shape = pool_shape(tokens)
    request_bytes = tokens * token_bytes(dtype_str)
    path = None
    if kind in ("shm", "memcpy"):
        cache, path = create_shared_kv_cache(shape, dtype, directory=shared_dir(shape, dtype))
    elif kind == "nixl" and device == "cpu":  # as a decode worker on nixl makes it (kvpool)
        cache = new_private_pool(shape, dtype)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    # This is what the prefill side sends: the pool is checked against it after kvreceiver trials.
    sent = source_chunks(tokens, dtype_str, device, cfg["blocks"]) if kind in BACKENDS else None
    server = sock = listener = None
    try:
        done_times: dict[str, float] = {}
        all_done = threading.Event()
        receivers: dict[str, KVReceiver] = {}
        trial = {"null": False}

        def finished(request_id: str) -> None:
            if on_cuda:  # A request is done once its writes into the CUDA pool have run.
                torch.cuda.synchronize()
            done_times[request_id] = time.perf_counter()
            if len(done_times) == n:
                all_done.set()

        def handler(header, payload):
            if trial["null"]:  # transport mode: drop the KV, finish on the commit
                if header.kind == "commit":
                    finished(header.request_id)
                return
            rx = receivers[header.request_id]
            if rx.on_frame(header, payload) in (TransferState.DONE, TransferState.FAILED):
                finished(header.request_id)

        grants = None
        if kind in ("nixl", "shm"):  # a decode worker's grants: one per reservation, per trial
            from pdserve.kvtransfer.backends.claims import Grants

            grants = Grants()
        if kind in BACKENDS:
            opts = dict(kv_cache=cache, kv_path=path, grants=grants) if kind == "shm" else {}
            if kind == "cuda_ipc":  # the decode pool, opened by the prefill process by CUDA IPC
                opts = dict(kv_cache=cache)
            if kind == "nixl":
                opts = dict(kv_caches=[cache], grants=grants)
            server = serve(kind, handler, **opts, **cfg["server_opts"].get(kind, {}))
            conn.send({"address": server.address})
        elif kind == "tcp":
            listener = socket.create_server(("127.0.0.1", 0))
            conn.send({"address": f"127.0.0.1:{listener.getsockname()[1]}"})
            listener.settimeout(120)
            sock, _ = listener.accept()
            sock.settimeout(60)
        else:
            conn.send({"address": path})
        # The tcp ceiling receives into the pool's bytes (its pool is on the host: kv_device).
        view = memoryview(cache.view(-1).view(torch.uint8).numpy()) if kind == "tcp" else None
        layer_bytes = request_bytes // NUM_LAYERS
        while True:
            msg = conn.recv()
            if msg == "stop":
                break
            receivers.clear()
            done_times.clear()
            all_done.clear()
            trial["null"] = msg["mode"] == "transport"
            issued = {}
            for i in range(n):
                rid = f"t{msg['trial']}-r{i}"
                block_ids = slot_block_ids(i % POOL_SLOTS, blocks_per_request, cfg["blocks"])
                receivers[rid] = KVReceiver(
                    rid, cache, make_layout(dtype_str), block_ids, 0, tokens
                )
                if grants is not None:
                    issued[rid] = grants.issue(rid, block_ids)
            cpu0, faults0 = time.process_time(), minor_faults()
            conn.send({"ready": True, "grants": issued} if grants is not None else "ready")
            if kind == "tcp":  # each request's bytes land in its pool slot, contiguous
                for i in range(n):
                    base = (i % POOL_SLOTS) * request_bytes
                    for layer in range(NUM_LAYERS):
                        off, end = base + layer * layer_bytes, base + (layer + 1) * layer_bytes
                        while off < end:
                            got = sock.recv_into(view[off:end])
                            if not got:
                                raise ConnectionError("the sender closed the socket")
                            off += got
                    finished(f"t{msg['trial']}-r{i}")
            elif kind == "memcpy":
                for i in range(n):
                    if not notify.poll(60):
                        raise TimeoutError("no notification from the sender")
                    notify.recv()
                    finished(f"t{msg['trial']}-r{i}")
            elif not all_done.wait(120):
                raise TimeoutError(f"only {len(done_times)} of {n} requests finished")
            failed = (
                []
                if trial["null"] or kind in ("tcp", "memcpy")
                else [
                    f"{r}: {rx.error}"
                    for r, rx in receivers.items()
                    if rx.state != TransferState.DONE
                ]
            )
            for rid in issued:  # every reservation ended with its commit: nothing is held
                grants.close(rid, lambda: None)
            conn.send(
                {
                    "done_times": list(done_times.values()),
                    "failed": failed,
                    **_used_since(cpu0, faults0),
                }
            )
            # Outside the timed trial (the parent has its times and CPU counts by now): check the
            # pool byte for byte after a kvreceiver trial, then clear it, so that no later check
            # can pass on what an earlier trial left (shm writes the pool in transport mode too).
            check = sent is not None and not trial["null"] and not failed
            mismatch = (
                check_pool(cache, sent, tokens, n, dtype_str, cfg["blocks"]) if check else None
            )
            if sent is not None:
                cache.zero_()
                if on_cuda:
                    torch.cuda.synchronize()
            conn.send({"kv_checked": min(n, POOL_SLOTS) if check else 0, "mismatch": mismatch})
    finally:
        if server is not None:
            server.stop()
        for s in (sock, listener):
            if s is not None:
                s.close()
        if path is not None:
            remove_shared_kv_cache(path)


# ---- prefill process --------------------------------------------------------------------------
def prefill_main(kind: str, conn, notify, cfg: dict) -> None:
    _child(_prefill, kind, conn, notify, cfg)


def _prefill(kind: str, conn, notify, cfg: dict) -> None:
    import torch

    from pdserve.kvtransfer.backends import connect
    from pdserve.kvtransfer.backends.shm_backend import map_shared_kv_cache
    from pdserve.kvtransfer.transport import Destination
    from pdserve.tuning.profiler import send_from_pool, send_request

    tokens, n = cfg["tokens"], cfg["requests"]
    dtype_str = cfg["dtype"]
    blocks_per_request, dst_shape = pool_shape(tokens)
    layout = make_layout(dtype_str)
    # The chunks are read out of the prefill side's own paged cache beforehand. With --device
    # cuda they are CUDA tensors (kv_device), which each transport's send copies to the host.
    chunks = source_chunks(tokens, dtype_str, kv_device(kind, cfg), cfg["blocks"])
    # --gather: each request's chunks are read out of the pool inside the timed loop
    gather = (
        source_pool(tokens, dtype_str, kv_device(kind, cfg), cfg["blocks"])
        if cfg["gather"]
        else None
    )
    address = conn.recv()
    transport = sock = shared = None
    if kind in BACKENDS:
        transport = connect(kind, address, timeout=60.0, **cfg["connect_opts"].get(kind, {}))
    elif kind == "tcp":
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=60)
    else:
        shared = map_shared_kv_cache(address, dst_shape, getattr(torch, dtype_str)).view(-1)
    layer_bytes = (
        [memoryview(d.view(-1).view(torch.uint8).numpy()) for _, d in chunks]
        if sock is not None
        else []
    )
    try:
        while True:
            msg = conn.recv()
            if msg == "stop":
                break
            dests = [
                Destination(
                    slot_block_ids(i % POOL_SLOTS, blocks_per_request, cfg["blocks"]),
                    layout,
                    grant=msg.get("grants", {}).get(f"t{msg['trial']}-r{i}", ""),
                )
                for i in range(n)
            ]
            claim = getattr(transport, "claim", None)
            if claim is not None:  # shm: a prefill worker claims on its call's thread, before
                for i, dest in enumerate(dests):  # the prefill runs, so not in the hand-off
                    claim(f"t{msg['trial']}-r{i}", dest)
            cpu0, faults0 = time.process_time(), minor_faults()
            starts = []
            for i in range(n):
                rid = f"t{msg['trial']}-r{i}"
                starts.append(time.perf_counter())
                if transport is not None:
                    dest = dests[i]
                    if gather:
                        send_from_pool(transport, *gather, tokens, rid, dest, layout)
                    else:
                        send_request(transport, chunks, rid, dest, layout)
                elif sock is not None:
                    for piece in layer_bytes:
                        sock.sendall(piece)
                else:
                    base = (i % POOL_SLOTS) * tokens * token_bytes(dtype_str) // DTYPES[dtype_str]
                    for _, data in chunks:
                        flat = data.view(-1)
                        shared[base : base + flat.numel()].copy_(flat)
                        base += flat.numel()
                    notify.send(i)
            if transport is not None:
                transport.flush(120.0)
            conn.send({"starts": starts, **_used_since(cpu0, faults0)})
    finally:
        if transport is not None:
            transport.close()
        if sock is not None:
            sock.close()


def shared_dir(shape, dtype) -> str:
    """Where the shared pool of shape goes: the shm backend's folder (/dev/shm) where it has room,
    else the temporary folder (a container's /dev/shm is often 64 MiB; a file there is still
    in memory, through the page cache)."""
    import shutil
    import tempfile

    from pdserve.kvtransfer.backends.shm_backend import default_shared_dir

    nbytes = math.prod(shape) * dtype.itemsize
    directory = default_shared_dir()
    if shutil.disk_usage(directory).free < nbytes * 1.1:
        log(f"{directory} has no room for a {nbytes / 2**20:.0f} MiB pool: using the temp folder")
        directory = tempfile.gettempdir()
    return directory


TARGET_RATIO = 0.5
# cuda_ipc's own ceiling is d2d (--device cuda); memcpy stands beside it as the host one
CEILING_OF = {
    "grpc": "tcp",
    "torch": "tcp",
    "shm": "memcpy",
    "nixl": "memcpy",
    "cuda_ipc": "memcpy",
}
MODES = {
    "transport": "the decode handler drops the frames (shm: the KV is already in the paged pool)",
    "kvreceiver": "a KVReceiver writes the KV into the decode paged cache and takes the commit",
}
CONTENTION_WARN_CORES = 0.2
DEFAULT_OUT = os.path.join("benchmarks", "results", "kv_transfer.json")
DEFAULT_CUDA_OUT = os.path.join("benchmarks", "results", "kv_transfer_cuda.json")


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


class TrialFailed(RuntimeError):
    """A trial that failed with both processes still in step with the parent."""


class Pair:
    """A prefill process and a decode process of one kind, alive for the whole run. Once one of
    them fails or stops answering, the pair is dead: its pipes may be out of step, so each later
    trial fails at once with the first reason instead of waiting on it."""

    def __init__(self, kind: str, cfg: dict):
        ctx = mp.get_context("spawn")
        self.kind, self.cfg, self.dead = kind, cfg, None
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
        try:
            self.tx.send(_recv(self.rx, f"{self.kind} decode")["address"])
        except (OSError, EOFError) as e:  # a child gone: say which, and what it left
            raise RuntimeError(self._gone(e)) from e

    def trial(self, trial: int, mode: str | None) -> dict:
        if self.dead:
            raise RuntimeError(f"not run: this pair failed earlier ({self.dead})")
        try:
            return self._trial(trial, mode)
        except (OSError, EOFError) as e:
            self.dead = self._gone(e)
            raise RuntimeError(self.dead) from e
        except Exception as e:
            if not isinstance(e, TrialFailed):
                self.dead = f"{type(e).__name__}: {e}"
            raise

    def _gone(self, e: BaseException) -> str:
        """Why a pipe to a child broke: each child's exit code (negative: the signal that ended
        it) and the error it sent before it went, which nothing had read yet."""
        parts = [f"{type(e).__name__}: {e}"]
        for proc, conn in zip(self.procs, (self.rx, self.tx)):
            proc.join(2.0)
            parts.append(f"{proc.name} exit code {proc.exitcode}")
            with contextlib.suppress(OSError, EOFError):
                while conn.poll(0):
                    msg = conn.recv()
                    if isinstance(msg, dict) and "error" in msg:
                        parts.append(f"{proc.name} failed:\n{msg['error']}")
        return "; ".join(parts)

    def _trial(self, trial: int, mode: str | None) -> dict:
        self.rx.send({"trial": trial, "mode": mode})
        ready = _recv(self.rx, f"{self.kind} decode")
        assert ready == "ready" or ready["ready"], ready
        grants = ready["grants"] if isinstance(ready, dict) else {}  # nixl: the write grants
        busy0, own0, t0 = busy_cpu_s(), os.times(), time.perf_counter()
        self.tx.send({"trial": trial, "grants": grants})
        sent = _recv(self.tx, f"{self.kind} prefill")
        got = _recv(self.rx, f"{self.kind} decode")
        wall = time.perf_counter() - t0
        own1 = os.times()
        busy1 = busy_cpu_s()
        # The decode side checks its pool after the timed part (see _decode). Its answer is read
        # before anything raises, or the next trial would read it in place of its own.
        check = _recv(self.rx, f"{self.kind} decode")
        if got["failed"]:
            raise TrialFailed(f"{len(got['failed'])} requests failed, e.g. {got['failed'][0]}")
        if check["mismatch"]:
            raise TrialFailed(f"the decode pool does not hold the KV sent: {check['mismatch']}")
        elapsed = max(got["done_times"]) - min(sent["starts"])
        own = got["cpu_s"] + sent["cpu_s"] + (own1.user + own1.system - own0.user - own0.system)
        foreign = None if busy0 is None or busy1 is None else max(0.0, busy1 - busy0 - own) / wall
        latencies = [d - s for d, s in zip(got["done_times"], sent["starts"])]
        request_bytes = self.cfg["tokens"] * token_bytes(self.cfg["dtype"])
        return {
            "gbps": self.cfg["requests"] * request_bytes / elapsed / 1e9,
            "elapsed_s": elapsed,
            "median_request_latency_ms": 1e3 * statistics.median(latencies),
            "prefill_cpu_s": sent["cpu_s"],
            "decode_cpu_s": got["cpu_s"],
            "prefill_page_faults": sent["faults"],
            "decode_page_faults": got["faults"],
            "foreign_cores_avg": foreign,
            "kv_identical_pool_slots": check["kv_checked"],
        }

    def stop(self) -> None:
        stop_children([self.rx, self.tx], self.procs, kill=True)


def machine(device: str = "cpu") -> dict:
    import grpc
    import torch

    cpu = cpu_model()
    info = {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "platform": platform.platform(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def summarize(runs, trials: dict, ceiling_of_key: dict) -> list[dict]:
    rows = []
    for key in runs:
        kind, _, mode = key.partition("/")
        good = [t for t in trials[key] if "gbps" in t]
        latencies = [
            t["median_request_latency_ms"]
            for t in good
            if t["median_request_latency_ms"] is not None
        ]
        row = {
            "backend": kind,
            "mode": mode or "raw",
            "rounds": len(good),
            "gbps": statistics.median(t["gbps"] for t in good) if good else None,
            "median_request_latency_ms": statistics.median(latencies) if latencies else None,
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


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; args.backends and args.modes come back as lists, args.out filled in,
    args.skipped maps a backend left out to why."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=24, help="requests per trial")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (after 1 warm-up round)")
    ap.add_argument("--mib", type=float, default=16.0, help="MiB of KV per request")
    ap.add_argument(
        "--tokens", type=int, default=None, help="prompt tokens per request (instead of --mib)"
    )
    ap.add_argument(
        "--backends",
        default=None,
        help="comma-separated, of grpc,shm,torch,nixl,cuda_ipc (default grpc,shm,torch; with --device "
        "cuda, grpc,torch; cuda_ipc with --device cuda only)",
    )
    ap.add_argument("--modes", default="transport,kvreceiver", help=f"of {sorted(MODES)}")
    ap.add_argument(
        "--gather",
        action="store_true",
        help="read each request's chunks out of the prefill side's pool as they are sent, as a "
        "worker does (nixl WRITEs straight from that pool); default: read beforehand",
    )
    ap.add_argument(
        "--blocks",
        choices=("shuffled", "runs", "churn"),
        default="shuffled",
        help="each reservation's blocks, and the prefill side's: shuffled, no two adjacent "
        "(default), consecutive (runs), or in runs of 30 out of order (churn)",
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where both sides' paged caches of grpc and torch live (cuda: two processes on GPU 0, "
        "the hand-off through pinned host memory; default cpu)",
    )
    ap.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="the KV dtype (default float32; bfloat16 is what a GPU engine holds)",
    )
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
    ap.add_argument(
        "--out", default=None, help=f"default {DEFAULT_OUT} ({DEFAULT_CUDA_OUT} with --device cuda)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.rounds = 6, 1
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in MODES:
            ap.error(f"--modes: {m!r} is not one of {sorted(MODES)}")
    args.skipped = {}
    if args.backends is None:
        args.backends = ["grpc", "shm", "torch"]
        if args.device == "cuda":
            args.backends.remove("shm")
            args.skipped["shm"] = SHM_ON_CUDA
    else:
        args.backends = [b for b in args.backends.split(",") if b]
        for b in args.backends:
            if b not in CEILING_OF:
                ap.error(f"--backends: {b!r} is not one of {sorted(CEILING_OF)}")
            if b == "nixl":
                from pdserve.deploy.config.schema import nixl_installed

                if not nixl_installed():
                    ap.error("--backends nixl: NIXL is not installed (pip install 'pdserve[nixl]')")
            if args.device == "cuda" and b == "nixl":
                ap.error(
                    "--backends nixl with --device cuda: this benchmark runs nixl between host "
                    "pools only (its CUDA path is issue 50's item 4); leave it out"
                )
            if args.device != "cuda" and b == "cuda_ipc":
                ap.error(f"--backends cuda_ipc: {CUDA_IPC_ON_CPU}")
            if args.device == "cuda" and b not in DEVICE_KINDS:
                ap.error(f"--backends {b} with --device cuda: {SHM_ON_CUDA}; leave it out")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error(
                f"--device cuda: this torch ({torch.__version__}) sees no CUDA device "
                f"(torch.cuda.is_available() is False)"
            )
    if args.out is None:
        args.out = DEFAULT_CUDA_OUT if args.device == "cuda" else DEFAULT_OUT
    return args


def print_table(rows: list[dict], args, cfg: dict, machine_info: dict, checked: int) -> None:
    """The result table on stdout; with --device cuda, also the GPU, the d2d ceiling's columns and
    the pool slots whose KV the decode side found identical to what was sent."""
    tokens, request_bytes = cfg["tokens"], cfg["tokens"] * token_bytes(args.dtype)
    cuda = args.device == "cuda"
    fmt = lambda x, f=".2f": "-" if x is None else format(x, f)  # noqa: E731
    print(
        f"\nKV transfer between two processes: {tokens} tokens x {NUM_LAYERS} layers = "
        f"{request_bytes / (1 << 20):.2f} MiB per request in {NUM_LAYERS + 1} frames, "
        f"{args.requests} requests back to back per trial, medians of {args.rounds} rounds, "
        f"malloc {'tuned' if cfg['tune_malloc'] else 'default'}\n"
    )
    if cuda:
        print(
            f"KV caches of {', '.join(args.backends)} on {machine_info['gpu']} in {args.dtype} "
            f"(torch {machine_info['torch']}, CUDA {machine_info['cuda']}); tcp is a host "
            f"socket. {D2D_COUNTING}."
        )
        for b, why in args.skipped.items():
            print(f"{b} skipped: {why}.")
        print()
    print(
        "| backend | mode | GB/s | ceiling | ceiling GB/s | ratio | target | result "
        "| median request latency | other procs (max cores) |" + (" d2d GB/s | of d2d |" * cuda)
    )
    print("|---|---|---|---|---|---|---|---|---|---|" + "---|---|" * cuda)
    for r in rows:
        busy = r["foreign_cores_max"]
        warn = " (busy!)" if busy is not None and busy > CONTENTION_WARN_CORES else ""
        d2d = f" {fmt(r['d2d_gbps'])} | {fmt(r['of_d2d'], '.2%')} |" if cuda else ""
        print(
            f"| {r['backend']} | {r['mode']} | {fmt(r['gbps'])} | {r['ceiling'] or '-'} "
            f"| {fmt(r['ceiling_gbps'])} | {fmt(r['ratio'], '.0%')} "
            f"| {'>= 50%' if r['mode'] == 'transport' else '-'} | {r['result']} "
            f"| {fmt(r['median_request_latency_ms'], '.1f')} ms | {fmt(busy)}{warn} |{d2d}"
        )
    if cuda:
        print(
            f"\nKV identity: {checked} pool slots, checked byte for byte against the sent KV "
            f"after the kvreceiver trials, all identical (a trial whose pool differs FAILS and "
            f"counts none here)"
        )


def main(argv=None) -> int:
    """The command line and the run.

    Workload: SmolLM2-135M's KV shape (30 layers, 3 kv heads, head dim 64, --dtype (float32 by
    default), block size 16 on both sides), one "kv" frame per layer, then a "commit". The
    prefill process reads its chunks out of its paged cache beforehand (read_chunk is the
    engine's cost, not the transport's); each request lands in its own reservation of the decode
    pool (shuffled block ids). Throughput = KV bytes / (last commit handled on the decode side -
    first send on the prefill side), both on the system-wide monotonic clock (on cuda a commit
    counts once the device finished the request's writes). Ceilings, with the same process pair
    layout and message sizes: tcp sends each layer's bytes with sendall and receives them into
    the pool with recv_into; memcpy copies each layer's bytes into a shared-memory pool the
    decode process mapped, then tells it over a pipe (the one copy shm makes, without its paged
    scatter); on cuda, d2d (DeviceCopy) as well.

    All process pairs start once; then a warm-up round (it also faults in every page of the pools)
    and --rounds measured rounds, each running every ceiling and backend once, interleaved, so
    that a backend and its ceiling see the same machine. The table shows medians over rounds:
    throughput, and the ratio of each round's backend to the same round's ceiling. Every process
    runs with torch.set_num_threads(1) and (unless --no-malloc-tune)
    kvtransfer.backends.tune_malloc(). Each trial records the CPU other processes used meanwhile
    (/proc/stat minus ours), and the table warns above CONTENTION_WARN_CORES."""
    args = parse_args(argv)
    cuda, backends = args.device == "cuda", args.backends
    for b, why in args.skipped.items():
        log(f"{b} skipped with --device {args.device}: {why}")
    tokens = args.tokens or int(args.mib * (1 << 20)) // token_bytes(args.dtype)
    cfg = {
        "tokens": tokens,
        "requests": args.requests,
        "device": args.device,
        "dtype": args.dtype,
        "tune_malloc": not args.no_malloc_tune,
        "blocks": args.blocks,
        "gather": args.gather,
        "server_opts": json.loads(args.server_opts),
        "connect_opts": json.loads(args.connect_opts),
    }
    kinds = sorted({CEILING_OF[b] for b in backends}) + backends
    runs, ceiling_of_key = ["d2d"] if cuda else [], {}  # d2d, then each ceiling with its backends
    for ceiling in sorted({CEILING_OF[b] for b in backends}):
        runs.append(ceiling)
        for b in backends:
            if CEILING_OF[b] == ceiling:
                for m in args.modes:
                    runs.append(f"{b}/{m}")
                    ceiling_of_key[f"{b}/{m}"] = ceiling
    machine_info = machine(args.device)
    results = {
        "command": shlex.join(["python", "-m", "benchmarks.transfer.kv_transfer", *sys.argv[1:]]),
        "date": _dt.datetime.now().astimezone().isoformat(),
        "machine": machine_info,
        "config": {
            "model_shape": {
                "num_layers": NUM_LAYERS,
                "num_kv_heads": NUM_KV_HEADS,
                "head_dim": HEAD_DIM,
                "dtype": args.dtype,
                "block_size": BLOCK_SIZE,
            },
            "device": args.device,
            "tokens_per_request": tokens,
            "kv_bytes_per_request": tokens * token_bytes(args.dtype),
            "frames_per_request": NUM_LAYERS + 1,
            "requests_per_trial": args.requests,
            "rounds": args.rounds,
            "torch_threads_per_process": 1,
            "malloc_tuned": cfg["tune_malloc"],
            "reservation_blocks": cfg["blocks"],
            "gather_while_sending": cfg["gather"],
            "modes": {m: MODES[m] for m in args.modes},
            "server_opts": cfg["server_opts"],
            "connect_opts": cfg["connect_opts"],
            **({"d2d": D2D_COUNTING, "skipped": args.skipped} if cuda else {}),
        },
        "trials": {key: [] for key in runs},
    }
    status, checked_slots = 0, 0
    pairs = {kind: Pair(kind, cfg) for kind in kinds}
    if cuda:
        pairs["d2d"] = DeviceCopy(args.requests * tokens * token_bytes(args.dtype))
    try:
        for kind, pair in pairs.items():
            try:
                pair.connect()
            except Exception as e:  # noqa: BLE001 - its trials fail; the other kinds still run
                pair.dead, status = f"{type(e).__name__}: {e}", 1
                log(f"{kind}: FAILED to start: {pair.dead}")
        for rnd in range(args.rounds + 1):  # round 0 warms up
            for trial, key in enumerate(runs):
                kind, _, mode = key.partition("/")
                if args.wait_idle:
                    busy = wait_idle(args.wait_idle)
                    if busy is not None and busy >= 0.15:
                        log(
                            f"the machine stayed busy ({busy:.2f} cores) for {args.wait_idle} s; "
                            f"measuring anyway"
                        )
                try:
                    row = pairs[kind].trial(rnd * 100 + trial, mode or None)
                except Exception as e:  # noqa: BLE001 - the report must say what broke
                    row = {"error": f"{type(e).__name__}: {e}"}
                    status = 1
                    log(f"round {rnd} {key}: FAILED {row['error']}")
                else:
                    log(f"round {rnd} {key}: {trial_line(row)}")
                    checked_slots += row.get("kv_identical_pool_slots", 0)
                if rnd:
                    results["trials"][key].append(row)
    finally:
        for pair in pairs.values():
            pair.stop()
    rows = summarize(runs, results["trials"], ceiling_of_key)
    if cuda:
        add_d2d(rows, results["trials"])
    results["table"] = rows
    print_table(rows, args, cfg, machine_info, checked_slots)
    write_result(args.out, results, "benchmarks.transfer.kv_transfer", argv)
    print(f"\nwrote {args.out}")
    return status


def trial_line(row: dict) -> str:
    """A measured trial, for the log."""
    if "prefill_cpu_s" not in row:  # The d2d ceiling runs no processes.
        return f"{row['gbps']:.2f} GB/s (device-to-device copy)"
    slots = row["kv_identical_pool_slots"]
    return (
        f"{row['gbps']:.2f} GB/s, cpu prefill {row['prefill_cpu_s']:.3f} s "
        f"decode {row['decode_cpu_s']:.3f} s, other processes "
        f"{row['foreign_cores_avg'] or 0:.2f} cores"
        + (f", KV identical in {slots} pool slots" if slots else "")
    )


if __name__ == "__main__":
    sys.exit(main())
