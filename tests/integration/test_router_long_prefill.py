"""A long prefill that keeps making progress is never cut: not by a fixed bound in the router
(router/legs.py bounds a Prefill by the client's deadline alone), not by the prefill worker's
own (prefill_worker/service.py keeps a given deadline whole), and not by the decode
reservation's lease, which each KV frame renews (decode_worker/handoff.py).

Real workers and the router run in this process over 127.0.0.1. The prefill worker's engine
steps are slowed so that one prompt's prefill takes several seconds in many short steps: far
longer than the decode worker's cap on a lease, while no engine turn comes near worker_stall_s.
"""

from __future__ import annotations

import time

from helpers.hang import greedy, stop_workers, with_stub
from helpers.models import random_prompts
from helpers.router import LONG_GREEDY, RPC_TIMEOUT, generate_call, start_router, stop_router
from helpers.threads import wait_until
from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
from pdserve.prefill_worker.server import PrefillWorker, PrefillWorkerConfig
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

ENGINE = dict(max_model_len=256, kv_cache_memory=1 << 20)
STEP_S = 0.25  # each prefill step sleeps this long first
CHUNK = 16  # prompt tokens per prefill step
LEASE_MS = 1000  # the decode worker's cap on any reservation's lease


def test_a_prefill_longer_than_any_lease_completes_once(model_dir):
    prompt = random_prompts([200], seed=31)[0]  # 13 steps of 16 tokens: over 3 s
    want = greedy(model_dir, [prompt])[0]
    decode = DecodeWorker(
        DecodeWorkerConfig(
            model=model_dir,
            worker_id="d0",
            lease_ms=LEASE_MS,
            max_lease_ms=LEASE_MS,
            stop_grace_s=0,
            engine_kwargs=dict(block_size=16, **ENGINE),
        )
    ).start()
    prefill = PrefillWorker(
        PrefillWorkerConfig(
            model=model_dir,
            worker_id="p0",
            # the prefill worker's own fallback bound, below the prefill's length: a deadline
            # given (the router's) is kept whole
            prefill_timeout_s=1.0,
            engine_kwargs=dict(block_size=4, max_num_batched_tokens=CHUNK, **ENGINE),
        )
    ).start()
    step, add = prefill.loop.engine.step, prefill.loop.add_request
    added = []

    def slow_step():
        time.sleep(STEP_S)
        return step()

    def counted_add(request_id, *args, **kwargs):
        added.append(request_id)
        return add(request_id, *args, **kwargs)

    prefill.loop.engine.step, prefill.loop.add_request = slow_step, counted_add
    decode, prefill = (
        with_stub(decode, worker_pb2_grpc.DecodeWorkerStub),
        with_stub(prefill, worker_pb2_grpc.PrefillWorkerStub),
    )
    router = start_router(model_dir, [prefill.address], [decode.address], worker_stall_s=3.0)
    try:
        start = time.monotonic()
        responses = list(generate_call(router, prompt, LONG_GREEDY))
        took = time.monotonic() - start
        ids = [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]
        assert ids == want
        final = responses[-1].finish
        assert final.finish_reason == "length"
        assert final.timings.prefill_worker == "p0"
        timings = final.timings
        prefill_s = (timings.prefill_end_unix_ns - timings.prefill_arrival_unix_ns) / 1e9
        # the prefill outlasted the lease cap and the worker's own bound several times over
        assert prefill_s > 3 * LEASE_MS / 1000, prefill_s
        assert took > prefill_s
        stats = decode.stub.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)
        assert stats.leases_expired == 0 and stats.kv_transfer_failures == 0
        assert len(added) == 1  # one prefill, never cut and retried
        wait_until(
            lambda: not prefill.loop.engine.has_unfinished_requests(), 10, "the prefill ended"
        )
    finally:
        stop_router(router)
        stop_workers(prefill, decode)
