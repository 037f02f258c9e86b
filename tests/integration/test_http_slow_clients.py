"""The HTTP front's bounded connections (router/openai/connections.py) over real sockets, on a
router with short timeouts and a small cap: idle, slowloris and stalled-body connections are
closed within their timeouts (408 where a request began), a fresh client is served while the cap
is full of slow ones, a TLS handshake that never comes is bounded too, a client gone mid-upload
is one log line, and the router raises its file descriptor limit. The cluster and the helpers are
in helpers/http.py; the pure logic is tests/unit/test_http_conn.py."""

from __future__ import annotations

import dataclasses
import logging
import resource
import socket
import threading
import time

import pytest

from helpers.http import MODEL, TIMEOUT, C, request, serves, split
from helpers.threads import wait_until
from helpers.tls import tls_files
from pdserve.protos.security import TLSConfig
from pdserve.router.openai.connections import connection_cap
from pdserve.router.server import Router

HEADER_S, BODY_S, CAP = 1.0, 1.5, 12
SLACK_S = 4.0  # generous: a timeout fires within its bound plus this
BODY_HEAD = (
    f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    "Content-Length: 1000\r\n\r\n"
).encode()


def bounded_router(workers, **kwargs) -> Router:
    """A router whose HTTP front has the short timeouts and the small cap above."""
    make = Router._http_front

    def http_front(self, options):
        front = make(self, options)
        front.settings = dataclasses.replace(
            front.settings,
            header_timeout_s=HEADER_S,
            body_timeout_s=BODY_S,
            max_connections=CAP,
            log_interval_s=0.2,
        )
        return front

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Router, "_http_front", http_front)
        return workers.router(**kwargs)


@pytest.fixture(scope="module", name="slow_router")
def fixture_slow_router(workers):
    r = bounded_router(workers)
    yield r
    r.stop()


def connect(router_) -> socket.socket:
    return socket.create_connection(split(router_.http_address), timeout=TIMEOUT)


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and the seconds that took."""
    t0, data = time.monotonic(), b""
    while True:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    sock.close()
    return data, time.monotonic() - t0


def health(router_) -> int:
    return request(router_.http_address, "GET", "/health")[0]


def slowloris(sock: socket.socket, stop: threading.Event) -> None:
    """A header byte every 0.2 s, never the blank line that ends the headers."""
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        while not stop.wait(0.2):
            sock.sendall(b"a")
    except OSError:
        pass  # closed by the server


def test_slow_and_idle_connections_are_closed_within_their_timeouts(slow_router, idle, caplog):
    caplog.set_level(logging.INFO)
    stats0 = slow_router.http.connection_stats()
    idle_sock, slow_sock, body_sock = (
        connect(slow_router),
        connect(slow_router),
        connect(slow_router),
    )
    stop = threading.Event()
    sender = threading.Thread(target=slowloris, args=(slow_sock, stop), daemon=True)
    sender.start()
    body_sock.sendall(BODY_HEAD + b'{"model": ')  # then nothing: the body stalls
    assert health(slow_router) == 200  # served meanwhile
    got = {}
    for name, sock in (("idle", idle_sock), ("slow", slow_sock), ("body", body_sock)):
        got[name] = read_until_closed(sock)
    stop.set()
    sender.join(5)
    assert got["idle"][0] == b"" and got["idle"][1] < HEADER_S + SLACK_S
    assert got["slow"][0].startswith(b"HTTP/1.1 408 ") and got["slow"][1] < HEADER_S + SLACK_S
    assert got["body"][0].startswith(b"HTTP/1.1 408 ") and got["body"][1] < BODY_S + SLACK_S
    stats = slow_router.http.connection_stats()
    assert stats["header_timeouts"] - stats0["header_timeouts"] >= 2
    assert stats["body_timeouts"] - stats0["body_timeouts"] == 1
    # the stalled body is one INFO line, no traceback, no error
    lines = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert lines == [f"HTTP POST {C}: its body stalled: closed (408) after 10 of 1000 body bytes"]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    serves(slow_router)


def drop_mid_upload(router_, caplog, length: int, sent: bytes) -> tuple[str, str]:
    """Sends a completion's headers and `sent` of a `length`-byte body, then disconnects: the
    one line (INFO, no traceback) that the router logs for it, and its logger."""
    caplog.set_level(logging.DEBUG)
    caplog.clear()
    head = BODY_HEAD.replace(b"Content-Length: 1000", f"Content-Length: {length}".encode())
    sock = connect(router_)
    sock.sendall(head + sent)
    time.sleep(0.3)  # read by the gate, or by the handler
    sock.close()
    wait_until(
        lambda: any("disconnected" in r.getMessage() for r in caplog.records),
        10,
        "the drop was not logged",
    )
    time.sleep(0.3)  # anything else it would log
    lines = [
        r
        for r in caplog.records
        if r.levelno >= logging.INFO and r.name.startswith(("pdserve.router", "uvicorn", "asyncio"))
    ]
    assert len(lines) == 1, [r.getMessage()[:200] for r in lines]
    (line,) = lines
    assert line.levelno == logging.INFO and line.exc_info is None
    return line.name, line.getMessage()


def test_a_client_gone_mid_upload_is_one_log_line(slow_router, idle, caplog):
    # a small body waits at the gate (router/openai/connections.py): the app never sees it
    sent = b'{"model": "' + MODEL.encode()
    name, line = drop_mid_upload(slow_router, caplog, 1000, sent)
    assert name == "pdserve.router.openai.connections"
    assert line == f"HTTP POST {C}: the client disconnected after 15 of 1000 body bytes"
    # a large one streams to the handler, which logs the drop (router/openai/app.py)
    sent = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"t5 " * 30_000
    name, line = drop_mid_upload(slow_router, caplog, 200_000, sent)
    assert name == "pdserve.router.openai.app"
    assert line.startswith(f"HTTP POST {C}: the client disconnected after ")
    assert line.endswith(" of 200000 body bytes")
    serves(slow_router)


def test_fresh_clients_are_served_while_the_cap_is_full_of_slow_ones(slow_router, idle):
    stats0 = slow_router.http.connection_stats()
    slow = []
    for _ in range(2 * CAP):  # twice the cap: each one past it closes the oldest
        slow.append(connect(slow_router))
        time.sleep(0.01)
    wait_until(
        lambda: slow_router.http.connection_stats()["evicted"] - stats0["evicted"] >= CAP,
        10,
        "connections past the cap did not evict the oldest",
    )
    # the oldest were closed, the newest are held
    for sock in slow[:CAP]:
        assert read_until_closed(sock)[0] == b""
    assert slow_router.http.connection_stats()["open"] <= CAP
    # a fresh client is served (each of its connections evicts a slow one), health answers
    for _ in range(3):
        assert health(slow_router) == 200
    serves(slow_router)
    stats = slow_router.http.connection_stats()
    assert stats["peak"] <= CAP + 1 and stats["refused"] == stats0["refused"]
    for sock in slow:
        sock.close()


def test_a_tls_handshake_that_never_comes_is_bounded(workers, tmp_path):
    files = tls_files(tmp_path)
    tls = TLSConfig(b"", files["cert"].read_bytes(), files["key"].read_bytes())
    r = bounded_router(workers, client_tls=tls)
    try:
        sock = connect(r)  # TCP only: no ClientHello (asyncio's default wait is 60 s)
        data, took = read_until_closed(sock)
        assert data == b"" and took < HEADER_S + SLACK_S
        status = request(r.http_address, "GET", "/health", tls_ca=files["ca"].read_bytes())[0]
        assert status == 200
    finally:
        r.stop()


def test_the_router_raises_its_fd_limit_and_derives_the_cap(workers):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 4096:
        pytest.skip(f"needs a finite hard RLIMIT_NOFILE >= 4096, got {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard // 2, hard))
    try:
        r = workers.router()
        try:
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
            assert r.http.connection_stats()["cap"] == connection_cap(hard)
        finally:
            r.stop()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
