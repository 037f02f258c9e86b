"""Must-show (b): a stranger without the cluster secret is refused at every control-plane door,
holds nothing, and receives no prompt or KV; a process with the secret that abuses a door gets a
clear error and holds nothing. (The KV channels of each backend: tests/integration/test_kv_security.py.)
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import msgpack
import pytest
import torch

from helpers.chaos import RPC_TIMEOUT, SECURITY, SecureCluster, stream, wait_until
from pdserve.kvtransfer.backends import connect
from pdserve.kvtransfer.backends.grpc_backend import FLUSH_METHOD, PUSH_METHOD, frame_pieces
from pdserve.kvtransfer.transport import Destination
from pdserve.kvtransfer.wire import ChunkHeader
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.protos.security import ClusterSecurity

SAMPLING = pdserve_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(2, 40))
MAX_LEASE_MS = 1500


class CountingDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """The stranger's fake decode worker: counts every call that reaches it."""

    def __init__(self):
        self.calls = 0

    def Reserve(self, request, context):
        self.calls += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "fake")


@pytest.fixture(scope="module")
def cluster(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    c = SecureCluster(model_dir, max_lease_ms=MAX_LEASE_MS)
    yield c
    c.stop()


@pytest.fixture
def fake_decode():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    fake = CountingDecode()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, f"127.0.0.1:{port}"
    server.stop(0)


def generate_prompt(cluster, sampling) -> list:
    """Every response of a Generate of PROMPT with `sampling`, through the router."""
    return list(
        cluster.api.Generate(
            pdserve_pb2.GenerateRequest(
                token_ids=pdserve_pb2.TokenIds(ids=PROMPT), sampling=sampling
            ),
            timeout=RPC_TIMEOUT,
        )
    )


def _reservation(cluster, rid="r", prompt=PROMPT, lease_ms=5000):
    return cluster.d.Reserve(
        worker_pb2.ReserveRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=SAMPLING, lease_ms=lease_ms
        ),
        timeout=RPC_TIMEOUT,
    )


@pytest.mark.parametrize("secret", [None, "a-wrong-secret-of-enough-length"])
def test_every_control_plane_door_refuses_a_stranger(cluster, fake_decode, secret):
    fake, fake_address = fake_decode
    stranger = ClusterSecurity(secret)
    held = "held-" + (
        "none" if secret is None else "wrong"
    )  # one per case: an aborted id stays known a while
    reservation = _reservation(cluster, held)  # a real one, for the stranger to aim at
    kv_address = reservation.endpoint.address
    calls = {
        "Registry.Register": lambda ch: worker_pb2_grpc.RegistryStub(ch).Register(
            worker_pb2.RegisterRequest(
                worker_id="d0", role="decode", address=fake_address, deployment_id="chaos"
            )
        ),
        "Registry.Heartbeat": lambda ch: worker_pb2_grpc.RegistryStub(ch).Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id="d0")
        ),
        "DecodeWorker.Reserve": lambda ch: worker_pb2_grpc.DecodeWorkerStub(ch).Reserve(
            worker_pb2.ReserveRequest(request_id="x", prompt_token_ids=PROMPT, lease_ms=2**32 - 1)
        ),
        "DecodeWorker.Stream": lambda ch: list(
            worker_pb2_grpc.DecodeWorkerStub(ch).Stream(worker_pb2.StreamRequest(request_id=held))
        ),
        "DecodeWorker.Abort": lambda ch: worker_pb2_grpc.DecodeWorkerStub(ch).Abort(
            worker_pb2.WorkerAbortRequest(request_id=held)
        ),
        "DecodeWorker.Stats": lambda ch: worker_pb2_grpc.DecodeWorkerStub(ch).Stats(
            worker_pb2.StatsRequest()
        ),
        "PrefillWorker.Prefill": lambda ch: worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(
            worker_pb2.PrefillRequest(
                request_id="x", prompt_token_ids=PROMPT, reservation=reservation
            )
        ),
        "PrefillWorker.Abort": lambda ch: worker_pb2_grpc.PrefillWorkerStub(ch).Abort(
            worker_pb2.WorkerAbortRequest(request_id="x")
        ),
        "PrefillWorker.Stats": lambda ch: worker_pb2_grpc.PrefillWorkerStub(ch).Stats(
            worker_pb2.StatsRequest()
        ),
        "KV.Push": lambda ch: ch.stream_unary(PUSH_METHOD)(
            iter(
                [
                    b"".join(
                        frame_pieces(
                            ChunkHeader(
                                held,
                                reservation.endpoint.layout_fingerprint,
                                kind="commit",
                                first_tokens=(5,),
                            )
                        )
                    )
                ]
            ),
            metadata=(("pdserve-kv-channel", "stranger"),),
        ),
        "KV.Flush": lambda ch: ch.unary_unary(FLUSH_METHOD)(
            msgpack.packb({"channel": "x", "frames": 1, "wait_s": float("nan")})
        ),
    }
    targets = {
        "Registry": cluster.router.address,
        "DecodeWorker": cluster.decode.address,
        "PrefillWorker": cluster.prefill.address,
        "KV": kv_address,
    }
    refused = {}
    for name, call in calls.items():
        channel = stranger.channel(targets[name.split(".")[0]])
        try:
            call_with_timeout = call(channel)
            refused[name] = f"answered {call_with_timeout!r}"
        except grpc.RpcError as e:
            refused[name] = e.code()
        finally:
            channel.close()
    assert refused == {name: grpc.StatusCode.UNAUTHENTICATED for name in calls}

    # nothing held or changed: the real reservation is still there and still the only one
    assert cluster.decode_stats().num_reserved == 1
    assert cluster.d.Abort(worker_pb2.WorkerAbortRequest(request_id=held)).found
    # the pool still holds the real decode worker: a client's prompt goes there, not to the fake
    ids, finish, how = stream(cluster.api, PROMPT, SAMPLING)
    assert how == "finished" and len(ids) == 6 and finish.timings.decode_worker == "d0"
    assert fake.calls == 0
    wait_until(cluster.kv_all_free, 10, "all KV free")


def test_lease_is_capped_by_the_worker(cluster):
    before = time.time_ns()
    reservation = _reservation(cluster, "long-lease", lease_ms=2**32 - 1)
    assert reservation.lease_deadline_unix_ns <= before + (MAX_LEASE_MS + 1000) * 1_000_000
    assert cluster.decode_stats().num_reserved == 1
    wait_until(
        lambda: cluster.decode_stats().num_reserved == 0,
        MAX_LEASE_MS / 1000 + 5,
        "the capped lease expired",
    )
    wait_until(cluster.kv_all_free, 5, "all KV free")


def test_commit_of_an_out_of_vocabulary_token_frees_the_reservation(cluster):
    reservation = _reservation(cluster, "oov")
    layout = cluster.decode.layout
    dest_layout = layout
    transport = connect("grpc", reservation.endpoint.address, security=SECURITY)
    try:
        dest = Destination(list(reservation.block_ids), dest_layout)
        # the tokens past what the decode worker's prefix cache holds (an earlier test's prompt)
        start, n = reservation.num_cached_tokens, len(PROMPT)
        for layer in range(layout.num_layers):  # every layer's KV really sent
            data = torch.zeros(2, n - start, layout.num_kv_heads, layout.head_dim)
            transport.send(
                ChunkHeader(
                    "oov",
                    layout.fingerprint,
                    layer,
                    start,
                    n,
                    0,
                    layout.num_kv_heads,
                    layout.head_dim,
                    "float32",
                ),
                data,
                dest,
            )
        transport.send(
            ChunkHeader("oov", layout.fingerprint, kind="commit", first_tokens=(10**9,)), None, dest
        )
        transport.flush(10)
    finally:
        transport.close()
    events = list(cluster.d.Stream(worker_pb2.StreamRequest(request_id="oov"), timeout=RPC_TIMEOUT))
    assert events[-1].finish_reason == "abort"
    assert "first_token" in events[-1].stop_str
    wait_until(cluster.kv_all_free, 5, "the refused commit's blocks freed")


def test_a_client_cannot_abort_another_clients_request(cluster, monkeypatch):
    # a channel of its own connection: channels to one target in one process share a subchannel
    # (one TCP connection, one peer) unless told otherwise, and the router scopes aborts by peer
    other = grpc.insecure_channel(
        cluster.router.address, options=[("grpc.use_local_subchannel_pool", 1)]
    )
    try:
        # long enough to be running still when the abort arrives right after its first tokens
        # (a poll of the decode worker's stats missed a 40-token one on a fast engine)
        sampling = pdserve_pb2.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        running = threading.Event()
        with futures.ThreadPoolExecutor(1) as pool:
            victim = pool.submit(
                stream, cluster.api, PROMPT, sampling, "victim-id", started=running
            )
            assert running.wait(RPC_TIMEOUT), "the victim's request never started"
            found = pdserve_pb2_grpc.PDServeStub(other).Abort(
                pdserve_pb2.AbortRequest(request_id="victim-id")
            )
            ids, finish, how = victim.result(timeout=RPC_TIMEOUT)
        assert not found.found
        assert how == "finished" and len(ids) == 200 and finish.finish_reason == "length"
    finally:
        other.close()
    # the owner can: same channel, same id. Decode steps slowed, so the stream still runs when
    # the Abort lands (on a loaded machine all 200 tokens were out before it, as in
    # tests/integration/test_router.py's abort test)
    engine = cluster.decode.loop.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.02), step())[1])
    running = threading.Event()
    with futures.ThreadPoolExecutor(1) as pool:
        mine = pool.submit(
            stream,
            cluster.api,
            PROMPT,
            pdserve_pb2.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
            "mine",
            started=running,
        )
        assert running.wait(RPC_TIMEOUT), "the request never started"
        assert cluster.api.Abort(pdserve_pb2.AbortRequest(request_id="mine")).found
        ids, finish, how = mine.result(timeout=RPC_TIMEOUT)
    assert how == "finished" and finish.finish_reason == "abort" and len(ids) < 200
    wait_until(cluster.kv_all_free, 5, "all KV free")


@pytest.mark.parametrize(
    "payload, method",
    [
        (b"\x1a\x03\xff\xfe\xfd", "Generate"),  # text with bytes that are not UTF-8
        (b"\x1a\x40abc", "Generate"),  # a length prefix past the end: truncated
        (b"\x0a\x02\xc3\x28", "Abort"),
    ],
)
def test_undecodable_requests_get_invalid_argument(cluster, payload, method):
    kind = (
        cluster.api_channel.unary_stream
        if method == "Generate"
        else cluster.api_channel.unary_unary
    )
    call = kind(f"/pdserve.v1.PDServe/{method}")
    with pytest.raises(grpc.RpcError) as err:
        result = call(payload, timeout=RPC_TIMEOUT)
        if method == "Generate":
            list(result)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid protobuf message" in err.value.details()


@pytest.mark.parametrize(
    "sampling, says",
    [
        (pdserve_pb2.SamplingParams(max_tokens=2**32 - 1), "a -1 sent as uint32"),
        (pdserve_pb2.SamplingParams(stop=["x"] * 65), "at most 64"),
        (pdserve_pb2.SamplingParams(stop=["x" * 600]), "at most 512"),
        (pdserve_pb2.SamplingParams(temperature=float("nan")), "finite"),
        (pdserve_pb2.SamplingParams(stop_token_ids=[10**6]), "vocabulary size"),
    ],
)
def test_numbers_and_sizes_are_checked_at_the_router(cluster, sampling, says):
    with pytest.raises(grpc.RpcError) as err:
        generate_prompt(cluster, sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in err.value.details()


def test_workers_check_fields_with_the_secret_too(cluster):
    with pytest.raises(grpc.RpcError) as err:
        cluster.d.Reserve(
            worker_pb2.ReserveRequest(
                request_id="big",
                prompt_token_ids=PROMPT,
                sampling=pdserve_pb2.SamplingParams(max_tokens=2**32 - 1),
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        cluster.d.Reserve(worker_pb2.ReserveRequest(request_id="v", prompt_token_ids=[10**6]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:  # tokens held back without end
        cluster.d.Reserve(
            worker_pb2.ReserveRequest(
                request_id="held", prompt_token_ids=PROMPT, stream_interval=2**32 - 1
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream_interval=4294967295: at most 64" in err.value.details()
    assert cluster.decode_stats().num_reserved == 0


def test_a_stranger_calling_in_a_loop_does_not_flood_the_log(cluster, caplog):
    stranger = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(cluster.decode.address))
    with caplog.at_level("WARNING", "pdserve.protos.security"):
        for _ in range(50):
            with pytest.raises(grpc.RpcError):
                stranger.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)
    lines = [r for r in caplog.records if "cluster secret" in r.getMessage()]
    assert len(lines) <= 1, [r.getMessage() for r in lines]
    assert SECURITY.secret not in caplog.text


def test_logprob_counts_past_the_bound_are_refused_on_the_wire(cluster):
    for sampling, field in (
        (pdserve_pb2.SamplingParams(max_tokens=4, prompt_logprobs=21), "prompt_logprobs"),
        (pdserve_pb2.SamplingParams(max_tokens=4, logprobs=True, top_logprobs=21), "top_logprobs"),
        (pdserve_pb2.SamplingParams(max_tokens=4, top_logprobs=2), "top_logprobs"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            generate_prompt(cluster, sampling)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sampling.{field}" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # nor does a worker take it from a router
            cluster.d.Reserve(
                worker_pb2.ReserveRequest(
                    request_id="plp", prompt_token_ids=PROMPT, sampling=sampling
                ),
                timeout=RPC_TIMEOUT,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
