"""Must-show (a) at CI scale (benchmarks/robustness/chaos.py runs the full 500 x 32): streams cancelled by their
clients at random points while a health probe runs every 100 ms. The prefill worker answers Abort
slowly (0.3 s, as a busy worker does), which is what stalled the router when its cancel callback
called Abort on gRPC's polling thread. Afterwards: no worker dropped out or had to register
again, no health check missed its 1 s deadline, every stream that was not cancelled is
token-identical to a clean run, and all KV is free."""

from __future__ import annotations

import random
import time
from concurrent import futures

import pytest

from helpers.chaos import HealthProbe, SecureCluster, stream, wait_until
from helpers.models import random_prompts
from pdserve.prefill_worker.service import PrefillWorkerServicer
from pdserve.protos.pdserve.v1 import pdserve_pb2

NUM_REQUESTS = 96
CONCURRENCY = 16
SAMPLING = pdserve_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    real_abort = PrefillWorkerServicer.Abort

    def slow_abort(self, request, context):  # a busy worker: its engine loop answers late
        time.sleep(0.3)
        return real_abort(self, request, context)

    # on the class, before the server binds its handlers
    PrefillWorkerServicer.Abort = slow_abort
    try:
        c = SecureCluster(model_dir, heartbeat_ms=300)
        yield c
        c.stop()
    finally:
        PrefillWorkerServicer.Abort = real_abort


def test_cancel_storm_keeps_router_and_streams_whole(cluster):
    prompts = random_prompts([random.Random(i).randint(4, 60) for i in range(16)], seed=3)
    clean = [stream(cluster.api, p, SAMPLING) for p in prompts]
    assert all(how == "finished" and len(ids) == 12 for ids, _, how in clean)
    registrations = cluster.registrations()

    rng = random.Random(7)
    plan = [
        (i % len(prompts), rng.randint(1, 11) if rng.random() < 0.5 else None)
        for i in range(NUM_REQUESTS)
    ]
    with HealthProbe(cluster.router.address, period_s=0.1, deadline_s=1.0) as probe:
        with futures.ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(
                pool.map(
                    lambda item: stream(
                        cluster.api, prompts[item[0]], SAMPLING, cancel_after=item[1]
                    ),
                    plan,
                )
            )
        time.sleep(0.5)  # the last aborts land while the probe still runs
    outcomes = [how for _, _, how in results]
    assert outcomes.count("cancelled") == sum(c is not None for _, c in plan)
    for (idx, cancel_after), (ids, finish, how) in zip(plan, results):
        if cancel_after is None:
            assert how == "finished", how
            assert ids == clean[idx][0]
            assert finish.finish_reason == "length"
    assert probe.failures == [], probe.failures
    assert len(probe.latencies) >= 5
    assert cluster.registrations() == registrations, "a worker dropped out and registered again"
    pool = cluster.router.pool
    assert pool.num_workers("prefill") == 1 and pool.num_workers("decode") == 1
    wait_until(cluster.kv_all_free, 10, "all KV free after the storm")
