"""torch.distributed backend: gloo point-to-point between a prefill rank and a decode rank, outside
any default process group (each worker may already sit in its own TP group).

A decode rank starts one TorchServer through `serve("torch", handler)`: it hosts a TCPStore
(`address` is the store's "host:port") and runs until `stop`. Each sender (TorchTransport) takes
a connection number from the store's counter and proves it holds the cluster secret
(backends.torch_auth); only then do both sides build a private gloo group under that
connection's key prefix. Rank 0 of the group is the server's receiving thread, rank 1 the sender,
and rank 2 a "waker" that lets `stop` end an idle channel. So any number of senders can share one
server, and a stranger never gets a group, a thread or a handler call. The store has no access
control and gloo's traffic is neither authenticated nor encrypted: TorchServer says what that
leaves open. A frame travels as a fixed-size envelope, then its payload (`_envelope`).
"""

from __future__ import annotations

import collections
import datetime
import itertools
import logging
import socket
import struct
import threading
import time

import torch
import torch.distributed as dist

from pdserve.kvtransfer.backends.frames import (
    FrameWorker,
    call_handler,
    encode_header,
    host_copy,
    screen,
)
from pdserve.kvtransfer.backends.torch_auth import (
    CONNECTIONS_KEY,
    Gatekeeper,
    authenticate,
    group_prefix,
)
from pdserve.kvtransfer.transport import Destination, FrameHandler, Transport, TransportServer
from pdserve.kvtransfer.wire import (
    MAX_HEADER_BYTES,
    ChunkHeader,
    WireError,
    header_from_fields,
    split_frame,
)
from pdserve.protos.security import INSECURE, ClusterSecurity

log = logging.getLogger(__name__)

RECEIVER_RANK, SENDER_RANK, WAKER_RANK, GROUP_SIZE = 0, 1, 2, 3
TAG_ENVELOPE, TAG_HEADER, TAG_PAYLOAD = 1, 2, 3
LOOKAHEAD = 4  # frames whose envelope the receiver has posted ahead
ENVELOPE_BYTES = 512  # int64 [header bytes, payload values, dtype code] + the header
_ENVELOPE = struct.Struct("<qqq")
_HEADER_LENGTH = struct.Struct("<I")  # the wire frame's length prefix
MAX_FRAME_BYTES = 512 << 20  # a payload, like the grpc backend's largest message
PAYLOAD_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)


def _envelope(n_header: int, n_values: int, code: int) -> bytearray:
    """A frame's envelope, a fixed ENVELOPE_BYTES uint8 message: int64 [header bytes, payload
    values, dtype code] (header bytes < 0: the channel ends), then the msgpack header itself when
    it fits (else the header follows as its own uint8 message). The payload follows as the flat
    tensor in its own dtype, left out when empty. gloo moves a message only once its receive is
    posted, and the fixed size is what lets the receiver post the envelopes of the next LOOKAHEAD
    frames ahead; folding the lengths and the header into one message saves a rendezvous per
    frame."""
    buf = bytearray(ENVELOPE_BYTES)
    _ENVELOPE.pack_into(buf, 0, n_header, n_values, code)
    return buf


def _end_envelope() -> torch.Tensor:
    """Header length -1: the channel ends."""
    return torch.frombuffer(_envelope(-1, 0, 0), dtype=torch.uint8)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def make_group(store, rank: int, timeout: float, host: str) -> dist.ProcessGroupGloo:
    """A private gloo group of one connection (blocks until all three ranks joined, or timeout)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = _td(timeout)
    return dist.ProcessGroupGloo(store, rank, GROUP_SIZE, opts)


def _local_address_towards(host: str, port: int) -> str:
    """This host's address on the route to `host`: what gloo must bind so the server can reach it
    (a connected UDP socket picks the route and sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def _is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


class _Connection:
    """The server's side of one sender: its group, its receiving thread, its waker. A pending gloo
    receive ends only with a message or a dead peer (a wait that times out tears the group down),
    so `wake` ends an idle channel by sending from the waker's rank."""

    def __init__(self, server: TorchServer, conn_id: int):
        self.server = server
        self.conn_id = conn_id
        self.lock = threading.Lock()
        self.waker: dist.ProcessGroupGloo | None = None
        self.wake_work = None
        self.broken = False
        self.thread = threading.Thread(
            target=self._run, name=f"pdserve-kv-torch-conn{conn_id}", daemon=True
        )

    def _store(self):
        s = self.server
        return dist.PrefixStore(
            group_prefix(self.conn_id),
            dist.TCPStore(s.host, s.port, is_master=False, timeout=_td(s.timeout)),
        )

    def _build(self):
        s, built = self.server, {}

        def build_waker():
            try:
                built["waker"] = make_group(self._store(), WAKER_RANK, s.timeout, s.host)
            except Exception as e:
                built["error"] = e

        helper = threading.Thread(
            target=build_waker, name=f"pdserve-kv-torch-waker{self.conn_id}", daemon=True
        )
        helper.start()
        try:
            pg = make_group(self._store(), RECEIVER_RANK, s.timeout, s.host)
        finally:
            helper.join(s.timeout + 5.0)
        if "waker" not in built:
            raise built.get("error") or TimeoutError("the waker rank did not join")
        return pg, built["waker"]

    def _run(self):
        try:
            pg, waker = self._build()
        except Exception as e:
            log.warning("KV sender %d never joined its group: %s", self.conn_id, e)
            return
        with self.lock:
            self.waker = waker
            if self.server.stopping:  # stop() ran while the group formed: end at once
                self.wake_work = waker.send([_end_envelope()], RECEIVER_RANK, TAG_ENVELOPE)
        try:
            self._receive(pg)
        except Exception as e:
            log.warning("KV channel %d closed: %s", self.conn_id, e)
        finally:
            with self.lock:
                self.waker = None
            del pg, waker  # closes the sockets: the sender sees a dead peer at its next send

    def _receive(self, pg) -> None:
        """Two threads per channel: this one takes each frame's envelope and posts the receive of
        its payload at once; a FrameWorker waits for the payloads and runs the handler. So a
        payload's receive is posted while the previous payloads stream in or are handled (gloo
        moves a message only once its receive is posted), and the envelopes of the next
        LOOKAHEAD frames are always posted ahead."""
        s = self.server
        worker = FrameWorker(
            self._complete, f"pdserve-kv-torch-handler{self.conn_id}", s.max_backlog_bytes
        )
        envelopes = [torch.empty(ENVELOPE_BYTES, dtype=torch.uint8) for _ in range(LOOKAHEAD)]
        pending = [pg.recv_anysource([e], TAG_ENVELOPE) for e in envelopes]
        try:
            for k in itertools.count():
                i = k % LOOKAHEAD
                pending[i].wait(_td(s.idle_timeout))
                raw = envelopes[i].numpy().tobytes()
                n_header, n_values, code = _ENVELOPE.unpack_from(raw)
                if n_header < 0:
                    return
                self._check_envelope(n_header, n_values, code)
                works, head = [], raw[_ENVELOPE.size : _ENVELOPE.size + n_header]
                if n_header > ENVELOPE_BYTES - _ENVELOPE.size:  # a header too long to ride inside
                    head = torch.empty(n_header, dtype=torch.uint8)
                    works.append(pg.recv([head], SENDER_RANK, TAG_HEADER))
                payload = None
                if n_values:
                    payload = torch.empty(n_values, dtype=PAYLOAD_DTYPES[code])
                    works.append(pg.recv([payload], SENDER_RANK, TAG_PAYLOAD))
                pending[i] = pg.recv_anysource([envelopes[i]], TAG_ENVELOPE)
                nbytes = 0 if payload is None else payload.numel() * payload.element_size()
                worker.put((head, payload, works), nbytes)
        finally:  # frames that fully arrive still count, unless the server is stopping
            worker.close(drain=not s.stopping)

    def _check_envelope(self, n_header: int, n_values: int, code: int) -> None:
        """Sizes a peer sends, before we allocate for them. Raising ends this channel: the frames
        after a bad envelope cannot be located."""
        if not (
            0 <= code < len(PAYLOAD_DTYPES)
            and 0 <= n_header <= MAX_HEADER_BYTES
            and n_values >= 0
            and n_values * PAYLOAD_DTYPES[code].itemsize <= self.server.max_frame_bytes
        ):
            raise WireError(
                f"bad envelope (header {n_header} bytes, {n_values} values of dtype code "
                f"{code}): at most {MAX_HEADER_BYTES} header bytes and max_frame_bytes="
                f"{self.server.max_frame_bytes} of payload"
            )

    def _complete(self, item) -> None:
        head, payload, works = item
        if self.broken:
            return
        try:
            for work in works:
                work.wait(_td(self.server.timeout))
        except RuntimeError as e:
            self.broken = True
            log.warning("KV channel %d lost a frame: %s", self.conn_id, e)
            return
        if isinstance(head, torch.Tensor):
            head = head.numpy().tobytes()
        try:  # the envelope frames each message, so a bad header costs only its own frame
            header = header_from_fields(split_frame(_HEADER_LENGTH.pack(len(head)) + head)[0])
        except WireError as e:
            header = e
        item = screen(header, payload, False, f"KV channel {self.conn_id}")
        if item is not None:
            self.server.call_handler(*item)

    def wake(self) -> None:
        with self.lock:
            if self.waker is not None and self.wake_work is None:
                self.wake_work = self.waker.send([_end_envelope()], RECEIVER_RANK, TAG_ENVELOPE)


class TorchServer(TransportServer):
    """Receiver side. timeout bounds group formation and a frame's messages; idle_timeout bounds the
    wait for the next frame (an idle channel past it closes and its sender must reconnect);
    max_backlog_bytes bounds the frames received but not yet handled, per channel; max_frame_bytes
    a frame's payload. security: the secret a sender must prove (torch_auth) within auth_timeout;
    at most max_pending_auth handshakes are kept waiting.

    What the secret leaves open: the TCPStore has no access control, so anyone who can reach its
    port can read, list and write its keys. They can disturb or refuse others' handshakes
    (rewrite their keys, flood the connection counter; both bounded here, never blocking the
    accept loop), fill the store's memory, and rewrite the gloo rendezvous keys of a connection
    that passed its handshake to redirect its group. The gloo traffic is neither authenticated nor
    encrypted, and `security.tls` does not apply to it. So bind the store (`host`) to a private
    interface, or use the grpc backend with TLS where the network is not trusted."""

    def __init__(
        self,
        handler: FrameHandler,
        host: str = "127.0.0.1",
        port: int = 0,  # the TCPStore's; 0: a free one (see .address)
        timeout: float = 30.0,
        idle_timeout: float = 24 * 3600.0,
        poll_interval: float = 0.02,
        max_backlog_bytes: int = 64 << 20,
        *,
        security: ClusterSecurity = INSECURE,
        auth_timeout: float = 10.0,
        max_pending_auth: int = 64,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ):
        self._handler = handler
        self.host, self.timeout, self.idle_timeout = host, timeout, idle_timeout
        self.max_backlog_bytes, self.max_frame_bytes = max_backlog_bytes, max_frame_bytes
        self._poll_interval = poll_interval
        self._store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=_td(timeout)
        )
        self.port = self._store.port
        self.address = f"{host}:{self.port}"
        self._gate = Gatekeeper(self._store, security.secret, auth_timeout, max_pending_auth)
        self.stopping = False
        self._stop_event = threading.Event()
        self._connections: list[_Connection] = []
        self._lock = threading.Lock()
        self._accept_thread = threading.Thread(
            target=self._accept, name="pdserve-kv-torch-accept", daemon=True
        )
        self._accept_thread.start()

    @property
    def num_channels(self) -> int:
        """Connections that passed their handshake and are still open."""
        with self._lock:
            return sum(1 for c in self._connections if c.thread.is_alive())

    def _accept(self) -> None:
        """Polls the handshakes (never waiting on a sender) and starts a connection for each that
        passed."""
        while not self._stop_event.wait(self._poll_interval):
            try:
                passed = self._gate.poll()
            except Exception as e:
                log.error("KV transfer store at %s failed: %s", self.address, e)
                return
            for conn_id in passed:
                conn = _Connection(self, conn_id)
                with self._lock:
                    if self.stopping:
                        return
                    self._connections.append(conn)
                    self._connections = [
                        c for c in self._connections if c.thread.is_alive() or c is conn
                    ]
                conn.thread.start()

    def call_handler(self, header: ChunkHeader, payload) -> None:
        call_handler(self._handler, header, payload)

    def stop(self) -> None:
        with self._lock:
            if self.stopping:
                return
            self.stopping = True
            connections = list(self._connections)
        self._stop_event.set()
        self._accept_thread.join(self.timeout)
        for conn in connections:
            conn.wake()
        deadline = time.monotonic() + self.timeout
        for conn in connections:
            conn.thread.join(max(0.0, deadline - time.monotonic()))
            if conn.thread.is_alive():
                log.warning("KV channel %d did not stop within %ss", conn.conn_id, self.timeout)
            conn.wake_work = None
        self._store = None


class TorchTransport(Transport):
    """Sender side. timeout bounds connecting and every wait for a send to complete; at most
    max_inflight_frames frames are in flight before `send` waits for the oldest. `flush` returns
    once every send completed (its bytes are in the receiver's socket), not once handled.

    The payload tensor is sent from its own memory: do not modify it until `flush` returns
    (read_chunk hands out a fresh tensor per chunk). gloo carries CPU tensors only, so a CUDA
    payload is first copied into pinned host memory (frames.host_copy) and sent from there; the
    receiver's handler gets CPU tensors either way.
    """

    def __init__(
        self,
        address: str,
        timeout: float = 30.0,
        max_inflight_frames: int = 32,
        gloo_host: str | None = None,
        *,
        security: ClusterSecurity = INSECURE,
    ):
        host, _, port = address.rpartition(":")
        self._address, self._timeout = address, timeout
        self._max_inflight = max(1, max_inflight_frames)
        try:
            # a plain connect first: a dead server fails at once, not after TCPStore's retries
            socket.create_connection((host, int(port)), timeout=timeout).close()
            self._store = dist.TCPStore(host, int(port), is_master=False, timeout=_td(timeout))
            conn_id = self._store.add(CONNECTIONS_KEY, 1) - 1
            authenticate(self._store, conn_id, security.secret, timeout)
            if gloo_host is None:
                gloo_host = (
                    "127.0.0.1" if _is_loopback(host) else _local_address_towards(host, int(port))
                )
            self._pg = make_group(
                dist.PrefixStore(group_prefix(conn_id), self._store),
                SENDER_RANK,
                timeout,
                gloo_host,
            )
        except ConnectionRefusedError as e:
            raise ConnectionRefusedError(
                f"cannot join the KV transfer server at {address}: {e}"
            ) from None
        except (OSError, RuntimeError, ValueError) as e:
            raise ConnectionError(f"cannot join the KV transfer server at {address}: {e}") from None
        self._lock = threading.Lock()
        self._inflight: collections.deque = collections.deque()  # (works, tensors kept alive)
        self._error: Exception | None = None
        self._closed = False

    def _fail(self, e: Exception, what: str) -> Exception:
        timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        err = (TimeoutError if timed_out else ConnectionError)(
            f"KV {what} to {self._address} failed: {e}"
        )
        self._error = err
        return err

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this KV transport is closed")
        if self._error is not None:
            raise ConnectionError(f"the KV channel to {self._address} is broken: {self._error}")

    def _wait_oldest(self, deadline: float) -> None:
        """Wait for the oldest frame's sends. gloo closes the pair when its wait times out, so a
        timeout inside it breaks the channel; one noticed before waiting does not."""
        works, _ = self._inflight[0]
        while works:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"KV sends to {self._address} did not complete in time")
            try:
                works[0].wait(_td(remaining))
            except RuntimeError as e:
                raise self._fail(e, "send") from None
            works.pop(0)
        self._inflight.popleft()

    def send(self, header: ChunkHeader, data: torch.Tensor | None, dest: Destination) -> None:
        head = encode_header(header)
        payload = None
        if data is not None and data.numel():
            # gloo carries CPU tensors only, so a CUDA chunk is staged in pinned host memory.
            payload = host_copy(data).view(-1)
            if payload.dtype not in PAYLOAD_DTYPES:
                raise ValueError(f"the torch KV backend cannot send {payload.dtype} payloads")
        code = PAYLOAD_DTYPES.index(payload.dtype) if payload is not None else 0
        envelope, header_bytes = (
            _envelope(len(head), 0 if payload is None else payload.numel(), code),
            None,
        )
        if len(head) <= ENVELOPE_BYTES - _ENVELOPE.size:
            envelope[_ENVELOPE.size : _ENVELOPE.size + len(head)] = head
        else:
            header_bytes = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        envelope = torch.frombuffer(envelope, dtype=torch.uint8)
        with self._lock:
            self._check_open()
            deadline = time.monotonic() + self._timeout
            while len(self._inflight) >= self._max_inflight:
                self._wait_oldest(deadline)
            try:
                works = [self._pg.send([envelope], RECEIVER_RANK, TAG_ENVELOPE)]
                if header_bytes is not None:
                    works.append(self._pg.send([header_bytes], RECEIVER_RANK, TAG_HEADER))
                if payload is not None:
                    works.append(self._pg.send([payload], RECEIVER_RANK, TAG_PAYLOAD))
            except RuntimeError as e:
                raise self._fail(e, "send") from None
            self._inflight.append((works, (envelope, header_bytes, payload)))

    def flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            self._check_open()
            while self._inflight:
                self._wait_oldest(deadline)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._error is None:  # a clean end, so the server's thread leaves without an error
                try:
                    end = _end_envelope()
                    self._inflight.append(
                        ([self._pg.send([end], RECEIVER_RANK, TAG_ENVELOPE)], (end,))
                    )
                    deadline = time.monotonic() + self._timeout
                    while self._inflight:
                        self._wait_oldest(deadline)
                except Exception as e:
                    log.debug("KV channel to %s did not close cleanly: %s", self._address, e)
            self._inflight.clear()
            self._pg = None
            self._store = None
