"""`pdserve profile`: measure this machine for the tuner and save a profile JSON.

    pdserve profile --model smollm2 --tp 1 --out profile.json --quick     # ~1 min on 2 cores
    pdserve profile --model smollm2 --tp 1,3 --out profile.json           # the full grids

Per TP degree, the engine runs in this process (LLMEngine, ignore_eos requests, every rank with
--threads-per-rank compute threads: on CPU a device is a core) and engine.step() is timed:
  prefill  one step that runs whole prompts (one, or several of equal length), 16..2048 tokens
  decode   B = 1..64 sequences of 32..1024 context tokens each (as far as the KV pool holds them),
           their KV put in place by reserve + commit, then steps that each decode B tokens
The step models of tuning/perf_model.py are fitted to these by non-negative least squares.
KV transfer per backend (grpc, shm, torch, and nixl where its extra is installed; --backends picks
some): a receiver process writes the KV into a paged cache as a decode worker does, while this
process sends requests layer by layer: latency from one small request at a time, bandwidth from
large ones back to back (transfer_mib x transfer_requests below: a few seconds a backend). On
nixl the receiver issues each request a write grant, as a decode worker's Reserve does, and the
sender WRITEs into the granted blocks. These are same-host figures (two processes on this machine,
the profile's `hardware`): a deployment whose `kvtransfer.profile` names this file ranks the
backends of `kvtransfer.backend: auto` by them (kvtransfer/choose.py); figures between two hosts
may be added by hand as `kv_transfer_cross_host` (the same keys), which this command cannot
measure on one machine.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback

from pdserve.tuning.perf_model import profile_dict, profile_from_dict
from pdserve.tuning.profile_engine import log, profile_tp

QUICK = {
    "prefill": [[32], [128], [512], [1024], [256] * 4, [64] * 8],
    "prefill_reps": 1,
    "batches": (1, 4, 16, 64),
    "contexts": (32, 256),
    "decode_steps": 3,
    "transfer_mib": 16.0,
    "transfer_requests": 6,
    "pings": 3,
}
FULL = {
    # one prompt of 16, 32, ..., 2048 tokens, then batches of several
    "prefill": [[1 << k] for k in range(4, 12)]
    + [[256] * 4, [128] * 8, [64] * 16, [1024] * 2, [512] * 4],
    "prefill_reps": 3,
    "batches": (1, 2, 4, 8, 16, 32, 64),
    "contexts": (32, 128, 512, 1024),
    "decode_steps": 5,
    "transfer_mib": 16.0,
    "transfer_requests": 12,
    "pings": 7,
}
TRANSFER_BLOCK_SIZE = 16
# how long the receiver waits for a batch's transfers to land before it answers with those it has
_BATCH_WAIT_S = 120.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2', an HF directory or a .gguf")
    p.add_argument("--tp", default="1", help="TP degrees to measure, e.g. 1,3 (default 1)")
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    p.add_argument(
        "--quick", action="store_true", help="small grids, one repeat (~1 min for SmolLM2 tp 1)"
    )
    p.add_argument(
        "--threads-per-rank",
        type=int,
        default=1,
        help="compute threads of each TP rank; a device is this many cores (default 1)",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=1 << 30,
        help="bytes of KV pool per rank while profiling; the profile's KV capacity and "
        "the tuner's YAML use it (default 1 GiB, the engine's CPU default)",
    )
    p.add_argument(
        "--backends",
        default=None,
        help="KV transfer backends to measure, of grpc,shm,torch,nixl (default: all of them that "
        "are installed here; nixl needs the nixl extra); '' measures none",
    )
    p.add_argument("--dtype", default="auto")


# ---- KV transfer --------------------------------------------------------------------------------
def _layout(info: dict):
    from pdserve.kvtransfer.layout import KVLayout

    return KVLayout(
        info["id"],
        info["dtype"],
        info["num_layers"],
        info["num_kv_heads"],
        info["head_dim"],
        TRANSFER_BLOCK_SIZE,
    )


def _pool_shape(info: dict, tokens: int, slots: int) -> tuple[int, ...]:
    blocks = -(-tokens // TRANSFER_BLOCK_SIZE) * slots
    return (
        info["num_layers"],
        2,
        blocks,
        TRANSFER_BLOCK_SIZE,
        info["num_kv_heads"],
        info["head_dim"],
    )


def _block_ids(slot: int, tokens: int) -> list[int]:
    per = -(-tokens // TRANSFER_BLOCK_SIZE)
    return list(range(slot * per, (slot + 1) * per))


def _receiver_main(conn, info: dict, tokens: int, slots: int) -> None:
    """The decode side: serves each backend the parent asks for; every request's KV goes into a
    paged cache through a KVReceiver; reports when each commit was taken."""
    try:
        import threading

        import torch

        from pdserve.kvtransfer.backends import (
            create_shared_kv_cache,
            remove_shared_kv_cache,
            serve,
            tune_malloc,
        )
        from pdserve.kvtransfer.receiver import KVReceiver
        from pdserve.kvtransfer.state import TransferState

        tune_malloc()
        torch.set_num_threads(1)
        dtype = getattr(torch, info["dtype"])
        cache, path = create_shared_kv_cache(_pool_shape(info, tokens, slots), dtype)
        layout = _layout(info)
        try:
            while True:
                msg = conn.recv()
                if msg == "stop":
                    break
                receivers, done, lock = {}, {}, threading.Lock()
                grants = None
                if msg["backend"] == "nixl":  # a decode worker's write grants, one per request
                    from pdserve.kvtransfer.backends.nixl_backend import Grants

                    grants = Grants()

                def handler(header, payload):
                    with lock:
                        rx = receivers.get(header.request_id)
                        if rx is None:  # request ids are "<slot>-<tokens>-<serial>"
                            slot, n, _ = header.request_id.split("-")
                            rx = receivers[header.request_id] = KVReceiver(
                                header.request_id,
                                cache,
                                layout,
                                _block_ids(int(slot), int(n)),
                                0,
                                int(n),
                            )
                    if rx.on_frame(header, payload) in (TransferState.DONE, TransferState.FAILED):
                        with lock:
                            done[header.request_id] = (time.perf_counter(), rx.error)
                        if grants is not None:  # the reservation ends: commit or failure
                            grants.close(header.request_id, None)

                opts = {"kv_cache": cache, "kv_path": path} if msg["backend"] == "shm" else {}
                if grants is not None:
                    opts = {"kv_caches": cache, "grants": grants}
                server = serve(msg["backend"], handler, **opts)
                conn.send({"address": server.address})
                while (cmd := conn.recv()) != "end":
                    if "grants" in cmd:  # nixl: a grant per request id, as Reserve issues them
                        conn.send({rid: grants.issue(rid, ids) for rid, ids in cmd["grants"]})
                        continue
                    deadline = time.monotonic() + _BATCH_WAIT_S
                    while len(done) < cmd["count"] and time.monotonic() < deadline:
                        time.sleep(0.0005)
                    # Take the batch and empty the table before answering: the parent sends
                    # the next batch as soon as it hears, and a request of that batch may land
                    # before this thread would get to clear it.
                    with lock:
                        batch = dict(done)
                        done.clear()
                    conn.send(batch)
                server.stop()
        finally:
            remove_shared_kv_cache(path)
    except BaseException:  # noqa: BLE001 - the parent must hear why
        conn.send({"error": traceback.format_exc()})


def _recv(conn, proc, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"the transfer receiver exited ({proc.exitcode}) without an answer")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the transfer receiver did not answer within {timeout:.0f} s")
    msg = conn.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise RuntimeError(f"the transfer receiver failed:\n{msg['error']}")
    return msg


def send_from_pool(transport, pool, block_ids, tokens: int, rid: str, dest, layout) -> None:
    """Request `rid`'s first `tokens` tokens out of a paged pool ([layers, 2, blocks, block_size,
    heads, head_dim], the request's block_ids in it) into `dest`, then its commit (first token 1),
    as a prefill worker's PushSink sends them: each layer straight out of the pool where the
    transport can (send_paged), else gathered by read_chunk and sent."""
    from pdserve.kvtransfer.reshard import chunk_header, read_chunk
    from pdserve.kvtransfer.wire import ChunkHeader

    for layer in range(pool.shape[0]):
        header = chunk_header(layout, rid, layer, 0, tokens, pool.dtype)
        if not transport.send_paged(header, pool[layer], block_ids, dest):
            chunk = read_chunk(pool[layer], layout, rid, layer, block_ids, 0, tokens)
            transport.send(*chunk, dest)
    transport.send(
        ChunkHeader(rid, layout.fingerprint, kind="commit", first_tokens=(1,)), None, dest
    )


def send_request(transport, frames, rid: str, dest, layout) -> None:
    """Sends prebuilt (header, data) frames as request `rid` into `dest`, then its commit (first
    token 1): one request's hand-off from chunks gathered beforehand (send_from_pool sends as a
    prefill worker does)."""
    from pdserve.kvtransfer.wire import ChunkHeader

    for header, data in frames:
        transport.send(ChunkHeader(**{**vars(header), "request_id": rid}), data, dest)
    transport.send(
        ChunkHeader(rid, layout.fingerprint, kind="commit", first_tokens=(1,)), None, dest
    )


def measure_transfer(info: dict, backends: list[str], grids: dict) -> dict:
    """Each backend's bandwidth and latency into a receiver process that holds a paged KV cache
    as a decode worker does (a child started here, stopped before this returns)."""
    import torch

    from pdserve.kvtransfer.backends import tune_malloc

    tune_malloc()
    dtype = getattr(torch, info["dtype"])
    big = max(
        TRANSFER_BLOCK_SIZE, int(grids["transfer_mib"] * (1 << 20)) // info["kv_bytes_per_token"]
    )
    slots = grids["transfer_requests"]
    layout = _layout(info)
    src = torch.randn(_pool_shape(info, big, 1), generator=torch.Generator().manual_seed(0)).to(
        dtype
    )
    source = (src, _block_ids(0, big))

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child, info, big, slots), daemon=True)
    proc.start()
    out = {}
    try:
        for backend in backends:
            link = _Link(backend, parent, proc, layout, slots, source)
            out[backend] = _measure_backend(link, info, grids, big)
            bw, latency = out[backend]["bandwidth_bytes_per_s"], out[backend]["latency_s"]
            log(f"transfer {backend}: {bw / 1e9:.2f} GB/s, latency {latency * 1e3:.2f} ms")
    finally:
        try:
            parent.send("stop")
        except OSError:
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


class _Link:
    """One backend's connection to the receiver process, and its batches of transfers."""

    def __init__(self, backend: str, parent, proc, layout, slots: int, source):
        self.backend, self.parent, self.proc = backend, parent, proc
        self.layout, self.slots = layout, slots
        self.source = source  # the sending side's paged pool and the request's blocks in it
        self.counter = iter(range(10**9))
        self.transport = None

    def connect(self) -> None:
        from pdserve.kvtransfer.backends import connect

        self.parent.send({"backend": self.backend})
        address = _recv(self.parent, self.proc)["address"]
        self.transport = connect(self.backend, address, timeout=60.0)

    def close(self) -> None:
        self.transport.close()
        self.parent.send("end")

    def send_batch(self, n: int, count: int) -> list[tuple[float, float]]:
        """`count` requests of n tokens at once, each read out of the source pool as it is sent;
        (sent, landed) per request."""
        from pdserve.kvtransfer.transport import Destination

        starts = {}
        # what the receiver parses: "<slot>-<tokens>-<serial>"
        rids = [
            (f"{i % self.slots}-{n}-{next(self.counter)}", i % self.slots) for i in range(count)
        ]
        tokens = {}
        if self.backend == "nixl":  # write grants first, as Reserve hands them out
            self.parent.send({"grants": [(rid, _block_ids(slot, n)) for rid, slot in rids]})
            tokens = _recv(self.parent, self.proc)
        for rid, slot in rids:
            starts[rid] = time.perf_counter()
            dest = Destination(_block_ids(slot, n), self.layout, grant=tokens.get(rid, ""))
            send_from_pool(self.transport, *self.source, n, rid, dest, self.layout)
        self.transport.flush(120.0)
        self.parent.send({"count": count})
        done = _recv(self.parent, self.proc)
        bad = [f"{r}: {e}" for r, (_, e) in done.items() if e]
        if bad or len(done) < count:
            raise RuntimeError(f"{self.backend}: {len(done)} of {count} transfers done; {bad[:1]}")
        return [(starts[r], t) for r, (t, _) in done.items()]


def _measure_backend(link: _Link, info: dict, grids: dict, big: int) -> dict:
    """Latency: the median of one-block pings; bandwidth: `slots` big requests at once, their
    span less that latency."""
    small, slots = TRANSFER_BLOCK_SIZE, link.slots
    link.connect()
    try:
        link.send_batch(small, 1)  # warm-up
        link.send_batch(big, 2)
        pings = []
        for _ in range(grids["pings"]):
            ((s, t),) = link.send_batch(small, 1)
            pings.append(t - s)
        per_request = small * info["kv_bytes_per_token"]
        latency = max(0.0, statistics.median(pings))
        times = link.send_batch(big, slots)
        elapsed = max(t for _, t in times) - min(s for s, _ in times)
        nbytes = slots * big * info["kv_bytes_per_token"]
        bw = nbytes / max(elapsed - latency, 1e-9)
    finally:
        link.close()
    return {
        "bandwidth_bytes_per_s": bw,
        "latency_s": latency,
        "samples": {
            "ping_s": pings,
            "ping_bytes": per_request,
            "bulk_bytes": nbytes,
            "bulk_requests": slots,
            "bulk_s": elapsed,
        },
        "path": "KV per layer out of a paged pool, as a prefill worker sends it, into a "
        "KVReceiver (paged cache), as a decode worker takes it",
        # two processes on this machine (hardware says which): what kvtransfer.backend auto's
        # same-host order is ranked by (kvtransfer/choose.py)
        "locality": "same_host",
    }


# ---- the command --------------------------------------------------------------------------------
def _hardware(info: dict, args) -> dict:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    memory = None
    try:
        with open("/proc/meminfo") as f:
            memory = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration):
        pass
    gpu = info["device"] == "cuda"
    return {
        "device": "gpu" if gpu else "cpu",
        "name": torch.cuda.get_device_name(0) if gpu else cpu,
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        # a device is threads_per_rank cores: this machine is one node of that many devices
        "devices_per_node": max(1, (os.cpu_count() or 1) // args.threads_per_rank),
        "memory_bytes": memory,
        "threads_per_rank": args.threads_per_rank,
        "kv_cache_memory": args.kv_cache_memory,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _backends(args) -> list[str] | None:
    """The KV backends to measure (--backends, default every one installed here); None, after
    saying why on stderr, when the arguments are wrong."""
    from pdserve.kvtransfer.backends import BACKENDS
    from pdserve.kvtransfer.choose import installed

    if args.backends is None:
        backends = list(installed())
    else:
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if "nixl" in backends and "nixl" not in installed():
        print(
            "pdserve profile: --backends names nixl, which is not installed here: "
            "pip install 'pdserve[nixl]'",
            file=sys.stderr,
        )
        return None
    bad = [b for b in backends if b not in BACKENDS]
    if bad or args.threads_per_rank < 1 or args.kv_cache_memory < 1:
        print(
            f"pdserve profile: --backends must be of {BACKENDS}, --threads-per-rank and "
            f"--kv-cache-memory >= 1",
            file=sys.stderr,
        )
        return None
    return backends


def _say_ranking(data: dict, path: str) -> None:
    """The order kvtransfer.backend auto would follow with this profile (kvtransfer/choose.py)."""
    from pdserve.kvtransfer.backends import BACKENDS
    from pdserve.kvtransfer.choose import ranking_from_profile

    ranking = ranking_from_profile(data, path, BACKENDS)
    print(f"kvtransfer.backend auto with kvtransfer.profile: {path}: {ranking.describe()}")


def run(args) -> int:
    try:
        tps = sorted({int(x) for x in str(args.tp).split(",") if x.strip()})
        if not tps or min(tps) < 1:
            raise ValueError
    except ValueError:
        print(
            f"pdserve profile: --tp {args.tp!r}: a comma-separated list of integers >= 1, e.g. 1,3",
            file=sys.stderr,
        )
        return 2
    backends = _backends(args)
    if backends is None:
        return 2
    grids = QUICK if args.quick else FULL
    cores = os.cpu_count() or 1
    t0 = time.perf_counter()
    entries, info = {}, None
    try:
        for tp in tps:
            if tp * args.threads_per_rank > cores:
                log(
                    f"warning: tp={tp} x {args.threads_per_rank} threads > {cores} cores: its ranks "
                    f"share cores, so its timings include that contention"
                )
            entries[tp], info = profile_tp(args.model, tp, grids, args)
        transfer = measure_transfer(info, backends, grids) if backends else {}
    except ValueError as e:  # the engine's message for a bad model or a TP degree it refuses
        print(f"pdserve profile: {e}", file=sys.stderr)
        return 2
    model = {
        k: info[k]
        for k in (
            "id",
            "name",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "hidden_size",
            "dtype",
        )
    }
    data = profile_dict(
        model=model,
        kv_bytes_per_token=info["kv_bytes_per_token"],
        hardware=_hardware(info, args),
        tp=entries,
        kv_transfer=transfer,
        block_size=info["block_size"],
        derived=False,
        source={
            "summary": "measured by `pdserve profile` on this machine",
            "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
            "date": _dt.datetime.now().astimezone().isoformat(),
            "quick": bool(args.quick),
            "seconds": round(time.perf_counter() - t0, 1),
        },
    )
    profile_from_dict(data, args.out)  # what the tuner will accept
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")
    if transfer:
        _say_ranking(data, args.out)
    return 0
