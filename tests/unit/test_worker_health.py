"""A worker's health service (worker_common/health.py) sends no response while it holds the lock
that gRPC's completion-queue thread takes to close a Watch. grpcio's HealthServicer did: a send
waits for that thread, which waited for the lock, and the worker's server served nothing more
(a worker's stop hung in CI). Without gRPC: the sends and the close callbacks are the test's."""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health_pb2

from pdserve.worker_common.health import Health

SERVING, NOT_SERVING = (
    health_pb2.HealthCheckResponse.SERVING,
    health_pb2.HealthCheckResponse.NOT_SERVING,
)
WAIT_S = 10.0  # a deadlock becomes a failure after this long


class Context:
    def __init__(self):
        self.callbacks, self.code = [], None

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def set_code(self, code):
        self.code = code

    def end(self) -> None:
        for callback in self.callbacks:
            callback()


def _watch(servicer, send, service: str = "") -> Context:
    context = Context()
    assert servicer.Watch(health_pb2.HealthCheckRequest(service=service), context, send) is None
    return context


def test_a_watch_that_closes_while_a_status_is_sent_does_not_wait_for_the_send():
    servicer = Health()
    first = _watch(servicer, lambda response: None)
    closed = []

    def send_waiting_for_a_close(response):
        # as gRPC's send: it returns once gRPC's thread took it, and that thread is now busy
        # closing the first watch
        if response is None or response.status != NOT_SERVING:
            return
        thread = threading.Thread(target=lambda: (first.end(), closed.append(True)))
        thread.start()
        thread.join(WAIT_S)

    _watch(servicer, send_waiting_for_a_close)
    servicer.enter_graceful_shutdown()
    assert closed == [True], "the close waited for the lock the send held"


def test_watchers_get_the_status_now_and_at_each_change_until_their_call_ends():
    servicer = Health()
    got = []
    context = _watch(servicer, got.append, "pdserve.worker.v1.DecodeWorker")
    servicer.set("pdserve.worker.v1.DecodeWorker", SERVING)
    context.end()
    servicer.set("pdserve.worker.v1.DecodeWorker", NOT_SERVING)
    assert [r and r.status for r in got] == [
        health_pb2.HealthCheckResponse.SERVICE_UNKNOWN,
        SERVING,
        None,  # the end of its stream
    ]


def test_check_and_graceful_shutdown():
    servicer = Health()
    servicer.set("a", SERVING)
    context = Context()
    assert servicer.Check(health_pb2.HealthCheckRequest(service="a"), context).status == SERVING
    servicer.Check(health_pb2.HealthCheckRequest(service="b"), context)
    assert context.code == grpc.StatusCode.NOT_FOUND
    got = []
    _watch(servicer, got.append, "a")
    servicer.enter_graceful_shutdown()
    servicer.set("a", SERVING)  # changes nothing once shutting down
    assert [r.status for r in got] == [SERVING, NOT_SERVING]
    assert (
        servicer.Check(health_pb2.HealthCheckRequest(service="a"), Context()).status == NOT_SERVING
    )


def test_a_server_without_non_blocking_calls_gets_a_stream_that_ends_with_the_call():
    servicer = Health()
    context = Context()
    stream = servicer.Watch(health_pb2.HealthCheckRequest(), context)
    assert next(stream).status == SERVING
    servicer.set("", NOT_SERVING)
    assert next(stream).status == NOT_SERVING
    context.end()
    assert list(stream) == []
