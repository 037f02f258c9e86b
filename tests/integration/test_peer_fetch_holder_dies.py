"""Must-show d of issue 49 for peer fetch: the decode worker holding a conversation's earlier turns
goes away while the prefill worker is pulling them. The turn is served with the engine's own
greedy tokens and no error to the client: the prefill worker computes what it did not receive, and
the router resumes the request on the other decode worker, which computes it all; no block of the
dead worker is used after the break.

One prefill worker, two decode workers and the Router in this process over 127.0.0.1; the holder
"dies" by stopping its servers and engine from inside its own FetchKV, after the first batch of
blocks went out, so the break falls mid-fetch every time."""

from __future__ import annotations

import threading

import grpc
import pytest

from helpers.models import random_prompts
from helpers.router_cluster import RPC_TIMEOUT
from helpers.threads import leaves_no_threads, wait_until
from helpers.worker import start_decode, start_prefill, start_router, stop_all
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.block_manager import block_hash
from pdserve.planner.local_prefill import LocalPrefill
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.peer_fetch import PeerFetch, PeerFetchCost

BS = 16
MAX_LEN = 512
ENGINE = dict(max_model_len=MAX_LEN, block_size=BS, kv_cache_memory=4 << 20)


@pytest.fixture
def cluster(tiny_models, one_thread):
    model_dir = tiny_models("llama-gqa")[0]
    with leaves_no_threads():
        decodes = [
            start_decode(model_dir, f"d{i}", engine=ENGINE, lease_ms=20_000, stop_grace_s=0)
            for i in range(2)
        ]
        prefill = start_prefill(model_dir, engine=ENGINE)
        router = start_router(
            model_dir,
            decodes,
            prefill,
            max_model_len=MAX_LEN,
            # turns go back to their holder, and never run there (12 new tokens > 1)
            local_prefill=LocalPrefill(reuse_max_new_tokens=1),
            # a loaded machine (CI) must not make the holder look down when turn 2 is routed,
            # nor cut the fetch stream before its second batch: either would skip the break
            worker_down_s=30,
            worker_silence_s=60,
        )
        cost = PeerFetchCost(PeerFetch(min_tokens=BS, timeout_s=60))
        cost.estimate = lambda *args: None  # always fetch (the tiny model recomputes faster)
        router.servicer.legs.peer_fetch = cost
        channel = grpc.insecure_channel(router.address)
        yield model_dir, router, prefill, decodes, pdserve_pb2_grpc.PDServeStub(channel)
        stop_all([channel], router, prefill, *decodes)


def generate(api, ids: list[int], max_tokens: int):
    sampling = pdserve_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    responses = list(
        api.Generate(
            pdserve_pb2.GenerateRequest(sampling=sampling, token_ids=pdserve_pb2.TokenIds(ids=ids)),
            timeout=RPC_TIMEOUT * 3,
        )
    )
    tokens = [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]
    return tokens, responses[-1].finish


def test_the_holder_going_away_mid_fetch_is_served_by_recompute(cluster):
    model_dir, router, prefill, decodes, api = cluster
    first, message = random_prompts([120, 12], seed=61)
    answer, finish = generate(api, first, 40)
    held_by = finish.timings.decode_worker
    # the one whose prefix cache holds turn 1
    head = block_hash(None, tuple(first[:BS]))
    (holder,) = [d for d in decodes if head in d.loop.engine.block_manager._cached]
    prompt = first + answer + message
    bm = prefill.loop.engine.block_manager
    assert prefill.loop.call(bm.reset_prefix_cache)  # all of turn 1 is the holder's alone
    read = holder.handoff.read_cached
    gone = threading.Event()
    batches = []

    def stop():
        try:
            holder.stop()
        finally:
            gone.set()

    def dies_mid_fetch(request_id, first_block, count):
        batches.append((first_block, count))
        if first_block == 0:
            return read(request_id, first_block, count)
        threading.Thread(target=stop, daemon=True).start()
        raise ConnectionError("the decode worker went away")

    holder.handoff.read_cached = dies_mid_fetch
    # what turn 2 is about: the router sends it back to the one worker it knows holds turn 1
    # (its view lags the worker's KV events on a loaded machine, and a tie goes round-robin)
    pool = router.servicer.legs.pool

    def known_held() -> list[int]:
        return sorted(n for n in pool.decode_matches(prompt).values() if n > 0)

    def routed_back() -> bool:
        held = known_held()
        return len(held) == 1 and held[0] >= len(first) - len(first) % BS

    wait_until(routed_back, 60, "the router never learned where turn 1 is held")
    before = prefill.stats()
    tokens, finish = generate(api, prompt, 8)
    # turn 2 went to the holder, and its prefill worker asked for the second batch of blocks
    assert [first for first, _ in batches] == [0, 8], (batches, known_held())
    assert gone.wait(120)
    after = prefill.stats()
    assert after.peer_fetch_failures == before.peer_fetch_failures + 1
    llm = LLM(model_dir, kv_cache_memory=4 << 20, max_model_len=MAX_LEN, block_size=BS)
    (want,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert tokens == want.outputs[0].token_ids
    # served by the other decode worker, which never held the conversation
    assert finish.timings.decode_worker and finish.timings.decode_worker != held_by
