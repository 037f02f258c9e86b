"""The two processes of a benchmarks/kv_transfer_bench.py pair, started by its parent with the spawn
context (decode_main, prefill_main are their targets): the decode side serves or listens and
times each request's commit, the prefill side reads its KV chunks and sends them; plus the
workload's KV shape they share (SmolLM2-135M, block size 16) and the decode pool's layout."""

from __future__ import annotations

import math
import socket
import time
import traceback

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
DTYPE_BYTES = 4
TOKEN_BYTES = 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE_BYTES * NUM_LAYERS  # 46,080
POOL_SLOTS = 4  # requests' worth of blocks in the decode pool, used in turn


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


def make_layout():
    from pdserve.kvtransfer.layout import KVLayout

    return KVLayout("smollm2-135m", "float32", NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)


def slot_block_ids(slot: int, blocks_per_request: int) -> list[int]:
    """A request's reservation: its slot's blocks in a shuffled (fixed) order."""
    ids = list(range(slot * blocks_per_request, (slot + 1) * blocks_per_request))
    return ids[1::2] + ids[0::2]


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
    blocks_per_request, shape = pool_shape(tokens)
    request_bytes = tokens * TOKEN_BYTES
    path = None
    if kind in ("shm", "memcpy"):
        cache, path = create_shared_kv_cache(shape, torch.float32)
    else:
        cache = torch.zeros(shape)
    server = sock = listener = None
    try:
        done_times: dict[str, float] = {}
        all_done = threading.Event()
        receivers: dict[str, KVReceiver] = {}
        trial = {"null": False}

        def finished(request_id: str) -> None:
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

        if kind in ("grpc", "shm", "torch"):
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
        view = memoryview(cache.view(-1).view(torch.uint8).numpy())
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
                    make_layout(),
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
    from pdserve.kvtransfer.reshard import read_chunk
    from pdserve.kvtransfer.transport import Destination
    from pdserve.tuning.profiler import send_request

    tokens, n = cfg["tokens"], cfg["requests"]
    blocks_per_request, dst_shape = pool_shape(tokens)
    layout = make_layout()
    # the prefill side's own paged cache: one request's worth of blocks, in reverse order
    src = torch.randn(
        NUM_LAYERS,
        2,
        blocks_per_request,
        BLOCK_SIZE,
        NUM_KV_HEADS,
        HEAD_DIM,
        generator=torch.Generator().manual_seed(0),
    )
    src_blocks = list(reversed(range(blocks_per_request)))
    chunks = [
        read_chunk(src[layer], layout, "x", layer, src_blocks, 0, tokens)
        for layer in range(NUM_LAYERS)
    ]
    address = conn.recv()
    transport = sock = shared = None
    if kind in ("grpc", "shm", "torch"):
        transport = connect(kind, address, timeout=60.0, **cfg["connect_opts"].get(kind, {}))
    elif kind == "tcp":
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=60)
    else:
        shared = map_shared_kv_cache(address, dst_shape, torch.float32).view(-1)
    layer_bytes = [memoryview(d.view(-1).view(torch.uint8).numpy()) for _, d in chunks]
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
                    base = (i % POOL_SLOTS) * tokens * TOKEN_BYTES // DTYPE_BYTES
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
