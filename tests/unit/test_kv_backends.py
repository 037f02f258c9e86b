"""The transport backends' parts that need no channel: backend names, the shared KV pool file and
its shm address, the wire format's framing (a fast header encoding, header-only frames sharing one
message) and the shm sender's paged writer; and kvtransfer imports no engine. KV chunks through a
real channel of each backend: tests/integration/test_kv_backends_channels.py."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import pathlib
import time

import pytest
import torch

from helpers.kv import SRC_BLOCK_IDS, source_cache, src_layout
from pdserve.kvtransfer import ChunkHeader, KVLayout, LayoutMismatch
from pdserve.kvtransfer.backends import (
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
from pdserve.kvtransfer.reshard import read_chunk, write_chunk
from pdserve.kvtransfer.wire import encode_frame

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_unknown_backend_names_the_field():
    with pytest.raises(
        ValueError,
        match=r"backend 'rdma' is not one of \('grpc', 'shm', 'torch', 'nixl', 'cuda_ipc'\)",
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


def test_fast_header_encoding_is_the_wire_format():
    layout = src_layout()
    header, data = read_chunk(source_cache(1)[2], layout, "r-é", 2, SRC_BLOCK_IDS, 3, 17)
    payload = data.numpy().tobytes()
    for h, p in [
        (header, payload),
        (ChunkHeader("r", "fp", kind="commit", first_tokens=(42,)), b""),
        (dataclasses.replace(header, in_place=True), b""),
    ]:
        assert b"".join(bytes(x) for x in frame_pieces(h, p)) == b"".join(
            bytes(x) for x in encode_frame(h, p)
        )


def test_header_only_frames_share_a_message_and_split_back():
    layout = src_layout()
    kv, data = read_chunk(source_cache(1)[0], layout, "a", 0, SRC_BLOCK_IDS, 0, 5)
    commit = ChunkHeader("a", layout.fingerprint, kind="commit", first_tokens=(3,))
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
