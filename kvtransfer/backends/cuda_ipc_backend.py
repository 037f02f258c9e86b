"""CUDA IPC backend (one GPU, two processes): the sender writes KV straight into the receiver's
CUDA KV pool, device to device.

A decode rank whose paged KV cache is on a GPU exports that cache's storage once (torch's CUDA
IPC handle of it, `export_pool`) and serves it with CudaIpcServer until the worker stops; the
address carries the handle as plain, checked fields (never a pickle), with the decode host's boot
id, the GPU's UUID, the decode process id, the pool's shape and dtype and a gRPC control channel:

    cuda_ipc://BOOT-ID/?gpu=GPU-UUID&pid=123&dev=0&handle=HEX&size=...&offset=0&rc=HEX&rco=0
        &ev=HEX&evsync=1&shape=30,2,512,16,3,64&dtype=bfloat16&control=127.0.0.1:40123

A sender on the same host and GPU (CudaIpcTransport) opens the handle once, writes each "kv"
chunk into the reserved blocks on the GPU, and waits for those copies to finish before any
header, commit or abort leaves on the control channel, so the KV is in place before the commit is
seen. A sender elsewhere is refused at `connect` (ConnectionError) and its caller falls back to the
host path (grpc or shm, kvtransfer/choose.py). The handle is dropped when the decode process is
gone, the transport closed, or a copy failed.
"""

from __future__ import annotations

import math
import os
import re
import threading
from urllib.parse import parse_qs, urlencode

import torch

from pdserve.kvtransfer.backends.grpc_backend import GrpcTransport
from pdserve.kvtransfer.backends.shm_backend import ShmControlServer, _boot_id
from pdserve.kvtransfer.reshard import dtype_name, write_chunk
from pdserve.kvtransfer.transport import Destination, FrameHandler, Transport, TransportServer
from pdserve.kvtransfer.wire import ChunkHeader
from pdserve.protos.limits import MAX_ADDRESS_CHARS
from pdserve.protos.security import INSECURE, ClusterSecurity

SCHEME = "cuda_ipc"
MAX_HANDLE_BYTES = 256  # a CUDA IPC handle is 64 bytes; torch prefixes a few of its own
MAX_POOL_BYTES = 1 << 42  # 4 TiB: more than any one GPU holds
MAX_DIMS = 8
MAX_DEVICE = 1023
MAX_PID = 1 << 22  # Linux's pid_max limit
_UUID = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_HOST = re.compile(r"^[A-Za-z0-9-]{0,64}$")
# the KV dtypes an address may name (reshard.dtype_name's spelling), those this torch has
_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "uint8")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_FIELDS = ("gpu", "pid", "dev", "handle", "size", "offset", "rc", "rco", "ev", "evsync")


# ---- the CUDA calls (tests substitute these) ------------------------------------------------
def gpu_uuid(device: int) -> str:
    """The UUID of this process's CUDA device `device` ("" when it cannot be read)."""
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except Exception:
        return ""


def local_gpus() -> dict[str, int]:
    """UUID -> device index of each GPU this process sees."""
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return {}
    return {u: i for i in range(count) if (u := gpu_uuid(i))}


def share_storage(kv_cache: torch.Tensor) -> tuple:
    """torch's IPC fields of the cache's storage: (device, handle, size, offset, ref counter
    handle, ref counter offset, event handle, event sync required)."""
    return kv_cache.untyped_storage()._share_cuda_()


def open_pool(fields: dict, device: torch.device) -> torch.Tensor:
    """Open the storage another process exported (share_storage's fields, checked) on `device`,
    as a tensor of the pool's shape and dtype."""
    torch.cuda._lazy_init()
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index,
            fields["handle"],
            fields["size"],
            fields["offset"],
            fields["rc"],
            fields["rco"],
            fields["ev"],
            fields["evsync"],
        )
        return as_pool(storage, fields)


def as_pool(storage: torch.UntypedStorage, fields: dict) -> torch.Tensor:
    """`storage` (the opened pool) as a contiguous tensor of the address's shape and dtype, once
    its size is the address's."""
    if storage.nbytes() != fields["size"]:
        raise ValueError(f"{storage.nbytes()} bytes, the address says {fields['size']}")
    shape = fields["shape"]
    stride = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    cache = torch.empty(0, dtype=fields["dtype"], device=storage.device)
    return cache.set_(storage, 0, shape, stride)


def synchronize(device: torch.device) -> None:
    """Wait for every copy queued on `device` by this process."""
    torch.cuda.synchronize(device)


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists and is visible from here."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- the address ----------------------------------------------------------------------------
def export_pool(kv_cache: torch.Tensor) -> dict:
    """The plain fields that let another process on this GPU open `kv_cache` (the whole
    contiguous CUDA storage of it); ValueError when it is not such a tensor."""
    if kv_cache.device.type != "cuda" or not kv_cache.is_contiguous():
        raise ValueError("the cuda_ipc backend needs a contiguous CUDA KV cache")
    nbytes = kv_cache.numel() * kv_cache.element_size()
    if kv_cache.storage_offset() != 0 or kv_cache.untyped_storage().nbytes() != nbytes:
        raise ValueError("the cuda_ipc KV cache must be the whole of its storage")
    dev, handle, size, offset, rc, rco, ev, evsync = share_storage(kv_cache)
    index = kv_cache.device.index or 0
    return {
        "gpu": gpu_uuid(index),
        "pid": os.getpid(),
        "dev": int(dev),
        "handle": bytes(handle).hex(),
        "size": int(size),
        "offset": int(offset),
        "rc": bytes(rc or b"").hex(),
        "rco": int(rco),
        "ev": bytes(ev or b"").hex(),
        "evsync": int(bool(evsync)),
    }


def format_address(fields: dict, shape, dtype: torch.dtype, control: str) -> str:
    query = {k: fields[k] for k in _FIELDS}
    query.update(
        shape=",".join(str(int(n)) for n in shape), dtype=dtype_name(dtype), control=control
    )
    return f"{SCHEME}://{_boot_id()}/?{urlencode(query)}"


def _int(query: dict, key: str, low: int, high: int) -> int:
    value = int(query[key][0])
    if not low <= value <= high:
        raise ValueError(f"{key}={value} outside [{low}, {high}]")
    return value


def _hex(query: dict, key: str, required: bool) -> bytes:
    text = query.get(key, [""])[0]
    if len(text) > 2 * MAX_HANDLE_BYTES or (required and not text):
        raise ValueError(f"{key}: a handle of 1 to {MAX_HANDLE_BYTES} bytes")
    return bytes.fromhex(text)


def parse_address(address: str) -> dict:
    """-> the address's fields, each checked for type and range: host, gpu, pid, dev, handle,
    size, offset, rc, rco, ev, evsync, shape, dtype, control. ValueError names what is wrong."""
    # urlsplit takes no "_" in a scheme, so the address is split here
    scheme, _, rest = address.partition("://")
    host, _, query_text = rest.partition("/?")
    query = parse_qs(query_text, keep_blank_values=True)
    try:
        if scheme != SCHEME or not _HOST.match(host):
            raise ValueError(f"scheme {scheme!r} or host {host!r}")
        if any(len(v) != 1 for v in query.values()):
            raise ValueError("a field given twice")
        gpu = query["gpu"][0]
        if not _UUID.match(gpu):
            raise ValueError(f"gpu {gpu!r}")
        shape = tuple(int(n) for n in query["shape"][0].split(","))
        if not 1 <= len(shape) <= MAX_DIMS or min(shape) < 1:
            raise ValueError(f"shape {shape}")
        dtype = _DTYPES.get(query["dtype"][0])
        if dtype is None:
            raise ValueError(f"dtype {query['dtype'][0]!r}")
        size = _int(query, "size", 1, MAX_POOL_BYTES)
        if math.prod(shape) * dtype.itemsize != size:
            raise ValueError(f"size {size} is not the pool's {shape} x {dtype}")
        control = query["control"][0]
        if not control:
            raise ValueError("no control address")
        return {
            "host": host,
            "gpu": gpu,
            "pid": _int(query, "pid", 1, MAX_PID),
            "dev": _int(query, "dev", 0, MAX_DEVICE),
            "handle": _hex(query, "handle", True),
            "size": size,
            "offset": _int(query, "offset", 0, MAX_POOL_BYTES),
            "rc": _hex(query, "rc", False),
            "rco": _int(query, "rco", 0, MAX_POOL_BYTES),
            "ev": _hex(query, "ev", False),
            "evsync": bool(_int(query, "evsync", 0, 1)),
            "shape": shape,
            "dtype": dtype,
            "control": control,
        }
    except (KeyError, ValueError, IndexError, TypeError) as e:
        raise ValueError(f"{address[:200]!r} is not a cuda_ipc KV address ({e})") from None


def locality(address: str) -> str:
    """ "BOOT-ID:GPU-UUID" of the pool at `address`, as a sender compares it with its own."""
    fields = parse_address(address)
    return f"{fields['host']}:{fields['gpu']}"


def why_not_here(fields: dict) -> str | None:
    """Why this process cannot write into the pool of `fields` (parse_address's); None if it can:
    the same host, the decode process visible and not this one, the same GPU visible."""
    if not fields["host"] or fields["host"] != _boot_id():
        return "the decode worker runs on another host"
    if fields["pid"] == os.getpid():
        return "the decode worker is this process (CUDA IPC opens another process's memory)"
    if not process_alive(fields["pid"]):
        return f"the decode process {fields['pid']} is not visible from here"
    if fields["gpu"] not in local_gpus():
        return f"GPU {fields['gpu']} is not one this process sees"
    return None


class CudaIpcServer(TransportServer):
    """Receiver side: `kv_cache` is the decode rank's CUDA KV pool; frames arrive on a gRPC
    control channel (options pass through to GrpcServer), in-place ones included."""

    def __init__(
        self,
        handler: FrameHandler,
        kv_cache: torch.Tensor,
        *,
        security: ClusterSecurity = INSECURE,
        **grpc_opts,
    ):
        if kv_cache is None:
            raise ValueError("the cuda_ipc backend needs kv_cache (the CUDA KV pool)")
        fields = export_pool(kv_cache)
        self.kv_cache = kv_cache  # the exported storage must outlive the server
        self._control = ShmControlServer(handler, security=security, **grpc_opts)
        self.address = format_address(fields, kv_cache.shape, kv_cache.dtype, self._control.address)
        if len(self.address) > MAX_ADDRESS_CHARS:  # a sender would refuse the offer
            self._control.stop()
            raise ValueError(f"the cuda_ipc address has over {MAX_ADDRESS_CHARS} characters")

    @property
    def num_channels(self) -> int:
        return self._control.num_channels

    def stop(self) -> None:
        self._control.stop()


class CudaIpcTransport(Transport):
    """Sender side: writes each "kv" chunk into the receiver's pool on the GPU; its header waits
    (with_in_place) and goes on the control channel with the next commit or abort, or at flush,
    after a synchronize that makes every copy queued so far complete. ConnectionError at once
    when this process cannot reach the pool (why_not_here) or the handle does not open."""

    carries_payload_frames = False

    def __init__(
        self,
        address: str,
        max_pending_headers: int = 64,
        *,
        security: ClusterSecurity = INSECURE,
        **grpc_opts,
    ):
        fields = parse_address(address)
        why = why_not_here(fields)
        if why is not None:
            raise ConnectionError(f"cuda_ipc: {why}; use the host path")
        self._pid, self._gone = fields["pid"], None
        self._device = torch.device("cuda", local_gpus()[fields["gpu"]])
        self._cache = self._open(fields)
        self._max_pending = max(1, max_pending_headers)
        self._pending: list[ChunkHeader] = []
        self._dirty = False  # copies queued since the last synchronize
        self._lock = threading.Lock()
        try:
            self._control = GrpcTransport(fields["control"], security=security, **grpc_opts)
        except BaseException:
            self._cache = None
            raise

    def _open(self, fields: dict) -> torch.Tensor:
        """The receiver's pool, opened once, as a tensor of its shape and dtype on this GPU."""
        try:
            return open_pool(fields, self._device)
        except Exception as e:
            raise ConnectionError(f"cuda_ipc: the pool's handle does not open ({e})") from None

    def _send_control(self, headers: list[ChunkHeader]) -> None:
        """Send `headers` after the copies queued so far are complete (caller holds the lock)."""
        if self._dirty:
            synchronize(self._device)
            self._dirty = False
        self._control.send_headers(headers)

    def _check_open(self) -> torch.Tensor:
        cache = self._cache
        if cache is None:
            raise ConnectionError(self._gone) if self._gone else RuntimeError("closed transport")
        if not process_alive(self._pid):
            self._drop(f"the decode process {self._pid} is gone")
            raise ConnectionError(self._gone)
        return cache

    def _drop(self, why: str) -> None:
        self._gone = f"the receiver's KV pool is gone ({why}): open a fresh transport"
        self._cache = None

    def send(self, header: ChunkHeader, data: torch.Tensor | None, dest: Destination) -> None:
        cache = self._check_open()
        if header.kind != "kv":
            if data is not None and data.numel():
                raise ValueError(
                    f"a {header.kind} frame carries no payload (request {header.request_id})"
                )
            with self._lock:
                self._send_control(self._take_pending() + [header])
            return
        if data is None:
            raise ValueError(f"a kv frame for request {header.request_id} needs its data")
        with self._lock:
            try:
                self._dirty = True
                write_chunk(cache, dest.layout, dest.block_ids, header, data)
            except Exception:
                # the receiver must not wait for KV that will never land
                abort = ChunkHeader(header.request_id, header.fingerprint, kind="abort")
                self._send_control(self._take_pending() + [abort])
                raise
            self._pending.append(ChunkHeader(**{**vars(header), "in_place": True}))
            if len(self._pending) >= self._max_pending:
                self._send_control(self._take_pending())

    def _take_pending(self) -> list[ChunkHeader]:
        pending, self._pending = self._pending, []
        return pending

    def flush(self, timeout: float) -> None:
        self._check_open()
        with self._lock:
            self._send_control(self._take_pending())
        self._control.flush(timeout)

    def close(self) -> None:
        with self._lock:
            if self._cache is not None:
                try:
                    self._send_control(self._take_pending())
                except Exception:  # the receiver is gone; nothing left to tell it
                    pass
            self._cache = None
        self._control.close()
