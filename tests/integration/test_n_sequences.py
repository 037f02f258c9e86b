"""n > 1 through the disaggregated path (issue #16), the workers and the Router in one process
over 127.0.0.1 with the shm and grpc KV backends: the n outputs equal engine.LLM's for the same
prompt and SamplingParams (greedy and seeded sampling), each sequence ends with its own Finish,
stop strings, usage, aborts and short KV pools; colocated, and across tensor-parallel sizes.

The engines alone (prefill once, fork on the decode engine) and the commit frame:
test_n_sequences_engine.py.
"""

from __future__ import annotations

import time

import grpc
import pytest

from helpers.engine import KV
from helpers.models import random_prompts
from helpers.n_sequences import GREEDY, MAX_MODEL_LEN, SEEDED, proto_sampling
from helpers.threads import run_in_threads, wait_until
from helpers.worker import BackendCluster, start_decode, start_prefill, start_router, stop_all
from pdserve.engine import LLM, SamplingParams
from pdserve.planner.local_prefill import LocalPrefill
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_thread")

RPC_TIMEOUT = 30.0


# ---- through the Router -------------------------------------------------------------------------
class Cluster:
    """A decode worker (KV over `backend`), a prefill worker and the Router in front."""

    def __init__(self, model_dir, backend: str, decode_blocks: int | None = None, **router):
        # these tests follow the KV hand-off: a repeated prompt must not go back to its decode
        # worker to run there from its prefix cache (router/legs.py's reuse)
        router.setdefault("local_prefill", LocalPrefill(reuse_max_new_tokens=0))
        engine = dict(max_model_len=MAX_MODEL_LEN)
        decode_kv = 1 << 20
        if decode_blocks is not None:
            probe = LLM(model_dir, kv_cache_memory=KV, block_size=16).engine
            decode_kv = (
                decode_blocks * probe.kv_cache[:, :, 0].numel() * probe.kv_cache.element_size()
            )
        self.decode = start_decode(
            model_dir,
            engine=dict(kv_cache_memory=decode_kv, **engine),
            lease_ms=10_000,
            kv_backend=backend,
        )
        self.prefill = start_prefill(model_dir, engine=engine)
        self.router = start_router(
            model_dir,
            self.decode,
            self.prefill,
            max_model_len=MAX_MODEL_LEN,
            max_inflight=16,
            **router,
        )
        self.channels = [
            grpc.insecure_channel(a)
            for a in (self.router.address, self.decode.address, self.prefill.address)
        ]
        self.api = pdserve_pb2_grpc.PDServeStub(self.channels[0])
        self.d = worker_pb2_grpc.DecodeWorkerStub(self.channels[1])
        self.p = worker_pb2_grpc.PrefillWorkerStub(self.channels[2])

    def stop(self):
        stop_all(self.channels, self.router, self.prefill, self.decode)

    def idle(self) -> bool:
        """Every KV block of both pools free, nothing reserved or running."""
        d = self.d.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)
        p = self.p.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)
        return (
            d.num_free_blocks == d.num_total_blocks
            and p.num_free_blocks == p.num_total_blocks
            and d.num_reserved == d.num_running == d.num_waiting == 0
            and p.num_running == p.num_waiting == 0
        )

    def wait_idle(self):
        wait_until(self.idle, 5, "both KV pools back to all free")

    def call(self, prompt, sampling, **kw):
        return generate(self.api, prompt, sampling, **kw)


def generate(api, prompt, sampling, **kw):
    """The response stream of a Generate of the token ids `prompt`."""
    return api.Generate(
        pdserve_pb2.GenerateRequest(
            token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=sampling, **kw
        ),
        timeout=RPC_TIMEOUT,
    )


def collect(responses, n: int):
    """Per sequence: token ids, text, and its Finish; checks that each index ends exactly once,
    with no delta after its Finish."""
    ids = {i: [] for i in range(n)}
    text = {i: "" for i in range(n)}
    finish = {}
    for r in responses:
        if r.HasField("delta"):
            d = r.delta
            assert d.index < n and d.index not in finish, (
                f"delta of sequence {d.index} after its end"
            )
            ids[d.index] += d.token_ids
            text[d.index] += d.text
        else:
            f = r.finish
            assert f.index < n and f.index not in finish, f"second Finish for sequence {f.index}"
            finish[f.index] = f
    assert sorted(finish) == list(range(n)), f"Finish for {sorted(finish)} of {n} sequences"
    return ids, text, finish


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("llama-gqa")[0], kv_cache_memory=KV)


@pytest.fixture(scope="module", params=["shm", "grpc"])
def cluster(request, tiny_models):
    c = Cluster(tiny_models("llama-gqa")[0], request.param)
    yield c
    c.stop()


@pytest.fixture
def idle(cluster):
    yield cluster
    cluster.wait_idle()


def want_of(llm, prompt, sampling):
    """engine.LLM's (token ids, text, finish reason, stop reason) per sequence index."""
    out = llm.generate([prompt], SamplingParams(**sampling_kwargs(sampling)), use_tqdm=False)[0]
    return {c.index: (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs}


@pytest.mark.parametrize(
    "params",
    [dict(GREEDY, n=2), dict(SEEDED, n=3), dict(SEEDED, n=2, top_k=20, seed=7, max_tokens=7)],
    ids=["greedy-n2", "seeded-n3", "seeded-topk-n2"],
)
@pytest.mark.parametrize("prompt_len", [21, 32])
def test_n_outputs_equal_the_engines(idle, llm, params, prompt_len):
    sampling = proto_sampling(**params)
    prompt = random_prompts([prompt_len], seed=prompt_len)[0]
    want = want_of(llm, prompt, sampling)
    n = params["n"]
    ids, text, finish = collect(idle.call(prompt, sampling), n)
    for i in range(n):
        assert ids[i] == want[i][0] and text[i] == want[i][1], f"sequence {i}"
        f = finish[i]
        assert f.finish_reason == "length" and f.index == i
        # usage: the request's prompt in each Finish, each sequence's own completion tokens
        assert f.usage.prompt_tokens == prompt_len
        assert f.usage.completion_tokens == len(want[i][0]) == params["max_tokens"]
        # the KV was sent once (the same figure in each), unless the decode side had it cached
        assert (f.usage.kv_transfer_bytes > 0) == (f.usage.cache_hits.decode_worker < prompt_len)
        assert f.timings.decode_worker == "d0" and f.timings.prefill_worker == "p0"
        assert 0 < f.timings.first_token_unix_ns <= f.timings.last_token_unix_ns
    assert len({f.usage.kv_transfer_bytes for f in finish.values()}) == 1
    if params.get("seed") is not None:  # the same seed again: the same n texts
        assert collect(idle.call(prompt, sampling), n)[1] == text


def test_stop_strings_end_each_sequence_on_its_own(idle, llm):
    """A stop string that some sequences produce and others do not: each ends where engine.LLM's
    does, with its own finish reason and stop string, and the others run on."""
    prompt = random_prompts([19], seed=41)[0]
    free = proto_sampling(**dict(SEEDED, n=4, max_tokens=12))
    runs = want_of(llm, prompt, free)
    # a word that sequence 1 says after a few tokens; the others may or may not
    stop = runs[1][1].split()[3]
    sampling = proto_sampling(**dict(SEEDED, n=4, max_tokens=12), stop=[stop])
    want = want_of(llm, prompt, sampling)
    assert want[1][2] == "stop" and any(w[2] == "length" for w in want.values()), want
    ids, text, finish = collect(idle.call(prompt, sampling), 4)
    for i in range(4):
        tokens, want_text, reason, stop_reason = want[i]
        assert (ids[i], text[i], finish[i].finish_reason) == (tokens, want_text, reason)
        if reason == "stop":
            assert finish[i].stop_str == stop_reason == stop
        assert finish[i].usage.completion_tokens == len(tokens)


def test_abort_of_an_n_request_ends_every_sequence_and_frees_both_pools(idle, monkeypatch):
    # decode steps slowed: the sequences must still be running when the Abort lands (with the
    # worker's Abort handler delayed by up to 250 ms they had all reached their max_tokens)
    engine = idle.decode.loop.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.02), step())[1])
    prompt = random_prompts([40], seed=42)[0]
    sampling = proto_sampling(temperature=1.0, n=3, max_tokens=MAX_MODEL_LEN - 41, ignore_eos=True)
    call = idle.call(prompt, sampling, request_id="n-abort")
    responses = []
    for r in call:
        responses.append(r)
        if len(responses) == 4:  # tokens are flowing on the decode worker
            found = idle.api.Abort(pdserve_pb2.AbortRequest(request_id="n-abort"), timeout=5)
            assert found.found
    ids, _, finish = collect(responses, 3)
    assert {f.finish_reason for f in finish.values()} == {"abort"}
    assert all(len(ids[i]) < MAX_MODEL_LEN - 41 for i in range(3))
    idle.wait_idle()


def test_client_cancel_of_an_n_request_frees_both_pools(idle):
    prompt = random_prompts([40], seed=43)[0]
    sampling = proto_sampling(temperature=0, n=3, max_tokens=MAX_MODEL_LEN - 41, ignore_eos=True)
    call = idle.call(prompt, sampling)
    got = 0
    for r in call:
        got += r.HasField("delta")
        if got == 5:
            call.cancel()
            break
    idle.wait_idle()


def test_concurrent_n_requests_all_complete(idle, llm):
    prompts = random_prompts([9, 30, 17], seed=44)
    sampling = proto_sampling(**dict(SEEDED, n=2, max_tokens=6))
    wants = [want_of(llm, p, sampling) for p in prompts]
    got = run_in_threads(
        lambda k: collect(idle.call(prompts[k], sampling), 2)[0], len(prompts), RPC_TIMEOUT
    )
    for k, want in enumerate(wants):
        assert got[k] == {i: want[i][0] for i in range(2)}


# ---- a decode pool that runs short ----------------------------------------------------------
def test_a_short_decode_pool_preempts_forks_refuses_what_never_fits_and_queues_the_rest(
    tiny_models, llm
):
    """8 decode blocks of 16 tokens. n=3 sequences that each grow to 4 blocks: the decode worker
    preempts (and recomputes) forks and the outputs are still engine.LLM's; n=10 of a 20-token
    prompt needs 2 + 9 blocks at once, more than the pool: INVALID_ARGUMENT at once (not a wait);
    n=3 while another reservation holds most blocks: the router's decode queue waits, then
    RESOURCE_EXHAUSTED. Every block is free afterwards, on both pools."""
    c = Cluster(tiny_models("llama-gqa")[0], "shm", decode_blocks=8, decode_queue_timeout_s=1.0)
    try:
        prompt = random_prompts([20], seed=51)[0]
        sampling = proto_sampling(temperature=0, n=3, max_tokens=40, ignore_eos=True)
        want = want_of(llm, prompt, sampling)
        ids, _, finish = collect(c.call(prompt, sampling), 3)
        assert ids == {i: want[i][0] for i in range(3)}
        assert all(f.finish_reason == "length" for f in finish.values())
        assert c.d.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT).num_preemptions > 0
        c.wait_idle()

        with pytest.raises(grpc.RpcError) as err:
            list(c.call(prompt, proto_sampling(temperature=0, n=10, max_tokens=4)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lower n" in err.value.details()

        held = c.d.Reserve(  # 6 of the 8 blocks, until aborted
            worker_pb2.ReserveRequest(
                request_id="holder",
                prompt_token_ids=random_prompts([90], seed=52)[0],
                sampling=proto_sampling(max_tokens=4),
                lease_ms=30_000,
            ),
            timeout=RPC_TIMEOUT,
        )
        assert len(held.block_ids) == 6
        with pytest.raises(grpc.RpcError) as err:  # 2 + 2 copy blocks > 2 free
            list(c.call(prompt, proto_sampling(temperature=0, n=3, max_tokens=4)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.d.Abort(worker_pb2.WorkerAbortRequest(request_id="holder"), timeout=5).found
        c.wait_idle()
        # n=1 of the same prompt still fits beside the holder: only the copies were short
        ids, _, _ = collect(c.call(prompt, proto_sampling(temperature=0, max_tokens=4)), 1)
        assert ids[0] == want[0][0][:4]
        c.wait_idle()
    finally:
        c.stop()


# ---- colocated: the decode worker runs the prompt itself -----------------------------------
def test_colocated_n_outputs_equal_the_engines(tiny_models, llm):
    model_dir = tiny_models("llama-gqa")[0]
    worker = start_decode(model_dir, "c0", engine=dict(max_num_batched_tokens=32))
    router = start_router(model_dir, worker, colocated=True)
    channels = [grpc.insecure_channel(a) for a in (router.address, worker.address)]
    try:
        api = pdserve_pb2_grpc.PDServeStub(channels[0])
        stub = worker_pb2_grpc.DecodeWorkerStub(channels[1])
        for params in (dict(GREEDY, n=2), dict(SEEDED, n=3)):
            sampling = proto_sampling(**params)
            prompt = random_prompts([45], seed=53)[0]  # > the 32-token budget: chunked
            want = want_of(llm, prompt, sampling)
            ids, text, finish = collect(generate(api, prompt, sampling), params["n"])
            for i in range(params["n"]):
                assert (ids[i], text[i]) == want[i][:2]
                assert finish[i].usage.completion_tokens == params["max_tokens"]

        def idle():
            st = stub.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)
            return st.num_free_blocks == st.num_total_blocks and st.num_running == 0

        wait_until(idle, 5, "the colocated pool back to all free")
    finally:
        for ch in channels:
            ch.close()
        router.stop()
        worker.stop()


# ---- prefill and decode of different tensor-parallel sizes ---------------------------------
@pytest.mark.parametrize("backend,prefill_tp,decode_tp", [("grpc", 2, 1), ("shm", 1, 2)])
def test_n_across_tp_sizes_equals_the_engine(tiny_models, llm, backend, prefill_tp, decode_tp):
    model_dir = tiny_models("llama-gqa")[0]
    workers = BackendCluster(model_dir, backend, prefill_tp, decode_tp)
    router = None
    try:
        router = start_router(
            model_dir,
            workers.decode,
            workers.prefill,
            max_model_len=workers.decode.loop.engine.config.max_model_len,
        )
        with grpc.insecure_channel(router.address) as channel:
            api = pdserve_pb2_grpc.PDServeStub(channel)
            prompt = random_prompts([21], seed=54)[0]
            for params in (dict(GREEDY, n=2), dict(SEEDED, n=3)):
                sampling = proto_sampling(**params)
                want = want_of(llm, prompt, sampling)
                ids, _, _ = collect(generate(api, prompt, sampling), params["n"])
                assert ids == {i: want[i][0] for i in range(params["n"])}

        def idle():
            s = workers.stats()
            return s.num_free_blocks == s.num_total_blocks and s.num_reserved == s.num_running == 0

        wait_until(idle, 5, f"decode pool not back to idle: {workers.stats()}")
    finally:
        if router is not None:
            router.stop()
        workers.stop()


def test_logprobs_of_every_token_first_included(idle, llm):
    """The prefill worker's first tokens' logprobs ride in the commit, so each sequence's stream
    has one logprob per token, as engine.LLM computes them (n=1 and n=3)."""
    prompt = random_prompts([14], seed=55)[0]
    for n in (1, 3):
        sampling = proto_sampling(**dict(SEEDED, n=n, max_tokens=6), logprobs=True)
        out = llm.generate([prompt], SamplingParams(**sampling_kwargs(sampling)), use_tqdm=False)
        want = {c.index: (c.token_ids, c.logprobs) for c in out[0].outputs}
        got = {i: ([], []) for i in range(n)}
        for r in idle.call(prompt, sampling):
            if r.HasField("delta"):
                got[r.delta.index][0].extend(r.delta.token_ids)
                got[r.delta.index][1].extend(r.delta.logprobs)
        for i in range(n):
            assert got[i][0] == want[i][0]
            assert got[i][1] == pytest.approx(want[i][1], abs=1e-4)


def test_a_failed_prefill_fails_an_n_request_with_its_status_and_frees_both_pools(
    idle, monkeypatch
):
    """As for n=1: the client gets the prefill worker's status, not n "abort" Finishes."""
    from pdserve.engine.errors import InvalidRequest as Refused

    def refuse(*args, **kwargs):
        raise Refused("refused for the test")

    monkeypatch.setattr(idle.prefill.loop, "add_request", refuse)
    responses = []
    with pytest.raises(grpc.RpcError) as err:
        for r in idle.call(random_prompts([12], seed=56)[0], proto_sampling(n=3, max_tokens=4)):
            responses.append(r)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "refused for the test" in err.value.details()
    assert not any(r.HasField("finish") for r in responses)


def test_a_sequence_ends_while_another_runs_and_an_abort_ends_only_the_open_one(
    idle, llm, monkeypatch
):
    """Sequence 0 hits a stop token early: its Finish comes at once, while sequence 1 still
    streams; an abort then ends sequence 1 alone ("abort"), and sequence 0 keeps its "stop"."""
    prompt = random_prompts([15], seed=57)[0]
    long = MAX_MODEL_LEN - len(prompt) - 1
    free = proto_sampling(temperature=1.0, seed=3, n=2, max_tokens=long, ignore_eos=True)
    runs = want_of(llm, prompt, free)
    stop = next(t for t in runs[0][0][1:] if t not in runs[1][0])  # never in sequence 1
    step = idle.decode.loop.engine.step
    monkeypatch.setattr(idle.decode.loop.engine, "step", lambda: (time.sleep(0.01), step())[1])
    sampling = proto_sampling(
        temperature=1.0, seed=3, n=2, max_tokens=long, ignore_eos=True, stop_token_ids=[stop]
    )
    responses, later = [], 0
    for r in idle.call(prompt, sampling, request_id="n-early"):
        responses.append(r)
        if r.HasField("finish") and r.finish.index == 0:
            later = len(responses)
        if later and len(responses) == later + 2:  # sequence 1 streamed on after sequence 0 ended
            assert all(x.delta.index == 1 for x in responses[later:])
            assert idle.api.Abort(pdserve_pb2.AbortRequest(request_id="n-early"), timeout=5).found
    ids, _, finish = collect(responses, 2)
    assert finish[0].finish_reason == "stop" and finish[0].stop_token == stop
    assert ids[0] == runs[0][0][: runs[0][0].index(stop) + 1]
    assert finish[1].finish_reason == "abort" and len(ids[1]) < long
    assert ids[1] == runs[1][0][: len(ids[1])]
