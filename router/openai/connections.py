"""The HTTP front's connections, bounded: how long a client may take to send its request, how
many connections may be open (a cap derived from the file descriptor limit), what happens to
those past the cap, and the rate limit on the error lines a flood of bad clients writes.

router/openai/server.py gives uvicorn `protocol_class(book, limits)` as its HTTP protocol and
runs `sweep` beside it on the front's event loop until the front stops; `raise_fd_limit` runs
when the router starts. From its accept a connection has `header_timeout_s` to send complete
request headers (again after each response, for the next request on a kept-alive connection),
then at most `body_timeout_s` between two pieces of its body; a client that stops reading a
response that long is closed too. A timed-out connection that sent part of a request gets 408,
one that sent nothing is just closed (sweep finds them within a second). A new connection
reaches uvicorn only once its headers (and a small body) have arrived (Gate), so a slow client
never starts a request handler. One ConnectionBook per front counts the open connections in the
order they have waited for their clients: past the cap, a new connection closes the one that
has waited longest (without complete headers first, then with a stalled body), or gets 503 if
none waits. RateLimitFilter keeps a flood's lines to one of a kind per interval.
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

log = logging.getLogger(__name__)  # one logger for the whole front's connections

HEAD, BODY, BUSY = "head", "body", "busy"  # what a connection waits for: its client, or us
# the loggers a flood of bad clients writes to: accept errors (asyncio), uvicorn's warnings,
# the front's, and the handlers' one line per client gone mid-upload
FLOOD_LOGGERS = (
    "asyncio",
    "uvicorn.error",
    "pdserve.router.openai.connections",
    "pdserve.router.openai.app",
)
_TIMEOUTS = {HEAD: "header_timeouts", BODY: "body_timeouts"}  # ConnectionBook.counts


# ---- file descriptors -------------------------------------------------------------------------
def raise_fd_limit() -> int:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit (vLLM does the same), at most
    2**20 where the hard limit is unlimited; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (hard, 1 << 20, 1 << 16) if hard == resource.RLIM_INFINITY else (hard,):
        if target == resource.RLIM_INFINITY or target <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def fd_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def connection_cap(limit: int) -> int:
    """The HTTP connections a process with `limit` file descriptors may hold: the limit less
    max(1024, limit / 4) kept for gRPC (clients, the workers' channels), files and the accept
    loop's burst, but at least half the limit."""
    return max(limit // 2, limit - max(1024, limit // 4))


LISTEN_BACKLOG = 65535  # the kernel's queue of connections not yet accepted (no descriptor
# each), clamped to net.core.somaxconn: it absorbs a burst of connects instead of dropping SYNs


def accept_batch(limit: int, cap: int) -> int:
    """How many sockets one turn of asyncio's accept loop may open before any is admitted (and
    as many evicted ones may wait one more turn to close): small, so that other connections'
    events come between two batches, and at most a quarter of the descriptors kept beside the
    cap. asyncio takes it as the listen backlog, which the front raises to LISTEN_BACKLOG."""
    return max(16, min(128, (limit - cap) // 4))


# ---- the book of open connections -------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # a TLS connection is counted from its accept; asyncio ends a handshake after this long
    handshake_timeout_s: float = 10.0
    log_interval_s: float = 10.0  # the cap's evictions and refusals: one line at most this often
    # a request whose Content-Length is over this goes to the app at once, which refuses it
    # (413) unread; 0: none does
    max_body_bytes: int = 0

    @property
    def sweep_s(self) -> float:
        """How often `sweep` looks for timed-out connections: a timeout fires this late at most."""
        return min(1.0, self.header_timeout_s / 4, self.body_timeout_s / 4)


class ConnectionBook:
    """The open connections of one HTTP front, on its event loop's thread only. A connection is
    counted from its accept (`accepted`: its socket is open; a TLS one handshakes before it is
    `admit`ted, and stays counted until handshake_timeout_s has surely ended that) until it is
    closed (`forget`). Those waiting for their client are kept oldest first, which is both the
    eviction order and the order they time out in: `heads` (no complete headers yet, by when
    they began to wait), `bodies` (by their last body byte)."""

    def __init__(self, cap: int, handshake_timeout_s: float = 10.0, clock=time.monotonic):
        if cap < 1:
            raise ValueError(f"the connection cap must be >= 1, got {cap}")
        self.cap = cap
        self._clock = clock
        self._handshake_s = handshake_timeout_s + 1.0
        self.pending: OrderedDict = OrderedDict()  # accepted, not yet admitted (TLS) -> when
        self.open: set = set()
        self.heads: OrderedDict = OrderedDict()  # -> since
        self.bodies: OrderedDict = OrderedDict()  # -> last byte
        self.counts = dict(evicted=0, refused=0, header_timeouts=0, body_timeouts=0, peak=0)

    def __len__(self) -> int:
        self._prune()
        return len(self.open) + len(self.pending)

    def _prune(self) -> None:
        """Drops the pending connections asyncio has surely aborted (their handshake timed out)."""
        horizon = self._clock() - self._handshake_s
        while self.pending:
            conn, since = next(iter(self.pending.items()))
            if since > horizon:
                break
            del self.pending[conn]

    def accepted(self, conn) -> None:
        """`conn`'s socket was just accepted: counted from now on."""
        self.pending[conn] = self._clock()
        self.counts["peak"] = max(self.counts["peak"], len(self.open) + len(self.pending))

    def admit(self, conn):
        """`conn` is ready to serve (a TLS one has its handshake done). Returns (True, None)
        within the cap, (True, victim) past it with the connection to close for it, and (False,
        None) past it with none to close: `conn` is to be refused (it stays counted until it is
        forgotten)."""
        self.pending.pop(conn, None)
        self.open.add(conn)
        if len(self) <= self.cap:
            return True, None
        victim = self.victim()
        if victim is None:
            self.counts["refused"] += 1
            return False, None
        self.counts["evicted"] += 1
        self.forget(victim)
        return True, victim

    def victim(self):
        """The connection that has waited longest for its client: without complete headers
        first, then with a stalled body; None when every connection waits for the server."""
        for waiting in (self.heads, self.bodies):
            if waiting:
                return next(iter(waiting))
        return None

    def waits(self, conn, phase: str) -> None:
        """`conn` now waits for its client's headers (HEAD), its body (BODY), or for the server
        (BUSY); moved to the young end of its queue."""
        self.heads.pop(conn, None)
        self.bodies.pop(conn, None)
        if phase == HEAD:
            self.heads[conn] = self._clock()
        elif phase == BODY:
            self.bodies[conn] = self._clock()

    def body_byte(self, conn) -> None:
        if conn in self.bodies:
            self.bodies.move_to_end(conn)
            self.bodies[conn] = self._clock()

    def expired(self, header_s: float, body_s: float) -> list:
        """[(conn, HEAD or BODY)] whose wait on their client is past its timeout, oldest first;
        they leave their queue (the caller closes them, or puts them back)."""
        now, out = self._clock(), []
        for waiting, phase, limit in ((self.heads, HEAD, header_s), (self.bodies, BODY, body_s)):
            while waiting:
                conn, since = next(iter(waiting.items()))
                if now - since < limit:
                    break
                del waiting[conn]
                out.append((conn, phase))
        return out

    def forget(self, conn) -> None:
        """`conn` is closed (or closing): no longer counted."""
        self.pending.pop(conn, None)
        self.open.discard(conn)
        self.heads.pop(conn, None)
        self.bodies.pop(conn, None)

    def stats(self) -> dict:
        return {"open": len(self), "cap": self.cap, **self.counts}


async def sweep(book: ConnectionBook, limits: Limits) -> None:
    """Runs on the front's event loop until cancelled: closes the connections whose wait on
    their client timed out, every limits.sweep_s, and logs the cap's evictions and refusals
    since the last such line, at most one line every limits.log_interval_s."""
    logged = dict(evicted=0, refused=0)
    window, next_line = time.monotonic(), 0.0  # what the next line covers; when it may come
    while True:
        await asyncio.sleep(limits.sweep_s)
        for i, (conn, phase) in enumerate(
            book.expired(limits.header_timeout_s, limits.body_timeout_s)
        ):
            conn.timed_out(phase)
            if i % 128 == 127:
                await asyncio.sleep(0)  # other connections' events between two batches
        now = time.monotonic()
        evicted = book.counts["evicted"] - logged["evicted"]
        refused = book.counts["refused"] - logged["refused"]
        if (evicted or refused) and now >= next_line:
            log.warning(
                "HTTP: at the cap of %d connections: %d waiting for their client closed for new "
                "ones, %d new ones refused (503: all others waited for the server) in %.0f s",
                book.cap,
                evicted,
                refused,
                now - window,
            )
            logged.update(evicted=book.counts["evicted"], refused=book.counts["refused"])
            window, next_line = now, now + limits.log_interval_s


# ---- logs -------------------------------------------------------------------------------------
_VARYING = re.compile(r"0x[0-9a-fA-F]+|\d+")


class RateLimitFilter(logging.Filter):
    """Lets one record of each kind (its logger, level and the first line of its text, with
    numbers blanked) through every `interval_s`, and at most `per_logger` records of one logger
    in any such interval (a client can vary the text: a path). A record let through after some
    were left out says how many. At most `max_kinds` kinds are remembered (the oldest go)."""

    def __init__(
        self,
        interval_s: float = 10.0,
        per_logger: int = 20,
        max_kinds: int = 512,
        clock=time.monotonic,
    ):
        super().__init__()
        self.interval_s = interval_s
        self.per_logger = per_logger
        self.max_kinds = max_kinds
        self._clock = clock
        self._kinds: OrderedDict = OrderedDict()  # kind -> [last let through, left out since]
        self._loggers: dict = {}  # name -> [window start, let through in it, left out since]
        self._lock = threading.Lock()

    @staticmethod
    def kind(record: logging.LogRecord) -> tuple:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is the handler's to report
            text = str(record.msg)
        return record.name, record.levelno, _VARYING.sub("#", text.split("\n", 1)[0][:160])

    def filter(self, record: logging.LogRecord) -> bool:
        key = self.kind(record)
        now = self._clock()
        with self._lock:
            seen = self._kinds.get(key)
            if seen is not None and now - seen[0] < self.interval_s:
                seen[1] += 1
                return False
            window = self._loggers.setdefault(record.name, [now, 0, 0])
            if now - window[0] >= self.interval_s:
                window[0], window[1] = now, 0
            if window[1] >= self.per_logger:
                window[2] += 1
                return False
            window[1] += 1
            left_out, others = (seen[1] if seen is not None else 0), window[2]
            window[2] = 0
            self._kinds[key] = [now, 0]
            self._kinds.move_to_end(key)
            while len(self._kinds) > self.max_kinds:
                self._kinds.popitem(last=False)
        if left_out:
            record.msg = f"{record.msg} [{left_out} more like this since the last one not logged]"
        if others:
            record.msg = f"{record.msg} [{others} more of {record.name} not logged]"
        return True


def install_filter(flt: logging.Filter, names=FLOOD_LOGGERS) -> None:
    for name in names:
        logging.getLogger(name).addFilter(flt)


def remove_filter(flt: logging.Filter, names=FLOOD_LOGGERS) -> None:
    for name in names:
        logging.getLogger(name).removeFilter(flt)


# ---- the protocols -----------------------------------------------------------------------------
_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_503 = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 35\r\nconnection: close\r\n\r\nthe server has too many connections"
)
CLOSED_BY = "pdserve.closed_by"  # scope key: why the server closed a request's connection


def protocol_class(book: ConnectionBook, limits: Limits) -> type:
    """The class uvicorn builds each connection with (uvicorn.Config(http=...) takes a class),
    bound to `book` and `limits`: a Gate, which hands its connection to a BoundedH11Protocol."""
    h11_class = type("BoundedH11", (BoundedH11Protocol,), {"book": book, "limits": limits})
    bound = {"__slots__": (), "book": book, "limits": limits, "h11_class": h11_class}
    return type("BoundedGate", (Gate,), bound)


GATE_BODY_BYTES = 64 << 10  # a body waits at the gate until complete or this long (uvicorn
# pauses reading past as much: the app streams the rest)
_HEAD_END = re.compile(rb"\n\r?\n")  # h11's end of the headers


class RequestGate:
    """One request's bytes while its headers, and a body of up to GATE_BODY_BYTES, are not all
    there. `feed` says when it may go on to h11 and the app: complete enough, more than h11
    takes as headers (it answers 400), a Content-Length the app refuses unread (over
    max_body), or a request the gate does not read plainly (Expect, Transfer-Encoding, a
    Content-Length that is not one plain number): those go at once."""

    __slots__ = ("buf", "head_end", "body_wanted", "_scanned", "_max_head", "_max_body")

    def __init__(self, max_head: int, max_body: int = 0):
        self.buf = bytearray()
        self.head_end = 0  # where the body begins, once the headers are complete
        self.body_wanted = 0
        self._scanned = 0  # no end of the headers before this offset
        self._max_head = max_head
        self._max_body = max_body

    @property
    def in_body(self) -> bool:
        return self.head_end > 0

    def feed(self, data: bytes) -> bool:
        self.buf += data
        if self.head_end:
            return len(self.buf) - self.head_end >= self.body_wanted
        found = _HEAD_END.search(self.buf, max(0, self._scanned - 2))
        if found is None:
            self._scanned = len(self.buf)
            return len(self.buf) > self._max_head
        end = found.end()
        wanted = _body_to_wait_for(bytes(self.buf[:end]), self._max_body)
        if wanted is None or len(self.buf) - end >= wanted:
            return True
        self.head_end, self.body_wanted = end, wanted
        return False

    def log(self, what: str) -> None:
        """One line for a request whose body never reached the app."""
        line = bytes(self.buf[: self.buf.find(b"\n")]).split(b" ")
        method = line[0][:16].decode("ascii", "replace")
        path = line[1].split(b"?")[0][:200].decode("ascii", "replace") if len(line) > 1 else "?"
        log.info(
            "HTTP %s %s: %s after %d of %d body bytes",
            "".join(c if c.isalpha() else "?" for c in method),
            "".join(c if c.isprintable() else "?" for c in path),
            what,
            len(self.buf) - self.head_end,
            _content_length(bytes(self.buf[: self.head_end])) or 0,
        )


class Gate(asyncio.Protocol):
    """A connection until its first request is complete enough to serve (RequestGate): counted
    in the book, timed out by `sweep`, evicted at the cap, all without uvicorn or the app, so an
    idle, slow or stalled client costs a few small objects and never a handler; a timeout is a
    408 (or a close, if it sent nothing) written here. Then it hands the transport to a
    BoundedH11Protocol, which takes the request as uvicorn would."""

    __slots__ = ("transport", "_kwargs", "_gate", "_phase", "_closed_by")
    book: ConnectionBook
    limits: Limits
    h11_class: type

    def __init__(self, **kwargs):  # uvicorn's: config, server_state, app_state, _loop
        self.transport = None
        self._kwargs = kwargs
        config = kwargs["config"]
        self._gate = RequestGate(
            config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE,
            self.limits.max_body_bytes,
        )
        self._phase = HEAD
        self._closed_by: str | None = None
        self.book.accepted(self)

    def connection_made(self, transport) -> None:
        self.transport = transport
        admitted, victim = self.book.admit(self)
        if victim is not None:
            victim.close_for("evicted")
        if not admitted:
            self._closed_by = "refused"
            transport.write(_503)
            transport.close()
            self.book.forget(self)
            return
        self.book.waits(self, HEAD)

    def data_received(self, data: bytes) -> None:
        gate = self._gate
        if gate.in_body:
            self.book.body_byte(self)
        if gate.feed(data):
            self._hand_over()
        elif gate.in_body and self._phase == HEAD:
            self._phase = BODY
            self.book.waits(self, BODY)

    def connection_lost(self, exc) -> None:
        self.book.forget(self)
        _break_cycle(self.transport)
        if self._gate is not None and self._gate.in_body and self._closed_by is None:
            self._gate.log("the client disconnected")

    def timed_out(self, phase: str) -> None:
        """`sweep` found this connection's wait on its client (`phase`) past its timeout."""
        if self.transport is None or self.transport.is_closing() or phase != self._phase:
            return
        self.book.counts[_TIMEOUTS[phase]] += 1
        if phase == BODY:
            self._gate.log("its body stalled: closed (408)")
        if self._gate.buf:
            self.transport.write(_408)  # h11 answers no request it has not read
        self.close_for(f"{phase}_timeout")

    def close_for(self, why: str, status: int | None = None) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._closed_by = why
            self.book.forget(self)
            self.transport.close()

    def _hand_over(self) -> None:
        proto = self.h11_class(**self._kwargs)
        self.book.forget(self)
        self.book.open.add(proto)
        transport, data = self.transport, bytes(self._gate.buf)
        self.transport = self._gate = None
        transport.set_protocol(proto)
        proto.connection_made(transport)
        proto.data_received(data)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol for a connection the Gate handed over: counted in the book and
    timed out by `sweep`. It reads h11's states after every event uvicorn handled (data
    received, a response complete) to tell the book what the connection waits for; each next
    request on the kept-alive connection waits at a RequestGate of its own before h11 sees it.
    It has a timer of its own only while the client does not read what it is sent."""

    book: ConnectionBook
    limits: Limits

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._phase: str | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes received since the connection began to wait for headers
        self._gate: RequestGate | None = None  # the next request's bytes while they wait
        self._closed_by: str | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_lost(self, exc) -> None:
        self.book.forget(self)
        _break_cycle(self.transport)
        gate = self._gate
        if gate is not None and gate.in_body and self._closed_by is None:
            gate.log("the client disconnected")
        self._phase, self._gate = None, None
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        gate = self._gate
        if gate is not None:
            self._unset_keepalive_if_required()
            if gate.in_body:
                self.book.body_byte(self)
            if gate.feed(data):
                self._gate = None
                super().data_received(bytes(gate.buf))
                self._sync()
            elif gate.in_body and self._phase == HEAD:
                self._phase = BODY
                self.book.waits(self, BODY)
            return
        if self._phase == HEAD:
            self._head_bytes += len(data)
        elif self._phase == BODY:
            self.book.body_byte(self)
        super().data_received(data)
        self._sync()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync()

    def shutdown(self) -> None:
        self._closed_by = "shutdown"
        super().shutdown()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.body_timeout_s, self._not_read)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    # -- what the connection waits for ------------------------------------------------------
    def _current_phase(self) -> str:
        theirs, ours = self.conn.their_state, self.conn.our_state
        if ours is h11.DONE or theirs is h11.IDLE:
            return HEAD  # the next request (or the rest of a body we already answered)
        if theirs is h11.SEND_BODY:
            return BODY
        return BUSY

    def _sync(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        phase = self._current_phase()
        if phase != self._phase:
            self._phase = phase
            self._head_bytes = 0
            self.book.waits(self, phase)
            if (
                phase == HEAD
                and self.conn.their_state is h11.IDLE
                and not self.conn.trailing_data[0]
            ):
                self._gate = RequestGate(
                    self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE,
                    self.limits.max_body_bytes,
                )

    def timed_out(self, phase: str) -> None:
        """`sweep` found this connection's wait on its client (`phase`) past its timeout."""
        if self.transport is None or self.transport.is_closing() or phase != self._phase:
            return  # closed, or it moved on while the sweep got to it
        gate = self._gate
        if phase == BODY and gate is None and self.flow.read_paused:
            self.book.waits(self, BODY)  # the app has not read what came: not the client's stall
            return
        self.book.counts[_TIMEOUTS[phase]] += 1
        if gate is not None:  # the request never reached h11
            if gate.in_body:
                gate.log("its body stalled: closed (408)")
            if gate.buf:
                self.transport.write(_408)
            self.close_for(f"{phase}_timeout")
        elif phase == BODY:
            self.close_for("body_timeout", status=408)
        else:
            if self._head_bytes and self.conn.our_state is h11.IDLE:
                self.transport.write(_408)  # h11 answers no request it has not read
            self.close_for("header_timeout")

    def _not_read(self) -> None:
        """The client read nothing of the response for body_timeout_s."""
        self._write_timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.close_for("response_not_read")
            self.transport.abort()  # its buffer would never drain

    def close_for(self, why: str, status: int | None = None) -> None:
        """Closes the connection (evicted, timed out); the request being read (if any) sees its
        client gone, and `why` in its scope (CLOSED_BY), so its handler can say so."""
        if self.transport is None or self.transport.is_closing():
            return
        self._closed_by = why
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            self.scope[CLOSED_BY] = why
            if status is not None and not cycle.response_started:
                try:
                    out = self.conn.send(
                        h11.Response(
                            status_code=status,
                            headers=[(b"content-length", b"0"), (b"connection", b"close")],
                            reason=STATUS_PHRASES[status],
                        )
                    )
                    out += self.conn.send(h11.EndOfMessage())
                    self.transport.write(out)
                except h11.LocalProtocolError:
                    pass
            cycle.disconnected = True
            cycle.message_event.set()
        self.book.forget(self)
        self.transport.close()


def _break_cycle(transport) -> None:
    """A closed asyncio socket transport refers to itself (its `_read_ready_cb` is one of its
    own methods, on Python 3.11 at least), so only the cyclic GC frees it: under a churn of
    thousands of connections a second that garbage made full collections of a second or more,
    which stall every thread of the router. Dropping the reference frees it at once."""
    if getattr(transport, "_read_ready_cb", None) is not None:
        transport._read_ready_cb = None


def _content_length(head: bytes) -> int | None:
    """The one Content-Length of a header block; None where there is none, several, or one that
    is not a plain number."""
    found = None
    for line in head.split(b"\n")[1:]:
        name, colon, value = line.partition(b":")
        if colon and name.strip().lower() == b"content-length":
            value = value.strip()
            if found is not None or not value.isdigit() or len(value) > 19:
                return None
            found = int(value)
    return found


def _body_to_wait_for(head: bytes, max_body: int = 0) -> int | None:
    """How many body bytes the gate waits for after the header block `head`: None for a request
    it lets through at once (Expect, Transfer-Encoding, a Content-Length it cannot read or one
    over `max_body` when that is set)."""
    lowered = head.lower()
    if b"\nexpect" in lowered or b"\ntransfer-encoding" in lowered:
        return None
    if b"\ncontent-length" not in lowered:
        return 0
    length = _content_length(head)
    if length is None or (max_body and length > max_body):
        return None
    return min(length, GATE_BODY_BYTES)
