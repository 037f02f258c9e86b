"""The transport backends end to end: engine-shaped KV chunks from a sender, through a real channel,
into a KVReceiver on the decode side (different block sizes on the two sides)."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import multiprocessing
import pathlib
import threading
import time

import pytest
import torch

from conftest import threads_joined
from pdserve.kvtransfer import ChunkHeader, KVLayout, LayoutMismatch, TransferState
from pdserve.kvtransfer.backends import (
    BACKENDS,
    connect,
    create_shared_kv_cache,
    remove_shared_kv_cache,
    serve,
)
from pdserve.kvtransfer.backends.grpc_backend import frame_pieces, split_message
from pdserve.kvtransfer.backends.shm_backend import (
    PagedWriter,
    format_address,
    map_shared_kv_cache,
    parse_address,
)
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.reshard import read_chunk, write_chunk
from pdserve.kvtransfer.transport import Destination
from pdserve.kvtransfer.wire import encode_frame

LAYOUT_KW = dict(dtype="float32", num_layers=3, num_kv_heads=2, head_dim=8)
SRC_BLOCK_SIZE, DST_BLOCK_SIZE = 4, 16
NUM_TOKENS = 37
SRC_BLOCK_IDS = [11, 3, 7, 0, 9, 10, 2, 4, 6, 1]  # 10 blocks of 4 >= 37 tokens
TOKEN_RANGES = [(0, 20), (20, 37)]
TIMEOUT = 5.0  # every connect/flush/wait in this file
REPO = pathlib.Path(__file__).resolve().parents[2]


def src_layout(model: str = "m") -> KVLayout:
    return KVLayout(model, **LAYOUT_KW, block_size=SRC_BLOCK_SIZE)


def source_cache(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, 12, SRC_BLOCK_SIZE, 2, 8, generator=g)


def token_view(cache: torch.Tensor, block_ids: list[int], block_size: int) -> torch.Tensor:
    """[layers, 2, tokens, heads, head_dim] of the first NUM_TOKENS tokens held in block_ids."""
    flat = cache.view(cache.shape[0], 2, -1, cache.shape[-2], cache.shape[-1])
    t = torch.arange(NUM_TOKENS)
    return flat[:, :, torch.tensor(block_ids)[t // block_size] * block_size + t % block_size]


def push_request(
    tx, request_id: str, seed: int, dest: Destination, model: str = "m"
) -> list[ChunkHeader]:
    """What a prefill worker does: layer by layer, two token ranges each, then the commit."""
    layout, src = src_layout(model), source_cache(seed)
    sent = []
    for layer in range(LAYOUT_KW["num_layers"]):
        for start, end in TOKEN_RANGES:
            header, data = read_chunk(
                src[layer], layout, request_id, layer, SRC_BLOCK_IDS, start, end
            )
            tx.send(header, data, dest)
            sent.append(header)
    commit = ChunkHeader(request_id, layout.fingerprint, kind="commit", first_token=seed)
    tx.send(commit, None, dest)
    return sent + [commit]


def sender_process(
    backend: str, address: str, request_id: str, seed: int, dest: Destination
) -> None:
    """The body of a spawned prefill process."""
    tx = connect(backend, address, timeout=TIMEOUT)
    try:
        push_request(tx, request_id, seed, dest)
        tx.flush(TIMEOUT)
    finally:
        tx.close()


def dying_sender_process(backend: str, address: str, request_id: str, dest: Destination) -> None:
    """A prefill process that dies mid-request, without closing its channel."""
    import os

    tx = connect(backend, address, timeout=TIMEOUT)
    header, data = read_chunk(
        source_cache(10)[0], src_layout(), request_id, 0, SRC_BLOCK_IDS, 0, 20
    )
    tx.send(header, data, dest)
    tx.flush(TIMEOUT)
    os._exit(3)


class DecodeSide:
    """A decode rank: a shared KV pool, one KVReceiver per reserved request, a server feeding them."""

    def __init__(self, backend: str, num_blocks: int = 8, **server_opts):
        self.backend = backend
        self.layout = KVLayout("m", **LAYOUT_KW, block_size=DST_BLOCK_SIZE)
        self.cache, self.path = create_shared_kv_cache(
            (3, 2, num_blocks, DST_BLOCK_SIZE, 2, 8), torch.float32
        )
        self.receivers: dict[str, KVReceiver] = {}
        self.frames: list[ChunkHeader] = []
        opts = dict(kv_cache=self.cache, kv_path=self.path) if backend == "shm" else {}
        if backend == "torch":
            opts["timeout"] = TIMEOUT
        self.server = serve(backend, self.on_frame, **opts, **server_opts)

    def reserve(self, request_id: str, block_ids: list[int]) -> Destination:
        self.receivers[request_id] = KVReceiver(
            request_id, self.cache, self.layout, block_ids, 0, NUM_TOKENS
        )
        return Destination(block_ids, self.layout)

    def on_frame(self, header: ChunkHeader, payload) -> None:
        self.frames.append(header)
        self.receivers[header.request_id].on_frame(header, payload)  # KeyError: not reserved here

    def wait_finished(self, request_id: str) -> KVReceiver:
        rx = self.receivers[request_id]
        deadline = time.monotonic() + TIMEOUT
        while (
            rx.state not in (TransferState.DONE, TransferState.FAILED)
            and time.monotonic() < deadline
        ):
            time.sleep(0.005)
        return rx

    def assert_received(self, request_id: str, seed: int) -> None:
        rx = self.wait_finished(request_id)
        assert rx.state == TransferState.DONE, rx.error
        assert rx.first_token == seed
        got = token_view(self.cache, rx.block_ids, DST_BLOCK_SIZE)
        assert torch.equal(got, token_view(source_cache(seed), SRC_BLOCK_IDS, SRC_BLOCK_SIZE))

    def close(self) -> None:
        self.server.stop()
        remove_shared_kv_cache(self.path)


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """close() and stop() join their threads (gRPC's own consumer thread may take a moment)."""
    with threads_joined(1.0):
        yield


@pytest.fixture(params=BACKENDS)
def decode(request):
    side = DecodeSide(request.param)
    yield side
    side.close()


def test_frames_arrive_in_order_and_fill_the_cache(decode):
    dest = decode.reserve("r1", [5, 1, 6])
    tx = connect(decode.backend, decode.server.address, timeout=TIMEOUT)
    try:
        sent = push_request(tx, "r1", seed=1, dest=dest)
        tx.flush(TIMEOUT)
        decode.assert_received("r1", seed=1)
    finally:
        tx.close()
    assert [dataclasses.replace(h, in_place=False) for h in decode.frames] == sent
    assert all(h.in_place == (decode.backend == "shm" and h.kind == "kv") for h in decode.frames)
    assert decode.receivers["r1"].bytes_received == sum(
        2 * (h.end - h.start) * 2 * 8 * 4 for h in sent if h.kind == "kv"
    )


def test_sender_in_another_process(decode):
    dest = decode.reserve("r-proc", [7, 0, 2])
    proc = multiprocessing.get_context("spawn").Process(
        target=sender_process, args=(decode.backend, decode.server.address, "r-proc", 2, dest)
    )
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert proc.exitcode == 0
    decode.assert_received("r-proc", seed=2)


def test_a_dead_sender_leaves_the_other_channels_working(decode):
    dead_dest, good_dest = decode.reserve("dead", [0, 1, 2]), decode.reserve("good", [5, 6, 7])
    tx = connect(decode.backend, decode.server.address, timeout=TIMEOUT)
    try:
        proc = multiprocessing.get_context("spawn").Process(
            target=dying_sender_process,
            args=(decode.backend, decode.server.address, "dead", dead_dest),
        )
        proc.start()
        proc.join(60)
        assert proc.exitcode == 3
        push_request(tx, "good", seed=11, dest=good_dest)
        tx.flush(TIMEOUT)
        decode.assert_received("good", seed=11)
    finally:
        tx.close()
    # its request stays unfinished (the decode worker's lease frees it), nothing hangs
    assert decode.receivers["dead"].state in (TransferState.PENDING, TransferState.TRANSFERRING)


def test_two_senders_to_one_server(decode):
    dests = {"a": decode.reserve("a", [0, 1, 2]), "b": decode.reserve("b", [5, 6, 7])}
    errors = []

    def prefill(request_id, seed):
        try:
            tx = connect(decode.backend, decode.server.address, timeout=TIMEOUT)
            try:
                push_request(tx, request_id, seed, dests[request_id])
                tx.flush(TIMEOUT)
            finally:
                tx.close()
        except Exception as e:
            errors.append(e)

    threads = [
        threading.Thread(target=prefill, args=(rid, seed)) for rid, seed in (("a", 3), ("b", 4))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    decode.assert_received("a", seed=3)
    decode.assert_received("b", seed=4)


def test_sender_whose_server_is_gone_fails_fast(decode):
    dest = decode.reserve("r1", [5, 1, 6])
    tx = connect(decode.backend, decode.server.address, timeout=TIMEOUT)
    try:
        header, data = read_chunk(source_cache(5)[0], src_layout(), "r1", 0, SRC_BLOCK_IDS, 0, 20)
        tx.send(header, data, dest)
        tx.flush(TIMEOUT)
        address = decode.server.address
        decode.server.stop()
        t0 = time.monotonic()
        with pytest.raises((ConnectionError, TimeoutError)):
            for _ in range(100):
                tx.send(header, data, dest)
                tx.flush(2.0)
                time.sleep(0.01)
        assert time.monotonic() - t0 < 5.0
    finally:
        tx.close()
    if (
        decode.backend != "shm"
    ):  # (shm maps the pool, which is still there; its control channel is not)
        t0 = time.monotonic()
        with pytest.raises(ConnectionError):
            connect(decode.backend, address, timeout=1.0)
        assert time.monotonic() - t0 < 5.0


def test_a_bad_frame_fails_only_its_request(decode):
    bad, good = decode.reserve("bad", [0, 1, 2]), decode.reserve("good", [5, 6, 7])
    tx = connect(decode.backend, decode.server.address, timeout=TIMEOUT)
    try:
        # a frame for a request this rank never reserved: the handler raises, the channel goes on
        ghost = ChunkHeader("ghost", src_layout().fingerprint, kind="commit", first_token=0)
        tx.send(ghost, None, bad)
        if (
            decode.backend == "shm"
        ):  # the sender writes in place, so it refuses (and aborts the request)
            with pytest.raises(LayoutMismatch, match="same model"):
                push_request(tx, "bad", seed=6, dest=bad, model="another-model")
        else:
            push_request(tx, "bad", seed=6, dest=bad, model="another-model")
        push_request(tx, "good", seed=7, dest=good)
        tx.flush(TIMEOUT)
        decode.assert_received("good", seed=7)
    finally:
        tx.close()
    rx = decode.wait_finished("bad")
    assert rx.state == TransferState.FAILED
    assert ("aborted" if decode.backend == "shm" else "same model") in rx.error


def test_unknown_backend_names_the_field():
    with pytest.raises(
        ValueError, match=r"backend 'rdma' is not one of \('grpc', 'shm', 'torch'\)"
    ):
        serve("rdma", lambda header, payload: None)
    with pytest.raises(ValueError, match="backend"):
        connect("ucx", "127.0.0.1:1")


def test_shared_kv_cache_is_zeroed_mapped_and_addressable():
    cache, path = create_shared_kv_cache(
        (2, 2, 3, 4, 1, 8), torch.bfloat16, name=f"pdserve-test-{time.time_ns()}"
    )
    try:
        assert cache.shape == (2, 2, 3, 4, 1, 8) and not cache.any()
        address = format_address(path, cache.shape, cache.dtype, "127.0.0.1:1")
        assert parse_address(address) == ([path], tuple(cache.shape), torch.bfloat16, "127.0.0.1:1")
        other = map_shared_kv_cache(path, cache.shape, torch.bfloat16)
        other[1, 0, 2] = 3.0
        assert torch.equal(cache[1, 0, 2], torch.full((4, 1, 8), 3.0, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="needs"):
            map_shared_kv_cache(path, (2, 2, 3, 4, 1, 9), torch.bfloat16)
        with pytest.raises(ValueError, match="not a shm KV address"):
            parse_address("grpc://127.0.0.1:5")
    finally:
        remove_shared_kv_cache(path)


def test_kvtransfer_imports_no_engine_and_no_worker():
    """Nothing of the engine (the shared KV pool files' one creator is kvpool/, a leaf both use)."""
    forbidden = {"engine", "prefill_worker", "decode_worker", "router", "deploy"}
    for path in (REPO / "kvtransfer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            for name in names:
                folder = name.removeprefix("pdserve.").split(".")[0]
                assert folder not in forbidden, f"{path} imports {name}"


def test_a_long_header_travels_whole(decode):
    """The longest request id (256 characters, 2 bytes each in UTF-8) makes a header too long for
    the torch backend's envelope: it goes as its own message."""
    rid = "é" * 256
    dest = decode.reserve(rid, [5, 1, 6])
    tx = connect(decode.backend, decode.server.address, timeout=TIMEOUT)
    try:
        push_request(tx, rid, seed=8, dest=dest)
        tx.flush(TIMEOUT)
        decode.assert_received(rid, seed=8)
    finally:
        tx.close()


def test_grpc_server_can_run_the_handler_on_a_worker_thread():
    side = DecodeSide("grpc", max_backlog_bytes=1 << 20)
    try:
        dest = side.reserve("r1", [2, 3, 4])
        tx = connect("grpc", side.server.address, timeout=TIMEOUT)
        try:
            push_request(tx, "r1", seed=9, dest=dest)
            tx.flush(TIMEOUT)
            side.assert_received("r1", seed=9)
        finally:
            tx.close()
    finally:
        side.close()


def test_fast_header_encoding_is_the_wire_format():
    layout = src_layout()
    header, data = read_chunk(source_cache(1)[2], layout, "r-é", 2, SRC_BLOCK_IDS, 3, 17)
    payload = data.numpy().tobytes()
    for h, p in [
        (header, payload),
        (ChunkHeader("r", "fp", kind="commit", first_token=42), b""),
        (dataclasses.replace(header, in_place=True), b""),
    ]:
        assert b"".join(bytes(x) for x in frame_pieces(h, p)) == b"".join(
            bytes(x) for x in encode_frame(h, p)
        )


def test_header_only_frames_share_a_message_and_split_back():
    layout = src_layout()
    kv, data = read_chunk(source_cache(1)[0], layout, "a", 0, SRC_BLOCK_IDS, 0, 5)
    commit = ChunkHeader("a", layout.fingerprint, kind="commit", first_token=3)
    abort = ChunkHeader("b", layout.fingerprint, kind="abort")
    in_place = dataclasses.replace(kv, in_place=True)
    message = b"".join(
        bytes(p)
        for h, d in [(in_place, b""), (commit, b""), (abort, b""), (kv, data.numpy().tobytes())]
        for p in frame_pieces(h, d)
    )
    frames = split_message(message)
    assert [h for h, _ in frames] == [in_place, commit, abort, kv]
    assert frames[0][1] is None and len(frames[1][1]) == 0 and len(frames[2][1]) == 0
    assert torch.equal(
        torch.frombuffer(bytearray(frames[3][1]), dtype=torch.float32), data.view(-1)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_writer_matches_write_chunk(dtype):
    """The shm sender's block-row copy writes what reshard.write_chunk writes, and refuses the same."""
    kw = dict(
        model="m", dtype=str(dtype).removeprefix("torch."), num_layers=2, num_kv_heads=4, head_dim=8
    )
    src_layout_, dst_layout = KVLayout(**kw, block_size=4), KVLayout(**kw, block_size=8)
    g = torch.Generator().manual_seed(3)
    src = torch.randn(2, 2, 16, 4, 4, 8, generator=g).to(dtype)
    src_blocks, dst_blocks = list(range(15, -1, -1)), [9, 2, 7, 0, 5, 11, 3, 1]
    fast, slow = (
        torch.zeros(2, 2, 12, 8, 4, 8, dtype=dtype),
        torch.zeros(2, 2, 12, 8, 4, 8, dtype=dtype),
    )
    writer = PagedWriter(fast)
    for layer, (start, end) in itertools.product(
        range(2), [(0, 8), (8, 8), (8, 21), (21, 27), (27, 64)]
    ):
        header, data = read_chunk(src[layer], src_layout_, "r", layer, src_blocks, start, end)
        assert writer.write(dst_layout, dst_blocks, header, data) == write_chunk(
            slow, dst_layout, dst_blocks, header, data
        )
    assert torch.equal(fast, slow) and fast.any()
    # a TP slice of the heads (resharding) takes write_chunk's path
    tp_layout = KVLayout(**kw, block_size=8, tp_size=2, tp_rank=1)
    part, ref = (
        torch.zeros(2, 2, 12, 8, 2, 8, dtype=dtype),
        torch.zeros(2, 2, 12, 8, 2, 8, dtype=dtype),
    )
    header, data = read_chunk(src[1], src_layout_, "r", 1, src_blocks, 3, 30)
    PagedWriter(part).write(tp_layout, dst_blocks, header, data)
    write_chunk(ref, tp_layout, dst_blocks, header, data)
    assert torch.equal(part, ref)
    header, data = read_chunk(src[0], src_layout_, "r", 0, src_blocks, 0, 8)
    with pytest.raises(LayoutMismatch, match="same model"):
        writer.write(KVLayout(**{**kw, "model": "other"}, block_size=8), dst_blocks, header, data)
    with pytest.raises(ValueError, match="do not fit"):
        writer.write(dst_layout, dst_blocks[:0], header, data)
    with pytest.raises(ValueError, match="layer 5"):
        writer.write(dst_layout, dst_blocks, dataclasses.replace(header, layer=5), data)
    with pytest.raises(ValueError, match="payload has"):
        writer.write(dst_layout, dst_blocks, header, data.view(-1)[:-1])


def test_concurrent_flushes_share_one_flush_call_within_the_servers_rpc_limit():
    """Many requests flushing one channel at once (a prefill worker finishing a batch of prompts)
    ask the server with one Flush call at a time: the server admits 2 * max_channels + 2 calls,
    and each extra Flush used to be refused (RESOURCE_EXHAUSTED) and failed its request."""
    handled = []

    def slow_handler(header, payload):  # keeps the flushes waiting on the server together
        time.sleep(0.02)
        handled.append(header.request_id)

    server = serve("grpc", slow_handler, max_channels=1)  # at most 4 calls at once
    tx = connect("grpc", server.address, timeout=TIMEOUT)
    errors = []

    def one(i: int) -> None:
        try:
            tx.send_headers([ChunkHeader(f"r{i}", "fp", kind="abort")])
            tx.flush(TIMEOUT)
        except Exception as e:  # the test reports every failure
            errors.append(repr(e))

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * TIMEOUT)
        assert errors == []
        assert sorted(handled) == sorted(f"r{i}" for i in range(12))
    finally:
        tx.close()
        server.stop()
