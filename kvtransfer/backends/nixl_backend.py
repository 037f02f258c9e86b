"""NIXL backend: the sender WRITEs KV one-sidedly into the decode worker's registered KV pool.

The decode worker's NixlServer makes one NIXL agent (UCX backend, no listener thread: NIXL's own
metadata exchange is never opened), registers every TP rank's KV pool with it, and serves a gRPC
control server (the gRPC backend's, taking in-place frames) whose address the reservation carries:

    nixl://pdserve-kv-3f2a...?control=127.0.0.1:40123&tp=2

Everything the sender learns travels on that control server, behind the cluster secret:
  NixlMetadata  -> the agent's metadata (its UCX address and the pools' remote keys), the pools'
                   base addresses, shape and dtype: fetched once per channel
  KVClaim       -> {request_id, grant, block_ids}: the sender asks to write one reservation. The
                   decode side checks it against the reservation (Grants): the grant is the one
                   Reserve handed out for that request id (KVEndpoint.write_grant), the reservation
                   still holds (not committed, aborted or past its lease), the block ids are exactly
                   the reserved ones, and no one claimed it before; otherwise PERMISSION_DENIED
                   with the reason, and nothing is written. A yes carries the claim's write window
                   and the first block it covers: the blocks before it hold the decode side's
                   cached prefix (shared with other requests), and no chunk reaches into them.
The sender (NixlTransport) then, per "kv" chunk, posts one WRITE into exactly the claimed
blocks. A single-rank prefill worker's chunk goes straight out of its own paged pool
(`send_paged`: the pool registered once with the sending agent, no gather); a gathered chunk
(`send`: the heads of several TP ranks joined) is registered for its WRITE alone, with a copy
per receiving rank that holds part of its heads. The descriptors, one per stretch of tokens
that continues on both sides (K and V), are made once per request and token range and moved
to each layer. NIXL's UCX
backend flushes the endpoint inside each transfer, so a transfer reported DONE is in the
receiver's memory. The chunk's header (in place, with the grant) follows on the ordered gRPC
control channel only once its WRITE is DONE, and waits, as the shm backend's do, to travel with
the request's "commit" or "abort" (or a flush, or once 64 wait), which go only once every WRITE
of the request ended: the decode side counts a layer only when its bytes are there, and commits
as the other backends do.

Lifecycle and bounds: a WRITE that is not DONE within xfer_timeout_s is released (cancelled) and
fails its request; no WRITE of a claim is posted after its write window (window_s) ends (once less
than a quarter of it is left, the sender waits for its WRITEs and claims again). So every WRITE of
a claim is over by the claim's start + window_s + xfer_timeout_s, and the decode side
holds back the blocks of a reservation that ends (abort, lease, failure) while its claim may still
write: until the sender's "commit" or "abort" for it arrives (the sender's last word, sent after
its last WRITE ended), or until every sending process of the claim is proven gone (a claim names
its process: boot id, pid namespace, pid and start time; on a DRAM pool a dead process on this
host writes no more). Only then are they freed (decode_worker/handoff.py). Past that bound (plus
a margin), a claim whose every sender is proven gone or ended its control connection itself (its
last Push stream closed from its side: a process on another host that died, whose kernel closed
the connection or whose keepalive failed, or a transport closed after its WRITEs) is over too: a
gone sender posts no WRITE, and the bound covers those it had posted (Grants.peer_gone; a stream
this server closed, idle or evicted, proves nothing). Past the bound with none of these, the
claim's sender broke its own bounds (stopped or hung, a WRITE that would not cancel): its blocks
stay held and the worker reports itself unhealthy (`Grants.stuck`, which fails the decode worker's
Stats) until the claim ends after all, its sender's connection closing included. A sender whose claim is refused, or whose WRITE fails,
fails the request; the prefill worker then sends "abort".

Trust: NIXL's one-sided WRITEs are not checked by the receiver's CPU: a process holding the
agent's metadata can write anywhere in the registered pool. What keeps writes inside a
reservation is that the metadata and every grant travel only over the authenticated control
plane (cluster secret, mTLS when configured), that this sender writes only into blocks the
decode side confirmed for that request, and that the decode side holds those blocks until the
claim is known over. A peer with the cluster secret is trusted as much as with the shm backend.

A pipelined sender (a prefill worker in pipeline stages, prefill_worker/stage_push.py): rank 0
writes the first stage's layers, every rank of a later stage its own heads of its own layers,
each from its own process, so each is a claimant of its own. Each claim then says which part it
is (PipelineStage: the sender's id, made by rank 0 per request and shared only with its stages,
the stage and stage count, the rank in the stage, the layers it writes), and the decode side
keeps the claimants apart by stage. A later stage's rank claims before each engine step's
WRITEs and, once they ended (its flush waits for them), sends its own last word for that claim
(KVRelease: request id, grant, agent and sender id, taken only on the connection that claimed);
rank 0's "commit" or "abort" (after its own WRITEs ended, as above) ends the first stage's claim
when every claimant is a stage of one sender, and each later stage's claim ends only by its own
release, its process proven gone, or the bound. Rank 0 commits only once every later stage's
rank reported its step's push, each report sent after that rank's flush (its WRITEs DONE) and
its release (a call that returns once the decode side took it: engine/kv_publish.py,
engine/tp.py), so a commit finds every later stage released and ends the hold; an abort, which
rank 0 sends without waiting for the later stages, may find one mid-step, and the blocks stay
held until that stage's release. The decode side counts the releases rather than trusting the
order: a commit while a stage has not released ends nothing but the first stage's claim. Rank 0
releases its own claim the same way when it fails a request without an abort (a later stage
could not push: prefill_worker/service.py). A claim whose part another agent holds (the same stage and rank of the same sender) is refused;
claimants that are not all stages of one sender (a retry from another worker) keep the rule of
two senders above.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlencode, urlsplit

import grpc
import msgpack
import numpy as np
import torch

from pdserve.kvtransfer.backends.claims import (
    RECLAIM_SHARE,
    ClaimsControl,
    Grants,
    ask_claim_cover,
    tell_released,
)
from pdserve.kvtransfer.backends.frames import host_copy
from pdserve.kvtransfer.backends.grpc_backend import GrpcTransport
from pdserve.kvtransfer.backends.grpc_sender import SERVICE
from pdserve.kvtransfer.reshard import dtype_name
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

SCHEME = "nixl"
METADATA_METHOD = f"/{SERVICE}/NixlMetadata"
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
EXTRA_HINT = "install the extra: pip install 'pdserve[nixl]' (or pip install nixl-cu12)"


def nixl_module():
    """NIXL's Python API module (nixl_cu12, nixl_cu13 or nixl, the first found); None when none is
    installed."""
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(f"{name}._api")
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    return None


def require_nixl():
    module = nixl_module()
    if module is None:
        raise RuntimeError(f"the nixl KV backend needs NIXL, which is not installed: {EXTRA_HINT}")
    return module


def nixl_available() -> bool:
    return nixl_module() is not None


# ---- addresses ------------------------------------------------------------------------------------


def format_address(agent_name: str, control: str, tp: int) -> str:
    return f"{SCHEME}://{agent_name}?{urlencode({'control': control, 'tp': int(tp)})}"


def parse_address(address: str) -> tuple[str, str, int]:
    """-> (agent name, control address, the receiver's TP size)"""
    parts = urlsplit(address)
    query = parse_qs(parts.query)
    try:
        if parts.scheme != SCHEME:
            raise ValueError(f"scheme {parts.scheme!r}")
        control = query["control"][0]
        tp = int(query["tp"][0])
        if not parts.netloc or not control or not 1 <= tp <= 1024:
            raise ValueError("an empty agent name or control address, or a bad tp")
    except (KeyError, ValueError, IndexError) as e:
        raise ValueError(
            f"{address!r} is not a nixl KV address ({e}); expected nixl://AGENT?control=HOST:PORT&tp=N"
        ) from None
    return parts.netloc, control, tp


def _mem_type(tensor: torch.Tensor) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


UCX_ERROR_MODES = ("peer", "none")


def _make_agent(nixl, name: str, ucx_error_handling: str = "none", progress: bool = False):
    """A NIXL agent with the UCX backend. No listener thread: NIXL's own metadata exchange is
    never opened, metadata travels only over the authenticated control server.

    ucx_error_handling "none" (this backend's default) lets UCX use the same host's CMA
    (process_vm_writev: one copy, no CPU on the receiving side) and RDMA between hosts, both
    passive on the target, so neither agent runs a progress thread (NIXL's spins on a core); a dead
    peer is left to this backend's own bounds (xfer_timeout_s). "peer" (NIXL's default) has UCX
    detect a failed peer, which only its network transports can: between two hosts without RDMA,
    where a WRITE over TCP needs the receiver to progress, both agents then run the thread.

    Every agent serializes its own calls (NIXL's STRICT sync mode): a process's one sending agent
    serves all of its channels, on whatever threads they run, and a server's agent its gRPC
    handlers. NIXL's default for an agent without a listener is no synchronization at all, and
    two threads in one UCX worker at once hung their writes and then aborted the process (a UCX
    assertion)."""
    if ucx_error_handling not in UCX_ERROR_MODES:
        raise ValueError(
            f"ucx_error_handling must be one of {UCX_ERROR_MODES}, got {ucx_error_handling!r}"
        )
    config = nixl.nixl_agent_config(
        enable_prog_thread=progress,
        enable_listen_thread=False,
        backends=[],
        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    agent = nixl.nixl_agent(name, config)
    agent.create_backend("UCX", {"ucx_error_handling_mode": ucx_error_handling})
    return agent


# ---- the receiving side ---------------------------------------------------------------------------


class NixlControlServer(ClaimsControl):
    """The claims' control server (kvtransfer/backends/claims.py) with NixlMetadata."""

    def __init__(self, handler: FrameHandler, owner: NixlServer, **opts):
        self._owner = owner
        super().__init__(handler, owner.grants, **opts)

    def extra_methods(self) -> dict:
        return {**super().extra_methods(), "NixlMetadata": self._metadata}

    def _metadata(self, request: bytes, context) -> bytes:
        return self._owner.metadata


class NixlServer(TransportServer):
    """Receiver side: every TP rank's pool (`kv_caches`, rank order, each one contiguous tensor)
    registered with one NIXL agent; frames arrive on a gRPC control server (options pass through
    to GrpcServer) and reach `handler` only past `grants` (made here when not given: the hand-off
    shares its own, decode_worker/handoff.py)."""

    def __init__(
        self,
        handler: FrameHandler,
        kv_caches: list[torch.Tensor] | torch.Tensor,
        grants: Grants | None = None,
        ucx_error_handling: str = "none",
        *,
        security: ClusterSecurity = INSECURE,
        **grpc_opts,
    ):
        nixl = require_nixl()
        caches = [kv_caches] if isinstance(kv_caches, torch.Tensor) else list(kv_caches)
        if not caches or any(
            not c.is_contiguous() or c.shape != caches[0].shape or c.dtype != caches[0].dtype
            for c in caches
        ):
            raise ValueError(
                "the nixl backend needs kv_caches: every TP rank's KV pool, contiguous tensors "
                "of one shape and dtype"
            )
        if caches[0].dim() != 6:
            raise ValueError(
                f"a KV pool is [layers, 2, blocks, block_size, heads, head_dim], got shape "
                f"{tuple(caches[0].shape)}"
            )
        self.grants = grants or Grants()
        # only a DRAM pool's writes end with the sending process (a GPU may still run its copies)
        self.grants.pid_proof = self.grants.pid_proof and not caches[0].is_cuda
        if self.grants.num_layers is None:  # what pipelined claims are checked against
            self.grants.num_layers = caches[0].shape[0]
        self.kv_caches = caches
        self.agent_name = f"pdserve-kv-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._agent = _make_agent(
            nixl, self.agent_name, ucx_error_handling, progress=ucx_error_handling == "peer"
        )
        self._regs = [self._agent.register_memory([c]) for c in caches]
        self.metadata = msgpack.packb(
            {
                "agent": self._agent.get_agent_metadata(),
                "pools": [[c.data_ptr(), c.numel() * c.element_size()] for c in caches],
                "shape": list(caches[0].shape),
                "dtype": dtype_name(caches[0].dtype),
                "mem": _mem_type(caches[0]),
                "devices": [c.device.index or 0 for c in caches],
                "xfer_timeout_s": self.grants.xfer_timeout_s,
                "ucx_error_handling": ucx_error_handling,
            }
        )
        try:
            self._control = NixlControlServer(handler, self, security=security, **grpc_opts)
        except BaseException:
            self._deregister()
            raise
        self.address = format_address(self.agent_name, self._control.address, len(caches))

    @property
    def num_channels(self) -> int:
        return self._control.num_channels

    def _deregister(self) -> None:
        regs, self._regs = self._regs, []
        for reg in regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:  # stopping anyway
                log.debug("deregistering a KV pool: %r", e)

    def stop(self) -> None:
        self._control.stop()
        self._deregister()


# ---- the sending side -----------------------------------------------------------------------------

_local = threading.Lock()
_agents: dict[str, object] = {}  # this process's sending agents, by UCX error mode
_remotes: dict[tuple[int, str], int] = {}  # (sending agent, remote agent name) -> its transports
# (sending agent, pool address, pool bytes) -> [registration, transports holding it, the pool]
_source_regs: dict[tuple[int, int, int], list] = {}


def _sending_agent(nixl, ucx_error_handling: str):
    """This process's sending agent for that UCX error mode (made at its first transport)."""
    with _local:
        agent = _agents.get(ucx_error_handling)
        if agent is None:
            name = f"pdserve-send-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            agent = _agents[ucx_error_handling] = _make_agent(
                nixl, name, ucx_error_handling, progress=ucx_error_handling == "peer"
            )
        return agent


def _add_remote(agent, name: str, metadata: bytes) -> None:
    key = (id(agent), name)
    with _local:
        if _remotes.get(key, 0) == 0:
            agent.add_remote_agent(metadata)
        _remotes[key] = _remotes.get(key, 0) + 1


def _drop_remote(agent, name: str) -> None:
    key = (id(agent), name)
    with _local:
        left = _remotes.get(key, 0) - 1
        if left > 0:
            _remotes[key] = left
            return
        _remotes.pop(key, None)
        try:
            agent.remove_remote_agent(name)
        except Exception as e:  # already gone
            log.debug("removing NIXL agent %s: %r", name, e)


def _register_source(agent, layer_kv: torch.Tensor, key: tuple[int, int]) -> None:
    """Register the sender's pool whose storage `key` (address, bytes) is, for one more transport:
    the first registers it with the agent and keeps a reference to the storage, so its memory
    stays allocated while registered."""
    full = (id(agent), *key)
    with _local:
        held = _source_regs.get(full)
        if held is None:
            storage = layer_kv.untyped_storage()
            reg = agent.register_memory([(key[0], key[1], 0, "")], "DRAM")
            held = _source_regs[full] = [reg, 0, storage]
        held[1] += 1


def _release_source(agent, key: tuple[int, int]) -> None:
    """One transport less holds the sender's pool at `key`; the last deregisters it."""
    full = (id(agent), *key)
    with _local:
        held = _source_regs.get(full)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _source_regs[full]
        try:
            agent.deregister_memory(held[0])
        except Exception as e:
            log.warning("deregistering a sender's KV pool: %r", e)


@dataclass
class _Write:
    """One posted WRITE: its handle, the source buffers registered for it alone, how many bytes it
    moves, when it was posted, and the in-place header that may follow once it is DONE. `keep`:
    what must stay alive while it reads (a chunk gathered for it)."""

    handle: object
    regs: list
    nbytes: int
    posted: float
    header: ChunkHeader | None = None
    keep: list = field(default_factory=list)


@dataclass
class _Outgoing:
    """One request's claim on this channel: its blocks, its window, its WRITEs not yet ended and
    the in-place headers of those that are DONE, not yet sent."""

    block_ids: tuple[int, ...]
    grant: str
    window_end: float
    window_s: float = 0.0  # the window's length (claims.py RECLAIM_SHARE)
    # the first of block_ids the claim covers: those before it hold the decode side's cached
    # prefix, which other requests may share (claims.py), and no chunk is written into them
    first_block: int = 0
    writes: list[_Write] = field(default_factory=list)
    headers: list[ChunkHeader] = field(default_factory=list)
    error: str | None = None
    stage: PipelineStage | None = None  # the part of a pipelined sender it claimed as
    # (rank, start, end, heads) -> its chunks' descriptors at source 0 and layer 0 (_post)
    descriptors: dict = field(default_factory=dict)


class NixlTransport(Transport):
    """Sender side: the receiver's pools by NIXL WRITE, the headers on the gRPC control channel.

    One sending NIXL agent per process is shared by its transports. `send` of a "kv" chunk claims
    the request's reservation at its first chunk (one control call) unless `claim` did before,
    and again when its window nears its end, then posts the chunk's WRITE
    and returns; checking a WRITE's state progresses it (each send checks the earlier ones; with
    ucx_error_handling "peer", UCX's progress thread runs them too). Its in-place header waits
    until it is DONE and goes with the request's commit or abort (which wait for all of its
    WRITEs, at most xfer_timeout_s), at `flush`, or once max_pending_headers of the request's wait.
    max_inflight_bytes bounds the chunk bytes of posted WRITEs (`send` waits for the oldest beyond
    it).

    A Destination with a PipelineStage claims as that part of a pipelined sender, and WRITEs
    only its layers. A later stage's rank ends each step's claim with `release` (its WRITEs
    ended, its headers sent, then the decode side told), and its next chunk claims again;
    `close` releases the pipelined claims it still holds once their WRITEs ended.
    """

    carries_payload_frames = False

    def __init__(
        self,
        address: str,
        timeout: float = 10.0,
        xfer_timeout_s: float | None = None,
        max_inflight_bytes: int = 512 << 20,
        max_pending_headers: int = 64,
        *,
        security: ClusterSecurity = INSECURE,
        **grpc_opts,
    ):
        nixl = require_nixl()
        self.remote_name, control, self.tp = parse_address(address)
        self._timeout = timeout
        self._max_inflight = max(1, max_inflight_bytes)
        self._max_pending = max(1, max_pending_headers)
        self._inflight = 0
        self._control = GrpcTransport(control, timeout=timeout, security=security, **grpc_opts)
        try:
            meta = self._fetch_metadata()
            # the receiver's UCX error mode: both ends of an endpoint must agree on it
            self._agent = _sending_agent(nixl, meta.get("ucx_error_handling", "peer"))
            _add_remote(self._agent, self.remote_name, meta["agent"])
        except BaseException:
            self._control.close()
            raise
        self._xfer_timeout = float(xfer_timeout_s or meta["xfer_timeout_s"])
        self._requests: dict[str, _Outgoing] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._sources: set[tuple[int, int]] = set()  # the sender's pools registered (send_paged)

    def _fetch_metadata(self) -> dict:
        try:
            meta = msgpack.unpackb(self._control.call(METADATA_METHOD, b"", self._timeout))
        except grpc.RpcError as e:
            raise ConnectionError(
                f"the nixl KV server at {self.remote_name} gave no metadata: "
                f"{e.code().name}: {e.details()}"
            ) from None
        try:
            shape = tuple(int(n) for n in meta["shape"])
            dtype = getattr(torch, meta["dtype"])
            pools = [(int(a), int(n)) for a, n in meta["pools"]]
            if len(shape) != 6 or len(pools) != self.tp or not isinstance(dtype, torch.dtype):
                raise ValueError("shape, pools or dtype")
            if not isinstance(meta["agent"], bytes) or meta["mem"] not in ("DRAM", "VRAM"):
                raise ValueError("agent or mem")
            if meta.get("ucx_error_handling", "peer") not in UCX_ERROR_MODES:
                raise ValueError("ucx_error_handling")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConnectionError(f"the nixl KV server sent bad metadata ({e})") from None
        self.shape, self.dtype, self.pools, self.mem = shape, dtype, pools, meta["mem"]
        self.devices = [int(d) for d in meta.get("devices", [0] * len(pools))]
        self._itemsize = torch.empty(0, dtype=dtype).element_size()
        # one layer of a receiving rank's pool: [2, blocks, block_size, heads, head_dim]
        self._layer_bytes = math.prod(shape[1:]) * self._itemsize
        return meta

    # ---- claims ---------------------------------------------------------------------------------
    def claim(self, request_id: str, dest: Destination) -> None:
        """Claim the reservation now, before the request's first chunk: a prefill worker claims
        on its call's thread, so that the engine's step does not wait for the call. Raises as
        a send would (PermissionError: the decode side refused)."""
        with self._lock:
            out = self._claim(request_id, dest)
        if out.error is not None:
            raise ConnectionError(out.error)

    def _claim(self, request_id: str, dest: Destination) -> _Outgoing:
        """The request's claim on this channel: made at its first chunk (or by `claim`), and made
        again once less than RECLAIM_SHARE of its window is left, after its WRITEs so far ended
        (the decode side then takes it as this agent's earlier WRITEs being over)."""
        out = self._requests.get(request_id)
        if out is not None:
            if (
                tuple(dest.block_ids) != out.block_ids
                or dest.grant != out.grant
                or dest.stage != out.stage
            ):
                raise ValueError(f"request {request_id} changed its destination after its claim")
            if time.monotonic() < out.window_end - out.window_s * RECLAIM_SHARE:
                return out
            self._settle(out, wait=True)
            if out.error is None:
                now = time.monotonic()
                out.window_s, out.first_block = self._ask_claim(request_id, dest)
                out.window_end = now + out.window_s
            return out
        if not dest.grant:
            raise ValueError(
                f"request {request_id} has no write grant: the nixl backend writes only into a "
                f"reservation whose KVEndpoint carries one"
            )
        num_blocks = self.shape[2]
        if any(not 0 <= b < num_blocks for b in dest.block_ids):
            raise ValueError(
                f"request {request_id} names blocks outside the receiver's pool of {num_blocks} "
                f"blocks"
            )
        now = time.monotonic()
        window_s, first_block = self._ask_claim(request_id, dest)
        out = _Outgoing(
            tuple(dest.block_ids),
            dest.grant,
            now + window_s,
            window_s,
            first_block=first_block,
            stage=dest.stage,
        )
        self._requests[request_id] = out
        return out

    def _ask_claim(self, request_id: str, dest: Destination) -> tuple[float, int]:
        """The claim's write window and the first block it covers (claims.py)."""
        return ask_claim_cover(
            self._control,
            request_id,
            dest.grant,
            dest.block_ids,
            self._agent.name,
            dest.stage,
            self._timeout,
        )

    # ---- sending --------------------------------------------------------------------------------
    def send(self, header: ChunkHeader, data: torch.Tensor | None, dest: Destination) -> None:
        if self._closed:
            raise RuntimeError("this KV transport is closed")
        if header.kind != "kv":
            if data is not None and data.numel():
                raise ValueError(
                    f"a {header.kind} frame carries no payload (request {header.request_id})"
                )
            self._finish(header, dest)
            return
        if data is None:
            raise ValueError(f"a kv frame for request {header.request_id} needs its data")
        self._send_kv(header, dest, lambda out: self._post(header, data, dest, out))

    def send_paged(
        self, header: ChunkHeader, layer_kv: torch.Tensor, block_ids: list[int], dest: Destination
    ) -> bool:
        """WRITE the chunk out of the sender's own pool into the claimed blocks: no gather, no
        copy but the WRITE's. The pool is registered with the sending agent at its first chunk
        (`_source_registration`). False where this path does not apply: a receiver's pool not in
        host memory, a pool on a device, another dtype, or a pool that is not contiguous.

        The WRITE reads the pool when it runs (on one host at once, inside the post; between
        hosts maybe later): the chunk's blocks must hold its KV until the request's commit, which
        waits for every WRITE. A prefill worker sends the commit on the engine's loop thread when
        the request finishes, before a next step can give its blocks to another request; a
        request that ends otherwise is aborted, and what a late WRITE reads then lands only in a
        reservation that the abort ends."""
        if self._closed:
            raise RuntimeError("this KV transport is closed")
        if (
            header.kind != "kv"
            or self.mem != "DRAM"
            or layer_kv.device.type != "cpu"
            or layer_kv.dtype != self.dtype
            or layer_kv.dim() != 5
            or not layer_kv.is_contiguous()
        ):
            return False
        self._send_kv(
            header, dest, lambda out: self._post_paged(header, layer_kv, block_ids, dest, out)
        )
        return True

    def _send_kv(self, header: ChunkHeader, dest: Destination, post) -> None:
        """Claim (at the request's first chunk), then `post(out)` the chunk's WRITE."""
        with self._lock:
            out = self._claim(header.request_id, dest)
            if out.error is not None:
                raise ConnectionError(out.error)
            if time.monotonic() > out.window_end:
                out.error = f"the write window of request {header.request_id}'s claim ended"
                raise TimeoutError(out.error)
            try:
                self._settle(out, wait=False)  # checking a WRITE progresses the ones in flight
                if out.error is not None:
                    raise ConnectionError(out.error)
                post(out)
                self._settle(out, wait=False)
                if out.error is not None:
                    raise ConnectionError(out.error)
                # the in-place headers of the WRITEs that are DONE wait, as over shm, for the
                # request's commit or abort (or a flush, or max_pending_headers of them): a
                # control message per layer woke gRPC's threads, which then took the GIL at
                # every torch call of the next layer's gather (2k-token prompts ran 1.5x slower)
                if len(out.headers) >= self._max_pending:
                    ready, out.headers = out.headers, []
                    self._control.send_headers(ready)
            except Exception as e:
                out.error = f"a KV write of request {header.request_id} failed: {e}"
                raise

    def _check_chunk(self, header: ChunkHeader, dest: Destination, out) -> None:
        """The chunk fits the receiver's pool, the claimed blocks (past the decode side's cached
        prefix) and the claim's layers."""
        layers, _, _, bs, _, head_dim = self.shape
        if dest.layout.block_size != bs or dest.layout.tp_size != self.tp:
            raise ValueError(
                f"the reservation's block size {dest.layout.block_size} and tp "
                f"{dest.layout.tp_size} differ from the receiver's pool ({bs}, {self.tp})"
            )
        if not 0 <= header.layer < layers or header.head_dim != head_dim:
            raise ValueError(f"chunk layer {header.layer} or head_dim does not fit the pool")
        if out.stage is not None and not out.stage.layers[0] <= header.layer < out.stage.layers[1]:
            raise ValueError(
                f"chunk layer {header.layer} is not one of the layers {list(out.stage.layers)} "
                f"pipeline stage {out.stage.stage} claimed"
            )
        if not 0 <= header.start <= header.end <= len(out.block_ids) * bs:
            raise ValueError(
                f"chunk tokens [{header.start}, {header.end}) do not fit the "
                f"{len(out.block_ids)} claimed blocks of {bs} tokens"
            )
        if header.start < out.first_block * bs:
            raise ValueError(
                f"chunk tokens [{header.start}, {header.end}) reach into the reservation's first "
                f"{out.first_block} blocks, which hold the decode worker's cached prefix (shared "
                f"with other requests): the claim covers tokens from {out.first_block * bs} on"
            )
        if not 0 <= header.head_start < header.head_end <= self.tp * self.shape[4]:
            raise ValueError(
                f"chunk heads [{header.head_start}, {header.head_end}) do not fit the receiver's "
                f"{self.tp * self.shape[4]}"
            )

    def _rank_heads(self, num_kv_heads: int) -> list[tuple[int, int]]:
        """The global KV heads [first, end) each receiving rank's pool holds (KVLayout's rule:
        with fewer heads than ranks, each head is in tp / num_kv_heads ranks' pools)."""
        per, replicas = self.shape[4], max(1, self.tp // max(1, num_kv_heads))
        return [(r // replicas * per, r // replicas * per + per) for r in range(self.tp)]

    def _post(self, header: ChunkHeader, data: torch.Tensor, dest: Destination, out) -> None:
        self._check_chunk(header, dest, out)
        start, end, h0, h1 = header.start, header.end, header.head_start, header.head_end
        head_dim = self.shape[5]
        data = host_copy(data)
        if data.dtype != self.dtype or data.numel() != 2 * (end - start) * (h1 - h0) * head_dim:
            raise ValueError(f"chunk payload does not match its header {header.shape}")
        data = data.view(2, end - start, h1 - h0, head_dim)
        if end == start:
            out.headers.append(dataclasses.replace(header, in_place=True, grant=out.grant))
            return
        local, remote, sources = self._pieces(header, data, out, dest.layout.num_kv_heads)
        nbytes = sum(s.numel() * s.element_size() for s in sources)
        self._wait_room(nbytes)
        regs = [self._agent.register_memory([s]) for s in sources]
        self._write(header, out, local, remote, regs, sources, nbytes)

    def _post_paged(
        self, header: ChunkHeader, layer_kv: torch.Tensor, block_ids, dest: Destination, out
    ) -> None:
        self._check_chunk(header, dest, out)
        start, end, h0, h1 = header.start, header.end, header.head_start, header.head_end
        _, src_blocks, src_bs, src_heads, head_dim = layer_kv.shape
        if src_heads != h1 - h0 or head_dim != self.shape[5]:
            raise ValueError(
                f"the sender's pool holds {src_heads} heads of {head_dim}, the chunk "
                f"{h1 - h0} of {self.shape[5]}"
            )
        if end == start:
            out.headers.append(dataclasses.replace(header, in_place=True, grant=out.grant))
            return
        first, last = start // src_bs, (end - 1) // src_bs
        if last >= len(block_ids):
            raise ValueError(f"tokens [{start}, {end}) pass the sender's {len(block_ids)} blocks")
        src_ids = block_ids[first : last + 1]
        # a request's layers share their descriptors: made once per token range and source
        # blocks (compared, as a next step of the request could change them)
        key = ("paged", start, end, h0, h1, src_blocks, src_bs)
        cached = out.descriptors.get(key)
        if cached is not None and cached[0] == src_ids:
            rel = cached[1]
        else:
            if min(src_ids) < 0 or max(src_ids) >= src_blocks:
                raise ValueError(f"the sender's block ids fall outside its pool of {src_blocks}")
            rel = self._paged_pieces(header, layer_kv, src_ids, out, dest.layout.num_kv_heads)
            out.descriptors[key] = (src_ids, rel)  # a slice: a copy of its own
        layer_base = header.layer * self._layer_bytes
        local, remote = rel[0].copy(), rel[1].copy()
        local[:, 0] += np.uint64(layer_kv.data_ptr())
        remote[:, 0] += rel[2] + np.uint64(layer_base)
        nbytes = 2 * (end - start) * (h1 - h0) * head_dim * self._itemsize
        self._wait_room(nbytes)
        self._source_registration(layer_kv)
        self._write(header, out, [local], [remote], [], [], nbytes)

    def _paged_pieces(
        self, header: ChunkHeader, layer_kv: torch.Tensor, src_ids, out, num_kv_heads: int
    ):
        """A paged chunk's descriptors for every receiving rank it reaches: local at the sender's
        layer 0 offset 0, remote at layer 0 offset 0 of the rank's pool, and the ranks' pool bases
        (one per remote row) to move them by."""
        local, remote, bases = [], [], []
        for rank, ((base, _), (r0, r1)) in enumerate(
            zip(self.pools, self._rank_heads(num_kv_heads))
        ):
            lo, hi = max(header.head_start, r0), min(header.head_end, r1)
            if lo >= hi:
                continue
            loc, rem = _paged_descriptors(
                tuple(layer_kv.shape), src_ids, header.start, header.end,
                lo - header.head_start, self.shape, out.block_ids, lo - r0, hi - lo,
                self._itemsize, self.devices[rank],
            )  # fmt: skip
            local.append(loc)
            remote.append(rem)
            bases.append(np.full(len(rem), base, dtype=np.uint64))
        return np.concatenate(local), np.concatenate(remote), np.concatenate(bases)

    def _source_registration(self, layer_kv: torch.Tensor) -> None:
        """The sender's pool (the whole storage layer_kv is a view of) registered with the
        sending agent, once per transport (registrations are shared by the process's transports:
        _register_source)."""
        storage = layer_kv.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self._sources:
            _register_source(self._agent, layer_kv, key)
            self._sources.add(key)

    def _write(self, header: ChunkHeader, out, local, remote, regs, sources, nbytes) -> None:
        """Post one WRITE of the chunk's descriptors; its registrations end with it."""
        agent = self._agent
        try:
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(np.concatenate(local), "DRAM"),
                agent.get_xfer_descs(np.concatenate(remote), self.mem),
                self.remote_name,
            )
            state = agent.transfer(handle)
        except Exception:
            for reg in regs:
                agent.deregister_memory(reg)
            raise
        write = _Write(
            handle,
            regs,
            nbytes,
            time.monotonic(),
            dataclasses.replace(header, in_place=True, grant=out.grant),
            sources,
        )
        if state == "ERR":
            self._end(write)
            raise ConnectionError(f"NIXL refused the WRITE to {self.remote_name}")
        out.writes.append(write)
        self._inflight += nbytes

    def _pieces(
        self, header: ChunkHeader, data: torch.Tensor, out, num_kv_heads: int
    ) -> tuple[list, list, list]:
        """The chunk's descriptors, local and remote, and its source tensors: per receiving rank
        the heads it holds (all of `data`, or a copy of its part)."""
        start, end, h0, h1 = header.start, header.end, header.head_start, header.head_end
        local, remote, sources = [], [], []
        for rank, ((base, _), (r0, r1)) in enumerate(
            zip(self.pools, self._rank_heads(num_kv_heads))
        ):
            lo, hi = max(h0, r0), min(h1, r1)
            if lo >= hi:
                continue
            src = data if (lo, hi) == (h0, h1) else data[:, :, lo - h0 : hi - h0].contiguous()
            sources.append(src)
            # a request's chunks differ by layer only (the same tokens and heads each layer):
            # its descriptors are made once, at base 0 and layer 0, and moved to each chunk's
            key = (rank, start, end, lo, hi)
            rel = out.descriptors.get(key)
            if rel is None:
                rel = out.descriptors[key] = _descriptors(
                    0, 0, 0, out.block_ids, start, end, self.shape, self._itemsize,
                    lo - r0, hi - lo, self.devices[rank],
                )  # fmt: skip
            loc, rem = rel[0].copy(), rel[1].copy()
            loc[:, 0] += np.uint64(src.data_ptr())
            rem[:, 0] += np.uint64(base + header.layer * self._layer_bytes)
            local.append(loc)
            remote.append(rem)
        return local, remote, sources

    def _wait_room(self, nbytes: int) -> None:
        """Until the posted WRITEs hold at most max_inflight_bytes with this one (or none is left)."""
        while self._inflight and self._inflight + nbytes > self._max_inflight:
            oldest = min(
                (o for o in self._requests.values() if o.writes),
                key=lambda o: o.writes[0].posted,
                default=None,
            )
            if oldest is None:
                self._inflight = 0
                return
            self._settle(oldest, wait=True, upto=1)

    def _end(self, write: _Write) -> None:
        """Release a WRITE (one still in progress is cancelled) and its source registrations;
        a failure here is logged, never raised: the request has failed or ended already."""
        try:
            write.handle.release()
        except Exception as e:
            log.warning("releasing a NIXL WRITE to %s: %r", self.remote_name, e)
        for reg in write.regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                log.warning("deregistering a KV chunk: %r", e)
        self._inflight -= write.nbytes
        self._inflight = max(0, self._inflight)

    def _settle(self, out: _Outgoing, wait: bool, upto: int | None = None) -> None:
        """Retire the request's WRITEs in order while they are DONE (waiting for each, up to
        xfer_timeout_s, when `wait`); one that failed or timed out fails the request, and its
        WRITEs still posted are released. `upto`: at most that many."""
        done = 0
        while out.writes and (upto is None or done < upto):
            write = out.writes[0]
            state = self._agent.check_xfer_state(write.handle)
            polls = 0
            while wait and state == "PROC":
                if time.monotonic() - write.posted > self._xfer_timeout:
                    state = "TIMEOUT"
                    break
                polls += 1  # each check progresses UCX; past the first ones, yield the core
                time.sleep(0 if polls < 100 else 0.0002)
                state = self._agent.check_xfer_state(write.handle)
            if state == "PROC":
                return
            if state != "DONE":
                out.error = out.error or (
                    f"a KV write to {self.remote_name} "
                    f"{'took longer than ' + str(self._xfer_timeout) + 's' if state == 'TIMEOUT' else 'failed'}"
                )
                for w in out.writes:
                    self._end(w)
                out.writes.clear()
                return
            out.writes.pop(0)
            self._end(write)
            out.headers.append(write.header)
            done += 1

    def _finish(self, header: ChunkHeader, dest: Destination) -> None:
        """A commit or abort: after every WRITE of its request ended, with its in-place headers."""
        with self._lock:
            out = self._requests.pop(header.request_id, None)
            if out is not None:
                self._settle(out, wait=True)
            grant = out.grant if out is not None else dest.grant
            if out is not None and out.error is not None and header.kind == "commit":
                # a WRITE failed: the receiver must not take a commit for KV that did not land
                self._control.send_headers(
                    [dataclasses.replace(header, kind="abort", first_tokens=(), grant=grant)]
                )
                raise ConnectionError(out.error)
            headers = out.headers if out is not None and out.error is None else []
            self._control.send_headers(headers + [dataclasses.replace(header, grant=grant)])

    def flush(self, timeout: float) -> None:
        if self._closed:
            raise RuntimeError("this KV transport is closed")
        with self._lock:
            headers = []
            for out in self._requests.values():
                self._settle(out, wait=True)
                if out.error is None:
                    headers += out.headers
                    out.headers = []
            self._control.send_headers(headers)
        self._control.flush(timeout)

    def release(self, request_id: str) -> None:
        """End this transport's pipelined claim of `request_id` (none: nothing to do): its
        WRITEs ended (waited for, at most xfer_timeout_s, or released), the headers of those that
        landed sent, then the decode side told (KVRelease), so that a reservation ending
        meanwhile need not wait for this claim. A later chunk of the request claims again.
        Raises ConnectionError when the decode side could not be told or a WRITE failed (then
        after the release: the request's KV is incomplete)."""
        with self._lock:
            out = self._requests.get(request_id)
            if out is None or out.stage is None:
                return
            del self._requests[request_id]
            self._settle(out, wait=True)
            if out.error is None and out.headers:
                self._control.send_headers(out.headers)
        self._tell_released(request_id, out)
        if out.error is not None:
            raise ConnectionError(out.error)

    def _tell_released(self, request_id: str, out: _Outgoing) -> None:
        tell_released(
            self._control, request_id, out.grant, self._agent.name, out.stage.sender, self._timeout
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for out in self._requests.values():
                self._settle(out, wait=True)
                for w in out.writes:
                    self._end(w)
            claims, self._requests = self._requests, {}
            for key in self._sources:  # every WRITE that read them ended above
                _release_source(self._agent, key)
            self._sources.clear()
        for request_id, out in claims.items():  # their WRITEs ended: a pipelined claim says so
            if out.stage is not None:
                try:
                    self._tell_released(request_id, out)
                except ConnectionError as e:
                    log.info("%s (the decode side's bound ends it)", e)
        self._control.close()
        _drop_remote(self._agent, self.remote_name)


def _descriptors(
    src_base: int,
    dst_base: int,
    layer: int,
    block_ids: tuple[int, ...],
    start: int,
    end: int,
    shape: tuple[int, ...],
    itemsize: int,
    head_offset: int = 0,
    num_heads: int | None = None,
    device: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 (address, length, device) descriptors, local and remote, that move tokens [start, end)
    of heads [head_offset, head_offset + num_heads) of one receiving rank: the source is
    [2, end - start, num_heads, head_dim] contiguous at src_base, the destination that rank's pool
    [layers, 2, blocks, block_size, heads, head_dim] at dst_base. A chunk with all of the rank's
    heads moves as one descriptor per (K or V, block touched); a part of its heads (a sender
    whose TP split cuts through the rank's) as one per (K or V, token)."""
    _, _, num_blocks, bs, heads, head_dim = shape
    num_heads = heads if num_heads is None else num_heads
    tok = heads * head_dim * itemsize  # one token of the rank in the pool
    part = num_heads * head_dim * itemsize  # one token of the source
    ntok = end - start
    if num_heads == heads:
        first, last = start // bs, (end - 1) // bs
        idx = np.arange(first, last + 1, dtype=np.int64)
        t0 = np.maximum(idx * bs, start)
        t1 = np.minimum((idx + 1) * bs, end)
        blocks = np.asarray(block_ids[first : last + 1], dtype=np.int64)
        lens = (t1 - t0) * tok
    else:
        t0 = np.arange(start, end, dtype=np.int64)
        idx = t0 // bs
        blocks = np.asarray(block_ids, dtype=np.int64)[idx]
        lens = np.full_like(t0, part)
    local, remote = [], []
    for kv in (0, 1):
        slot = ((layer * 2 + kv) * num_blocks + blocks) * bs + (t0 - idx * bs)
        dst = dst_base + slot * tok + head_offset * head_dim * itemsize
        src = src_base + (kv * ntok + (t0 - start)) * part
        src, dst, run = _merge_runs(src, dst, lens)
        local.append(np.stack([src, run, np.zeros_like(run)], axis=1))
        remote.append(np.stack([dst, run, np.full_like(run, device)], axis=1))
    return np.concatenate(local).astype(np.uint64), np.concatenate(remote).astype(np.uint64)


def _paged_descriptors(
    src_shape: tuple[int, ...],
    src_ids: tuple[int, ...],
    start: int,
    end: int,
    src_head: int,
    shape: tuple[int, ...],
    block_ids: tuple[int, ...],
    dst_head: int,
    num_heads: int,
    itemsize: int,
    device: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 descriptors, local and remote, that move tokens [start, end) of `num_heads` heads
    straight from the sender's paged layer [2, blocks, block_size, heads, head_dim] at offset 0
    (src_ids: its blocks from the one holding token start on; heads from src_head) into one
    receiving rank's pool [layers, 2, blocks, block_size, heads, head_dim] at offset 0, layer 0
    (block_ids: the claimed blocks; heads from dst_head). Whole token rows on both sides move as
    one piece per stretch of tokens that stays in one block on each side; a part of a row (the
    two sides split the heads differently) as one per token. Pieces that continue each other on
    both sides are merged."""
    _, src_blocks, src_bs, src_heads, head_dim = src_shape
    _, _, dst_blocks, dst_bs, dst_heads, _ = shape
    src_tok, dst_tok = src_heads * head_dim * itemsize, dst_heads * head_dim * itemsize
    part = num_heads * head_dim * itemsize
    if num_heads == src_heads == dst_heads:
        cuts = np.union1d(
            np.arange(start - start % src_bs + src_bs, end, src_bs, dtype=np.int64),
            np.arange(start - start % dst_bs + dst_bs, end, dst_bs, dtype=np.int64),
        )
        t0 = np.concatenate(([start], cuts)).astype(np.int64)
        lens = (np.concatenate((cuts, [end])) - t0) * part
    else:
        t0 = np.arange(start, end, dtype=np.int64)
        lens = np.full_like(t0, part)
    sb = np.asarray(src_ids, dtype=np.int64)[t0 // src_bs - start // src_bs]
    db = np.asarray(block_ids, dtype=np.int64)[t0 // dst_bs]
    local, remote = [], []
    for kv in (0, 1):
        src = (
            (kv * src_blocks + sb) * src_bs + t0 % src_bs
        ) * src_tok + src_head * head_dim * itemsize
        dst = (
            (kv * dst_blocks + db) * dst_bs + t0 % dst_bs
        ) * dst_tok + dst_head * head_dim * itemsize
        src, dst, run = _merge_runs(src, dst, lens)
        local.append(np.stack([src, run, np.zeros_like(run)], axis=1))
        remote.append(np.stack([dst, run, np.full_like(run, device)], axis=1))
    return np.concatenate(local).astype(np.uint64), np.concatenate(remote).astype(np.uint64)


def _merge_runs(src: np.ndarray, dst: np.ndarray, lens: np.ndarray):
    """Adjacent descriptors that continue each other on both sides become one (consecutive
    block ids make one long copy; on one host each descriptor is a system call)."""
    if len(lens) < 2:
        return src, dst, lens
    joins = (src[:-1] + lens[:-1] == src[1:]) & (dst[:-1] + lens[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    ends = np.concatenate((starts[1:], [len(lens)]))
    total = np.concatenate(([0], np.cumsum(lens)))
    return src[starts], dst[starts], total[ends] - total[starts]


__all__ = [
    "NixlServer",
    "NixlTransport",
    "nixl_available",
    "require_nixl",
    "format_address",
    "parse_address",
]
