"""The KV transfer benchmark's --device and --dtype options and the data path they exercise: the
host copy a transport makes of a chunk (a CPU tensor as before, a CUDA tensor through pinned
memory), the check that the decode pool holds the sent KV byte for byte, and the command line's
defaults and refusals. The CUDA tests run only where torch sees a GPU; the benchmark's own
two-process runs (`python -m benchmarks.transfer.kv_transfer --quick`) are not run here: the fast
lane starts no process."""

from __future__ import annotations

import pytest
import torch

from benchmarks.transfer import kv_transfer as bench
from benchmarks.transfer.kv_transfer import (
    DTYPES,
    POOL_SLOTS,
    DeviceCopy,
    check_pool,
    make_layout,
    pool_shape,
    slot_block_ids,
    source_chunks,
    token_bytes,
)
from pdserve.kvtransfer.backends.frames import host_copy, payload_view
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.state import TransferState
from pdserve.kvtransfer.wire import ChunkHeader

TOKENS = 40  # two and a half blocks: read_chunk trims a partial last block


def deliver(cache: torch.Tensor, chunks: list, dtype: str, requests: int, as_bytes: bool) -> None:
    """What a decode worker does with `requests` requests' frames: a KVReceiver per request writes
    each chunk into the request's pool slot. as_bytes: the payload as the grpc backend hands it
    over (payload_view's bytes), else as the torch backend does (a CPU tensor, host_copy)."""
    blocks_per_request, _ = pool_shape(TOKENS)
    for i in range(requests):
        rid = f"r{i}"
        rx = KVReceiver(
            rid,
            cache,
            make_layout(dtype),
            slot_block_ids(i % POOL_SLOTS, blocks_per_request),
            0,
            TOKENS,
        )
        for header, data in chunks:
            payload = bytes(payload_view(data)) if as_bytes else host_copy(data)
            rx.on_frame(ChunkHeader(**{**vars(header), "request_id": rid}), payload)
        commit = ChunkHeader(rid, make_layout(dtype).fingerprint, kind="commit", first_tokens=(1,))
        assert rx.on_frame(commit, None) == TransferState.DONE, rx.error


def test_host_copy_of_a_cpu_tensor_is_the_tensor_or_its_contiguous_copy():
    t = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    assert host_copy(t).data_ptr() == t.data_ptr()  # no copy, as before
    strided = t.transpose(0, 2)
    copied = host_copy(strided)
    assert copied.is_contiguous() and torch.equal(copied, strided)
    bf16 = torch.randn(5, 3, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert bytes(payload_view(bf16)) == bf16.view(torch.uint8).numpy().tobytes()
    assert payload_view(None) == b"" and payload_view(torch.empty(0)) == b""


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("as_bytes", [True, False], ids=["grpc-bytes", "torch-tensor"])
def test_the_pool_check_passes_on_the_sent_kv_and_names_a_difference(dtype, as_bytes):
    chunks = source_chunks(TOKENS, dtype, "cpu")
    assert all(d.dtype == getattr(torch, dtype) for _, d in chunks)
    _, shape = pool_shape(TOKENS)
    cache = torch.zeros(shape, dtype=getattr(torch, dtype))
    assert "bytes differ" in check_pool(cache, chunks, TOKENS, 1, dtype)  # nothing arrived
    deliver(cache, chunks, dtype, POOL_SLOTS + 1, as_bytes)
    assert check_pool(cache, chunks, TOKENS, POOL_SLOTS + 1, dtype) is None
    cache[7, 1].view(-1)[slot_block_ids(2, pool_shape(TOKENS)[0])[0] * 16 * 3 * 64] += 1
    why = check_pool(cache, chunks, TOKENS, POOL_SLOTS + 1, dtype)
    assert why is not None and why.startswith("pool slot 2") and "layer 7" in why


def test_the_same_seed_gives_both_sides_the_same_kv_whatever_the_dtype():
    f32 = source_chunks(TOKENS, "float32", "cpu")
    again = source_chunks(TOKENS, "float32", "cpu")
    bf16 = source_chunks(TOKENS, "bfloat16", "cpu")
    for (_, a), (_, b), (_, c) in zip(f32, again, bf16):
        assert torch.equal(a, b) and torch.equal(a.to(torch.bfloat16), c)
    assert token_bytes("float32") == 46080 and token_bytes("bfloat16") == 23040


def test_the_command_line_keeps_cpu_defaults():
    args = bench.parse_args([])
    assert (args.device, args.dtype, args.backends) == ("cpu", "float32", ["grpc", "shm", "torch"])
    assert args.out == bench.DEFAULT_OUT and args.skipped == {}
    assert bench.parse_args(["--quick", "--dtype", "bfloat16"]).requests == 6


def test_cuda_leaves_shm_out_and_refuses_it_by_name(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = bench.parse_args(["--device", "cuda", "--dtype", "bfloat16"])
    assert args.backends == ["grpc", "torch"] and "CUDA cache" in args.skipped["shm"]
    assert args.out == bench.DEFAULT_CUDA_OUT
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda", "--backends", "grpc,shm"])
    assert "--backends shm with --device cuda" in capsys.readouterr().err


def test_cuda_ipc_runs_only_with_cuda_caches(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = bench.parse_args(["--device", "cuda", "--backends", "cuda_ipc,grpc"])
    assert args.backends == ["cuda_ipc", "grpc"]
    assert bench.kv_device("cuda_ipc", {"device": "cuda"}) == "cuda"
    with pytest.raises(SystemExit):
        bench.parse_args(["--backends", "cuda_ipc"])
    assert "run it with --device cuda" in capsys.readouterr().err


def test_cuda_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda"])
    assert "sees no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_chunks_reach_a_cuda_pool_byte_for_byte():
    for dtype in sorted(DTYPES):
        chunks = source_chunks(TOKENS, dtype, "cuda")
        assert all(d.is_cuda for _, d in chunks)
        staged = host_copy(chunks[0][1])
        assert staged.device.type == "cpu" and staged.is_pinned()
        assert torch.equal(staged, chunks[0][1].cpu())
        _, shape = pool_shape(TOKENS)
        cache = torch.zeros(shape, dtype=getattr(torch, dtype), device="cuda")
        for as_bytes in (True, False):
            cache.zero_()
            deliver(cache, chunks, dtype, POOL_SLOTS, as_bytes)
            torch.cuda.synchronize()
            assert check_pool(cache, chunks, TOKENS, POOL_SLOTS, dtype) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_copy_ceiling_measures_and_checks_its_copy():
    d2d = DeviceCopy(8 << 20)
    d2d.connect()
    row = d2d.trial(0, None)
    assert row["gbps"] > 0 and len(row["window_gbps"]) == 5
    d2d.stop()
