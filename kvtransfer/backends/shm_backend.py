"""Shared-memory backend (same host): the sender writes KV straight into the receiver's KV pool.

The decode side allocates its paged KV cache in a shared file (`create_shared_kv_cache`, under
/dev/shm by default). The server's address names that file, its shape and dtype, and a gRPC
control channel:

    shm:///dev/shm/pdserve-kv-...?shape=30,2,512,16,3,64&dtype=float32&control=127.0.0.1:40123

The sender maps the same file. For a "kv" frame it runs `write_chunk` into the mapped cache (the
KV is never serialized), then sends the header alone with `in_place=True` on the control channel,
so the receiver's handler gets payload=None and only records coverage. "commit" and "abort"
frames follow on the same ordered channel, after the writes, so the KV is in place before the
commit is seen.
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
                write_chunk(self._cache, dest.layout, dest.block_ids, header, data)
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
