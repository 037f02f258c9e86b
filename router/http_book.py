"""The HTTP front's bookkeeping (router/http_conn.py holds its protocols): the file descriptor
limit and the connection cap derived from it, the book of open connections, and the rate limit
on the loggers a flood of bad clients writes to.

`sweep` runs on the front's event loop and closes the connections whose wait timed out.
`raise_fd_limit` runs when the router starts (the soft RLIMIT_NOFILE up to the hard one);
`connection_cap` leaves a share of the descriptors to gRPC, the workers' channels and files. One
ConnectionBook per front counts its open connections against the cap, in the order they have
waited for their clients, so that past the cap the one that waited longest gives way to a new
one. RateLimitFilter keeps the error lines of a flood (accept errors, bad requests, clients gone
mid-upload) to one of a kind per interval, with the count of those it left out.
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

log = logging.getLogger("pdserve.router.http_conn")  # one logger for the whole front

HEAD, BODY, BUSY = "head", "body", "busy"  # what a connection waits for: its client, or us
# the loggers a flood of bad clients writes to: accept errors (asyncio), uvicorn's warnings,
# the front's, and the handlers' one line per client gone mid-upload
FLOOD_LOGGERS = ("asyncio", "uvicorn.error", "pdserve.router.http_conn", "pdserve.router.http_api")
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
