"""kvtransfer.backend "auto" with a ranking from a profile where nixl is the fastest on one host
(kvtransfer/choose.py): the decode worker serves and offers nixl first (with the reservation's
write grant), the prefill worker on the same host pushes over nixl, the greedy tokens are the
engine's, the per-backend push counters (pdserve:kv_push_bytes{backend="nixl"}) count it, a
failed nixl channel falls back to the next offer, and the pool ends idle. Skipped where NIXL is
not installed. The ranking alone: tests/unit/test_auto_rank_profile.py."""

from __future__ import annotations

import pytest

from helpers.models import random_prompts
from helpers.threads import wait_until
from helpers.worker import (
    GREEDY,
    MAX_MODEL_LEN,
    Cluster,
    forget_channels,
    idle,
    start_decode,
    used_backends,
)
from pdserve.engine import LLM, SamplingParams
from pdserve.kvtransfer.backends import BACKENDS
from pdserve.kvtransfer.backends.nixl_backend import nixl_available
from pdserve.kvtransfer.choose import host_id, ranking_from_profile
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import worker_pb2

pytestmark = [
    pytest.mark.skipif(
        not nixl_available(), reason="NIXL is not installed: pip install 'pdserve[nixl]'"
    ),
    pytest.mark.usefixtures("one_thread"),
]

PROFILE = {
    "kv_bytes_per_token": 4096,
    "kv_transfer": {
        "grpc": {"bandwidth_bytes_per_s": 1.5e9, "latency_s": 1e-3},
        "shm": {"bandwidth_bytes_per_s": 2.0e9, "latency_s": 1e-3},
        "nixl": {"bandwidth_bytes_per_s": 9.0e9, "latency_s": 1e-3},
    },
    "source": {"date": "2026-11-30"},
}


class RankedCluster(Cluster):
    """One decode worker on "auto" with `ranking`, one prefill worker, in this process."""

    def __init__(self, model_dir, ranking: dict):
        self.decode = start_decode(
            model_dir,
            engine=dict(kv_cache_memory=1 << 17, max_model_len=MAX_MODEL_LEN),
            kv_backend="auto",
            kv_ranking=ranking,
        )
        self.add_prefill(model_dir)


@pytest.fixture(scope="module")
def expected(tiny_models):
    prompts = random_prompts([30, 7, 21], seed=17)
    llm = LLM(tiny_models("llama-gqa")[0], kv_cache_memory=1 << 20)
    outs = llm.generate(prompts, SamplingParams(**sampling_kwargs(GREEDY)), use_tqdm=False)
    llm.shutdown()
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def cluster(tiny_models):
    ranking = ranking_from_profile(PROFILE, "nixl-first.json", BACKENDS)
    assert ranking.same_host[0] == "nixl"
    c = RankedCluster(tiny_models("llama-gqa")[0], ranking.to_dict())
    yield c
    c.stop()


def test_a_profile_naming_nixl_first_hands_off_over_nixl(cluster, expected):
    prompts, want = expected
    reservation = cluster.reserve("offers", prompts[0])
    cluster.d.Abort(worker_pb2.WorkerAbortRequest(request_id="offers"), timeout=10)
    offers = reservation.endpoint.offers
    assert [o.backend for o in offers] == ["nixl", "shm", "grpc"]
    assert all(o.host == host_id() for o in offers)
    assert [o.cross_host_rank for o in offers] == [0, 0, 1]  # other hosts: grpc only
    assert offers[0].write_grant and not offers[2].write_grant
    assert cluster.decode.parts["decode"].kv_backends == "auto: nixl, shm, grpc"
    forget_channels(cluster)
    assert [cluster.generate(f"nixl-{i}", p) for i, p in enumerate(prompts)] == want
    assert used_backends(cluster) == {"nixl"}
    pushed = cluster.p.Stats(worker_pb2.StatsRequest(), timeout=10).kv_push_bytes_by_backend
    assert pushed["nixl"] > 0 and set(pushed) == {"nixl"}
    wait_until(lambda: idle(cluster), 5, "the decode pool back to idle")


def test_a_nixl_channel_that_cannot_open_falls_back_to_shm(cluster, expected, monkeypatch):
    prompts, want = expected
    forget_channels(cluster)
    servicer = cluster.prefill.parts["prefill"].servicer
    real = servicer._transport

    def no_nixl(backend, address):
        if backend == "nixl":
            raise ConnectionError("the nixl KV server gave no metadata")
        return real(backend, address)

    monkeypatch.setattr(servicer, "_transport", no_nixl)
    assert cluster.generate("no-nixl", prompts[1]) == want[1]
    assert used_backends(cluster) == {"shm"}
    wait_until(lambda: idle(cluster), 5, "the decode pool back to idle")
