"""The HTTP front's connection bounds (router/openai/connections.py) without a socket: the book's
count and eviction order, the log filter's rate, the cap derived from the fd limit, and the
protocol's timers driven through a fake transport on an event loop. Over real sockets, with a
router: tests/integration/test_http_slow_clients.py."""

from __future__ import annotations

import asyncio
import logging

import pytest
import uvicorn

from pdserve.router.openai.connections import (
    BODY,
    BUSY,
    CLOSED_BY,
    HEAD,
    BoundedH11Protocol,
    ConnectionBook,
    Gate,
    Limits,
    RateLimitFilter,
    accept_batch,
    connection_cap,
    protocol_class,
    raise_fd_limit,
    sweep,
)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


# ---- the book ----------------------------------------------------------------------------------
def join(book, conn, phase=HEAD):
    """`conn` accepted, then ready (as its protocol does); it waits in `phase` if admitted."""
    book.accepted(conn)
    admitted, victim = book.admit(conn)
    if admitted:
        book.waits(conn, phase)
    return admitted, victim


def test_book_evicts_the_longest_wait_for_headers_then_a_stalled_body():
    clock = Clock()
    book = ConnectionBook(4, clock=clock)
    for name, phase in (("busy", BUSY), ("body", BODY), ("head1", HEAD), ("head2", HEAD)):
        assert join(book, name, phase) == (True, None)
        clock.t += 1
    assert len(book) == 4
    # head1 began to wait first; a later wait (its next request) moves it to the young end
    book.waits("head1", BUSY)
    book.waits("head1", HEAD)
    assert join(book, "new1") == (True, "head2")
    assert join(book, "new2", BUSY) == (True, "head1")
    assert join(book, "new3", BUSY) == (True, "new1")
    # no connection without headers: the stalled body goes
    assert join(book, "new4", BUSY) == (True, "body")
    # all four wait for the server: refused, and counted until its protocol closes it
    assert join(book, "new5") == (False, None)
    assert len(book) == 5
    book.forget("new5")
    assert len(book) == 4 and book.open == {"busy", "new2", "new3", "new4"}
    assert book.stats() == {
        "open": 4,
        "cap": 4,
        "evicted": 4,
        "refused": 1,
        "header_timeouts": 0,
        "body_timeouts": 0,
        "peak": 5,
    }


def test_book_body_bytes_reorder_stalled_bodies():
    clock = Clock()
    book = ConnectionBook(2, clock=clock)
    join(book, "a", BODY)
    clock.t += 1
    join(book, "b", BODY)
    clock.t += 1
    book.body_byte("a")  # a still uploads: b has stalled longer
    assert book.victim() == "b"


def test_book_counts_handshakes_until_they_must_have_ended():
    clock = Clock()
    book = ConnectionBook(2, handshake_timeout_s=10, clock=clock)
    book.accepted("tls1")  # accepted, handshake not done: counted, but never a victim
    book.accepted("tls2")
    assert len(book) == 2 and book.victim() is None
    book.accepted("tls3")
    assert book.admit("tls3") == (False, None)  # past the cap, nothing to close for it
    clock.t += 11.5  # asyncio aborted the other handshakes by now
    assert len(book) == 1  # tls3, until its protocol closes it


def test_book_rejects_a_zero_cap():
    with pytest.raises(ValueError):
        ConnectionBook(0)


# ---- the cap from the fd limit -----------------------------------------------------------------
@pytest.mark.parametrize(
    "limit, cap", [(1024, 512), (4096, 3072), (20000, 15000), (1 << 20, (1 << 20) * 3 // 4)]
)
def test_connection_cap_keeps_descriptors_for_grpc(limit, cap):
    assert connection_cap(limit) == cap
    batch = accept_batch(limit, cap)
    assert 16 <= batch <= 128 and cap + 2 * batch < limit


def test_raise_fd_limit_reaches_the_hard_limit():
    import resource

    soft = raise_fd_limit()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert soft == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert soft == hard or hard == resource.RLIM_INFINITY


# ---- the log filter ----------------------------------------------------------------------------
def record(msg, *args, name="asyncio", level=logging.ERROR):
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_rate_limit_filter_one_line_per_kind_and_interval():
    clock = Clock()
    flt = RateLimitFilter(10.0, clock=clock)
    accept = "socket.accept() out of system resource\nsocket: <fd=%d>"
    assert flt.filter(record(accept, 7))
    for fd in range(100):  # the same kind: numbers do not make a new one
        assert not flt.filter(record(accept, fd))
    other = record("HTTP %s: the client disconnected after %d bytes", "POST", 3, name="x")
    assert flt.filter(other)  # another kind passes
    clock.t += 10.0
    again = record(accept, 8)
    assert flt.filter(again)
    assert again.getMessage().endswith("[100 more like this since the last one not logged]")
    fresh = record(accept, 9)
    clock.t += 10.0
    assert flt.filter(fresh) and "not logged" not in fresh.getMessage()


def test_rate_limit_filter_caps_a_loggers_lines_whatever_their_text():
    clock = Clock()
    flt = RateLimitFilter(10.0, per_logger=3, clock=clock)
    let = [flt.filter(record(f"HTTP POST /{word}: stalled", name="x")) for word in "abcdefg"]
    assert let == [True, True, True, False, False, False, False]
    assert flt.filter(record("another logger", name="y"))
    clock.t += 10.0
    rec = record("HTTP POST /h: stalled", name="x")
    assert flt.filter(rec) and rec.getMessage().endswith("[4 more of x not logged]")


def test_rate_limit_filter_bounds_the_kinds_it_remembers():
    flt = RateLimitFilter(10.0, max_kinds=3, clock=Clock())
    for word in ("a", "b", "c", "d"):
        assert flt.filter(record(f"kind {word}"))
    assert len(flt._kinds) == 3
    assert flt.filter(record("kind a"))  # forgotten, so let through again


# ---- the protocols, through a fake transport ---------------------------------------------------
class FakeTransport(asyncio.Transport):
    def __init__(self, loop):
        super().__init__()
        self.loop, self.protocol = loop, None
        self.written, self.closing, self.reading = b"", False, True

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def set_protocol(self, protocol):
        self.protocol = protocol

    def get_protocol(self):
        return self.protocol

    def send(self, data: bytes) -> None:
        self.protocol.data_received(data)

    def write(self, data):
        self.written += bytes(data)

    def is_closing(self):
        return self.closing

    def close(self):
        if not self.closing:
            self.closing = True
            self.loop.call_soon(self.protocol.connection_lost, None)

    abort = close

    def pause_reading(self):
        self.reading = False

    def resume_reading(self):
        self.reading = True


def run_front(scenario, cap=10, header_s=0.1, body_s=0.15, log_s=10.0, max_body=0):
    """Runs `scenario(connect, book, seen)` on a fresh event loop with the sweeper; connect()
    makes a connection (a Gate) on a fake transport and returns the transport; `seen` collects
    (the app's last receive() type, why the front closed the connection, the body bytes the
    app read) per request."""
    seen = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        message, body = await receive(), 0
        while message["type"] == "http.request" and message.get("more_body"):
            body += len(message.get("body", b""))
            message = await receive()
        body += len(message.get("body", b""))
        seen.append((message["type"], scope.get(CLOSED_BY), body))
        if message["type"] == "http.disconnect":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main():
        book = ConnectionBook(cap)
        limits = Limits(header_s, body_s, log_interval_s=log_s, max_body_bytes=max_body)
        cls = protocol_class(book, limits)
        config = uvicorn.Config(app, http=cls, lifespan="off", log_config=None)
        config.load()
        state = uvicorn.server.ServerState()
        loop = asyncio.get_running_loop()

        def connect():
            transport = FakeTransport(loop)
            transport.protocol = cls(config=config, server_state=state, app_state={}, _loop=loop)
            transport.protocol.connection_made(transport)
            return transport

        sweeper = asyncio.create_task(sweep(book, limits))
        await scenario(connect, book, seen)
        sweeper.cancel()

    asyncio.run(main())
    return seen


REQ = b"POST /v1/x?k=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"
_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def test_idle_connection_closed_silently_and_a_partial_header_with_408():
    async def scenario(connect, book, seen):
        idle, slow = connect(), connect()
        slow.send(b"GET / HTTP/1.1\r\nHost: x\r\n")
        await asyncio.sleep(0.05)
        slow.send(b"X-A: b\r\n")  # bytes do not extend the header deadline
        assert len(book) == 2 and not idle.closing
        await asyncio.sleep(0.15)
        assert idle.closing and idle.written == b""
        assert slow.closing and slow.written == _408
        await asyncio.sleep(0)
        assert len(book) == 0 and book.counts["header_timeouts"] == 2

    run_front(scenario)


def test_a_small_body_waits_at_the_gate_until_it_is_complete(caplog):
    caplog.set_level(logging.INFO)

    async def scenario(connect, book, seen):
        t = connect()
        t.send(REQ + b"12")
        await asyncio.sleep(0.1)
        t.send(b"34")  # a byte in time: the body deadline moves
        await asyncio.sleep(0.1)
        assert isinstance(t.protocol, Gate) and t.protocol._phase == BODY and not t.closing
        await asyncio.sleep(0.2)
        assert t.closing and t.written == _408
        await asyncio.sleep(0.01)
        assert seen == [] and book.counts["body_timeouts"] == 1 and len(book) == 0
        # a body that completes goes to the app whole
        t = connect()
        t.send(REQ + b"1234")
        await asyncio.sleep(0.01)
        assert seen == []
        t.send(b"567890")
        await asyncio.sleep(0.01)
        assert seen == [("http.request", None, 10)] and b"200 OK" in t.written
        # the next request on that connection waits at a gate of its own
        t.send(REQ.replace(b"/v1/x", b"/v1/z") + b"12345")
        await asyncio.sleep(0.01)
        assert len(seen) == 1 and t.protocol._phase == BODY
        t.send(b"67890")
        await asyncio.sleep(0.01)
        assert seen[1] == ("http.request", None, 10) and t.written.count(b"200 OK") == 2
        # a client gone mid-body: one line, as for the stall
        t = connect()
        t.send(REQ.replace(b"/v1/x", b"/v1/y") + b"123")
        t.close()
        await asyncio.sleep(0.01)

    run_front(scenario)
    lines = [
        r.getMessage() for r in caplog.records if r.name == "pdserve.router.openai.connections"
    ]
    assert lines == [
        "HTTP POST /v1/x: its body stalled: closed (408) after 4 of 10 body bytes",
        "HTTP POST /v1/y: the client disconnected after 3 of 10 body bytes",
    ]


def test_a_large_body_streams_to_the_app_which_sees_a_stall_as_a_disconnect():
    async def scenario(connect, book, seen):
        t = connect()
        t.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        t.send(b"x" * (70 << 10))  # past the gate's 64 KiB: the app reads it
        await asyncio.sleep(0.1)
        assert isinstance(t.protocol, BoundedH11Protocol) and t.protocol._phase == BODY
        await asyncio.sleep(0.3)
        assert t.closing and t.written.startswith(b"HTTP/1.1 408 Request Timeout")
        await asyncio.sleep(0.01)
        assert seen == [("http.disconnect", "body_timeout", 70 << 10)]
        assert book.counts["body_timeouts"] == 1

    run_front(scenario)


@pytest.mark.parametrize(
    "headers",
    [
        b"Expect: 100-continue\r\nContent-Length: 5\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"Content-Length: 5\r\nContent-Length: 5\r\n",
        b"Content-Length: 1000001\r\n",  # over max_body_bytes: the app refuses it unread
    ],
)
def test_what_the_gate_does_not_read_plainly_goes_through_at_once(headers):
    async def scenario(connect, book, seen):
        t = connect()
        t.send(b"POST / HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        assert isinstance(t.protocol, BoundedH11Protocol)  # the app runs (or h11 refuses it)
        assert t.protocol._gate is None

    run_front(scenario, max_body=1_000_000)


def test_a_served_connection_waits_for_its_next_request_then_times_out():
    async def scenario(connect, book, seen):
        t = connect()
        t.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.05)
        assert b"200 OK" in t.written and seen == [("http.request", None, 0)]
        assert t.protocol._phase == HEAD and not t.closing  # waits for its next request
        t.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.05)
        assert t.written.count(b"200 OK") == 2
        await asyncio.sleep(0.15)
        assert t.closing and book.counts["header_timeouts"] == 1 and len(book) == 0

    run_front(scenario, header_s=0.12)


def test_at_the_cap_the_longest_wait_for_headers_then_for_a_body_is_evicted():
    async def scenario(connect, book, seen):
        first, second = connect(), connect()
        await asyncio.sleep(0.01)
        third = connect()  # past the cap: the first is closed for it
        assert first.closing and not second.closing and not third.closing
        for t in (second, third):  # both wait for their body: none waits for headers
            t.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n")
        await asyncio.sleep(0.01)
        fourth = connect()  # the body that stalled longest goes
        assert second.closing and not third.closing
        fourth.send(b"GET / HTTP/1.1\r\nHost: x\r\n")  # not complete yet
        third.send(b"123456789")  # answered: waits for its next request
        await asyncio.sleep(0.01)
        # fourth has waited for its headers longer than third: it goes for the fifth
        fifth = connect()
        assert fourth.closing and not fifth.closing
        await asyncio.sleep(0.01)
        assert book.counts["evicted"] == 3 and len(book) == 2

    run_front(scenario, cap=2, header_s=5, body_s=5)


def test_at_the_cap_with_every_connection_waiting_for_the_server_503():
    async def scenario(connect, book, seen):
        t = connect()
        t.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # not yet answered: busy
        assert t.protocol._phase == BUSY
        refused = connect()
        assert refused.closing and refused.written.startswith(b"HTTP/1.1 503")
        await asyncio.sleep(0.01)
        assert book.counts["refused"] == 1 and len(book) == 1

    run_front(scenario, cap=1, header_s=5, body_s=5)


def test_the_caps_evictions_are_one_log_line_per_interval(caplog):
    caplog.set_level(logging.INFO)

    async def scenario(connect, book, seen):
        for _ in range(5):  # each one past the cap of 1 evicts the one before
            connect()
        await asyncio.sleep(0.3)  # a sweep
        for _ in range(3):
            connect()
        await asyncio.sleep(0.3)  # another sweep, within the interval: no line
        assert book.counts["evicted"] == 7

    run_front(scenario, cap=1, header_s=1, body_s=1, log_s=60)
    lines = [
        r.getMessage() for r in caplog.records if r.name == "pdserve.router.openai.connections"
    ]
    assert len(lines) == 1 and "4 waiting for their client closed for new ones" in lines[0]
