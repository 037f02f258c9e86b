"""Peer fetch through a secured 1P+1D cluster in this process (a DecodeWorker, a PrefillWorker and
the Router over 127.0.0.1, one cluster secret, a tiny random float32 model): a conversation's
second turn goes through the prefill pool (local prefill off), whose prefill worker pulls the
first turn's KV, prompt and answer, from the decode worker that holds it instead of recomputing it
(docs/architecture.md section 11).

Greedy tokens are identical with the fetch on and off, and are the engine's own answer; the
usage, the workers' stats and the router's /metrics count the fetched tokens by source "peer"; a
corrupted block is refused and its tokens computed; a decode worker whose fetch stream breaks
midway leaves the rest to be computed, with no error; a caller without the cluster secret gets
nothing from FetchKV."""

from __future__ import annotations

import grpc
import pytest

from helpers.models import random_prompts
from helpers.router_cluster import RPC_TIMEOUT
from helpers.threads import leaves_no_threads, wait_until
from helpers.worker import start_decode, start_prefill, start_router, stop_all
from pdserve.decode_worker import service as decode_service
from pdserve.engine import LLM, SamplingParams
from pdserve.planner.local_prefill import LocalPrefill
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.protos.security import INSECURE, ClusterSecurity
from pdserve.router.peer_fetch import PeerFetch, PeerFetchCost

BS = 16
MAX_LEN = 512
ANSWER = 40
SECURITY = ClusterSecurity("peer-fetch-test-secret-0123456789")
ENGINE = dict(max_model_len=MAX_LEN, block_size=BS, kv_cache_memory=4 << 20)
# the counts below are exact: a loaded machine (CI) must not end a fetch at the default 5 s
FETCH_TIMEOUT_S = 60.0


def started(model_dir: str):
    """The secured 1P+1D cluster on `model_dir`: (model_dir, router, prefill, decode, stub),
    then stopped."""
    with leaves_no_threads():
        decode = start_decode(model_dir, engine=ENGINE, lease_ms=20_000, security=SECURITY)
        prefill = start_prefill(model_dir, engine=ENGINE, security=SECURITY)
        router = start_router(
            model_dir,
            decode,
            prefill,
            max_model_len=MAX_LEN,
            security=SECURITY,
            # every turn through the prefill pool: the path under test
            local_prefill=LocalPrefill(reuse_max_new_tokens=0),
            peer_fetch=PeerFetch(min_tokens=BS, timeout_s=FETCH_TIMEOUT_S),
        )
        channel = grpc.insecure_channel(router.address)
        yield model_dir, router, prefill, decode, pdserve_pb2_grpc.PDServeStub(channel)
        stop_all([channel], router, prefill, decode)


@pytest.fixture(scope="module")
def cluster(tiny_models, one_thread):
    yield from started(tiny_models("llama-gqa")[0])


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


def second_turn(cluster, seed: int, first_len: int = 80):
    """Turn 1 of a new conversation, then a cold prefill worker (its prefix cache reset, so all
    of the earlier turn is the decode worker's alone); returns turn 2's prompt."""
    _, _, prefill, _, api = cluster
    first, message = random_prompts([first_len, 12], seed=seed)
    answer, _ = generate(api, first, ANSWER)
    bm = prefill.loop.engine.block_manager
    wait_until(lambda: prefill.loop.call(bm.reset_prefix_cache), 30, "prefill worker not idle")
    return first + answer + message


def fetch_on(router, on: bool) -> None:
    """Peer fetch on (whatever the estimate: the tiny model recomputes a block faster than it
    is fetched, so the router would rightly recompute) or off."""
    cost = PeerFetchCost(PeerFetch(enabled=on, min_tokens=BS, timeout_s=FETCH_TIMEOUT_S))
    cost.estimate = lambda *args: None  # as before anything is measured: fetch
    router.servicer.legs.peer_fetch = cost


def reference(model_dir, prompt) -> list[int]:
    llm = LLM(model_dir, kv_cache_memory=4 << 20, max_model_len=MAX_LEN, block_size=BS)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return out.outputs[0].token_ids


def prefill_stats(prefill):
    return prefill.stats()


def test_greedy_tokens_are_identical_with_the_fetch_on_and_off(cluster):
    model_dir, router, prefill, decode, api = cluster
    want = None
    for on in (False, True):
        fetch_on(router, on)
        prompt = second_turn(cluster, seed=51)  # the same conversation each time
        before = prefill_stats(prefill)
        tokens, finish = generate(api, prompt, 8)
        after = prefill_stats(prefill)
        hits = finish.usage.cache_hits
        # the decode worker holds turn 1 but its answer's last token (whole blocks), and after
        # the first pass turn 2's prompt too
        assert hits.decode_worker >= (80 + ANSWER - 1) // BS * BS
        held = min(hits.decode_worker, len(prompt) - 1) // BS * BS
        # the push sends the decode worker only what it does not hold
        cache = prefill.loop.engine.kv_cache
        per_token = cache[:, :, 0].numel() * cache.element_size() // BS
        assert finish.usage.kv_transfer_bytes == (len(prompt) - hits.decode_worker) * per_token
        if on:
            assert hits.peer == held and hits.prefill_worker == held
            assert after.peer_fetches == before.peer_fetches + 1
            assert after.prefix_hit_tokens_peer - before.prefix_hit_tokens_peer == held
            assert after.peer_fetch_bytes > before.peer_fetch_bytes
        else:
            assert hits.peer == 0 and hits.prefill_worker == 0
            assert after.peer_fetches == before.peer_fetches
        want = want or tokens
        assert tokens == want
    assert want == reference(model_dir, prompt)
    served = decode.stats()
    assert served.peer_fetch_served_blocks >= held // BS
    # the router's /metrics: hits by source, the path chosen, the fetch's seconds
    registry = router.metrics_registry
    model = {"model_name": router.servicer.options.model_id}
    assert (
        registry.get_sample_value(
            "pdserve:prompt_cache_hit_tokens_total", {**model, "source": "peer"}
        )
        >= held
    )
    assert (
        registry.get_sample_value("pdserve:reuse_paths_total", {**model, "path": "peer_fetch"}) >= 1
    )
    assert registry.get_sample_value("pdserve:peer_fetch_duration_seconds_count", model) >= 1
    worker = {**model, "role": "prefill", "worker": router.pool.name(router.pool.prefill[0])}
    wait_until(
        lambda: (
            (
                registry.get_sample_value(
                    "pdserve:prefix_cache_hit_tokens_by_source_total", {**worker, "source": "peer"}
                )
                or 0
            )
            >= held
        ),
        30,
        "the router never exported the prefill worker's peer hits",
    )


def test_a_corrupted_block_is_refused_and_computed(cluster, monkeypatch):
    model_dir, router, prefill, decode, api = cluster
    fetch_on(router, True)
    prompt = second_turn(cluster, seed=52)

    class OnTheWay:
        """worker_pb2 as the decode service sees it, whose FetchKVBlock of block 1 has a byte
        changed after its digest was taken: what a bad link or memory would do."""

        def __getattr__(self, name):
            return getattr(worker_pb2, name)

        @staticmethod
        def FetchKVBlock(**fields):
            if fields["index"] == 1:
                data = fields["data"]
                fields["data"] = bytes([data[0] ^ 0xFF]) + data[1:]
            return worker_pb2.FetchKVBlock(**fields)

    monkeypatch.setattr(decode_service, "worker_pb2", OnTheWay())
    before = prefill_stats(prefill)
    tokens, finish = generate(api, prompt, 8)
    after = prefill_stats(prefill)
    assert after.peer_fetch_refused_blocks == before.peer_fetch_refused_blocks + 1
    assert finish.usage.cache_hits.peer == BS  # block 0 only; the rest computed
    assert tokens == reference(model_dir, prompt)


def test_a_fetch_that_breaks_midway_leaves_the_rest_computed(cluster, monkeypatch):
    model_dir, router, prefill, decode, api = cluster
    fetch_on(router, True)
    prompt = second_turn(cluster, seed=53, first_len=120)  # 9 blocks held: two batches
    read = decode.handoff.read_cached

    def dies_after_the_first_batch(request_id, first, count):
        if first > 0:
            raise ConnectionError("the decode worker went away")
        return read(request_id, first, count)

    monkeypatch.setattr(decode.handoff, "read_cached", dies_after_the_first_batch)
    before = prefill_stats(prefill)
    tokens, finish = generate(api, prompt, 8)
    after = prefill_stats(prefill)
    assert after.peer_fetch_failures == before.peer_fetch_failures + 1
    assert finish.usage.cache_hits.peer == 8 * BS  # the first batch (FETCH_BATCH blocks)
    assert tokens == reference(model_dir, prompt)


def test_fetch_kv_gives_nothing_without_the_secret_and_checks_its_fields(cluster):
    _, _, _, decode, _ = cluster
    for security in (INSECURE, ClusterSecurity("not-the-cluster-secret-at-all")):
        channel = security.channel(decode.address)
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(
                stub.FetchKV(
                    worker_pb2.FetchKVRequest(request_id="x", num_blocks=1, max_bytes=1),
                    timeout=RPC_TIMEOUT,
                )
            )
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
    channel = SECURITY.channel(decode.address)
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)
    for request, code in (
        (worker_pb2.FetchKVRequest(request_id="x", num_blocks=0, max_bytes=1), "INVALID_ARGUMENT"),
        (worker_pb2.FetchKVRequest(request_id="x", num_blocks=1, max_bytes=0), "INVALID_ARGUMENT"),
        (worker_pb2.FetchKVRequest(request_id="x", num_blocks=1, max_bytes=1), "NOT_FOUND"),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.FetchKV(request, timeout=RPC_TIMEOUT))
        assert refused.value.code().name == code
    channel.close()


def test_a_prefill_with_a_bad_peer_fetch_is_refused_before_any_work(cluster):
    _, _, prefill, _, _ = cluster
    channel = SECURITY.channel(prefill.address)
    stub = worker_pb2_grpc.PrefillWorkerStub(channel)
    for bad in (
        worker_pb2.PeerFetch(address="", max_blocks=1, max_bytes=1, timeout_ms=1),
        worker_pb2.PeerFetch(address="h:1", max_blocks=0, max_bytes=1, timeout_ms=1),
        worker_pb2.PeerFetch(address="h:1", max_blocks=1, max_bytes=1, timeout_ms=10**9),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            stub.Prefill(
                worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=[5, 6], peer_fetch=bad),
                timeout=RPC_TIMEOUT,
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "peer_fetch" in refused.value.details()
    channel.close()


@pytest.fixture(scope="module", params=["qwen3.5", "falcon-mamba"])
def hybrid_cluster(request, tmp_path_factory, one_thread):
    """The cluster on a tiny random Qwen3.5 (a hybrid: Gated DeltaNet layers beside attention)
    and Falcon Mamba (Mamba alone: no KV at all, its blocks of no bytes)."""
    from helpers.arch import build_arch_model

    model_dir = str(tmp_path_factory.mktemp("hybrid") / request.param)
    build_arch_model(model_dir, request.param, initializer_range=0.1)  # (a state moves logits)
    yield from started(model_dir)


def test_a_hybrid_s_fetch_brings_the_state_after_its_blocks(hybrid_cluster):
    """A hybrid's turn 2 through the prefill pool: its decode worker kept the recurrent state
    where turn 1's decode last passed a block boundary (112, of 80 + 40 tokens), and the fetch
    brings the blocks through there with that state, so the prefill worker starts its recurrent
    layers from it and computes only the rest: the engine's own tokens, 112 tokens by source
    "peer". Without the fetch its (reset) cache serves nothing."""
    model_dir, router, prefill, decode, api = hybrid_cluster
    sampling = pdserve_pb2.SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logprobs=True
    )
    for on in (False, True):
        fetch_on(router, on)
        prompt = second_turn(hybrid_cluster, seed=52)
        before = prefill_stats(prefill)
        responses = list(
            api.Generate(
                pdserve_pb2.GenerateRequest(
                    sampling=sampling, token_ids=pdserve_pb2.TokenIds(ids=prompt)
                ),
                timeout=RPC_TIMEOUT * 3,
            )
        )
        deltas = [r.delta for r in responses if r.HasField("delta")]
        tokens = [t for d in deltas for t in d.token_ids]
        logprob = sum(x for d in deltas for x in d.logprobs)
        hits = responses[-1].finish.usage.cache_hits
        if on:
            assert hits.peer == hits.prefill_worker == (80 + ANSWER - 1) // BS * BS
            assert prefill_stats(prefill).peer_fetches == before.peer_fetches + 1
        else:
            assert hits.peer == 0 and hits.prefill_worker == 0
        # the engine's own tokens and logprobs (which a state a little off moves, where the
        # tokens of a tiny random model may not)
        llm = LLM(model_dir, kv_cache_memory=4 << 20, max_model_len=MAX_LEN, block_size=BS)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
        (out,) = llm.generate([prompt], params)
        llm.shutdown()
        assert tokens == out.outputs[0].token_ids
        assert abs(logprob - out.outputs[0].cumulative_logprob) < 1e-3
