"""The transport interface: ordered frames from a prefill rank to a decode rank.

A channel is long-lived and carries the frames of many requests; frames on one channel arrive in
the order they were sent, so a request's "commit" always follows its KV. Backends:
  grpc   streamed bytes over a client-streaming RPC (any two hosts)
  shm    same host: KV is written straight into the decode worker's KV pool, which lives in shared
         memory; only the headers travel
  torch  torch.distributed send/recv over a process group of the two ranks (gloo on CPU, nccl on GPU)
  nixl   one-sided NIXL WRITEs into the decode worker's registered KV pool, the headers on gRPC
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.wire import ChunkHeader

# called on the receiving side for every frame, in channel order; payload is bytes-like or a
# tensor, None when the sender already wrote the KV in place (shm), or a RefusedFrame
FrameHandler = Callable[[ChunkHeader, object], None]


@dataclass(frozen=True)
class RefusedFrame:
    """The payload of the "abort" header a server hands the handler in place of a frame it refused
    (an in-place frame off the shm backend, an unreadable header naming a request): the request
    fails with `reason`. A handler that knows nothing of it still sees an abort."""

    reason: str


def refusal(request_id: str, reason: str) -> tuple[ChunkHeader, RefusedFrame]:
    """What to hand the handler so that `request_id` fails with `reason`."""
    return ChunkHeader(request_id, "", kind="abort"), RefusedFrame(reason)


@dataclass(frozen=True)
class PipelineStage:
    """Which part of a pipelined sender pushes a request's KV (nixl only: its claims say it, so
    that the decode side can tell the stages of one sender from senders racing each other):
    pipeline stage `stage` of `stages`, its pushing rank `rank` there, the decoder layers
    [first, end) it writes, and `sender`, the id every stage of one prefill attempt shares (made
    by rank 0 per request, random: a claim that names it is one of that attempt's stages)."""

    sender: str
    stage: int
    stages: int
    layers: tuple[int, int]
    rank: int = 0


@dataclass(frozen=True)
class Destination:
    """Where a request's KV goes on one decode rank (from its reservation). grant: the
    reservation's write grant (KVEndpoint.write_grant; the claiming backends, nixl and shm:
    kvtransfer/backends/claims.py): what the receiver checks every claim and frame of the request
    against. stage: the sender's pipeline stage when it pushes in stages (the claiming backends;
    None: the whole model's KV from one sender)."""

    block_ids: list[int]
    layout: KVLayout
    grant: str = ""
    stage: PipelineStage | None = None


class Transport(ABC):
    """Sender side of one channel."""

    # whether frames other than in-place KV carry their payload ("state", "draft"): nixl's and
    # cuda_ipc's do not (they write KV in place only)
    carries_payload_frames = True

    @abstractmethod
    def send(self, header: ChunkHeader, data: torch.Tensor | None, dest: Destination) -> None:
        """Queue one frame. May block briefly when the channel is full (backpressure)."""

    def send_paged(
        self,
        header: ChunkHeader,
        layer_kv: torch.Tensor,
        block_ids: list[int],
        dest: Destination,
    ) -> bool:
        """Send a "kv" chunk straight out of the sender's paged pool, where this transport can:
        layer_kv is that layer of the pool ([2, blocks, block_size, heads, head_dim], all of the
        header's heads), block_ids the request's blocks in it. False (the default): the caller
        gathers the chunk (kvtransfer.reshard.read_chunk) and calls `send`."""
        return False

    @abstractmethod
    def flush(self, timeout: float) -> None:
        """Return once every frame sent so far was handed to the receiver; raise TimeoutError."""

    @abstractmethod
    def close(self) -> None: ...


class TransportServer(ABC):
    """Receiver side: accepts channels and calls the handler for each frame. Once listening it
    sets `address`: what a sender passes to `connect` (host:port, a shm name, a store address)."""

    address: str

    @abstractmethod
    def stop(self) -> None: ...
