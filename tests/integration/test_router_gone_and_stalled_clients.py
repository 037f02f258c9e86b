"""Two ways a Generate client can leave work behind in the router and on the workers, through a
real router over 127.0.0.1 (one DecodeWorker, one PrefillWorker): a client that cancels while
its call is still being validated and tokenized (the step under way runs on after the cancel)
must start no leg, and a client that stops reading its stream must lose its admission slot and
its legs at the request's deadline, with DEADLINE_EXCEEDED. The same with fakes:
tests/unit/test_router_stalled_writes.py."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from helpers.models import random_prompts
from helpers.router_cluster import Cluster, pool_idle
from helpers.threads import leaves_no_threads, wait_until
from helpers.worker import record_aborts
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.grpc_loop import BridgeContext

LONG = pdserve_pb2.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_models, one_thread):
    with leaves_no_threads():
        c = Cluster(tiny_models("llama-gqa")[0])
        yield c
        c.stop()


@pytest.fixture
def idle(cluster):
    """Each test leaves the decode pool as it found it: every block free, nothing reserved."""
    yield cluster
    wait_until(lambda: pool_idle(cluster), 5, f"decode pool not back to idle: {cluster.stats()}")


def slow_decode(cluster, monkeypatch) -> None:
    """Each decode step 20 ms: a LONG request runs for seconds on the decode worker."""
    engine = cluster.decode.loop.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.02), step())[1])


def test_a_client_that_leaves_while_its_prompt_is_tokenized_starts_no_leg(idle, monkeypatch):
    """The call's first step (validation, tokenizing, admission) runs on the router's thread
    pool and goes on after the client left. Before, it then started a leg that nothing would
    abort (the end-of-call callback came too late to be added): the request ran to max_tokens
    on the decode worker, holding its reservation, outside admission and PDServe.Abort."""
    servicer = idle.router.servicer
    slow_decode(idle, monkeypatch)
    tokenizing, release, rpc_ended, left = (threading.Event() for _ in range(4))
    encode = servicer.encoder.encode_with_images

    def held_encode(request):  # the step waits here until the client has left
        tokenizing.set()
        assert release.wait(20)
        return encode(request)

    monkeypatch.setattr(servicer.encoder, "encode_with_images", held_encode)
    ended = BridgeContext.ended

    def ended_then_say(self):
        ended(self)
        rpc_ended.set()

    monkeypatch.setattr(BridgeContext, "ended", ended_then_say)
    leave = servicer.admission.leave
    monkeypatch.setattr(servicer.admission, "leave", lambda ticket: (leave(ticket), left.set()))
    reserves = []
    reserve = servicer.legs._reserve
    monkeypatch.setattr(servicer.legs, "_reserve", lambda *a: reserves.append(a[1]) or reserve(*a))

    call = idle.api.Generate(
        pdserve_pb2.GenerateRequest(
            request_id="leaves-early",
            token_ids=pdserve_pb2.TokenIds(ids=random_prompts([8], seed=21)[0]),
            sampling=LONG,
        )
    )
    assert tokenizing.wait(20), "the call never reached its tokenizing"
    call.cancel()
    assert rpc_ended.wait(20), "the router never saw the client leave"
    release.set()
    assert left.wait(20), "the call never left admission"
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    stats = idle.stats()
    assert pool_idle(idle), f"the decode worker runs a request nobody reads: {stats}"
    assert reserves == [], "a leg started for a client that had left"
    assert servicer.admission.running() == 0 and not servicer._inflight


def test_a_client_that_stops_reading_is_cut_at_its_deadline(idle, monkeypatch):
    """A client that reads one response and then stops (its HTTP/2 window stays closed) stalls
    the router's writes, so its call never reads its leg again, where the deadline was checked.
    Before, the call kept its admission slot (and /pause waited for it) for as long as the
    connection lived; now the write is cut at the request's deadline: DEADLINE_EXCEEDED, the
    slot freed, the leg aborted on the workers."""
    servicer = idle.router.servicer
    slow_decode(idle, monkeypatch)  # still running at the deadline
    aborted = record_aborts(idle.decode, monkeypatch)
    small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    sampling = pdserve_pb2.SamplingParams()
    sampling.CopyFrom(LONG)
    sampling.logprobs, sampling.top_logprobs = True, 5  # larger responses: the window fills
    with grpc.insecure_channel(idle.router.address, options=small_window) as channel:
        call = pdserve_pb2_grpc.PDServeStub(channel).Generate(
            pdserve_pb2.GenerateRequest(
                request_id="stops-reading",
                token_ids=pdserve_pb2.TokenIds(ids=random_prompts([8], seed=22)[0]),
                sampling=sampling,
                deadline_ms=1500,
            )  # no gRPC timeout: nothing but the router ends it
        )
        assert next(call).HasField("delta")
        # the client reads nothing more
        wait_until(
            lambda: servicer.admission.running() == 0,
            30,
            "the call kept its admission slot past its deadline",
        )
        wait_until(lambda: aborted and pool_idle(idle), 15, "the leg still runs on the workers")
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:  # what the window held, then the status
                pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline_ms" in err.value.details()
