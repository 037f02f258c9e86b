"""The router's HTTP/2 keepalive on its channels to workers (router/pool.py) and the workers'
servers permitting it (worker_common/grpc_server.py): a worker process that is stopped (SIGSTOP)
keeps its socket open and answers nothing, and a call open on it must fail UNAVAILABLE within
the keepalive bound rather than wait for its own deadline; a worker that answers must not hang up
on the pings (gRPC's default server sends GOAWAY "too_many_pings" to a client pinging more often
than every 5 minutes without data).

The server runs in a child process, so that it can be stopped without stopping the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.protos.keepalive import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, MIN_PING_INTERVAL_MS
from pdserve.router.pool import WORKER_CHANNEL_OPTIONS

SERVER = """
import time
from pdserve.worker_common.grpc_server import ServiceHost
host = ServiceHost("keepalive-test", "127.0.0.1", 0, 4, 1 << 20)
print(host.start(lambda server: None, ()), flush=True)
time.sleep(300)
"""
# the bound: a ping goes out after KEEPALIVE_TIME_MS without traffic and fails after
# KEEPALIVE_TIMEOUT_MS; the call's own deadline is far beyond it
BOUND_S = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 5
CALL_DEADLINE_S = BOUND_S + 30


@pytest.fixture
def worker_processes():
    """Two (child Popen, address) pairs: a ServiceHost in each of two child processes, killed
    after. Both checks below wait out keepalive timers; they run side by side on the two."""
    children = []
    try:
        for _ in range(2):
            child = subprocess.Popen(
                [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True
            )
            children.append(child)
        pairs = []
        for child in children:
            address = child.stdout.readline().strip()
            assert address, "the server did not start"
            pairs.append((child, address))
        yield pairs
    finally:
        for child in children:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait(10)


def open_watch(address, options):
    """(channel, a Health.Watch call open on it, with its first response read)."""
    channel = grpc.insecure_channel(address, options)
    watch = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=""), timeout=CALL_DEADLINE_S
    )
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    return channel, watch


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
def test_a_stopped_worker_fails_unavailable_and_a_quiet_call_survives_pings(worker_processes):
    """A call open on a stopped worker fails UNAVAILABLE within the keepalive bound; meanwhile a
    call with no data on the other worker, pinged every MIN_PING_INTERVAL_MS (the most the server
    permits), stays open for 3.5 intervals: three such pings would be enough for a default server
    to hang up."""
    (stopped_child, stopped_address), (_, quiet_address) = worker_processes
    fast_pings = [
        (key, MIN_PING_INTERVAL_MS if key == "grpc.keepalive_time_ms" else value)
        for key, value in WORKER_CHANNEL_OPTIONS
    ]
    quiet_channel, quiet_watch = open_watch(quiet_address, fast_pings)
    quiet_since = time.monotonic()
    channel, watch = open_watch(stopped_address, WORKER_CHANNEL_OPTIONS)
    try:
        os.kill(stopped_child.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in watch:
                pass
        waited = time.monotonic() - stopped
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert waited < BOUND_S, f"the stopped worker was noticed after {waited:.0f} s"
        left = 3.5 * MIN_PING_INTERVAL_MS / 1000 - (time.monotonic() - quiet_since)
        time.sleep(max(0.0, left))
        assert not quiet_watch.done(), (
            f"the server hung up: {quiet_watch.code()} {quiet_watch.details()}"
        )
    finally:
        quiet_watch.cancel()
        quiet_channel.close()
        channel.close()
