"""Shared-memory backend (same host): the sender writes KV straight into the receiver's KV pool.

The decode side allocates its paged KV cache in a shared file (`create_shared_kv_cache`, under
/dev/shm by default). The server's address names that file, its shape and dtype, and a gRPC
control channel:

    shm:///dev/shm/pdserve-kv-...?shape=30,2,512,16,3,64&dtype=float32&control=127.0.0.1:40123

The sender maps the same file. For a "kv" frame it writes the chunk into the mapped cache (what
`write_chunk` does, block by block when it can; the KV is never serialized), then sends the
header alone with `in_place=True` on the control channel, so the receiver's handler gets
payload=None and only records coverage. "commit" and "abort" frames follow on the same ordered
channel, after the writes, so the KV is in place before the commit is seen. Header-only frames
queued together travel in one gRPC message (see grpc_backend).
"""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import uuid
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

import torch

from kvtransfer.backends.grpc_backend import GrpcServer, GrpcTransport
from kvtransfer.layout import KVLayout, LayoutMismatch
from kvtransfer.reshard import dtype_name, write_chunk
from kvtransfer.transport import Destination, FrameHandler, Transport, TransportServer
from kvtransfer.wire import ChunkHeader

SCHEME = "shm"


def _default_directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def create_shared_kv_cache(shape, dtype: torch.dtype = torch.float32, name: str | None = None,
                           directory: str | None = None) -> tuple[torch.Tensor, str]:
    """A zero-filled tensor backed by a shared file that another process can map; returns (tensor, path).

    The file outlives the tensor: call `remove_shared_kv_cache(path)` when the cache is retired
    (the mapping stays valid after the unlink, for as long as the tensor lives).
    """
    shape = tuple(int(n) for n in shape)
    numel = math.prod(shape)
    if numel <= 0:
        raise ValueError(f"a shared KV cache needs a non-empty shape, got {shape}")
    path = os.path.join(directory or _default_directory(), name or f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, nbytes)     # a fresh (truncated) file reads as zeros
    finally:
        os.close(fd)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape), path


def remove_shared_kv_cache(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def map_shared_kv_cache(path: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """Map an existing shared KV cache file (the sender's view of the receiver's pool)."""
    shape = tuple(int(n) for n in shape)
    numel = math.prod(shape)
    expected = numel * torch.empty((), dtype=dtype).element_size()
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ConnectionError(f"the shared KV cache {path} cannot be opened: {e} (the shm backend "
                              f"needs both workers on the same host)") from None
    if size != expected:
        raise ValueError(f"the shared KV cache {path} holds {size} bytes, but shape {shape} in "
                         f"{dtype_name(dtype)} needs {expected}")
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


def format_address(path: str, shape, dtype: torch.dtype, control: str) -> str:
    query = urlencode({"shape": ",".join(str(int(n)) for n in shape), "dtype": dtype_name(dtype),
                       "control": control})
    return f"{SCHEME}://{quote(path)}?{query}"


def parse_address(address: str) -> tuple[str, tuple[int, ...], torch.dtype, str]:
    """-> (path, shape, dtype, control address)"""
    parts = urlsplit(address)
    query = parse_qs(parts.query)
    try:
        if parts.scheme != SCHEME:
            raise ValueError(f"scheme {parts.scheme!r}")
        shape = tuple(int(n) for n in query["shape"][0].split(","))
        dtype = getattr(torch, query["dtype"][0], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype {query['dtype'][0]!r}")
        control = query["control"][0]
    except (KeyError, ValueError, IndexError) as e:
        raise ValueError(f"{address!r} is not a shm KV address ({e}); expected "
                         f"shm://PATH?shape=...&dtype=...&control=HOST:PORT") from None
    return unquote(parts.path), shape, dtype, control


def write_in_place(kv_cache: torch.Tensor, layout: KVLayout, block_ids: list[int], header: ChunkHeader,
                   data: torch.Tensor) -> int:
    """`write_chunk`, with a block-granular copy when the chunk holds exactly this rank's heads.

    write_chunk scatters one token (heads x head_dim values) at a time, about a third of memcpy
    speed; here whole blocks move as rows (numpy fancy assignment on bytes, any dtype), which runs
    at memcpy speed. Anything else (a head subset to reshard, a device tensor) goes to write_chunk.
    The checks mirror write_chunk's.
    """
    d0, d1 = layout.head_range
    if not (isinstance(data, torch.Tensor) and data.device.type == "cpu" and kv_cache.device.type == "cpu"
            and kv_cache.is_contiguous() and data.dtype == kv_cache.dtype
            and (header.head_start, header.head_end) == (d0, d1) and header.kind == "kv"):
        return write_chunk(kv_cache, layout, block_ids, header, data)
    layout.check_compatible(header.fingerprint, "sender")
    if header.dtype != dtype_name(kv_cache.dtype):
        raise LayoutMismatch(f"chunk dtype {header.dtype} != cache dtype {dtype_name(kv_cache.dtype)}")
    if not 0 <= header.layer < layout.num_layers:
        raise ValueError(f"chunk layer {header.layer} outside [0, {layout.num_layers})")
    start, end, bs = header.start, header.end, layout.block_size
    if end > len(block_ids) * bs or start < 0 or end < start:
        raise ValueError(f"chunk tokens [{start}, {end}) do not fit the {len(block_ids)} reserved "
                         f"blocks of {bs} tokens")
    if data.numel() != math.prod(header.shape):
        raise ValueError(f"chunk payload has {data.numel()} values, header says {header.shape}")
    if end == start:
        return 0
    # bytes views: tokens [2, n, token_bytes] of the chunk, [2, blocks, block_size, token_bytes] of the cache
    src = data.contiguous().view(torch.uint8).numpy().reshape(2, end - start, -1)
    dst = kv_cache[header.layer].view(torch.uint8).numpy()
    dst = dst.reshape(2, dst.shape[1], bs, -1)
    t = start
    if t % bs:                                   # a partial first block
        n = min(bs - t % bs, end - t)
        dst[:, block_ids[t // bs], t % bs:t % bs + n] = src[:, :n]
        t += n
    num_full = (end - t) // bs
    if num_full:                                 # whole blocks, one row each
        ids = block_ids[t // bs:t // bs + num_full]
        part = src[:, t - start:t - start + num_full * bs].reshape(2, num_full, -1)
        rows = dst.reshape(2, dst.shape[1], -1)
        rows[0, ids] = part[0]
        rows[1, ids] = part[1]
        t += num_full * bs
    if t < end:                                  # a partial last block
        dst[:, block_ids[t // bs], :end - t] = src[:, t - start:]
    return end - start


class ShmServer(TransportServer):
    """Receiver side: the KV pool is `kv_cache` (made by `create_shared_kv_cache`, file `kv_path`);
    frames arrive on a gRPC control channel (options pass through to GrpcServer)."""

    def __init__(self, handler: FrameHandler, kv_cache: torch.Tensor, kv_path: str, **grpc_opts):
        if kv_cache is None or kv_path is None:
            raise ValueError("the shm backend needs kv_cache and kv_path (from create_shared_kv_cache)")
        expected = kv_cache.numel() * kv_cache.element_size()
        if not kv_cache.is_contiguous() or os.path.getsize(kv_path) != expected:
            raise ValueError(f"kv_cache is not the whole contiguous tensor of {kv_path}: map it with "
                             f"create_shared_kv_cache")
        self._control = GrpcServer(handler, **grpc_opts)
        self._address = format_address(kv_path, kv_cache.shape, kv_cache.dtype, self._control.address)

    @property
    def address(self) -> str:
        return self._address

    def stop(self) -> None:
        self._control.stop()


class ShmTransport(Transport):
    """Sender side: writes KV into the mapped pool, headers go on the control channel."""

    def __init__(self, address: str, **grpc_opts):
        path, shape, dtype, control = parse_address(address)
        self._cache = map_shared_kv_cache(path, shape, dtype)
        try:
            self._control = GrpcTransport(control, **grpc_opts)
        except BaseException:
            self._cache = None
            raise

    def send(self, header: ChunkHeader, data: torch.Tensor | None, dest: Destination) -> None:
        if self._cache is None:
            raise RuntimeError("this KV transport is closed")
        if header.kind == "kv":
            if data is None:
                raise ValueError(f"a kv frame for request {header.request_id} needs its data")
            try:
                write_in_place(self._cache, dest.layout, dest.block_ids, header, data)
            except Exception:
                # the receiver must not wait for KV that will never land: fail the request there,
                # and tell the caller why here
                self._control.send(ChunkHeader(header.request_id, header.fingerprint, kind="abort"),
                                   None, dest)
                raise
            header, data = dataclasses.replace(header, in_place=True), None
        self._control.send(header, data, dest)

    def flush(self, timeout: float) -> None:
        self._control.flush(timeout)

    def close(self) -> None:
        self._cache = None      # unmaps once no view of it is left
        self._control.close()
