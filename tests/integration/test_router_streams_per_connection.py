"""A stranger's calls that send headers and never a body hold the router's gRPC server only up to
a bound per connection (router/server.py streams_per_connection): past it, that connection's next
call waits in the client, while a call on another connection is served. No worker is needed:
gRPC health answers from the router alone."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pdserve.router.server import Router, RouterConfig, streams_per_connection

HEALTH = "/grpc.health.v1.Health/Check"
GENERATE = "/pdserve.v1.PDServe/Generate"
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


@pytest.fixture(scope="module")
def router(tiny_models):
    router = Router(
        RouterConfig(model=tiny_models("llama-gqa")[0], max_inflight=1, max_queued=1)
    ).start()
    yield router
    router.stop()


async def _health(channel, timeout: float) -> grpc.StatusCode:
    check = channel.unary_unary(
        HEALTH,
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    try:
        await check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def _fill_then_ask(address: str, held: int) -> tuple[grpc.StatusCode, grpc.StatusCode]:
    """`held` Generate calls without a body on one connection, then health on that connection
    and on another."""

    async def never():
        await asyncio.sleep(3600)
        yield b""

    async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as filled:
        assert await _health(filled, 30) == grpc.StatusCode.OK  # the connection is up
        calls = [filled.stream_stream(GENERATE)(never()) for _ in range(held)]
        # each call opens its stream before the health check made after it
        same = await _health(filled, 2)
        async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as other:
            elsewhere = await _health(other, 30)
        for call in calls:
            call.cancel()
        await asyncio.gather(*(_ended(call) for call in calls))
    return same, elsewhere


async def _ended(call) -> None:
    try:
        await call.code()
    except asyncio.CancelledError:
        pass


def test_calls_without_a_body_fill_only_their_own_connection(router):
    limit = streams_per_connection(1, 1)
    # one held call fewer than the bound leaves the room health needs on that connection
    assert asyncio.run(_fill_then_ask(router.address, limit - 2)) == (
        grpc.StatusCode.OK,
        grpc.StatusCode.OK,
    )
    assert asyncio.run(_fill_then_ask(router.address, limit)) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.OK,
    )
