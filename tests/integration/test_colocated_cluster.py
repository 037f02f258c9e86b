"""Colocated serving: the router in front of workers that prefill and decode themselves (Reserve
with run_prefill, no prefill pool, no KV hand-off). Same greedy tokens as the engine alone, and the
pool ends free. (The YAML's `pools.colocated`: tests/unit/test_colocated.py.)"""

from __future__ import annotations

import threading

import grpc
import pytest

from helpers.models import random_prompts
from helpers.threads import wait_until
from helpers.worker import start_decode, start_router, stop_all
from pdserve.engine import LLM, SamplingParams
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc

GREEDY = pdserve_pb2.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def colocated(tiny_models):
    model_dir = tiny_models("llama-gqa")[0]
    worker = start_decode(model_dir, "c0", engine=dict(max_num_batched_tokens=32))
    router = start_router(model_dir, worker, colocated=True)
    channels = [grpc.insecure_channel(a) for a in (router.address, worker.address)]
    yield (
        model_dir,
        pdserve_pb2_grpc.PDServeStub(channels[0]),
        worker_pb2_grpc.DecodeWorkerStub(channels[1]),
    )
    stop_all(channels, router, worker)


def _tokens(api, prompt, sampling=GREEDY):
    out, finish = [], None
    for resp in api.Generate(
        pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=sampling),
        timeout=30,
    ):
        if resp.HasField("delta"):
            out += resp.delta.token_ids
        else:
            finish = resp.finish
    return out, finish


def _concurrently(api, prompts) -> dict:
    """Each prompt's (tokens, finish) from one Generate call per prompt, all at once."""
    results = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, _tokens(api, prompts[i])))
        for i in range(len(prompts))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_colocated_matches_engine_concurrently_and_frees_the_pool(colocated):
    model_dir, api, worker = colocated
    prompts = random_prompts([70, 9, 33, 50], seed=21)  # 70 > the 32-token budget: chunked
    want = [
        o.outputs[0].token_ids
        for o in LLM(model_dir, kv_cache_memory=1 << 20).generate(
            prompts, SamplingParams(**sampling_kwargs(GREEDY)), use_tqdm=False
        )
    ]
    results = _concurrently(api, prompts)
    assert [results[i][0] for i in range(len(prompts))] == want
    finish = results[0][1]
    assert finish.finish_reason == "length" and finish.usage.completion_tokens == 10
    assert finish.timings.first_token_unix_ns and not finish.timings.prefill_worker

    def idle():
        s = worker.Stats(worker_pb2.StatsRequest(), timeout=10)
        return s.num_free_blocks == s.num_total_blocks and s.num_running == 0

    wait_until(idle, 5, "the colocated worker still holds blocks")


def test_colocated_bad_request_and_cancel(colocated):
    _, api, worker = colocated
    with pytest.raises(grpc.RpcError) as err:
        _tokens(api, [5, 6], pdserve_pb2.SamplingParams(top_p=2.0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()
    call = api.Generate(
        pdserve_pb2.GenerateRequest(
            token_ids=pdserve_pb2.TokenIds(ids=[5, 6, 7]),
            sampling=pdserve_pb2.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
        ),
        timeout=30,
    )
    assert next(call).HasField("delta")
    call.cancel()

    def idle():
        s = worker.Stats(worker_pb2.StatsRequest(), timeout=10)
        return s.num_free_blocks == s.num_total_blocks and s.num_running == 0

    wait_until(idle, 15, "a cancelled colocated stream still holds blocks")


def test_colocated_router_spreads_prompts_by_queued_tokens(tiny_models):
    """Two colocated workers: a burst goes to both (the pick charges each prompt to its worker
    until its first token; free blocks alone are only re-read every health sweep), and every
    charge is released when the requests end."""
    model_dir = tiny_models("llama-gqa")[0]
    workers = [
        start_decode(model_dir, f"c{i}", engine=dict(max_num_batched_tokens=32)) for i in range(2)
    ]
    # one sweep at the start and none after (a silence bound to match: no answer for a minute is
    # expected here, not a death)
    router = start_router(
        model_dir,
        workers,
        colocated=True,
        stats_interval_s=60,
        worker_down_s=150,
        worker_silence_s=150,
    )
    channel = grpc.insecure_channel(router.address)
    try:
        api = pdserve_pb2_grpc.PDServeStub(channel)
        wait_until(lambda: all(w.num_free_blocks > 0 for w in router.pool.decode), 5, "first sweep")
        router.pool.decode[1].num_free_blocks -= 3  # as if c1 was busier at the last sweep
        prompts = random_prompts([40] * 6, seed=5)
        results = _concurrently(api, prompts)
        used = {results[i][1].timings.decode_worker for i in range(len(prompts))}
        assert used == {"c0", "c1"}
        assert [w.queued_tokens for w in router.pool.decode] == [0, 0]
    finally:
        channel.close()
        router.stop()
        for w in workers:
            w.stop()
