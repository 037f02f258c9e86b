"""The channel every pdserve process calls another with (protos/security.py ClusterSecurity.channel):
each kind of call carries the cluster secret beside the caller's own metadata, and a call on a
closed channel raises instead of crashing the process.

A server with the deployment's ServerGuard answers four methods (one of each kind) over 127.0.0.1.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent import futures

import grpc
import pytest

from pdserve.protos.security import INSECURE, SECRET_METADATA_KEY, ClusterSecurity

SECURITY = ClusterSecurity("channel-test-secret-0123456789")
SERVICE = "pdserve.test.Echo"
OWN = ("x-caller", "mine")


def _echo_metadata(context) -> bytes:
    """What the handler saw: the caller's own entry and the secret's key (never its value)."""
    keys = {key: value for key, value in context.invocation_metadata()}
    return f"{keys.get(OWN[0], '-')} {SECRET_METADATA_KEY in keys}".encode()


def _handlers():
    def unary(request, context):
        return _echo_metadata(context)

    def server_stream(request, context):
        yield _echo_metadata(context)
        yield b"second"

    def client_stream(requests, context):
        return _echo_metadata(context) + b" " + str(sum(1 for _ in requests)).encode()

    def bidi(requests, context):
        for _ in requests:
            yield _echo_metadata(context)

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
            "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        },
    )


@pytest.fixture(scope="module")
def address():
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=SECURITY.server_interceptors())
    server.add_generic_rpc_handlers((_handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_every_kind_of_call_carries_the_secret_and_the_callers_metadata(address):
    with SECURITY.channel(address) as channel:
        unary = channel.unary_unary(f"/{SERVICE}/Unary", _registered_method=True)
        md = (OWN,)
        assert unary(b"", timeout=5, metadata=md) == b"mine True"
        assert unary(b"", 5) == b"- True"  # no metadata of its own; timeout as grpc places it
        reply, call = unary.with_call(b"", timeout=5, metadata=md)
        assert reply == b"mine True" and call.code() == grpc.StatusCode.OK
        assert unary.future(b"", timeout=5, metadata=md).result() == b"mine True"
        stream = channel.unary_stream(f"/{SERVICE}/ServerStream")
        assert list(stream(b"", timeout=5, metadata=md)) == [b"mine True", b"second"]
        upload = channel.stream_unary(f"/{SERVICE}/ClientStream")
        assert upload(iter([b"a", b"b"]), timeout=5, metadata=md) == b"mine True 2"
        assert upload.with_call(iter([b"a"]), timeout=5)[0] == b"- True 1"
        assert upload.future(iter([]), timeout=5).result() == b"- True 0"
        bidi = channel.stream_stream(f"/{SERVICE}/Bidi")
        assert list(bidi(iter([b"a", b"b"]), timeout=5, metadata=md)) == [b"mine True"] * 2
        grpc.channel_ready_future(channel).result(timeout=5)  # subscribe/unsubscribe pass through
    with INSECURE.channel(address) as stranger:
        with pytest.raises(grpc.RpcError) as info:
            stranger.unary_unary(f"/{SERVICE}/Unary")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


CLOSED_CHANNEL_SCRIPT = textwrap.dedent(
    """
    from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
    from pdserve.protos.security import ClusterSecurity

    channel = ClusterSecurity("channel-test-secret-0123456789").channel("127.0.0.1:9")
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)
    channel.close()
    try:  # a method never called on this channel before
        stub.Abort(worker_pb2.WorkerAbortRequest(request_id="late"), timeout=1)
    except ValueError as e:
        print("refused:", e)
    """
)


def test_a_first_call_on_a_closed_channel_raises_instead_of_crashing():
    # grpc's intercepted channel registered the method at its first call, on the closed channel
    # (grpc/grpc#43455): the process died of a segfault, as a CI run's router did at its stop.
    # In a process of its own, so that a crash fails this test rather than the suite
    done = subprocess.run(
        [sys.executable, "-c", CLOSED_CHANNEL_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "refused: Cannot invoke RPC on closed channel" in done.stdout
