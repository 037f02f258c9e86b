"""The two processes of a benchmarks/kv_transfer_bench.py pair, started by its parent with the spawn
context (decode_main, prefill_main are their targets): the decode side serves or listens and
times each request's commit, the prefill side reads its KV chunks and sends them; plus the
workload's KV shape they share (SmolLM2-135M, block size 16), the decode pool's layout, and the
check that the decode pool holds, byte for byte, the KV the prefill side sent.

cfg["device"] and cfg["dtype"] say where the paged caches of the backends under test (grpc,
torch) live and in what dtype: with "cuda" the prefill side's chunks are CUDA tensors (the
transports copy them to the host through pinned memory) and the KVReceiver writes into a CUDA
pool. The raw ceilings (tcp, memcpy) and the shm backend always move host memory. DeviceCopy,
the ceiling of a hand-off between CUDA caches, runs in the parent process and sits here beside
the workload it measures."""

from __future__ import annotations

import math
import socket
import statistics
import time
import traceback

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
POOL_SLOTS = 4  # requests' worth of blocks in the decode pool, used in turn
BACKENDS = ("grpc", "shm", "torch")  # the kinds that run a transport backend (the rest: ceilings)
DTYPES = {"float32": 4, "bfloat16": 2}  # the KV dtypes the benchmark runs, and their sizes
DEVICE_KINDS = ("grpc", "torch")  # the kinds whose caches live on cfg["device"]
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


def slot_block_ids(slot: int, blocks_per_request: int) -> list[int]:
    """A request's reservation: its slot's blocks in a shuffled (fixed) order."""
    ids = list(range(slot * blocks_per_request, (slot + 1) * blocks_per_request))
    return ids[1::2] + ids[0::2]


def source_chunks(tokens: int, dtype: str, device: str) -> list:
    """The prefill side's KV chunks, one (header, data) per layer, read out of its own paged cache:
    one request's worth of blocks in reverse order, random values of a fixed seed (drawn on the
    CPU in float32, so that every device and dtype sees the same values, then converted)."""
    import torch

    from pdserve.kvtransfer.reshard import read_chunk

    blocks_per_request, _ = pool_shape(tokens)
    shape = (NUM_LAYERS, 2, blocks_per_request, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    src = torch.randn(shape, generator=torch.Generator().manual_seed(SOURCE_SEED))
    src = src.to(device=device, dtype=getattr(torch, dtype))
    src_blocks = list(reversed(range(blocks_per_request)))
    layout = make_layout(dtype)
    return [
        read_chunk(src[layer], layout, "x", layer, src_blocks, 0, tokens)
        for layer in range(NUM_LAYERS)
    ]


def check_pool(cache, chunks: list, tokens: int, requests: int, dtype: str) -> str | None:
    """None when every pool slot the trial's requests used holds `chunks` byte for byte (each
    request sends the same KV; a slot holds the last request that used it), else what differs."""
    import torch

    from pdserve.kvtransfer.reshard import read_chunk

    blocks_per_request, _ = pool_shape(tokens)
    layout = make_layout(dtype)
    for slot in range(min(requests, POOL_SLOTS)):
        ids = slot_block_ids(slot, blocks_per_request)
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
        cache, path = create_shared_kv_cache(shape, dtype)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    # This is what the prefill side sends: the pool is checked against it after kvreceiver trials.
    sent = source_chunks(tokens, dtype_str, device) if kind in BACKENDS else None
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

        if kind in BACKENDS:
            opts = dict(kv_cache=cache, kv_path=path) if kind == "shm" else {}
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
            for i in range(n):
                rid = f"t{msg['trial']}-r{i}"
                receivers[rid] = KVReceiver(
                    rid,
                    cache,
                    make_layout(dtype_str),
                    slot_block_ids(i % POOL_SLOTS, blocks_per_request),
                    0,
                    tokens,
                )
            cpu0, faults0 = time.process_time(), minor_faults()
            conn.send("ready")
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
            mismatch = check_pool(cache, sent, tokens, n, dtype_str) if check else None
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
    from pdserve.tuning.profiler import send_request

    tokens, n = cfg["tokens"], cfg["requests"]
    dtype_str = cfg["dtype"]
    blocks_per_request, dst_shape = pool_shape(tokens)
    layout = make_layout(dtype_str)
    # The chunks are read out of the prefill side's own paged cache beforehand. With --device
    # cuda they are CUDA tensors (kv_device), which each transport's send copies to the host.
    chunks = source_chunks(tokens, dtype_str, kv_device(kind, cfg))
    address = conn.recv()
    transport = sock = shared = None
    if kind in ("grpc", "shm", "torch"):
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
            cpu0, faults0 = time.process_time(), minor_faults()
            starts = []
            for i in range(n):
                rid = f"t{msg['trial']}-r{i}"
                starts.append(time.perf_counter())
                if transport is not None:
                    dest = Destination(slot_block_ids(i % POOL_SLOTS, blocks_per_request), layout)
                    # the headers read_chunk would build for this request
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
