"""gRPC backend: one long-lived client-streaming RPC per channel.

No .proto: the service is registered with generic handlers whose (de)serializers are the identity
on bytes, so KV bytes never pass through protobuf.

  /pdserve.kv.v1.KVTransfer/Push   client-streaming; each message holds wire frames
                                   (u32 header length | msgpack header | payload); the channel id
                                   rides in the call metadata; the reply is b"" when the stream ends
  /pdserve.kv.v1.KVTransfer/Flush  unary; msgpack {"channel", "frames", "wait_s"} -> msgpack
                                   {"frames": frames of that channel the handler returned from}
                                   (-1: no open stream with that id); waits up to wait_s for "frames"

A message is one frame, or several when the sender had payload-less frames queued ("commit",
"abort", in-place "kv" headers of the shm backend): such a frame ends right after its header, so
frames that follow it in the message are read as frames; a frame with a payload is always the
last one of its message and its payload runs to the message's end. A single frame per message
is therefore the plain wire format; the batching only saves gRPC's per-message cost (about
100 us of CPU a side) for header-only traffic.

Sender: `send` puts the frame on a queue bounded in bytes (backpressure); gRPC's request-iterator
thread drains it into the stream (joining each message's pieces once), so `send` returns quickly
and frames keep their order. `flush` asks the server until it has handled every frame sent so far
on this channel, or the deadline passes.

Receiver: the RPC's thread reads each message and runs the handler on its frames, in order. With
max_backlog_bytes > 0 a per-channel worker thread runs the handler instead, so receiving the next
frame overlaps handling this one; on the 2-core bench machine that measured no faster (gRPC's
Python threads and the handler contend for the GIL), so it is off by default.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import struct
import threading
import time
import uuid
from concurrent import futures

import grpc
import msgpack
import torch

from kvtransfer.transport import Destination, FrameHandler, Transport, TransportServer
from kvtransfer.wire import ChunkHeader, WireError, decode_frame

log = logging.getLogger(__name__)

SERVICE = "pdserve.kv.v1.KVTransfer"
PUSH_METHOD = f"/{SERVICE}/Push"
FLUSH_METHOD = f"/{SERVICE}/Flush"
CHANNEL_METADATA_KEY = "pdserve-kv-channel"
MAX_MESSAGE_BYTES = 512 << 20       # a frame is one message; a layer of a long prompt is tens of MB
FLUSH_POLL_S = 0.5                  # one Flush RPC waits at most this long on the server
MAX_FRAMES_PER_MESSAGE = 256


def channel_options(max_message_bytes: int, extra=()) -> list[tuple[str, object]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes), *extra]


_HEADER_FIELDS = tuple(f.name for f in dataclasses.fields(ChunkHeader))
_HEADER_LENGTH = struct.Struct("<I")     # the wire frame's length prefix


def encode_header(header: ChunkHeader) -> bytes:
    """The msgpack header of `encode_frame`, byte for byte, without dataclasses.asdict's deep
    copy (about 80 us a frame, as much as the rest of the send path)."""
    return msgpack.packb({name: getattr(header, name) for name in _HEADER_FIELDS})


def frame_pieces(header: ChunkHeader, payload: bytes | memoryview = b"") -> list:
    """`encode_frame`: the pieces of one frame, in order, without copying the payload."""
    head = encode_header(header)
    return [_HEADER_LENGTH.pack(len(head)), head, payload]


def carries_payload(header: ChunkHeader) -> bool:
    """Whether the frame's payload follows its header (else the frame ends with its header)."""
    return header.kind == "kv" and not header.in_place


def payload_view(data: torch.Tensor | None) -> memoryview | bytes:
    """The raw bytes of a tensor, without a copy when it is already contiguous on the CPU."""
    if data is None:
        return b""
    flat = data.detach().to("cpu").contiguous().view(-1)
    if flat.numel() == 0:
        return b""
    return memoryview(flat.view(torch.uint8).numpy())


def split_message(message) -> list[tuple[ChunkHeader, memoryview | None]]:
    """The frames of one Push message, with the payload each handler call gets."""
    frames, view = [], memoryview(message)
    while True:
        header, rest = decode_frame(view)
        if carries_payload(header):
            frames.append((header, rest))
            return frames
        frames.append((header, None if header.in_place else rest[:0]))
        if not len(rest):
            return frames
        view = rest


class FrameWorker:
    """Runs `handle(item)` for one channel's items in arrival order on its own thread, so the
    channel's reader can take the next frame meanwhile. Holds at most max_bytes of payloads (and
    always one item): `put` blocks beyond that, which backs up to the sender.
    max_bytes <= 0: no thread, `put` runs the handler itself."""

    def __init__(self, handle, name: str, max_bytes: int = 64 << 20):
        self._handle = handle
        self._max_bytes = max_bytes
        self._items: collections.deque = collections.deque()
        self._bytes = 0
        self._closing = False
        self._cond = threading.Condition()
        self._thread = None
        if max_bytes > 0:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def put(self, item, nbytes: int) -> None:
        if self._thread is None:
            if not self._closing:
                self._handle(item)
            return
        with self._cond:
            while self._items and self._bytes + nbytes > self._max_bytes and not self._closing:
                self._cond.wait(0.5)
            if self._closing:
                return
            self._items.append((item, nbytes))
            self._bytes += nbytes
            self._cond.notify_all()

    def close(self, drain: bool, timeout: float | None = None) -> None:
        """Stop after the queued items (drain) or right after the item in hand; joins the thread."""
        with self._cond:
            self._closing = True
            if not drain:
                self._items.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closing:
                    self._cond.wait(1.0)
                if not self._items:
                    return
                item, nbytes = self._items.popleft()
                self._bytes -= nbytes
                self._cond.notify_all()
            self._handle(item)


def call_handler(handler: FrameHandler, header: ChunkHeader, payload) -> None:
    try:
        handler(header, payload)
    except Exception:   # one request's trouble must not close a channel that carries others
        log.exception("KV frame handler failed for request %s (%s frame)", header.request_id, header.kind)


class GrpcServer(TransportServer):
    """Receives frames on any number of streams and calls the handler per frame, in stream order.

    max_channels bounds the concurrent streams (each holds a server thread while open);
    max_backlog_bytes > 0 runs the handler on a worker thread per channel, with at most that many
    payload bytes received but not yet handled.
    """

    def __init__(self, handler: FrameHandler, host: str = "127.0.0.1", port: int = 0,
                 max_channels: int = 16, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_backlog_bytes: int = 0, stop_grace: float = 0.2, grpc_options=()):
        self._handler = handler
        self._max_channels = max_channels
        self._max_backlog_bytes = max_backlog_bytes
        self._stop_grace = stop_grace
        self._cond = threading.Condition()
        self._handled: dict[str, int] = {}      # open channel id -> frames handled
        self._stopped = False
        # every open stream holds a thread; the rest serve Flush calls
        workers = 2 * max_channels + 2
        self._executor = futures.ThreadPoolExecutor(workers, thread_name_prefix="pdserve-kv-grpc")
        methods = grpc.method_handlers_generic_handler(SERVICE, {
            "Push": grpc.stream_unary_rpc_method_handler(self._push),
            "Flush": grpc.unary_unary_rpc_method_handler(self._flush),
        })
        self._server = grpc.server(self._executor, handlers=[methods],
                                   options=channel_options(max_message_bytes, grpc_options),
                                   maximum_concurrent_rpcs=workers)
        try:
            bound = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:
            self._executor.shutdown(wait=False)
            raise OSError(f"cannot listen on {host}:{port} for KV transfer: {e}") from None
        self._address = f"{host}:{bound}"
        self._server.start()

    @property
    def address(self) -> str:
        return self._address

    def _open(self, channel: str | None, context) -> None:
        if not channel:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a KV push stream needs a {CHANNEL_METADATA_KEY!r} metadata entry")
        with self._cond:
            if len(self._handled) >= self._max_channels:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"this KV transfer server already has {self._max_channels} open channels "
                              f"(raise max_channels)")
            if channel in self._handled:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"KV channel {channel} is already open")
            self._handled[channel] = 0
            self._cond.notify_all()

    def _push(self, request_iterator, context):
        channel = dict(context.invocation_metadata()).get(CHANNEL_METADATA_KEY)
        self._open(channel, context)

        def handle(frame):
            call_handler(self._handler, *frame)
            with self._cond:
                self._handled[channel] += 1
                self._cond.notify_all()

        worker = FrameWorker(handle, f"pdserve-kv-grpc-handler-{channel[:8]}", self._max_backlog_bytes)
        try:
            for message in request_iterator:
                try:
                    frames = split_message(message)
                except WireError as e:   # the peer speaks another format: this channel is unusable
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV frame on channel {channel}: {e}")
                for header, payload in frames:
                    worker.put((header, payload), 0 if payload is None else len(payload))
        except grpc.RpcError:            # the client went away or the server is stopping
            pass
        finally:
            # frames that arrived are handled (a sender's close returns after them), unless stopping
            worker.close(drain=not self._stopped)
            with self._cond:
                self._handled.pop(channel, None)
                self._cond.notify_all()
        return b""

    def _flush(self, request: bytes, context) -> bytes:
        try:
            ask = msgpack.unpackb(request)
            channel, frames = str(ask["channel"]), int(ask["frames"])
            wait_s = min(max(float(ask.get("wait_s", 0.0)), 0.0), FLUSH_POLL_S)
        except Exception as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad Flush request: {e}")
        with self._cond:
            self._cond.wait_for(lambda: self._stopped or self._handled.get(channel, -1) >= frames,
                                timeout=wait_s)
            return msgpack.packb({"frames": self._handled.get(channel, -1)})

    def stop(self) -> None:
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            self._cond.notify_all()
        # cancels the open streams; their threads leave after the frame in hand
        self._server.stop(grace=self._stop_grace).wait(self._stop_grace + 5.0)
        self._executor.shutdown(wait=True)


class _FrameQueue:
    """Frames waiting for the gRPC stream, bounded in bytes (one message always fits).

    A frame joins the last queued message when that message ends with a payload-less frame
    (see the module docstring), so header-only traffic rides in few messages."""

    def __init__(self, max_bytes: int):
        self._max_bytes = max_bytes
        self._items: collections.deque[list] = collections.deque()   # [pieces, nbytes, open, frames]
        self._bytes = 0
        self._closed = False
        self._cond = threading.Condition()

    def put(self, pieces: list, payload_less: bool, timeout: float, failed, num_frames: int = 1) -> None:
        nbytes = sum(len(p) for p in pieces)
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._items and self._bytes + nbytes > self._max_bytes:
                if failed():
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the KV channel stayed full ({self._bytes} bytes queued) for "
                                       f"{timeout}s: the receiver is not keeping up")
                self._cond.wait(min(remaining, 0.1))
            tail = self._items[-1] if self._items else None
            if tail is not None and tail[2] and tail[3] + num_frames <= MAX_FRAMES_PER_MESSAGE:
                tail[0].extend(pieces)
                tail[1] += nbytes
                tail[2] = payload_less
                tail[3] += num_frames
            else:
                self._items.append([list(pieces), nbytes, payload_less, num_frames])
            self._bytes += nbytes
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain(self):
        """The request iterator of the Push call: messages in order, until closed and empty."""
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait(1.0)
                if not self._items:
                    return
                pieces, nbytes, _, _ = self._items.popleft()
            message = b"".join(pieces)       # the one copy of the payload on this side
            with self._cond:
                self._bytes -= nbytes
                self._cond.notify_all()
            yield message


class GrpcTransport(Transport):
    """Sender side: one Push stream for the life of the transport.

    timeout bounds connecting, a `send` blocked on a full queue, and `close`. The payload is
    read when gRPC takes the frame, not during `send`: do not modify it until `flush` returns
    (read_chunk hands out a fresh tensor per chunk).
    """

    def __init__(self, address: str, timeout: float = 10.0, max_queued_bytes: int = 64 << 20,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, grpc_options=()):
        self._address = address
        self._timeout = timeout
        self._channel = grpc.insecure_channel(address, options=channel_options(max_message_bytes, grpc_options))
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise ConnectionError(f"no KV transfer server answered at {address} within {timeout}s") from None
        self._id = uuid.uuid4().hex
        self._lock = threading.Lock()    # frames enter the queue in send order
        self._frames_sent = 0
        self._closed = False
        self._queue = _FrameQueue(max_queued_bytes)
        self._messages = self._queue.drain()
        self._flush_rpc = self._channel.unary_unary(FLUSH_METHOD)
        self._call = self._channel.stream_unary(PUSH_METHOD).future(
            self._messages, metadata=((CHANNEL_METADATA_KEY, self._id),))
        self._ended = threading.Event()
        self._call.add_done_callback(lambda _: self._ended.set())

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this KV transport is closed")
        if self._ended.is_set():    # (the call's own done() takes a lock gRPC's threads hold often)
            if self._call.cancelled():
                raise ConnectionError(f"the KV channel to {self._address} was cancelled")
            err = self._call.exception()
            if err is None:
                raise ConnectionError(f"the KV transfer server at {self._address} ended the channel")
            raise ConnectionError(f"the KV channel to {self._address} failed: "
                                  f"{err.code().name}: {err.details()}")

    def send(self, header: ChunkHeader, data: torch.Tensor | None, dest: Destination) -> None:
        payload = payload_view(data)
        if len(payload) and not carries_payload(header):
            raise ValueError(f"a {header.kind} frame{' written in place' if header.in_place else ''} "
                             f"carries no payload (request {header.request_id})")
        pieces = frame_pieces(header, payload)
        with self._lock:
            self._check_open()
            self._queue.put(pieces, not carries_payload(header), self._timeout, self._ended.is_set)
            self._check_open()
            self._frames_sent += 1

    def send_headers(self, headers: list[ChunkHeader]) -> None:
        """Queue payload-less frames (commit, abort, in-place kv) to travel in one message."""
        if not headers:
            return
        if any(carries_payload(h) for h in headers):
            raise ValueError("send_headers takes only frames without a payload (commit, abort, in-place kv)")
        pieces = [piece for h in headers for piece in frame_pieces(h)[:2]]
        with self._lock:
            self._check_open()
            self._queue.put(pieces, True, self._timeout, self._ended.is_set, num_frames=len(headers))
            self._check_open()
            self._frames_sent += len(headers)

    def flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            target = self._frames_sent
        while True:
            self._check_open()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the KV transfer server at {self._address} did not handle "
                                   f"{target} frames within {timeout}s")
            ask = msgpack.packb({"channel": self._id, "frames": target,
                                 "wait_s": min(remaining, FLUSH_POLL_S)})
            try:
                reply = msgpack.unpackb(self._flush_rpc(ask, timeout=remaining))
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue         # the loop raises TimeoutError
                raise ConnectionError(f"flush on the KV channel to {self._address} failed: "
                                      f"{e.code().name}: {e.details()}") from None
            if reply["frames"] >= target:
                return

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.close()       # ends the stream once the queued frames are out
        try:
            self._call.result(timeout=self._timeout)
        except Exception as e:    # the server is gone or slow: closing the channel cancels the call
            log.debug("KV channel to %s ended with %r", self._address, e)
        self._channel.close()
        # the request iterator may still sit in gRPC's consumer thread; finishing it lets that thread go
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                self._messages.close()
                break
            except ValueError:    # "generator already executing": it is about to see the close
                time.sleep(0.005)
