"""The gRPC backend's sender side (GrpcTransport) and the names both sides share; the protocol is
described in grpc_backend.

A transport holds one gRPC channel (carrying the cluster secret on every call) and one Push stream
on it at a time. Opening a stream waits until the server has admitted it (a Flush for the new
stream's id answers >= 0), so a wrong secret, a full server or no server at all surfaces at
`connect` as ConnectionError (ConnectionRefusedError for the secret), not at a later send.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import grpc
import msgpack
import torch

from pdserve.kvtransfer.backends.frames import (
    ByteQueue,
    carries_payload,
    frame_pieces,
    payload_view,
)
from pdserve.kvtransfer.transport import Destination, Transport
from pdserve.kvtransfer.wire import ChunkHeader
from pdserve.protos import keepalive
from pdserve.protos.security import INSECURE, ClusterSecurity

log = logging.getLogger(__name__)

SERVICE = "pdserve.kv.v1.KVTransfer"
PUSH_METHOD = f"/{SERVICE}/Push"
FLUSH_METHOD = f"/{SERVICE}/Flush"
CHANNEL_METADATA_KEY = "pdserve-kv-channel"
MAX_CHANNEL_ID_CHARS = 64  # a channel id is a uuid4 hex (32)
MAX_MESSAGE_BYTES = 512 << 20  # a frame is one message; a layer of a long prompt is tens of MB
FLUSH_POLL_S = 0.5  # one Flush RPC waits at most this long on the server
ADMIT_POLL_S = 0.1  # ... and this long while a new stream is being admitted
MAX_FRAMES_PER_MESSAGE = 256
# how a stream may end and be reopened when nothing sent on it is unconfirmed: the server closed
# it (idle or evicted: CANCELLED) or lost it (UNAVAILABLE, the reopen then fails fast if it is gone)
_REOPENABLE = (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def channel_options(max_message_bytes: int, extra=()) -> list[tuple[str, object]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # a stopped peer fails the push within ~20 s instead of holding it (protos/keepalive.py);
        # the receiving server takes the server half, both ends use the same list
        *keepalive.CLIENT_OPTIONS,
        *keepalive.SERVER_OPTIONS,
        *extra,
    ]


class _FrameQueue(ByteQueue):
    """Frames waiting for the gRPC stream, bounded in bytes (one message always fits); its items
    are [pieces, nbytes, ends payload-less, frames].

    A frame joins the last queued message when that message ends with a payload-less frame
    (see grpc_backend's docstring), so header-only traffic rides in few messages."""

    def __init__(self, max_bytes: int):
        super().__init__()
        self._max_bytes = max_bytes

    def put(
        self, pieces: list, payload_less: bool, timeout: float, failed, num_frames: int = 1
    ) -> None:
        """Blocks while the queue is full; raises TimeoutError when it took nothing for `timeout`
        seconds (a stopped or hung receiver), however long a steadily draining queue takes."""
        nbytes = sum(len(p) for p in pieces)
        deadline = time.monotonic() + timeout
        with self.cond:
            seen = self.num_bytes
            while self.items and self.num_bytes + nbytes > self._max_bytes:
                if failed():
                    return
                if self.num_bytes < seen:  # the receiver took some: it is alive
                    seen, deadline = self.num_bytes, time.monotonic() + timeout
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"the KV channel stayed full ({self.num_bytes} bytes queued) with "
                        f"nothing taken for {timeout}s: the receiver is stopped or hung"
                    )
                self.cond.wait(min(remaining, 0.1))
            tail = self.items[-1] if self.items else None
            if tail is not None and tail[2] and tail[3] + num_frames <= MAX_FRAMES_PER_MESSAGE:
                tail[0].extend(pieces)
                tail[1] += nbytes
                tail[2] = payload_less
                tail[3] += num_frames
            else:
                self.items.append([list(pieces), nbytes, payload_less, num_frames])
            self.num_bytes += nbytes
            self.cond.notify_all()

    def drain(self):
        """The request iterator of the Push call: messages in order, until closed and empty."""
        while (entry := self.take()) is not None:
            pieces, nbytes, _, _ = entry
            message = b"".join(pieces)  # the one copy of the payload on this side
            self.release(nbytes)
            yield message


class _Stream:
    """One Push call: its id, its queue, and how many of its frames were sent and confirmed."""

    def __init__(self, push_rpc, max_queued_bytes: int, wait_for_ready: bool):
        self.id = uuid.uuid4().hex
        self.queue = _FrameQueue(max_queued_bytes)
        self.messages = self.queue.drain()
        self.sent = self.confirmed = 0
        # one Flush call in flight per stream (the server bounds its concurrent calls): it asks
        # for the lowest frame count a flush waits for, and its answer confirms every frame the
        # server has handled, for all of them
        self.asking = threading.Lock()
        self.flush_targets: list[int] = []
        self.ended = (
            threading.Event()
        )  # (the call's own done() takes a lock gRPC's threads hold often)
        self.call = push_rpc.future(
            self.messages,
            metadata=((CHANNEL_METADATA_KEY, self.id),),
            wait_for_ready=wait_for_ready,
        )
        self.call.add_done_callback(lambda _: self.ended.set())
        self.stalled: TimeoutError | None = None  # set when the receiver stopped taking frames

    def code(self) -> grpc.StatusCode:
        """How the ended call ended."""
        if self.call.cancelled():
            return grpc.StatusCode.CANCELLED
        err = self.call.exception()
        return grpc.StatusCode.OK if err is None else err.code()

    def failure(self, address: str) -> ConnectionError:
        if self.stalled is not None:
            return ConnectionError(f"the KV channel to {address} failed: {self.stalled}")
        if self.call.cancelled():
            return ConnectionError(f"the KV channel to {address} was cancelled")
        err = self.call.exception()
        if err is None:
            return ConnectionError(f"the KV transfer server at {address} ended the channel")
        if err.code() == grpc.StatusCode.CANCELLED:
            return ConnectionError(
                f"the KV transfer server at {address} closed the channel (it was idle "
                f"and its slot was needed, or the server stopped) before frames "
                f"sent on it were confirmed"
            )
        kind = ConnectionRefusedError if err.code() in _REFUSALS else ConnectionError
        return kind(f"the KV channel to {address} failed: {err.code().name}: {err.details()}")

    def finish(self, timeout: float) -> None:
        """Ends the stream once its queued frames are out (or the call is over)."""
        self.queue.close()
        try:
            self.call.result(timeout=timeout)
        except Exception as e:  # the server is gone or slow: closing the channel cancels the call
            log.debug("KV stream %s ended with %r", self.id[:8], e)

    def release(self) -> None:
        # the request iterator may still sit in gRPC's consumer thread; finishing it lets that thread go
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                self.messages.close()
                return
            except ValueError:  # "generator already executing": it is about to see the close
                time.sleep(0.005)


class GrpcTransport(Transport):
    """Sender side: one Push stream at a time on one channel.

    `send` puts the frame on a queue bounded in bytes (backpressure) that gRPC's request-iterator
    thread drains into the stream, so `send` returns quickly and frames keep their order. `flush`
    asks the server until it has handled every frame sent so far, or the deadline passes;
    concurrent flushes share one Flush call at a time (the server admits 2 * max_channels + 2
    calls in all). A stream the server closed (idle, or evicted for a new sender) is reopened at
    the next send when a flush confirmed every frame sent on it; otherwise the send raises
    ConnectionError (frames may be lost) and the caller opens a fresh transport.

    timeout bounds connecting (and reopening), a `send` blocked on a full queue that takes nothing
    (then the stream fails for every sender), and `close`. The
    payload is read when gRPC takes the frame, not during `send`: do not modify it until `flush`
    returns (read_chunk hands out a fresh tensor per chunk). security: the deployment's cluster
    secret (and TLS) the server expects.
    """

    def __init__(
        self,
        address: str,
        timeout: float = 10.0,
        max_queued_bytes: int = 64 << 20,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        grpc_options=(),
        *,
        security: ClusterSecurity = INSECURE,
    ):
        self._address, self._timeout, self._max_queued_bytes = address, timeout, max_queued_bytes
        self._channel = security.channel(address, channel_options(max_message_bytes, grpc_options))
        self._flush_rpc = self._channel.unary_unary(FLUSH_METHOD)
        self._push_rpc = self._channel.stream_unary(PUSH_METHOD)
        self._lock = threading.Lock()  # frames enter the queue in send order
        self._closed = False
        try:
            # a fresh server may still be starting: wait for it, up to timeout
            self._stream = self._open_stream(wait_for_ready=True)
        except BaseException:
            self._channel.close()
            raise

    def _ask(
        self,
        stream: _Stream,
        frames: int,
        wait_s: float,
        timeout: float,
        wait_for_ready: bool | None = None,
    ) -> int:
        ask = msgpack.packb({"channel": stream.id, "frames": frames, "wait_s": wait_s})
        try:
            reply = msgpack.unpackb(
                self._flush_rpc(ask, timeout=timeout, wait_for_ready=wait_for_ready)
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(e.details()) from None
            kind = ConnectionRefusedError if e.code() in _REFUSALS else ConnectionError
            hint = (
                " (both workers need the deployment's cluster secret)"
                if e.code() in _REFUSALS
                else ""
            )
            raise kind(
                f"the KV transfer server at {self._address} refused this sender: "
                f"{e.code().name}: {e.details()}{hint}"
            ) from None
        return int(reply["frames"])

    def _open_stream(self, wait_for_ready: bool) -> _Stream:
        """A new Push stream, once the server admitted it."""
        deadline = time.monotonic() + self._timeout
        stream = _Stream(self._push_rpc, self._max_queued_bytes, wait_for_ready)
        try:
            while True:
                if stream.ended.is_set():  # refused: a full server, a bad channel id...
                    raise stream.failure(self._address)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ConnectionError(
                        f"no KV transfer server answered at {self._address} within {self._timeout}s"
                    )
                try:
                    if (
                        self._ask(
                            stream, 0, min(remaining, ADMIT_POLL_S), remaining, wait_for_ready
                        )
                        >= 0
                    ):
                        return stream
                except TimeoutError:
                    continue  # the loop raises ConnectionError
        except BaseException:
            stream.call.cancel()
            stream.finish(0)
            stream.release()
            raise

    def _usable_stream(self) -> _Stream:
        """The open stream; a closed one is replaced when none of its frames can have been lost."""
        if self._closed:
            raise RuntimeError("this KV transport is closed")
        stream = self._stream
        if not stream.ended.is_set():
            return stream
        if stream.stalled or stream.sent != stream.confirmed or stream.code() not in _REOPENABLE:
            raise stream.failure(self._address)
        log.info(
            "KV channel to %s was closed by the server (%s); reopening it",
            self._address,
            stream.code().name,
        )
        stream.finish(0)
        stream.release()
        self._stream = self._open_stream(wait_for_ready=False)  # a server that is gone fails fast
        return self._stream

    def _queue(self, pieces: list, payload_less: bool, num_frames: int) -> None:
        with self._lock:
            stream = self._usable_stream()
            try:
                stream.queue.put(
                    pieces, payload_less, self._timeout, stream.ended.is_set, num_frames
                )
            except TimeoutError as e:
                # the stream is dead to every sender: the next one fails at once, instead of
                # each waiting out the timeout on its own (an engine thread waits here)
                stream.stalled = e
                stream.call.cancel()
                raise stream.failure(self._address) from None
            if stream.ended.is_set():
                raise stream.failure(self._address)
            stream.sent += num_frames

    def send(self, header: ChunkHeader, data: torch.Tensor | None, dest: Destination) -> None:
        payload = payload_view(data)
        if len(payload) and not carries_payload(header):
            raise ValueError(
                f"a {header.kind} frame{' written in place' if header.in_place else ''} "
                f"carries no payload (request {header.request_id})"
            )
        self._queue(frame_pieces(header, payload), not carries_payload(header), 1)

    def send_headers(self, headers: list[ChunkHeader]) -> None:
        """Queue payload-less frames (commit, abort, in-place kv) to travel in one message."""
        if not headers:
            return
        if any(carries_payload(h) for h in headers):
            raise ValueError(
                "send_headers takes only frames without a payload (commit, abort, in-place kv)"
            )
        self._queue([piece for h in headers for piece in frame_pieces(h)[:2]], True, len(headers))

    def flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._closed:
                raise RuntimeError("this KV transport is closed")
            stream, target = self._stream, self._stream.sent
            stream.flush_targets.append(target)
        try:
            while target > stream.confirmed:
                if stream.ended.is_set():
                    raise stream.failure(self._address)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"the KV transfer server at {self._address} did not handle "
                        f"{target} frames within {timeout}s"
                    )
                if stream.asking.acquire(timeout=min(remaining, FLUSH_POLL_S)):
                    try:
                        self._ask_for_waiters(stream, remaining)
                    finally:
                        stream.asking.release()
        finally:
            with self._lock:
                stream.flush_targets.remove(target)

    def _ask_for_waiters(self, stream: _Stream, remaining: float) -> None:
        """One Flush call (the caller holds stream.asking) for the lowest count still awaited."""
        with self._lock:
            pending = [t for t in stream.flush_targets if t > stream.confirmed]
        if not pending:
            return  # the last answer confirmed them all
        try:
            handled = self._ask(stream, min(pending), min(remaining, FLUSH_POLL_S), remaining)
        except TimeoutError:
            return  # the caller's loop raises TimeoutError past its deadline
        with self._lock:  # frames are handled in order: the first `handled` are done
            stream.confirmed = max(stream.confirmed, min(handled, stream.sent))

    def call(self, method: str, request: bytes, timeout: float) -> bytes:
        """One unary call of another method of the server's service (`method` its full path) on
        this transport's channel, carrying the cluster secret. grpc.RpcError as raised."""
        return self._channel.unary_unary(method)(request, timeout=timeout)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stream = self._stream
        stream.finish(self._timeout)
        self._channel.close()
        stream.release()
