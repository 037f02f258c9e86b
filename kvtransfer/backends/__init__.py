"""Transport backends and the factory the workers use.

    server = serve("grpc", handler)                 # decode rank: frames -> handler(header, payload)
    transport = connect("grpc", server.address)     # prefill rank

    grpc   any two hosts; frames ride one client-streaming RPC per channel
    shm    same host; serve("shm", handler, kv_cache=..., kv_path=...) with the pool made by
           create_shared_kv_cache; the sender writes KV straight into it, headers ride gRPC
    torch  torch.distributed gloo point-to-point in a private group per sender (no default group)
    nixl   one-sided NIXL WRITEs into the decode worker's registered pool; serve("nixl", handler,
           kv_caches=[...]) with every TP rank's pool; needs the `nixl` extra (NIXL installed)
    cuda_ipc  same GPU, two processes; serve("cuda_ipc", handler, kv_cache=...) with the CUDA pool;
           the sender writes KV into it device to device, headers ride gRPC after a synchronize

A deployment's default, `kvtransfer.backend: auto`, is not a backend of its own: a decode worker
serves grpc and shm side by side and each prefill worker picks one per reservation
(kvtransfer/choose.py).

security (protos.security.ClusterSecurity): the deployment's cluster secret; a server built with
one refuses senders without it (grpc, shm: UNAUTHENTICATED before any handler runs; torch: an
HMAC handshake before the gloo group forms), and a transport presents it. INSECURE: no check.
Other options (keyword arguments) go to the backend's server or transport class; see each module.
Worker processes should call tune_malloc() once at start (see its docstring).
"""

from __future__ import annotations

import ctypes
import importlib

from pdserve.kvtransfer.backends.shm_backend import (
    create_shared_kv_cache,
    default_shared_dir,
    populate,
    remove_shared_kv_cache,
)
from pdserve.kvtransfer.transport import FrameHandler, Transport, TransportServer
from pdserve.protos.security import INSECURE, ClusterSecurity

BACKENDS = ("grpc", "shm", "torch", "nixl", "cuda_ipc")


def tune_malloc(mmap_threshold: int = 64 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Make glibc malloc keep frame-sized buffers mapped; call once at a worker's start.

    Every frame allocates a buffer of a layer's KV (half a megabyte for SmolLM2 at a few hundred
    tokens): above glibc's default mmap threshold each one is a fresh mmap, faulted in page by page
    and unmapped when freed. Serving buffers below `mmap_threshold` from the heap, and keeping up to
    `trim_threshold` of freed heap, removes that churn.
    It changes the whole process's allocator, hence opt-in. Returns False where it is not glibc.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, mmap_threshold)) and bool(
        mallopt(m_trim_threshold, trim_threshold)
    )


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(
            f"backend {backend!r} is not one of {BACKENDS}: set backend to one of them"
        )


def _check_security(security) -> None:
    if not isinstance(security, ClusterSecurity):
        raise TypeError(
            f"security must be a protos.security.ClusterSecurity, got {type(security).__name__}"
        )


# backend: (its module, its server class, its transport class); a module is imported when used
_CLASSES = {
    "grpc": ("grpc_backend", "GrpcServer", "GrpcTransport"),
    "shm": ("shm_backend", "ShmServer", "ShmTransport"),
    "torch": ("torch_backend", "TorchServer", "TorchTransport"),
    "nixl": ("nixl_backend", "NixlServer", "NixlTransport"),
    "cuda_ipc": ("cuda_ipc_backend", "CudaIpcServer", "CudaIpcTransport"),
}


def _backend_class(backend: str, security, side: int) -> type:
    """The backend's server (side 1) or transport (side 2) class, once both arguments check."""
    _check(backend)
    _check_security(security)
    module = importlib.import_module(f"{__name__}.{_CLASSES[backend][0]}")
    return getattr(module, _CLASSES[backend][side])


def serve(
    backend: str, handler: FrameHandler, *, security: ClusterSecurity = INSECURE, **opts
) -> TransportServer:
    """Start the receiving side (decode rank); its `address` is what senders pass to `connect`.
    Only senders presenting `security`'s secret get their frames to `handler`."""
    return _backend_class(backend, security, 1)(handler, security=security, **opts)


def connect(
    backend: str, address: str, *, security: ClusterSecurity = INSECURE, **opts
) -> Transport:
    """Open a channel from a sender (prefill rank) to the server at `address`, presenting
    `security`'s secret. ConnectionRefusedError: the server refused it."""
    return _backend_class(backend, security, 2)(address, security=security, **opts)


__all__ = [
    "BACKENDS",
    "serve",
    "connect",
    "create_shared_kv_cache",
    "default_shared_dir",
    "populate",
    "remove_shared_kv_cache",
    "tune_malloc",
]
