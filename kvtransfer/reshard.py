"""Reading KV out of one paged cache and writing it into another, across block sizes and TP splits.

Data moves per token (each side maps token t to its own block_ids[t // block_size]) and per
global kv-head range, so prefill with tp=3 can fill decode with tp=1 and the other way round:
every receiving rank takes the intersection of the chunk's heads with its own.
"""

from __future__ import annotations

import math
import warnings

import torch

from pdserve.kvtransfer.layout import KVLayout, LayoutMismatch
from pdserve.kvtransfer.wire import ChunkHeader


def view_bytes(payload, dtype: torch.dtype) -> torch.Tensor:
    # received frames are read-only buffers; we only read them, so a zero-copy view is safe and
    # torch's "not writable" warning is noise here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def slots(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    t = torch.arange(start, end)
    return torch.tensor(block_ids, dtype=torch.long)[t // block_size] * block_size + t % block_size


def read_chunk(
    layer_kv: torch.Tensor,
    layout: KVLayout,
    request_id: str,
    layer: int,
    block_ids: list[int],
    start: int,
    end: int,
    traceparent: str = "",
) -> tuple[ChunkHeader, torch.Tensor]:
    """This rank's heads of tokens [start, end): header + contiguous [2, n, heads, head_dim].
    traceparent: the sender's trace context for the header ("" when the request is not traced).

    layer_kv: [2, num_blocks, block_size, heads_per_rank, head_dim] (block_size the layout's).
    Whole blocks are gathered (one row of block_size tokens each) and the partial ends trimmed:
    this runs between two layers of a prefill, on the thread the next layer waits for, and a
    per-token gather made it an order of magnitude slower."""
    bs, heads, head_dim = layout.block_size, layout.heads_per_rank, layout.head_dim
    if end > start:
        first, last = start // bs, (end - 1) // bs
        ids = torch.tensor(block_ids[first : last + 1], dtype=torch.long, device=layer_kv.device)
        rows = layer_kv.view(2, -1, bs, heads, head_dim).index_select(1, ids)
        data = rows.view(2, -1, heads, head_dim)[:, start - first * bs : end - first * bs]
        if not data.is_contiguous():  # a partial first or last block
            data = data.contiguous()
    else:
        data = layer_kv.new_empty((2, 0, heads, head_dim))
    return chunk_header(layout, request_id, layer, start, end, layer_kv.dtype, traceparent), data


def chunk_header(
    layout: KVLayout,
    request_id: str,
    layer: int,
    start: int,
    end: int,
    dtype: torch.dtype,
    traceparent: str = "",
) -> ChunkHeader:
    """The "kv" header of this rank's heads of tokens [start, end) of one layer (what read_chunk
    sends with the data, and what a transport that reads the pool itself sends alone)."""
    h0, h1 = layout.head_range
    return ChunkHeader(
        request_id,
        layout.fingerprint,
        layer,
        start,
        end,
        h0,
        h1,
        layout.head_dim,
        dtype_name(dtype),
        traceparent=traceparent,
    )


def check_chunk(layout: KVLayout, header: ChunkHeader, cache_dtype: torch.dtype) -> None:
    """A "kv" header's fields against this rank's layout and cache, before any byte is written
    (a stranger's header names the blocks we write into)."""
    layout.check_compatible(header.fingerprint, "sender")
    if header.dtype != dtype_name(cache_dtype):
        raise LayoutMismatch(f"chunk dtype {header.dtype} != cache dtype {dtype_name(cache_dtype)}")
    if header.head_dim != layout.head_dim:
        raise LayoutMismatch(f"chunk head_dim {header.head_dim} != this layout's {layout.head_dim}")
    if not 0 <= header.layer < layout.num_layers:
        raise ValueError(f"chunk layer {header.layer} outside [0, {layout.num_layers})")
    if not 0 <= header.head_start < header.head_end <= layout.num_kv_heads:
        raise ValueError(
            f"chunk kv heads [{header.head_start}, {header.head_end}) are not a "
            f"non-empty range of the model's {layout.num_kv_heads}"
        )


def write_chunk(
    kv_cache: torch.Tensor, layout: KVLayout, block_ids: list[int], header: ChunkHeader, payload
) -> int:
    """Write the part of a chunk this rank holds into its blocks; returns the tokens written.

    kv_cache: [num_layers, 2, num_blocks, block_size, heads_per_rank, head_dim] of this rank.
    payload: a tensor or a bytes-like object in the header's dtype and shape; anything else in
    size or dtype is refused (ValueError), never written or counted.
    """
    check_chunk(layout, header, kv_cache.dtype)
    if (
        header.end > len(block_ids) * layout.block_size
        or header.start < 0
        or header.end < header.start
    ):
        raise ValueError(
            f"chunk tokens [{header.start}, {header.end}) do not fit the "
            f"{len(block_ids)} reserved blocks of {layout.block_size} tokens"
        )
    expected = math.prod(header.shape)
    if isinstance(payload, torch.Tensor):
        if payload.dtype != kv_cache.dtype:
            raise ValueError(
                f"chunk payload is {dtype_name(payload.dtype)}, header says {header.dtype}"
            )
        data = payload
    else:
        nbytes, need = memoryview(payload).nbytes, expected * kv_cache.element_size()
        if nbytes != need:
            raise ValueError(
                f"chunk payload has {nbytes} bytes, header says shape {header.shape} "
                f"in {header.dtype}: {need} bytes"
            )
        data = view_bytes(payload, kv_cache.dtype) if nbytes else kv_cache.new_empty(0)
    if data.numel() != expected:
        raise ValueError(f"chunk payload has {data.numel()} values, header says {header.shape}")
    data = data.view(header.shape)
    d0, d1 = layout.head_range
    lo, hi = max(d0, header.head_start), min(d1, header.head_end)
    if lo >= hi or header.end == header.start:
        return 0
    # A CPU payload bound for a CUDA cache: .to() is a blocking host-to-device copy, so the
    # frame's buffer may be released as soon as it returns; the scatter below is queued on the
    # current stream, before any kernel that later reads these blocks on it.
    part = data[:, :, lo - header.head_start : hi - header.head_start].to(kv_cache.device)
    flat = kv_cache[header.layer].view(2, -1, layout.heads_per_rank, layout.head_dim)
    idx = slots(block_ids, layout.block_size, header.start, header.end).to(kv_cache.device)
    flat[:, idx, lo - d0 : hi - d0] = part
    return header.end - header.start
