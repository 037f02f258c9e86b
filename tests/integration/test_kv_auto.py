"""kvtransfer.backend "auto" (kvtransfer/choose.py): a decode worker serves grpc and shm and
offers both in each reservation; a prefill worker on the same machine pushes over shm, one that
sees another machine's pool (a different locality) or cannot open shm falls back to grpc; the
greedy tokens are the engine's either way, and a reservation's offers are checked field by
field before any work."""

from __future__ import annotations

import grpc
import pytest

from helpers.models import random_prompts
from helpers.threads import wait_until
from helpers.worker import GREEDY, BackendCluster, forget_channels, idle, used_backends
from pdserve.engine import LLM, SamplingParams
from pdserve.kvtransfer import choose
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import worker_pb2

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def expected(tiny_models):
    prompts = random_prompts([30, 7, 21], seed=13)
    llm = LLM(tiny_models("llama-gqa")[0], kv_cache_memory=1 << 20)
    outs = llm.generate(prompts, SamplingParams(**sampling_kwargs(GREEDY)), use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def cluster(tiny_models):
    c = BackendCluster(tiny_models("llama-gqa")[0], "auto", 1, 1)
    yield c
    c.stop()


def test_a_reservation_offers_shm_then_grpc_and_the_same_host_takes_shm(cluster, expected):
    prompts, want = expected
    endpoint = cluster.reserve("offers", prompts[0]).endpoint
    cluster.d.Abort(worker_pb2.WorkerAbortRequest(request_id="offers"), timeout=10)
    assert [o.backend for o in endpoint.offers] == ["shm", "grpc"]
    assert endpoint.backend == "grpc" and endpoint.address == endpoint.offers[1].address
    assert endpoint.offers[0].locality and not endpoint.offers[1].locality
    forget_channels(cluster)
    assert [cluster.generate(f"same-{i}", p) for i, p in enumerate(prompts)] == want
    assert used_backends(cluster) == {"shm"}
    wait_until(lambda: idle(cluster), 5, "the decode pool back to idle")


def test_another_machines_pool_or_a_failed_shm_falls_back_to_grpc(cluster, expected, monkeypatch):
    prompts, want = expected
    forget_channels(cluster)
    # what a prefill worker on another machine sees: the pool's file is not its own
    monkeypatch.setattr(choose, "locality", lambda address: "another-boot:1:2")
    assert [cluster.generate(f"other-{i}", p) for i, p in enumerate(prompts)] == want
    assert used_backends(cluster) == {"grpc"}
    monkeypatch.undo()
    # the same machine, but shm cannot be opened: the next offer is tried
    forget_channels(cluster)
    servicer = cluster.prefill.parts["prefill"].servicer
    real = servicer._transport

    def no_shm(backend, address):
        if backend == "shm":
            raise OSError("cannot map the pool")
        return real(backend, address)

    monkeypatch.setattr(servicer, "_transport", no_shm)
    assert cluster.generate("no-shm", prompts[0]) == want[0]
    assert used_backends(cluster) == {"grpc"}
    wait_until(lambda: idle(cluster), 5, "the decode pool back to idle")


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda e: [e.offers.add(backend="grpc", address="x") for _ in range(4)], "at most 4"),
        (lambda e: setattr(e.offers[0], "backend", "carrier-pigeon"), "offers[0].backend"),
        (lambda e: setattr(e.offers[1], "locality", "x" * 129), "offers[1].locality"),
        (lambda e: e.offers[0].offers.add(backend="grpc", address="x"), "do not nest"),
    ],
    ids=["too-many", "backend", "locality", "nested"],
)
def test_bad_offers_are_refused_before_any_work(cluster, expected, change, message, request):
    prompts, _ = expected
    rid = request.node.callspec.id  # each its own: an aborted id stays taken a moment
    reservation = cluster.reserve(rid, prompts[1])
    try:
        change(reservation.endpoint)
        with pytest.raises(grpc.RpcError) as refused:
            cluster.prefill_req(rid, prompts[1], reservation)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in refused.value.details()
    finally:
        cluster.d.Abort(worker_pb2.WorkerAbortRequest(request_id=rid), timeout=10)
    wait_until(lambda: idle(cluster), 5, "the decode pool back to idle")


def test_no_offer_this_worker_can_use_is_unavailable(cluster, expected):
    prompts, _ = expected
    reservation = cluster.reserve("no-usable", prompts[1])
    try:
        del reservation.endpoint.offers[1]  # shm only, and not this machine's pool
        reservation.endpoint.offers[0].locality = "another-boot:1:2"
        with pytest.raises(grpc.RpcError) as refused:
            cluster.prefill_req("no-usable", prompts[1], reservation)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no KV channel of the reservation's offers (shm)" in refused.value.details()
    finally:
        cluster.d.Abort(worker_pb2.WorkerAbortRequest(request_id="no-usable"), timeout=10)
    wait_until(lambda: idle(cluster), 5, "the decode pool back to idle")
