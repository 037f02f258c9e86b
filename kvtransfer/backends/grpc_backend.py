"""gRPC backend: one long-lived client-streaming RPC per channel, one stream message per frame.

No .proto: the service is registered with generic handlers whose (de)serializers are the identity
on bytes, so KV bytes never pass through protobuf.

  /pdserve.kv.v1.KVTransfer/Push   client-streaming; each message is one wire frame
                                   (u32 header length | msgpack header | payload); the channel id
                                   rides in the call metadata; the reply is b"" when the stream ends
  /pdserve.kv.v1.KVTransfer/Flush  unary; msgpack {"channel", "frames", "wait_s"} -> msgpack
                                   {"frames": frames of that channel the handler returned from}
                                   (-1: no open stream with that id); waits up to wait_s for "frames"

Sender: `send` encodes the frame (one join of the pieces) and puts it on a queue bounded in bytes
(backpressure); gRPC's request-iterator thread drains the queue into the stream, so `send` returns
quickly and frames keep their order. `flush` asks the server until it has handled every frame sent
so far on this channel, or the deadline passes.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from concurrent import futures

import grpc
import msgpack
import torch

from kvtransfer.transport import Destination, FrameHandler, Transport, TransportServer
from kvtransfer.wire import ChunkHeader, WireError, decode_frame, encode_frame

log = logging.getLogger(__name__)

SERVICE = "pdserve.kv.v1.KVTransfer"
PUSH_METHOD = f"/{SERVICE}/Push"
FLUSH_METHOD = f"/{SERVICE}/Flush"
CHANNEL_METADATA_KEY = "pdserve-kv-channel"
MAX_MESSAGE_BYTES = 512 << 20       # one frame is one message; a layer of a long prompt is tens of MB
FLUSH_POLL_S = 0.5                  # one Flush RPC waits at most this long on the server


def channel_options(max_message_bytes: int, extra=()) -> list[tuple[str, object]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes), *extra]


def payload_view(data: torch.Tensor | None) -> memoryview | bytes:
    """The raw bytes of a tensor, without a copy when it is already contiguous on the CPU."""
    if data is None:
        return b""
    flat = data.detach().to("cpu").contiguous().view(-1)
    if flat.numel() == 0:
        return b""
    return memoryview(flat.view(torch.uint8).numpy())


class GrpcServer(TransportServer):
    """Receives frames on any number of streams and calls the handler per frame, in stream order.

    max_channels bounds the concurrent streams (each holds one server thread while open).
    """

    def __init__(self, handler: FrameHandler, host: str = "127.0.0.1", port: int = 0,
                 max_channels: int = 16, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 stop_grace: float = 0.2, grpc_options=()):
        self._handler = handler
        self._max_channels = max_channels
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

    def handled_frames(self) -> dict[str, int]:
        with self._cond:
            return dict(self._handled)

    def _push(self, request_iterator, context):
        channel = dict(context.invocation_metadata()).get(CHANNEL_METADATA_KEY)
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
        try:
            for message in request_iterator:
                try:
                    header, payload = decode_frame(message)
                except WireError as e:   # the peer speaks another format: this channel is unusable
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV frame on channel {channel}: {e}")
                self._call_handler(header, payload)
                with self._cond:
                    self._handled[channel] += 1
                    self._cond.notify_all()
        except grpc.RpcError:            # the client went away or the server is stopping
            pass
        finally:
            with self._cond:
                self._handled.pop(channel, None)
                self._cond.notify_all()
        return b""

    def _call_handler(self, header: ChunkHeader, payload: memoryview) -> None:
        try:
            self._handler(header, None if header.in_place else payload)
        except Exception:   # one request's trouble must not close a channel that carries others
            log.exception("KV frame handler failed for request %s (%s frame)", header.request_id,
                          header.kind)

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
        # cancels the open streams; their handler threads leave at the next frame boundary
        self._server.stop(grace=self._stop_grace).wait(self._stop_grace + 5.0)
        self._executor.shutdown(wait=True)


class _FrameQueue:
    """Encoded frames waiting for the gRPC stream, bounded in bytes (one frame always fits)."""

    def __init__(self, max_bytes: int):
        self._max_bytes = max_bytes
        self._items: collections.deque[bytes] = collections.deque()
        self._bytes = 0
        self._closed = False
        self._cond = threading.Condition()

    def put(self, frame: bytes, timeout: float, failed) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._items and self._bytes + len(frame) > self._max_bytes:
                if failed():
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the KV channel stayed full ({self._bytes} bytes queued) for "
                                       f"{timeout}s: the receiver is not keeping up")
                self._cond.wait(min(remaining, 0.1))
            self._items.append(frame)
            self._bytes += len(frame)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain(self):
        """The request iterator of the Push call: frames in order, until closed and empty."""
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait(1.0)
                if not self._items:
                    return
                frame = self._items.popleft()
                self._bytes -= len(frame)
                self._cond.notify_all()
            yield frame


class GrpcTransport(Transport):
    """Sender side: one Push stream for the life of the transport.

    timeout bounds connecting, a `send` blocked on a full queue, and `close`.
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
        self._frames = self._queue.drain()
        self._flush_rpc = self._channel.unary_unary(FLUSH_METHOD)
        self._call = self._channel.stream_unary(PUSH_METHOD).future(
            self._frames, metadata=((CHANNEL_METADATA_KEY, self._id),))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this KV transport is closed")
        if self._call.done():
            if self._call.cancelled():
                raise ConnectionError(f"the KV channel to {self._address} was cancelled")
            err = self._call.exception()
            if err is None:
                raise ConnectionError(f"the KV transfer server at {self._address} ended the channel")
            raise ConnectionError(f"the KV channel to {self._address} failed: "
                                  f"{err.code().name}: {err.details()}")

    def send(self, header: ChunkHeader, data: torch.Tensor | None, dest: Destination) -> None:
        frame = b"".join(encode_frame(header, payload_view(data)))
        with self._lock:
            self._check_open()
            self._queue.put(frame, self._timeout, self._call.done)
            self._check_open()
            self._frames_sent += 1

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
                self._frames.close()
                break
            except ValueError:    # "generator already executing": it is about to see the close
                time.sleep(0.005)
