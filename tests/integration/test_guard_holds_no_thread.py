"""What a caller can hold on a pdserve gRPC server before it is refused (protos/security.py
ServerGuard), over 127.0.0.1.

A caller without the cluster secret who sends a call's headers and never its request message
holds no handler thread: the refusal reads no request. Health needs no secret, so its calls
that wait for their request hold at most a bounded share of the threads, each for a bounded
time, and a health Watch holds none once it answered. A request-streaming method's undecodable
message ends the call INVALID_ARGUMENT, as a unary method's does, whichever thread reads it.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from helpers.threads import wait_until
from pdserve.kvtransfer.backends import connect
from pdserve.kvtransfer.backends.grpc_backend import FLUSH_METHOD, GrpcServer
from pdserve.protos import security
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.protos.security import ClusterSecurity
from pdserve.worker_common.grpc_server import ServiceHost

SECURITY = ClusterSecurity("guard-test-secret-0123456789")
STATS = "/pdserve.worker.v1.DecodeWorker/Stats"
CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"
WAIT_S = 30.0  # how long a refusal may take to arrive on a loaded machine


class _Bodyless:
    """Calls that send their headers and hold their request message back until `send()` (then
    an empty message), as a stranger's that never send it would."""

    def __init__(self, address: str):
        self._release = threading.Event()
        self._channel = grpc.insecure_channel(address)  # no secret
        self.calls = []

    def _body(self):
        self._release.wait()
        yield b""

    def open(self, method: str, n: int) -> list:
        opened = [self._channel.stream_unary(method).future(self._body()) for _ in range(n)]
        self.calls += opened
        return opened

    def send(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._release.set()
        for call in self.calls:
            call.cancel()
        self._channel.close()


def _code(call) -> grpc.StatusCode | None:
    """The status code a call ended with (None while it is open)."""
    if not call.done():
        return None
    error = call.exception()
    return error.code() if error is not None else grpc.StatusCode.OK


class _Stats(worker_pb2_grpc.DecodeWorkerServicer):
    def Stats(self, request, context):
        return worker_pb2.WorkerStats(worker_id="w")


@pytest.fixture
def worker():
    """A worker's server as every worker runs one, with 4 handler threads."""
    host = ServiceHost(
        "w", "127.0.0.1", 0, max_workers=4, max_message_bytes=1 << 20, security=SECURITY
    )
    address = host.start(
        lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_Stats(), s),
        ("pdserve.worker.v1.DecodeWorker",),
    )
    yield address
    host.stop(0.1)


def _stats(address: str) -> str:
    with SECURITY.channel(address) as channel:
        reply = worker_pb2_grpc.DecodeWorkerStub(channel).Stats(
            worker_pb2.StatsRequest(), timeout=WAIT_S
        )
    return reply.worker_id


def assert_refused(calls) -> None:
    """Every call ended refused: UNAUTHENTICATED, or, for calls that came past the server's
    limit of calls at once while the first were being refused (a loaded machine), turned away
    as that limit says. Before the fix the first calls never ended at all."""
    codes = {_code(c) for c in calls}
    assert grpc.StatusCode.UNAUTHENTICATED in codes, codes
    assert codes <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes


def test_bodyless_calls_without_the_secret_hold_no_kv_server_thread():
    # max_channels=1: 4 handler threads and at most 4 calls at once
    server = GrpcServer(lambda header, payload: None, max_channels=1, security=SECURITY)
    stranger = _Bodyless(server.address)
    try:
        calls = stranger.open(FLUSH_METHOD, 12)
        wait_until(lambda: all(c.done() for c in calls), WAIT_S, "every bodyless call refused")
        assert_refused(calls)
        # the stranger's connection is still open; a real sender gets its channel and a Flush
        transport = connect("grpc", server.address, timeout=WAIT_S, security=SECURITY)
        try:
            transport.flush(WAIT_S)
        finally:
            transport.close()
    finally:
        stranger.close()
        server.stop()


def test_bodyless_calls_without_the_secret_and_to_health_leave_the_worker_serving(
    worker, monkeypatch
):
    monkeypatch.setattr(security, "OPEN_WAIT_S", 600.0)  # the waiting Check waits for send()
    stranger = _Bodyless(worker)
    try:
        refused = stranger.open(STATS, 12)
        checks = stranger.open(CHECK, 6)
        health = checks + stranger.open(WATCH, 3)
        wait_until(lambda: all(c.done() for c in refused), WAIT_S, "every Stats refused")
        assert_refused(refused)
        # 4 threads: one of them at most waits for a health call's request, the rest are refused
        wait_until(
            lambda: sum(c.done() for c in health) >= len(health) - 1,
            WAIT_S,
            "the health calls past the bound refused",
        )
        assert {_code(c) for c in health} <= {grpc.StatusCode.RESOURCE_EXHAUSTED, None}
        assert _stats(worker) == "w"
        stranger.send()  # the waiting health call gets its (empty) request and is answered
        # (a Watch answers and stays open, holding no thread)
        wait_until(lambda: all(c.done() for c in checks), WAIT_S, "the waiting Check answered")
    finally:
        stranger.close()
    with grpc.insecure_channel(worker) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=WAIT_S
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_health_call_that_never_sends_its_request_is_cancelled_after_a_bound(worker, monkeypatch):
    """Before, the call that waited held its thread, and health's only slot, for as long as
    the stranger kept the connection open: every probe after it was RESOURCE_EXHAUSTED."""
    monkeypatch.setattr(security, "OPEN_WAIT_S", 0.5)
    stranger = _Bodyless(worker)
    try:
        checks = stranger.open(CHECK, 6)
        wait_until(lambda: all(c.done() for c in checks), WAIT_S, "every bodyless Check ended")
        codes = [_code(c) for c in checks]
        # 4 threads: one waited for its request until the bound, the rest were refused at once
        assert grpc.StatusCode.CANCELLED in codes, codes
        assert set(codes) <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}
        # the stranger's connection is still open, and a probe is answered
        with grpc.insecure_channel(worker) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=WAIT_S
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        stranger.close()


def test_health_watches_hold_no_thread(worker):
    channel = grpc.insecure_channel(worker)
    stub = health_pb2_grpc.HealthStub(channel)
    watches = []
    # no deadline on the watches (one ending would free its thread); their first answer is
    # waited for on a thread of the test's own, for at most WAIT_S
    reader = futures.ThreadPoolExecutor(1)
    try:
        for _ in range(8):  # twice the threads; one at a time, each answered before the next
            watch = stub.Watch(health_pb2.HealthCheckRequest())
            watches.append(watch)
            first = reader.submit(next, watch).result(WAIT_S)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
        assert _stats(worker) == "w"
        check = stub.Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for watch in watches:
            watch.cancel()
        reader.shutdown(wait=True)
        channel.close()


def _streams_server():
    """A server with a Streams that reads on a thread of its own (as the decode worker's does)
    and a method that reads on its handler's thread."""

    def read_on_a_thread(requests, context):
        seen = []
        reader = threading.Thread(target=lambda: seen.extend(_ids(requests)), daemon=True)
        reader.start()
        reader.join(WAIT_S)
        for rid in seen:
            yield worker_pb2.StreamsResponse(requests=[{"request_id": rid}])

    def read_here(requests, context):
        return worker_pb2.StreamsResponse(requests=[{"request_id": rid} for rid in _ids(requests)])

    handlers = grpc.method_handlers_generic_handler(
        "pdserve.test.Streams",
        {
            "OnAThread": grpc.stream_stream_rpc_method_handler(
                read_on_a_thread,
                request_deserializer=worker_pb2.StreamsRequest.FromString,
                response_serializer=worker_pb2.StreamsResponse.SerializeToString,
            ),
            "Here": grpc.stream_unary_rpc_method_handler(
                read_here,
                request_deserializer=worker_pb2.StreamsRequest.FromString,
                response_serializer=worker_pb2.StreamsResponse.SerializeToString,
            ),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=SECURITY.server_interceptors())
    server.add_generic_rpc_handlers((handlers,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _ids(requests) -> list[str]:
    ids = []
    try:
        for request in requests:
            ids += list(request.attach)
    except Exception:  # the guard ended the call; the handler ends too
        pass
    return ids


GOOD = worker_pb2.StreamsRequest(attach=["a"]).SerializeToString()
BAD = b"\x0a\x02\xc3\x28"  # attach: a string that is not UTF-8


@pytest.mark.parametrize("method", ["OnAThread", "Here"])
def test_an_undecodable_message_on_a_request_stream_is_invalid_argument(method):
    server, address = _streams_server()
    try:
        with SECURITY.channel(address) as channel:
            kind = channel.stream_stream if method == "OnAThread" else channel.stream_unary
            call = kind(f"/pdserve.test.Streams/{method}")
            with pytest.raises(grpc.RpcError) as info:
                reply = call(iter([GOOD, BAD]), timeout=WAIT_S)
                list(reply) if method == "OnAThread" else reply
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid protobuf message" in info.value.details()
            assert "Streams/" + method in info.value.details()
            good = call(iter([GOOD]), timeout=WAIT_S)  # the server keeps serving
            replies = list(good) if method == "OnAThread" else [good]
            replies = [worker_pb2.StreamsResponse.FromString(r) for r in replies]
            assert [r.requests[0].request_id for r in replies] == ["a"]
    finally:
        server.stop(None)


def test_on_grpc_aio_a_stranger_s_bodyless_call_is_refused_at_once():
    async def run():
        server = grpc.aio.server(
            interceptors=SECURITY.server_interceptors(aio=True), maximum_concurrent_rpcs=4
        )
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_Stats(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        release = asyncio.Event()

        async def body():
            await release.wait()
            yield b""

        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        calls = [asyncio.ensure_future(channel.stream_unary(STATS)(body())) for _ in range(8)]
        done, pending = await asyncio.wait(calls, timeout=WAIT_S)
        codes = {c.exception().code() for c in done if c.exception() is not None}
        release.set()
        for call in pending:
            call.cancel()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as own:
            stub = worker_pb2_grpc.DecodeWorkerStub(own)
            reply = await stub.Stats(
                worker_pb2.StatsRequest(), metadata=SECURITY.metadata(), timeout=WAIT_S
            )
        await channel.close()
        await server.stop(0)
        return not pending, codes, reply.worker_id

    all_done, codes, worker_id = asyncio.run(run())
    # every call ended at once: refused, or, past the server's 4 calls at once while the first
    # were being refused (a loaded machine), turned away as the server's limit says
    assert all_done and grpc.StatusCode.UNAUTHENTICATED in codes, codes
    assert codes <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert worker_id == "w"


def test_health_through_the_bound_answers_as_before(worker):
    with grpc.insecure_channel(worker) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        ok = stub.Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
        assert ok.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=WAIT_S)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(CHECK)(b"\x0a\x02\xc3\x28", timeout=WAIT_S)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_on_grpc_aio_an_undecodable_message_on_a_request_stream_is_invalid_argument():
    """The router's reflection service (request-streaming, open) on grpc.aio."""

    async def run():
        server = grpc.aio.server(
            interceptors=SECURITY.server_interceptors(
                open_prefixes=("/grpc.reflection.",), aio=True
            )
        )
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(("a.B", reflection.SERVICE_NAME)), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

        async def ask(*messages):
            for message in messages:
                yield message

        info = channel.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
        )
        try:
            async for _ in info(ask(BAD), timeout=WAIT_S):
                pass
        except grpc.RpcError as e:
            refused = (e.code(), e.details())
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        names = []
        good = reflection_pb2.ServerReflectionRequest(list_services="")
        async for reply in stub.ServerReflectionInfo(ask(good), timeout=WAIT_S):
            names += [s.name for s in reply.list_services_response.service]
        await channel.close()
        await server.stop(0)
        return refused, names

    (code, details), names = asyncio.run(run())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid protobuf" in details
    assert "a.B" in names
