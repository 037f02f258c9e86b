"""The DecodeWorker and PrefillWorker gRPC services end to end in one process, over 127.0.0.1:
Reserve -> Prefill (KV pushed over the grpc kvtransfer backend) -> Stream, bad requests, aborts,
a client that goes away, lease expiry and a layout mismatch. Every wait has a timeout, and every
test ends with the decode pool fully free.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from helpers.models import random_prompts
from helpers.threads import leaves_no_threads, wait_until
from helpers.worker import (
    GREEDY,
    MAX_MODEL_LEN,
    RPC_TIMEOUT,
    Cluster,
    generate_concurrently,
    record_aborts,
)
from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
from pdserve.engine import LLM, SamplingParams
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc


@pytest.fixture(scope="module")
def cluster(tiny_models):
    with leaves_no_threads():
        c = Cluster(tiny_models("llama-gqa")[0])
        yield c
        c.stop()


@pytest.fixture
def idle(cluster):
    """Each test leaves the decode pool as it found it: every block free, nothing reserved."""
    yield cluster

    def clean():
        s = cluster.stats()
        return (
            s.num_free_blocks == s.num_total_blocks and s.num_reserved == 0 and s.num_running == 0
        )

    wait_until(clean, 5, f"decode pool not back to idle: {cluster.stats()}")


@pytest.fixture(scope="module")
def expected(tiny_models):
    prompts = random_prompts([30, 7, 21], seed=5)
    llm = LLM(tiny_models("llama-gqa")[0], kv_cache_memory=1 << 20)
    outs = llm.generate(prompts, SamplingParams(**sampling_kwargs(GREEDY)), use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


def test_reserve_prefill_stream_matches_engine(idle, expected):
    prompts, want = expected
    for i, prompt in enumerate(prompts):
        assert idle.generate(f"seq-{i}", prompt) == want[i]
    assert generate_concurrently(idle, prompts) == want


def test_a_stream_opened_late_sends_what_queued_as_one_event(idle, expected):
    """A stream that falls behind the engine sends what queued up as one event per sequence
    (decode_worker/service.py Stream): opened after the request finished decoding, it carries
    the same tokens, with their logprobs, in one event, the hand-off's first token included."""
    prompts, want = expected
    sampling = pdserve_pb2.SamplingParams()
    sampling.CopyFrom(GREEDY)
    sampling.logprobs = True
    committed = idle.stats().kv_transfers
    reservation = idle.reserve("late", prompts[0], sampling)
    first = idle.prefill_req("late", prompts[0], reservation, sampling)

    def decoded() -> bool:  # committed (the prefill's answer may come first), then finished
        s = idle.stats()
        return s.kv_transfers > committed and s.num_reserved == 0 and s.num_running == 0

    wait_until(decoded, 10, "the request decoded to its end")
    events = idle.stream("late")
    assert [t for e in events for t in e.token_ids] == want[0]
    assert first.first_tokens[0] == want[0][0]
    assert sum(len(e.logprobs) for e in events) == len(want[0])
    # the committed first token keeps its own event only where the rest has top logprobs
    assert len(events) == 1 and events[0].finish_reason == "length"


def test_bad_requests_name_the_problem_and_the_worker_keeps_serving(idle, expected):
    cases = [
        ([], GREEDY, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (list(range(2, 2 + MAX_MODEL_LEN)), GREEDY, grpc.StatusCode.OUT_OF_RANGE, "max_model_len"),
        (
            [5, 6, 7],
            pdserve_pb2.SamplingParams(top_p=1.5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p",
        ),
    ]
    for i, (prompt, sampling, code, named) in enumerate(cases):
        with pytest.raises(grpc.RpcError) as err:
            idle.reserve(f"bad-{i}", prompt, sampling)
        assert err.value.code() == code and named in err.value.details(), err.value
    with pytest.raises(grpc.RpcError) as err:
        idle.prefill_req(
            "bad-p", [5, 6], worker_pb2.ReserveResponse(), pdserve_pb2.SamplingParams(top_p=1.5)
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()
    prompts, want = expected
    assert idle.generate("good-after-bad", prompts[1]) == want[1]


def test_pool_full_is_resource_exhausted(idle):
    total = idle.stats().num_total_blocks
    prompts = random_prompts([MAX_MODEL_LEN - 8] * (total + 1), seed=21)
    reserved, code = [], None
    for i, prompt in enumerate(prompts):
        try:
            idle.reserve(f"full-{i}", prompt)
            reserved.append(f"full-{i}")
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            break
    for rid in reserved:
        assert idle.d.Abort(
            worker_pb2.WorkerAbortRequest(request_id=rid), timeout=RPC_TIMEOUT
        ).found
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in details
    assert reserved, "not even one reservation fit"


def test_unknown_stream_abort_and_cancelled_stream(idle, monkeypatch):
    with pytest.raises(grpc.RpcError) as err:
        idle.stream("nobody")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # Abort of a reservation frees its blocks at once; its stream ends with "abort"
    prompt = random_prompts([40], seed=7)[0]
    idle.reserve("to-abort", prompt)
    s = idle.stats()
    assert s.num_reserved == 1 and s.num_free_blocks < s.num_total_blocks
    assert idle.d.Abort(
        worker_pb2.WorkerAbortRequest(request_id="to-abort"), timeout=RPC_TIMEOUT
    ).found
    s = idle.stats()
    assert s.num_reserved == 0 and s.num_free_blocks == s.num_total_blocks
    assert idle.stream("to-abort")[-1].finish_reason == "abort"
    assert not idle.d.Abort(
        worker_pb2.WorkerAbortRequest(request_id="to-abort"), timeout=RPC_TIMEOUT
    ).found
    # a client that cancels its stream mid-way: the decode side aborts the request. Its steps
    # are slowed: on a loaded CI machine the stream's 54 tokens were once all out before the
    # cancel landed, and a request that finished is not aborted
    aborted = record_aborts(idle.decode, monkeypatch)
    engine = idle.decode.loop.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.05), step())[1])
    long = pdserve_pb2.SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - 10, ignore_eos=True)
    prompt = random_prompts([8], seed=8)[0]
    reservation = idle.reserve("cancel-me", prompt, long)
    idle.prefill_req("cancel-me", prompt, reservation, long)
    call = idle.d.Stream(worker_pb2.StreamRequest(request_id="cancel-me"), timeout=RPC_TIMEOUT)
    first = next(call)
    assert first.token_ids and not first.HasField("finish_reason")
    call.cancel()
    wait_until(lambda: aborted, 15, "the decode side did not abort the cancelled stream's request")
    assert aborted[0] == ("cancel-me", "the stream client went away")

    def freed():  # the abort is asked for before the engine's loop thread carries it out
        s = idle.stats()
        return s.num_running == 0 and s.num_free_blocks == s.num_total_blocks

    wait_until(freed, 30, "the aborted request still runs or holds blocks")


def test_a_reserve_the_router_aborted_before_it_came_is_cancelled(idle):
    # the router's Abort overtook its Reserve (it gave the Reserve up while it was under way):
    # the Reserve holds nothing, and the worker goes on serving that id's next Reserve
    prompt = random_prompts([40], seed=10)[0]
    abort = worker_pb2.WorkerAbortRequest(request_id="overtaken")
    assert not idle.d.Abort(abort, timeout=RPC_TIMEOUT).found
    with pytest.raises(grpc.RpcError) as err:
        idle.reserve("overtaken", prompt)
    assert err.value.code() == grpc.StatusCode.CANCELLED and "aborted before" in err.value.details()
    assert idle.stats().num_reserved == 0
    idle.reserve("overtaken", prompt)
    assert idle.d.Abort(abort, timeout=RPC_TIMEOUT).found


def test_a_prefill_the_router_aborted_before_it_came_is_cancelled(idle, expected):
    # the router aborts the prefill worker first (router/legs.py Legs.abort) and may do so
    # before its Prefill arrives: served, the Prefill would push KV into a reservation the
    # router freed meanwhile, whose blocks another request may hold by then
    prompts, want = expected
    abort = worker_pb2.WorkerAbortRequest(request_id="overtaken-prefill")
    reservation = idle.reserve("overtaken-prefill", prompts[0])
    before = idle.p.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT).kv_transfers
    assert not idle.p.Abort(abort, timeout=RPC_TIMEOUT).found  # not here yet: remembered
    with pytest.raises(grpc.RpcError) as err:
        idle.prefill_req("overtaken-prefill", prompts[0], reservation)
    assert err.value.code() == grpc.StatusCode.CANCELLED and "aborted before" in err.value.details()
    p = idle.p.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)
    assert p.num_running == 0 and p.num_waiting == 0 and p.kv_transfers == before
    # the refusal's abort frame frees the reservation (as the router's Abort would)
    assert idle.stream("overtaken-prefill")[-1].finish_reason == "abort"
    # refused once, the id is forgotten: a Prefill of it now is served
    assert idle.generate("overtaken-prefill", prompts[0]) == want[0]


def test_lease_expiry_frees_a_reservation_never_prefilled(idle):
    prompt = random_prompts([33], seed=9)[0]
    reply = idle.reserve("lease", prompt, lease_ms=300)
    assert len(reply.block_ids) == 3 and reply.block_size == 16
    assert 0 < reply.lease_deadline_unix_ns - time.time_ns() <= 300_000_000
    assert idle.stats().num_reserved == 1
    wait_until(lambda: idle.stats().num_reserved == 0, 15, "the lease never expired")
    s = idle.stats()
    assert s.num_free_blocks == s.num_total_blocks
    last = idle.stream("lease")[-1]
    assert last.finish_reason == "abort" and "lease expired" in last.stop_str


def test_prefill_into_another_layout_is_refused(idle):
    prompt = random_prompts([20], seed=10)[0]
    reservation = idle.reserve("other-layout", prompt)
    assert reservation.endpoint.backend == "grpc" and reservation.endpoint.tp_size == 1
    assert reservation.endpoint.layout_fingerprint == idle.prefill.layout.fingerprint
    forged = worker_pb2.ReserveResponse()
    forged.CopyFrom(reservation)
    forged.endpoint.layout_fingerprint = "0123456789abcdef"
    with pytest.raises(grpc.RpcError) as err:
        idle.prefill_req("other-layout", prompt, forged)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "same model" in err.value.details()
    assert idle.d.Abort(
        worker_pb2.WorkerAbortRequest(request_id="other-layout"), timeout=RPC_TIMEOUT
    ).found
    p = idle.p.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)
    assert p.num_running == 0 and p.num_waiting == 0


def test_stats_answer_while_the_engine_loop_is_busy(idle):
    """Health checks and heartbeats read Stats: a long engine step (a long prompt's prefill) must
    not make a live worker look dead, so Stats does not wait for the loop thread."""
    release = threading.Event()
    busy = [w.loop.submit(release.wait, 30) for w in (idle.decode, idle.prefill)]
    try:
        time.sleep(0.1)
        assert not any(f.done() for f in busy)  # both loop threads are held
        d = idle.d.Stats(worker_pb2.StatsRequest(), timeout=1.0)
        p = idle.p.Stats(worker_pb2.StatsRequest(), timeout=1.0)
        assert d.num_free_blocks == d.num_total_blocks > 0 and d.worker_id == "d0"
        assert p.num_total_blocks > 0 and p.num_waiting == 0 and p.worker_id == "p0"
    finally:
        release.set()
    assert all(f.result(5) for f in busy)


def test_more_open_streams_than_sixteen_leave_the_worker_answering(tiny_models):
    """Every open Stream holds a gRPC handler thread on the decode worker; with a fixed pool of 16
    the 17th stream and every Stats/Reserve behind it waited for a stream to end."""
    n = 24
    worker = DecodeWorker(
        DecodeWorkerConfig(
            model=tiny_models("llama-gqa")[0],
            worker_id="d-many",
            lease_ms=20_000,
            engine_kwargs=dict(kv_cache_memory=1 << 20, block_size=4, max_model_len=MAX_MODEL_LEN),
        )
    ).start()
    channel = grpc.insecure_channel(worker.address)
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)
    calls = []
    try:
        for i, prompt in enumerate(random_prompts([3] * n, seed=17)):
            stub.Reserve(
                worker_pb2.ReserveRequest(
                    request_id=f"many-{i}", prompt_token_ids=prompt, sampling=GREEDY
                ),
                timeout=1.0,
            )
            calls.append(
                stub.Stream(worker_pb2.StreamRequest(request_id=f"many-{i}"), timeout=RPC_TIMEOUT)
            )
        time.sleep(0.2)  # every stream is open and waiting for its KV
        assert stub.Stats(worker_pb2.StatsRequest(), timeout=1.0).num_reserved == n
        # the last stream is served too: after an abort it ends at once with "abort"
        assert stub.Abort(
            worker_pb2.WorkerAbortRequest(request_id=f"many-{n - 1}"), timeout=1.0
        ).found
        assert list(calls[-1])[-1].finish_reason == "abort"
    finally:
        for i in range(n):
            stub.Abort(worker_pb2.WorkerAbortRequest(request_id=f"many-{i}"), timeout=RPC_TIMEOUT)
        for call in calls:
            call.cancel()
        channel.close()
        worker.stop()
