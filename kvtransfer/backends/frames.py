"""What the backends share about frames: fast header encoding, splitting a message into frames,
the per-channel handler thread, and what a server refuses before its handler sees a frame.

A server hands the handler only frames whose header passed ChunkHeader's checks. In place of a
frame it refuses it hands `refusal(...)` (an "abort" with a RefusedFrame payload), so the request
fails with the reason: a header with bad fields that still names its request, or an in-place
frame on a backend where the sender cannot have written the KV itself (only shm can: a layer
counts as written only when its bytes arrived).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import struct
import threading

import msgpack
import torch

from pdserve.kvtransfer.transport import FrameHandler, refusal
from pdserve.kvtransfer.wire import (
    OMIT_WHEN_EMPTY,
    PAYLOAD_KINDS,
    ChunkHeader,
    WireError,
    header_from_fields,
    split_frame,
)

log = logging.getLogger(__name__)

IN_PLACE_REFUSED = (
    "in-place KV frames are only valid on the shm backend: this server received no "
    "bytes for that layer (send the KV as the frame's payload, or use the shm backend "
    "on the decode worker's host)"
)

_HEADER_FIELDS = tuple(f.name for f in dataclasses.fields(ChunkHeader))
_HEADER_LENGTH = struct.Struct("<I")  # the wire frame's length prefix


def encode_header(header: ChunkHeader) -> bytes:
    """The msgpack header of `encode_frame`, byte for byte, without dataclasses.asdict's deep
    copy, a large share of the send path's cost. Empty optional fields are left out, as
    encode_frame does."""
    fields = {name: getattr(header, name) for name in _HEADER_FIELDS}
    for name in OMIT_WHEN_EMPTY:
        if not fields[name]:
            del fields[name]
    return msgpack.packb(fields)


def frame_pieces(header: ChunkHeader, payload: bytes | memoryview = b"") -> list:
    """`encode_frame`: the pieces of one frame, in order, without copying the payload."""
    head = encode_header(header)
    return [_HEADER_LENGTH.pack(len(head)), head, payload]


def carries_payload(header: ChunkHeader) -> bool:
    """Whether the frame's payload follows its header (else the frame ends with its header)."""
    return header.kind in PAYLOAD_KINDS and not header.in_place


def host_copy(data: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor of `data`'s values: `data` itself when it already is one.

    A CUDA tensor (a chunk read_chunk took out of a CUDA cache) is copied into fresh pinned
    (page-locked) host memory: the copy is one DMA transfer, where pageable memory would go through
    the driver's own staging buffer first. The copy is blocking (non_blocking=False), so the bytes
    are on the host when this returns, and the chunk may be freed or reused at once. The pinned
    block goes back to torch's caching host allocator once the frame is sent, so the next chunk of
    that size takes it without a new cudaHostAlloc."""
    data = data.detach()
    if data.is_cuda:
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        host.copy_(data, non_blocking=False)
        return host
    return data.to("cpu").contiguous()


def payload_view(data: torch.Tensor | None) -> memoryview | bytes:
    """The raw bytes of a tensor, without a copy when it is already contiguous on the CPU (a CUDA
    tensor is copied to the host through pinned memory: `host_copy`)."""
    if data is None:
        return b""
    flat = host_copy(data).view(-1)
    if flat.numel() == 0:
        return b""
    return memoryview(flat.view(torch.uint8).numpy())


def iter_frames(message):
    """The frames of one Push message: (header, payload) each, or (WireError, None) for a frame
    whose fields are bad. Where a frame ends depends only on its raw kind and in_place, so the
    frames after a bad one still split; a WireError raised here means the framing itself is
    broken and nothing after it can be found."""
    view = memoryview(message)
    while True:
        fields, rest = split_frame(view)
        try:
            header = header_from_fields(fields)
        except WireError as e:
            header = e
        in_place = fields.get("in_place", False) is True
        if fields.get("kind", "kv") in PAYLOAD_KINDS and not in_place:
            yield header, (rest if isinstance(header, ChunkHeader) else None)
            return
        yield header, (None if in_place or not isinstance(header, ChunkHeader) else rest[:0])
        if not len(rest):
            return
        view = rest


def split_message(message) -> list[tuple[ChunkHeader, memoryview | None]]:
    """The frames of one Push message, with the payload each handler call gets; WireError on the
    first bad one."""
    frames = list(iter_frames(message))
    for header, _ in frames:
        if isinstance(header, WireError):
            raise header
    return frames


def screen(header: ChunkHeader | WireError, payload, accepts_in_place: bool, where: str):
    """What the handler gets for one received frame: the frame itself, a refusal that fails its
    request, or None (a bad frame that names no request: logged and dropped)."""
    if isinstance(header, WireError):
        log.warning("refused a KV frame on %s: %s", where, header)
        if header.request_id is None:
            return None
        return refusal(header.request_id, f"bad KV frame: {header}")
    if header.in_place and not accepts_in_place:
        log.warning("refused an in-place KV frame for %s on %s", header.request_id, where)
        return refusal(header.request_id, IN_PLACE_REFUSED)
    return header, payload


class ByteQueue:
    """Items in arrival order with the bytes they hold, under one condition: the producer checks
    `num_bytes` against its bound, the consumer `take`s and then `release`s an item's bytes."""

    def __init__(self):
        self.items: collections.deque = collections.deque()
        self.num_bytes = 0
        self.closed = False
        self.cond = threading.Condition()

    def take(self):
        """The oldest item, waiting for one; None once closed and empty."""
        with self.cond:
            while not self.items and not self.closed:
                self.cond.wait(1.0)
            return self.items.popleft() if self.items else None

    def release(self, nbytes: int) -> None:
        with self.cond:
            self.num_bytes -= nbytes
            self.cond.notify_all()

    def close(self, drop: bool = False) -> None:
        """No more items: `take` returns what is queued (none with drop), then None."""
        with self.cond:
            self.closed = True
            if drop:
                self.items.clear()
            self.cond.notify_all()


class FrameWorker:
    """Runs `handle(item)` for one channel's items in arrival order on its own thread, so the
    channel's reader can take the next frame meanwhile. Holds at most max_bytes of payloads (and
    always one item): `put` blocks beyond that, which backs up to the sender.
    max_bytes <= 0: no thread, `put` runs the handler itself."""

    def __init__(self, handle, name: str, max_bytes: int = 64 << 20):
        self._handle = handle
        self._max_bytes = max_bytes
        self._queue = ByteQueue()
        self._thread = None
        if max_bytes > 0:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def put(self, item, nbytes: int) -> None:
        q = self._queue
        if self._thread is None:
            if not q.closed:
                self._handle(item)
            return
        with q.cond:
            while q.items and q.num_bytes + nbytes > self._max_bytes and not q.closed:
                q.cond.wait(0.5)
            if q.closed:
                return
            q.items.append((item, nbytes))
            q.num_bytes += nbytes
            q.cond.notify_all()

    def close(self, drain: bool, timeout: float | None = None) -> None:
        """Stop after the queued items (drain) or right after the item in hand; joins the thread."""
        self._queue.close(drop=not drain)
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while (entry := self._queue.take()) is not None:
            item, nbytes = entry
            self._queue.release(nbytes)
            self._handle(item)


def call_handler(handler: FrameHandler, header: ChunkHeader, payload) -> None:
    try:
        handler(header, payload)
    except Exception:  # one request's trouble must not close a channel that carries others
        log.exception(
            "KV frame handler failed for request %s (%s frame)", header.request_id, header.kind
        )
