"""gRPC backend: its protocol and its receiving side, GrpcServer; grpc_sender.GrpcTransport sends.

A decode rank starts one GrpcServer through `serve("grpc", handler)` and stops it when it stops.
Each sender holds one long-lived client-streaming Push call per channel. There is no .proto: the
service is registered with generic handlers whose (de)serializers are the identity on bytes, so
KV bytes never pass through protobuf.

  /pdserve.kv.v1.KVTransfer/Push   client-streaming; each message holds wire frames (u32 header
                                   length | msgpack header | payload); the channel id rides in the
                                   call metadata; the reply is b"" when the stream ends
  /pdserve.kv.v1.KVTransfer/Flush  unary; msgpack {"channel", "frames", "wait_s"} -> msgpack
                                   {"frames": frames of that channel the handler returned from}
                                   (-1: no open stream with that id); waits up to wait_s

Both calls need the cluster secret (protos/security.py); GrpcServer says what it refuses.
"""

from __future__ import annotations

import logging
import math
from concurrent import futures

import grpc
import msgpack

from pdserve.kvtransfer.backends.channels import ChannelTable, Refused, peer_host
from pdserve.kvtransfer.backends.frames import (  # noqa: F401
    FrameWorker,
    call_handler,
    frame_pieces,
    iter_frames,
    screen,
    split_message,
)
from pdserve.kvtransfer.backends.grpc_sender import (  # noqa: F401
    CHANNEL_METADATA_KEY,
    FLUSH_METHOD,
    FLUSH_POLL_S,
    MAX_CHANNEL_ID_CHARS,
    MAX_MESSAGE_BYTES,
    PUSH_METHOD,
    SERVICE,
    GrpcTransport,
    channel_options,
)
from pdserve.kvtransfer.transport import FrameHandler, TransportServer
from pdserve.kvtransfer.wire import WireError
from pdserve.protos.security import INSECURE, ClusterSecurity

log = logging.getLogger(__name__)

MAX_FLUSH_BYTES = 1024  # a Flush request is a map of three small fields
MAX_FLUSH_FRAMES = 1 << 62


def parse_flush(request: bytes) -> tuple[str, int, float]:
    """(channel, frames, wait_s) of a Flush request; ValueError says which field to fix."""
    if len(request) > MAX_FLUSH_BYTES:
        raise ValueError(f"a Flush request has at most {MAX_FLUSH_BYTES} bytes, got {len(request)}")
    try:
        ask = msgpack.unpackb(request)
    except Exception as e:
        raise ValueError(f"not msgpack ({e})") from None
    if not isinstance(ask, dict):
        raise ValueError('send a msgpack map {"channel": str, "frames": int, "wait_s": float}')
    channel, frames, wait_s = ask.get("channel"), ask.get("frames"), ask.get("wait_s", 0.0)
    if not isinstance(channel, str) or not 0 < len(channel) <= MAX_CHANNEL_ID_CHARS:
        raise ValueError(
            f'"channel" must be the stream\'s id, a string of 1 to {MAX_CHANNEL_ID_CHARS} '
            f"characters"
        )
    if (
        not isinstance(frames, int)
        or isinstance(frames, bool)
        or not 0 <= frames <= MAX_FLUSH_FRAMES
    ):
        raise ValueError(f'"frames" must be an int in [0, {MAX_FLUSH_FRAMES}], got {frames!r:.40}')
    if (
        not isinstance(wait_s, (int, float))
        or isinstance(wait_s, bool)
        or not math.isfinite(wait_s)
        or wait_s < 0
    ):
        raise ValueError(
            f'"wait_s" must be a finite number of seconds >= 0, got {wait_s!r:.40}: send '
            f"e.g. 0.5 (the server waits at most {FLUSH_POLL_S}s per call)"
        )
    return channel, frames, float(wait_s)


class GrpcServer(TransportServer):
    """Receives frames on any number of streams and calls the handler per frame, in stream order.

    A message is one frame, or several when the sender had payload-less frames queued ("commit",
    "abort", in-place "kv" headers): such a frame ends right after its header, and a frame with a
    payload is always the last of its message. In-place frames are refused here (only the shm
    backend's server takes them). The interceptor refuses a call without the cluster secret
    before any handler runs, so a refused stream holds no channel slot and no thread. Every Flush
    field and frame header is checked before work (kvtransfer.wire, backends.frames): a frame this
    server cannot use fails its request or is dropped, and only broken framing ends its channel.

    max_channels bounds the open streams (each holds a server thread), max_channels_per_peer those
    of one network address; idle_timeout_s closes a stream with no frame for that long, and a new
    stream at a limit evicts the longest-idle one idle at least min_idle_evict_s (backends.channels).
    The RPC's thread runs the handler; max_backlog_bytes > 0 runs it on a worker thread per channel
    instead, with at most that many payload bytes received but not yet handled (it was no faster:
    gRPC's Python threads and the handler contend for the GIL). security: who may push (INSECURE:
    anyone).
    """

    accepts_in_place = False  # the shm and nixl backends' control servers say True

    def extra_methods(self) -> dict:
        """More unary methods of the service, name -> handler(request bytes, context) -> bytes,
        with the identity (de)serializers and behind the same cluster-secret check (the nixl
        backend's control server adds its own)."""
        return {}

    def __init__(
        self,
        handler: FrameHandler,
        host: str = "127.0.0.1",
        port: int = 0,  # 0: a free port, then read .address
        max_channels: int = 16,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_backlog_bytes: int = 0,
        stop_grace: float = 0.2,
        grpc_options=(),
        *,
        security: ClusterSecurity = INSECURE,
        max_channels_per_peer: int = 8,
        idle_timeout_s: float = 60.0,
        min_idle_evict_s: float = 1.0,
    ):
        self._handler = handler
        self._max_backlog_bytes = max_backlog_bytes
        self._stop_grace = stop_grace
        self._stopped = False
        self._channels = ChannelTable(
            max_channels, min(max_channels_per_peer, max_channels), idle_timeout_s, min_idle_evict_s
        )
        # every open stream holds a thread; the rest serve Flush calls and streams being admitted
        workers = 2 * max_channels + 2
        self._executor = futures.ThreadPoolExecutor(workers, thread_name_prefix="pdserve-kv-grpc")
        methods = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Push": grpc.stream_unary_rpc_method_handler(self._push),
                "Flush": grpc.unary_unary_rpc_method_handler(self._flush),
                **{
                    name: grpc.unary_unary_rpc_method_handler(method)
                    for name, method in self.extra_methods().items()
                },
            },
        )
        self._server = grpc.server(
            self._executor,
            handlers=[methods],
            interceptors=security.server_interceptors(),
            options=channel_options(max_message_bytes, grpc_options),
            maximum_concurrent_rpcs=workers,
        )
        try:
            bound, why = security.add_port(self._server, f"{host}:{port}"), "the port is taken"
        except RuntimeError as e:
            bound, why = 0, e
        if not bound:
            self._channels.stop()
            self._executor.shutdown(wait=False)
            raise OSError(f"cannot listen on {host}:{port} for KV transfer: {why}")
        self.address = f"{host}:{bound}"
        self._server.start()

    @property
    def num_channels(self) -> int:
        return self._channels.num_open

    def _push(self, request_iterator, context):
        channel_id = dict(context.invocation_metadata()).get(CHANNEL_METADATA_KEY)
        if not isinstance(channel_id, str) or not 0 < len(channel_id) <= MAX_CHANNEL_ID_CHARS:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a KV push stream needs a {CHANNEL_METADATA_KEY!r} metadata entry of 1 to "
                f"{MAX_CHANNEL_ID_CHARS} characters",
            )
        try:
            channel = self._channels.admit(channel_id, peer_host(context.peer()), context)
        except Refused as e:
            context.abort(e.code, e.message)
        where = f"KV channel {channel_id[:8]} from {channel.peer}"

        def handle(item):
            if item is not None:
                call_handler(self._handler, *item)
            self._channels.done(channel)  # a dropped frame counts too: the sender counted it

        worker = FrameWorker(
            handle, f"pdserve-kv-grpc-handler-{channel_id[:8]}", self._max_backlog_bytes
        )
        self._stream_opened(context)
        ended_here = False  # this server ends the stream (bad framing)
        try:
            for message in request_iterator:
                try:
                    for header, payload in iter_frames(message):
                        self._channels.received(channel, 1)
                        worker.put(
                            screen(header, payload, self.accepts_in_place, where),
                            0 if payload is None else len(payload),
                        )
                except WireError as e:  # framing lost: frame counts (Flush) cannot agree any more
                    ended_here = True
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"bad KV frame on channel {channel_id}: {e}; the channel is closed",
                    )
        except grpc.RpcError:  # the client went away or the server is stopping
            pass
        finally:
            # frames that arrived are handled (a sender's close returns after them), unless stopping
            worker.close(drain=not self._stopped)
            # before release: `closed` still says whether this server closed it (evicted, idle)
            self._stream_ended(context, by_server=ended_here or channel.closed or self._stopped)
            self._channels.release(channel)
        return b""

    def _stream_opened(self, context) -> None:
        """A Push stream was admitted (a hook: the nixl backend's control server tracks its
        senders' connections)."""

    def _stream_ended(self, context, by_server: bool) -> None:
        """A Push stream ended: closed by this server (evicted, idle, stopping) when `by_server`,
        else by its sender (its transport closed, its process or connection gone)."""

    def _flush(self, request: bytes, context) -> bytes:
        try:
            channel, frames, wait_s = parse_flush(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad Flush request: {e}")
        handled = self._channels.wait_handled(channel, frames, min(wait_s, FLUSH_POLL_S))
        return msgpack.packb({"frames": handled})

    def stop(self) -> None:
        with self._channels.cond:
            if self._stopped:
                return
            self._stopped = True
        self._channels.stop()  # also wakes Flush calls waiting on frames
        # cancels the open streams; their threads leave after the frame in hand
        self._server.stop(grace=self._stop_grace).wait(self._stop_grace + 5.0)
        self._executor.shutdown(wait=True)


__all__ = ["GrpcServer", "GrpcTransport", "parse_flush", "split_message", "frame_pieces"]
