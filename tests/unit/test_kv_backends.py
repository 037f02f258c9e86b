"""The transport backends end to end: engine-shaped KV chunks from a sender, through a real channel,
into a KVReceiver on the decode side (different block sizes on the two sides)."""
from __future__ import annotations

import ast
import dataclasses
import multiprocessing
import pathlib
import threading
import time

import pytest
import torch

from kvtransfer import ChunkHeader, KVLayout, LayoutMismatch, TransferState
from kvtransfer.backends import BACKENDS, connect, create_shared_kv_cache, remove_shared_kv_cache, serve
from kvtransfer.backends.shm_backend import format_address, map_shared_kv_cache, parse_address
from kvtransfer.receiver import KVReceiver
from kvtransfer.reshard import read_chunk
from kvtransfer.transport import Destination

LAYOUT_KW = dict(dtype="float32", num_layers=3, num_kv_heads=2, head_dim=8)
SRC_BLOCK_SIZE, DST_BLOCK_SIZE = 4, 16
NUM_TOKENS = 37
SRC_BLOCK_IDS = [11, 3, 7, 0, 9, 10, 2, 4, 6, 1]       # 10 blocks of 4 >= 37 tokens
TOKEN_RANGES = [(0, 20), (20, 37)]
TIMEOUT = 5.0                                          # every connect/flush/wait in this file
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


def push_request(tx, request_id: str, seed: int, dest: Destination, model: str = "m") -> list[ChunkHeader]:
    """What a prefill worker does: layer by layer, two token ranges each, then the commit."""
    layout, src = src_layout(model), source_cache(seed)
    sent = []
    for layer in range(LAYOUT_KW["num_layers"]):
        for start, end in TOKEN_RANGES:
            header, data = read_chunk(src[layer], layout, request_id, layer, SRC_BLOCK_IDS, start, end)
            tx.send(header, data, dest)
            sent.append(header)
    commit = ChunkHeader(request_id, layout.fingerprint, kind="commit", first_token=seed)
    tx.send(commit, None, dest)
    return sent + [commit]


def sender_process(backend: str, address: str, request_id: str, seed: int, dest: Destination) -> None:
    """The body of a spawned prefill process."""
    tx = connect(backend, address, timeout=TIMEOUT)
    try:
        push_request(tx, request_id, seed, dest)
        tx.flush(TIMEOUT)
    finally:
        tx.close()


class DecodeSide:
    """A decode rank: a shared KV pool, one KVReceiver per reserved request, a server feeding them."""

    def __init__(self, backend: str, num_blocks: int = 8):
        self.backend = backend
        self.layout = KVLayout("m", **LAYOUT_KW, block_size=DST_BLOCK_SIZE)
        self.cache, self.path = create_shared_kv_cache((3, 2, num_blocks, DST_BLOCK_SIZE, 2, 8), torch.float32)
        self.receivers: dict[str, KVReceiver] = {}
        self.frames: list[ChunkHeader] = []
        opts = dict(kv_cache=self.cache, kv_path=self.path) if backend == "shm" else {}
        if backend == "torch":
            opts["timeout"] = TIMEOUT
        self.server = serve(backend, self.on_frame, **opts)

    def reserve(self, request_id: str, block_ids: list[int]) -> Destination:
        self.receivers[request_id] = KVReceiver(request_id, self.cache, self.layout, block_ids, 0, NUM_TOKENS)
        return Destination(block_ids, self.layout)

    def on_frame(self, header: ChunkHeader, payload) -> None:
        self.frames.append(header)
        self.receivers[header.request_id].on_frame(header, payload)   # KeyError: not reserved here

    def wait_finished(self, request_id: str) -> KVReceiver:
        rx = self.receivers[request_id]
        deadline = time.monotonic() + TIMEOUT
        while rx.state not in (TransferState.DONE, TransferState.FAILED) and time.monotonic() < deadline:
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
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not left, f"threads left behind: {sorted(t.name for t in left)}"


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
        2 * (h.end - h.start) * 2 * 8 * 4 for h in sent if h.kind == "kv")


def test_sender_in_another_process(decode):
    dest = decode.reserve("r-proc", [7, 0, 2])
    proc = multiprocessing.get_context("spawn").Process(
        target=sender_process, args=(decode.backend, decode.server.address, "r-proc", 2, dest))
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert proc.exitcode == 0
    decode.assert_received("r-proc", seed=2)


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

    threads = [threading.Thread(target=prefill, args=(rid, seed)) for rid, seed in (("a", 3), ("b", 4))]
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
    if decode.backend != "shm":   # (shm maps the pool, which is still there; its control channel is not)
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
        if decode.backend == "shm":   # the sender writes in place, so it refuses (and aborts the request)
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
    with pytest.raises(ValueError, match=r"backend 'rdma' is not one of \('grpc', 'shm', 'torch'\)"):
        serve("rdma", lambda header, payload: None)
    with pytest.raises(ValueError, match="backend"):
        connect("ucx", "127.0.0.1:1")


def test_shared_kv_cache_is_zeroed_mapped_and_addressable():
    cache, path = create_shared_kv_cache((2, 2, 3, 4, 1, 8), torch.bfloat16, name=f"pdserve-test-{time.time_ns()}")
    try:
        assert cache.shape == (2, 2, 3, 4, 1, 8) and not cache.any()
        address = format_address(path, cache.shape, cache.dtype, "127.0.0.1:1")
        assert parse_address(address) == (path, tuple(cache.shape), torch.bfloat16, "127.0.0.1:1")
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
    forbidden = {"engine", "prefill_worker", "decode_worker", "router", "deploy"}
    for path in (REPO / "kvtransfer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] not in forbidden, f"{path} imports {name}"
