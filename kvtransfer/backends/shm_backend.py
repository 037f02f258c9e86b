"""Shared-memory backend (same host): the sender writes KV straight into the receiver's KV pool.

A decode rank allocates its paged KV cache in a shared file (`create_shared_kv_cache`, under
/dev/shm by default) and serves it with ShmServer until the worker stops; the address names that
file, its shape and dtype, and a gRPC control channel:

    shm:///dev/shm/pdserve-kv-...?shape=30,2,512,16,3,64&dtype=float32&control=127.0.0.1:40123

The sender (ShmTransport) maps the same file and writes each "kv" chunk into it, so the KV is
never serialized; only the header travels, on the ordered control channel, followed by "commit"
and "abort" frames, so the KV is in place before the commit is seen. Only this backend's control
server takes such in-place frames. The control channel needs the deployment's cluster secret like
the gRPC backend, and the pool file is mode 0600 (its owner's processes only). A sender unmaps a
receiver's pool once the receiver is gone, or it would hold every dead receiver's pages
(release_gone_pools).

The decode side cannot see a copy into its pool, so a sender claims a reservation before its
first write, as on the nixl backend (kvtransfer/backends/claims.py): the reservation's write
grant (KVEndpoint.write_grant) and its block ids, on the control server, which refuses a
reservation that ended. Every frame then carries the grant, and a reservation that ends while a
claim may still write is held until the sender's commit or abort (a pipelined stage's release),
or its process is proven gone. A sender copies synchronously, so none of its writes is under way
when it sends: it claims again, without waiting for anything, when the claim's write window nears
its end (a prefill longer than the window). A destination without a grant (a receiver that
issues none: `pdserve profile`'s) is written unclaimed; a prefill worker never takes one from a
reservation (prefill_worker/service.py refuses a shm endpoint without its grant).

Addresses reach a prefill worker inside reservations, from the network: a sender there takes an
address only where it names pool files (`pool_file_problem`: KV_FILE_PREFIX files directly in the
shared folder, default_shared_dir(), where every decode worker puts its pool), and `locality` is
"" for any other, so kvtransfer/choose.py never picks it. A claim's reply names the receiver's
pool files (pool_identity), and a sender whose mapped files are others refuses the request
before writing: an address may join one decode worker's pool with another's control server.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import os
import stat
import tempfile
import threading
import time
import uuid
import weakref
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

import numpy as np
import torch

from pdserve.kvpool import KV_FILE_PREFIX, create_pool_file, map_pool_file
from pdserve.kvtransfer.backends.claims import (
    RECLAIM_SHARE,
    ClaimsControl,
    Grants,
    ask_claim_cover,
    tell_released,
)
from pdserve.kvtransfer.backends.grpc_backend import GrpcServer, GrpcTransport
from pdserve.kvtransfer.layout import KVLayout, LayoutMismatch
from pdserve.kvtransfer.reshard import dtype_name, write_chunk
from pdserve.kvtransfer.transport import (
    Destination,
    FrameHandler,
    PipelineStage,
    Transport,
    TransportServer,
)
from pdserve.kvtransfer.wire import ChunkHeader
from pdserve.protos.security import INSECURE, ClusterSecurity

log = logging.getLogger(__name__)

SCHEME = "shm"


def default_shared_dir() -> str:
    """Where shared KV pools go: /dev/shm (memory) when the host has it."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def create_shared_kv_cache(
    shape, dtype: torch.dtype = torch.float32, name: str | None = None, directory: str | None = None
) -> tuple[torch.Tensor, str]:
    """A zero-filled tensor backed by a shared file that another process can map; returns (tensor, path).
    The file is made by kvpool/, the one creator of pool files (the engine's own pools
    included).

    The file outlives the tensor: call `remove_shared_kv_cache(path)` when the cache is retired
    (the mapping stays valid after the unlink, for as long as the tensor lives).
    """
    path = os.path.join(
        directory or default_shared_dir(),
        name or f"{KV_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}",
    )
    return create_pool_file(path, shape, dtype), path


def remove_shared_kv_cache(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclasses.dataclass
class _Claim:
    """A sender's claim of one reservation (claims.py): what it claimed, and until when it may
    start a write."""

    block_ids: tuple[int, ...]
    grant: str
    stage: PipelineStage | None
    window_s: float
    window_end: float  # time.monotonic()
    # the first of block_ids the claim covers: those before it hold the decode side's cached
    # prefix, which other requests may share (claims.py), and no chunk is copied into them
    first_block: int = 0


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (asm-generic/mman-common.h)
# A sender faults a receiver's pool in this many bytes per madvise call (populate_in_background):
# each call holds the process's mmap lock for reading, about 0.5 ms per 2 MiB, and a thread of
# the process that maps or unmaps memory meanwhile (torch allocating a large tensor) waits for it
POPULATE_CHUNK = 2 << 20
# the share of the wall time the background populate spends in madvise: it rests for three
# times as long as each call took, so it takes about a quarter of a core at most
POPULATE_DUTY = 0.25
# how long a sender that lets go of its pools waits for the populate thread to drop them
POPULATE_JOIN_S = 5.0


def populate(
    tensor: torch.Tensor | weakref.ref,
    stop: threading.Event | None = None,
    chunk: int = 0,
    duty: float = 1.0,
) -> bool:
    """Fault every page of a shared KV pool into this process's page tables, writable, without
    touching the contents (madvise MADV_POPULATE_WRITE); False where the kernel cannot, or when
    `stop` was set or the tensor (a weak reference to it) is gone before the end. chunk > 0: that
    many bytes per call, both checked between calls. duty < 1 (with `stop`): after each call,
    wait on `stop` for as long as the call took times (1 / duty - 1).

    Pool files live in tmpfs with 4 KiB pages, and a page is faulted in by each process on its
    first touch: the first writer of a fresh reservation paid for its faults many times over what
    the copy itself costs once mapped. One call faults pages several times cheaper than first
    touches do (a 1 GiB pool: about 0.25 s)."""
    get = tensor if isinstance(tensor, weakref.ref) else (lambda: tensor)
    t = get()
    if t is None or t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page  # madvise wants a page-aligned start
    end = t.data_ptr() + t.numel() * t.element_size()
    step = end - start if chunk <= 0 else max(page, chunk // page * page)
    rest = 1 / duty - 1 if stop is not None and 0 < duty < 1 else 0.0
    del t
    for at in range(start, end, step):
        # held across the call only: the mapping cannot go (nor its addresses be reused) under it
        t = get()
        if t is None or (stop is not None and stop.is_set()):
            return False
        began = time.monotonic()
        done = madvise(at, min(step, end - at), _MADV_POPULATE_WRITE) == 0
        del t
        if not done:
            return False
        if rest and at + step < end and stop.wait((time.monotonic() - began) * rest):
            return False
    return True


def populate_in_background(tensors: list[torch.Tensor], stop: threading.Event) -> threading.Thread:
    """Populate `tensors` (a sender's mappings of a receiver's pools) on a daemon thread,
    POPULATE_CHUNK at a time and resting between calls (POPULATE_DUTY), until done, `stop` is set
    or the tensors are gone. Between its calls the thread holds them by weak reference only: a
    pool released because its receiver is gone (release_gone_pools) is unmapped at once.

    The first hand-off to a receiver used to wait for all of it: 0.25 s of a 1 GiB pool, most of
    the first request's TTFT after `pdserve up` and again after each idle close of the channel.
    Now that hand-off faults in only the pages it writes, and the rest is faulted in beside it.
    The thread keeps the process's priority: it used to run at nice 19, and on a busy machine a
    call preempted at that priority held the mmap lock for seconds (its thread got about 1/70 of
    a core), while the engine thread, wanting the lock to map a tensor, waited without using the
    CPU and the router took the worker for hung (docs/experiments/design-measurements.md).
    Resting between short calls keeps its share of the cores small instead."""
    refs = [weakref.ref(t) for t in tensors]

    def run() -> None:
        for ref in refs:
            if not populate(ref, stop, POPULATE_CHUNK, POPULATE_DUTY):
                return

    thread = threading.Thread(target=run, name="pdserve-shm-populate", daemon=True)
    thread.start()
    return thread


def map_shared_kv_cache(path: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """Map an existing shared KV cache file (the sender's view of the receiver's pool)."""
    try:
        return map_pool_file(path, shape, dtype)
    except OSError as e:
        raise ConnectionError(
            f"the shared KV cache {path} cannot be opened: {e} (the shm backend "
            f"needs both workers on the same host)"
        ) from None


def format_address(paths: str | list[str], shape, dtype: torch.dtype, control: str) -> str:
    """paths: the pool file of each TP rank of the receiver, in rank order (shape is one rank's)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    query = urlencode(
        {
            "shape": ",".join(str(int(n)) for n in shape),
            "dtype": dtype_name(dtype),
            "control": control,
        }
    )
    return (
        f"{SCHEME}://{','.join(quote(p) for p in paths)}?{query}"  # quote() escapes a ',' in a path
    )


def parse_address(address: str) -> tuple[list[str], tuple[int, ...], torch.dtype, str]:
    """-> (pool file per rank, one rank's shape, dtype, control address)"""
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
        paths = [unquote(p) for p in parts.path.split(",")]
        if not all(paths):
            raise ValueError("an empty pool path")
    except (KeyError, ValueError, IndexError) as e:
        raise ValueError(
            f"{address!r} is not a shm KV address ({e}); expected "
            f"shm://PATH[,PATH...]?shape=...&dtype=...&control=HOST:PORT"
        ) from None
    return paths, shape, dtype, control


class PagedWriter:
    """`write_chunk` into one paged cache, block by block where it can.

    write_chunk scatters one token (heads x head_dim values) at a time, about a third of memcpy
    speed. When a chunk holds exactly this rank's heads, whole blocks move as rows instead (numpy
    fancy assignment over bytes, so any dtype), at memcpy speed; the cache's per-layer byte views
    are made once. Anything else (a head subset to reshard, device tensors) goes to write_chunk.
    The checks mirror write_chunk's.
    """

    def __init__(self, kv_cache: torch.Tensor):
        self.kv_cache = kv_cache
        self._fast = kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
        self._dtype = dtype_name(kv_cache.dtype)
        self._rows: dict[
            tuple[int, int], np.ndarray
        ] = {}  # (layer, block_size) -> [2, blocks, bs, token bytes]
        self._layouts: dict[KVLayout, tuple] = {}  # what the checks need, computed once

    def _layer_rows(self, layer: int, block_size: int) -> np.ndarray:
        rows = self._rows.get((layer, block_size))
        if rows is None:
            rows = self.kv_cache[layer].view(torch.uint8).numpy()
            rows = self._rows[(layer, block_size)] = rows.reshape(2, rows.shape[1], block_size, -1)
        return rows

    def write(
        self, layout: KVLayout, block_ids: list[int], header: ChunkHeader, data: torch.Tensor
    ) -> int:
        known = self._layouts.get(layout)
        if known is None:
            known = self._layouts[layout] = (
                layout.fingerprint,
                layout.head_range,
                layout.num_layers,
                layout.block_size,
                layout.head_dim,
            )
        fingerprint, (d0, d1), num_layers, bs, head_dim = known
        if not (
            self._fast
            and isinstance(data, torch.Tensor)
            and data.device.type == "cpu"
            and data.dtype == self.kv_cache.dtype
            and header.head_start == d0
            and header.head_end == d1
        ):
            return write_chunk(self.kv_cache, layout, block_ids, header, data)
        if header.fingerprint != fingerprint:
            layout.check_compatible(header.fingerprint, "sender")
        if header.dtype != self._dtype:
            raise LayoutMismatch(f"chunk dtype {header.dtype} != cache dtype {self._dtype}")
        if header.head_dim != head_dim:
            raise LayoutMismatch(f"chunk head_dim {header.head_dim} != this layout's {head_dim}")
        if not 0 <= header.layer < num_layers:
            raise ValueError(f"chunk layer {header.layer} outside [0, {num_layers})")
        start, end = header.start, header.end
        if end > len(block_ids) * bs or start < 0 or end < start:
            raise ValueError(
                f"chunk tokens [{start}, {end}) do not fit the {len(block_ids)} reserved "
                f"blocks of {bs} tokens"
            )
        if data.numel() != 2 * (end - start) * (d1 - d0) * header.head_dim:
            raise ValueError(f"chunk payload has {data.numel()} values, header says {header.shape}")
        if end == start:
            return 0
        if not data.is_contiguous():
            data = data.contiguous()
        src = data.view(torch.uint8).numpy().reshape(2, end - start, -1)  # [2, tokens, token bytes]
        dst = self._layer_rows(header.layer, bs)
        t = start
        if t % bs:  # a partial first block
            n = min(bs - t % bs, end - t)
            dst[:, block_ids[t // bs], t % bs : t % bs + n] = src[:, :n]
            t += n
        num_full = (end - t) // bs
        if num_full:  # whole blocks, one row each
            rows = dst.reshape(2, dst.shape[1], -1)
            rows[:, block_ids[t // bs : t // bs + num_full]] = src[
                :, t - start : t - start + num_full * bs
            ].reshape(2, num_full, -1)
            t += num_full * bs
        if t < end:  # a partial last block
            dst[:, block_ids[t // bs], : end - t] = src[:, t - start :]
        return end - start


class ShmControlServer(GrpcServer):
    """A gRPC server of headers where in-place frames are valid (their sender wrote the KV into
    the pool) and nobody claims: the cuda_ipc backend's (ShmServer's has the claims)."""

    accepts_in_place = True


class ShmServer(TransportServer):
    """Receiver side: the KV pool is `kv_cache` (made by `create_shared_kv_cache`, file `kv_path`);
    frames arrive on a gRPC control channel (options pass through to GrpcServer), with the write
    claims (claims.py), and reach `handler` only past `grants` (made here when not given: the
    hand-off shares its own, decode_worker/handoff.py).

    A tensor-parallel receiver passes a list: kv_path[r] is rank r's pool file, all shaped like
    kv_cache (rank 0's); the sender then writes each rank's share of the heads into its file.
    """

    def __init__(
        self,
        handler: FrameHandler,
        kv_cache: torch.Tensor,
        kv_path: str | list[str],
        grants: Grants | None = None,
        *,
        security: ClusterSecurity = INSECURE,
        **grpc_opts,
    ):
        if kv_cache is None or not kv_path:
            raise ValueError(
                "the shm backend needs kv_cache and kv_path (from create_shared_kv_cache)"
            )
        paths = [kv_path] if isinstance(kv_path, str) else list(kv_path)
        expected = kv_cache.numel() * kv_cache.element_size()
        if not kv_cache.is_contiguous() or any(os.path.getsize(p) != expected for p in paths):
            raise ValueError(
                f"kv_cache is not the whole contiguous tensor of each of {paths}: map it "
                f"with create_shared_kv_cache"
            )
        self.grants = grants or Grants()
        if self.grants.num_layers is None:  # what pipelined claims are checked against
            self.grants.num_layers = kv_cache.shape[0]
        self._control = ClaimsControl(
            handler, self.grants, pool_identity(paths), security=security, **grpc_opts
        )
        self.address = format_address(paths, kv_cache.shape, kv_cache.dtype, self._control.address)

    @property
    def num_channels(self) -> int:
        return self._control.num_channels

    def stop(self) -> None:
        self._control.stop()


WATCH_S = 2.0  # how often a sender process checks that the pools it maps still exist

_live: weakref.WeakSet = weakref.WeakSet()  # every ShmTransport holding a mapping
_live_lock = threading.Condition()  # notified when a transport leaves _live
_watching = False


def pool_file_problem(path: str) -> str | None:
    """Why a sender must not map `path` as a receiver's pool (None: it may): a pool file is a
    regular file (not a link) named KV_FILE_PREFIX... directly in the shared folder
    (default_shared_dir(): /dev/shm, where decode workers put their pools). A file that does not
    exist is not refused here (mapping it fails)."""
    directory = default_shared_dir()
    name = os.path.basename(path)
    if (
        not os.path.isabs(path)
        or os.path.normpath(path) != path
        or not name.startswith(KV_FILE_PREFIX)
        or os.path.realpath(os.path.dirname(path)) != os.path.realpath(directory)
    ):
        return (
            f"{path[:200]!r} is not a KV pool file: a sender writes only into files named "
            f"{KV_FILE_PREFIX}* directly in {directory}, where decode workers put their pools"
        )
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if not stat.S_ISREG(mode):
        return f"{path[:200]!r} is not a KV pool file: not a regular file (a link, a folder, ...)"
    return None


def address_problem(address: str) -> str | None:
    """Why a sender must not take the shm `address` (None: it may): one that does not parse, or
    names a file that is not a pool file (pool_file_problem)."""
    try:
        paths = parse_address(address)[0]
    except ValueError as e:
        return str(e)
    return next(filter(None, map(pool_file_problem, paths)), None)


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _file_name(file_id: tuple[int, int] | None) -> str:
    """A file's identity across processes: its machine (boot id), device and inode ("" for a
    file that could not be seen)."""
    return f"{_boot_id()}:{file_id[0]}:{file_id[1]}" if file_id is not None else ""


def pool_identity(paths: list[str]) -> list[str]:
    """What names a receiver's pool files in its claims' replies (ClaimsControl), so that a
    sender that maps one receiver's files and claims on another's control server finds them
    apart."""
    return [_file_name(_file_id(p)) for p in paths]


def _boot_id() -> str:
    """This kernel's boot id: the same for every process (and container) on one machine, new at
    each boot ("" where the kernel does not say)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def locality(address: str) -> str:
    """What a sender compares to tell that it can map the pool at `address` (a ShmServer's): the
    machine's boot id and the first pool file's identity. Equal only on the same machine and
    the same shared-memory mount (two containers with /dev/shm each of their own differ); ""
    when the file cannot be seen from here, or the address names a file that is not a pool file
    (address_problem)."""
    if address_problem(address) is not None:
        return ""
    return _file_name(_file_id(parse_address(address)[0][0]))


def release_gone_pools() -> int:
    """Unmap, in every ShmTransport of this process, the pools whose file was unlinked or replaced
    (their receiver is gone); returns how many transports let go. Runs every WATCH_S seconds on a
    daemon thread while any transport maps a pool, and when a transport is made."""
    with _live_lock:
        transports = list(_live)
    released = 0
    for transport in transports:
        why = transport._why_gone()
        if why is not None:
            transport._release(why)
            released += 1
    return released


def _watch() -> None:
    global _watching
    while True:
        with _live_lock:
            _live_lock.wait_for(lambda: not _live, WATCH_S)
            if not _live:  # the last transport closed: the next one starts a watcher again
                _watching = False
                return
        release_gone_pools()


def _track(transport: ShmTransport) -> None:
    """Watch `transport`'s pools; one it replaces (same control address, another pool: its
    receiver restarted) is released now."""
    global _watching
    with _live_lock:
        replaced = [
            t
            for t in _live
            if t._control_address == transport._control_address and t is not transport
        ]
        _live.add(transport)
        if not _watching:
            _watching = True
            threading.Thread(target=_watch, name="pdserve-shm-pools", daemon=True).start()
    for old in replaced:
        if old._paths != transport._paths:
            old._release(f"its receiver at {old._control_address} now serves {transport._paths}")
    release_gone_pools()


def _untrack(transport: ShmTransport) -> None:
    with _live_lock:
        _live.discard(transport)
        _live_lock.notify_all()


class ShmTransport(Transport):
    """Sender side: writes KV into the mapped pool; headers go on the control channel.

    For a "kv" frame it writes the chunk into the mapped cache (what `write_chunk` does, block by
    block when it can), then sends the header alone with `in_place=True`, so the receiver's handler
    gets payload=None and only records coverage (the plain gRPC server refuses such frames: there,
    no bytes would have arrived).

    The in-place headers of a channel wait (at most max_pending_headers of them) and travel with
    the next commit or abort, or at `flush`, in one control message: the KV itself is written at
    `send`, so holding back its bookkeeping delays nothing but the receiver's progress counter,
    and it saves gRPC's per-message cost on every layer.

    The mapping is dropped (`_release`) once the receiver is gone: its pool file unlinked or
    replaced, or its control address serving another pool; the transport's sends then raise
    ConnectionError, so its user opens a fresh one. close() drops it too.

    Claims (the module docstring): a request's first "kv" chunk claims its reservation unless
    `claim` did before, and a chunk sent once less than RECLAIM_SHARE of the window is left claims
    it again; its commit or abort ends the claim. A Destination with a PipelineStage claims as that part of a pipelined
    sender, and `release` ends each step's claim (a later stage's rank: stage_push.py); `close`
    releases those it still holds.
    """

    def __init__(
        self,
        address: str,
        max_pending_headers: int = 64,
        *,
        security: ClusterSecurity = INSECURE,
        **grpc_opts,
    ):
        paths, shape, dtype, control = parse_address(address)
        self._paths, self._control_address, self._gone = paths, control, None
        # each file's identity before it is mapped: a file replaced meanwhile reads as gone, and
        # a claim's reply that names another pool is refused (the address joins two receivers)
        self._file_ids = [_file_id(p) for p in paths]
        self._pool = [_file_name(i) for i in self._file_ids]
        self._caches = [map_shared_kv_cache(p, shape, dtype) for p in paths]
        # this process's first touch of every page, beside the hand-offs, not in front of them
        self._populating = threading.Event()
        self.populate_thread = populate_in_background(list(self._caches), self._populating)
        self._writers = [PagedWriter(c) for c in self._caches]
        self._rank_layouts: dict[KVLayout, list[KVLayout]] = {}
        self._max_pending = max(1, max_pending_headers)
        self._pending: list[ChunkHeader] = []
        self._lock = threading.Lock()
        self._timeout = float(grpc_opts.get("timeout", 10.0))  # a claim's or release's call
        self._agent = f"shm-{os.getpid()}-{uuid.uuid4().hex[:12]}"  # this sender, in its claims
        self._claims: dict[str, _Claim] = {}
        try:
            self._control = GrpcTransport(control, security=security, **grpc_opts)
        except BaseException:
            self._caches = self._writers = None
            self._stop_populate()
            raise
        _track(self)

    def _stop_populate(self) -> None:
        """Stop the populate thread and wait for it to let go of the pools (it holds one across a
        single madvise call: at most POPULATE_CHUNK of work), so the caller's drop of the pools
        unmaps them at once."""
        self._populating.set()
        if self.populate_thread is not threading.current_thread():
            self.populate_thread.join(POPULATE_JOIN_S)

    def _why_gone(self) -> str | None:
        """Why the receiver's pool is gone (a file unlinked or replaced); None while it is there."""
        if self._writers is None:
            return None  # nothing mapped
        for path, file_id in zip(self._paths, self._file_ids):
            now = _file_id(path)
            if now is None or now != file_id:
                return f"{path} was {'unlinked' if now is None else 'replaced'}"
        return None

    def _release(self, why: str) -> None:
        """Unmap the receiver's pool (a send in progress keeps its views until it returns) and
        close the control channel: the receiver is gone."""
        with self._lock:
            if self._writers is None:
                return
            self._gone = f"the receiver's KV pool is gone ({why}): open a fresh transport"
            self._caches = self._writers = None
        self._stop_populate()
        _untrack(self)
        threading.Thread(target=self._control.close, daemon=True).start()

    def send(self, header: ChunkHeader, data: torch.Tensor | None, dest: Destination) -> None:
        writers = self._writers
        if writers is None:
            if self._gone is not None:
                raise ConnectionError(self._gone)
            raise RuntimeError("this KV transport is closed")
        if header.kind in ("state", "draft"):  # (a hybrid's state, an EAGLE head's KV: their
            # payload on the control channel)
            with self._lock:  # (after the in-place KV headers before it; the claim goes on)
                self._control.send_headers(self._take_pending())
                self._control.send(dataclasses.replace(header, grant=dest.grant), data, dest)
            return
        if header.kind != "kv":
            if data is not None and data.numel():
                raise ValueError(
                    f"a {header.kind} frame carries no payload (request {header.request_id})"
                )
            with self._lock:  # the sender's last word: its claim is over
                claim = self._claims.pop(header.request_id, None)
                grant = claim.grant if claim is not None else getattr(dest, "grant", "")
                last = dataclasses.replace(header, grant=grant)
                self._control.send_headers(self._take_pending() + [last])
            return
        if data is None:
            raise ValueError(f"a kv frame for request {header.request_id} needs its data")
        self.claim(header.request_id, dest)
        try:
            self._check_covered(header, dest)
            for writer, layout in zip(writers, self._layouts(dest.layout, len(writers))):
                writer.write(layout, dest.block_ids, header, data)
        except Exception:
            # the receiver must not wait for KV that will never land: fail the request there,
            # and tell the caller why here
            with self._lock:
                self._claims.pop(header.request_id, None)
                abort = ChunkHeader(
                    header.request_id, header.fingerprint, kind="abort", grant=dest.grant
                )
                self._control.send_headers(self._take_pending() + [abort])
            raise
        with self._lock:
            self._pending.append(dataclasses.replace(header, in_place=True, grant=dest.grant))
            if len(self._pending) >= self._max_pending:
                self._control.send_headers(self._take_pending())

    def claim(self, request_id: str, dest: Destination) -> None:
        """Claim the reservation before a write (the class docstring): at the request's first
        chunk, or before it (a prefill worker claims on its call's thread, so that the engine's
        step does not wait for the call), and again when its window nears its end.
        PermissionError: the decode side refused (the reservation ended); ConnectionError: it
        could not be asked. A destination without a grant is not claimed (the module
        docstring)."""
        if not dest.grant:
            return
        with self._lock:
            claim = self._claims.get(request_id)
        now = time.monotonic()
        if claim is not None:
            if (tuple(dest.block_ids), dest.grant, dest.stage) != (
                claim.block_ids,
                claim.grant,
                claim.stage,
            ):
                raise ValueError(f"request {request_id} changed its destination after its claim")
            if now < claim.window_end - claim.window_s * RECLAIM_SHARE:
                return
        window_s, first_block = ask_claim_cover(
            self._control,
            request_id,
            dest.grant,
            dest.block_ids,
            self._agent,
            dest.stage,
            self._timeout,
            pool=self._pool,
        )
        with self._lock:
            # a claim whose window ended writes nothing more without claiming again: one left by
            # a request that never sent its last word (its sender failed it otherwise) goes; a
            # pipelined one ends with its release, which must still reach the decode side
            for rid in [
                r for r, c in self._claims.items() if c.window_end < now and c.stage is None
            ]:
                del self._claims[rid]
            self._claims[request_id] = _Claim(
                tuple(dest.block_ids), dest.grant, dest.stage, window_s, now + window_s, first_block
            )

    def _check_covered(self, header: ChunkHeader, dest: Destination) -> None:
        """A chunk reaches no block before the first its claim covers (the decode side's cached
        prefix, shared with other requests): ValueError, before any copy."""
        with self._lock:
            claim = self._claims.get(header.request_id)
        first = claim.first_block * dest.layout.block_size if claim is not None else 0
        if header.start < first:
            raise ValueError(
                f"chunk tokens [{header.start}, {header.end}) of request {header.request_id} "
                f"reach into the reservation's first {claim.first_block} blocks, which hold the "
                f"decode worker's cached prefix (shared with other requests): the claim covers "
                f"tokens from {first} on"
            )

    def release(self, request_id: str) -> None:
        """End this transport's pipelined claim of `request_id` (none: nothing to do): its
        headers sent, then the decode side told (KVRelease), so that a reservation ending
        meanwhile need not wait for it; a later chunk claims again. Its copies ended when they
        returned. ConnectionError when the decode side could not be told."""
        with self._lock:
            claim = self._claims.get(request_id)
            if claim is None or claim.stage is None:
                return
            del self._claims[request_id]
            self._control.send_headers(self._take_pending())
        tell_released(
            self._control, request_id, claim.grant, self._agent, claim.stage.sender, self._timeout
        )

    def _layouts(self, layout: KVLayout, tp: int) -> list[KVLayout]:
        """The receiver's layout of each of its tp ranks (one per mapped pool file)."""
        ranks = self._rank_layouts.get(layout)
        if ranks is None:
            ranks = (
                [layout]
                if tp == 1
                else [dataclasses.replace(layout, tp_size=tp, tp_rank=r) for r in range(tp)]
            )
            self._rank_layouts[layout] = ranks
        return ranks

    def _take_pending(self) -> list[ChunkHeader]:
        pending, self._pending = self._pending, []
        return pending

    def flush(self, timeout: float) -> None:
        if self._gone is not None:
            raise ConnectionError(self._gone)
        with self._lock:
            self._control.send_headers(self._take_pending())
        self._control.flush(timeout)

    def close(self) -> None:
        if self._writers is not None:
            try:
                with self._lock:
                    self._control.send_headers(self._take_pending())
            except Exception:  # the receiver is gone; nothing left to tell it
                pass
        with self._lock:
            self._caches = self._writers = None  # unmaps once no view of them is left
            claims, self._claims = self._claims, {}
        for request_id, claim in claims.items():  # no copy is under way: a pipelined claim ends
            if claim.stage is not None:
                try:
                    tell_released(
                        self._control,
                        request_id,
                        claim.grant,
                        self._agent,
                        claim.stage.sender,
                        self._timeout,
                    )
                except ConnectionError as e:
                    log.info("%s (the decode side's bound ends it)", e)
        self._stop_populate()
        _untrack(self)
        self._control.close()
