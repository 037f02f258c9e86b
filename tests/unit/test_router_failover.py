"""The pieces of a resume, for a request that outlives its decode worker, without a worker: the
lowered token budgets, and a stop string across the resume point that ends the stream at the
router. The resume itself, over real workers: tests/integration/test_router_failover_workers.py.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from pdserve.engine.tokenizer import load_tokenizer
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.router.call import resume_sampling
from pdserve.router.legs import Inflight, Leg, Legs, RouterStatus
from pdserve.router.text import TextStream


# ---- pieces of a resume -------------------------------------------------------------------------
def test_resumed_sampling_lowers_the_token_budgets():
    sampling = pdserve_pb2.SamplingParams(temperature=0.5, seed=3, max_tokens=48, min_tokens=10)
    assert resume_sampling(sampling, 0) is sampling
    resumed = resume_sampling(sampling, 12)
    assert (resumed.max_tokens, resumed.min_tokens, resumed.seed, resumed.temperature) == (
        36,
        0,
        3,
        0.5,
    )
    assert resume_sampling(sampling, 4).min_tokens == 6
    assert resume_sampling(sampling, 48) is None  # nothing left to generate
    unset = resume_sampling(pdserve_pb2.SamplingParams(), 5)  # the engine default, 16
    assert unset.max_tokens == 11 and not unset.HasField("min_tokens")


class FakeStream:
    """A decode stream that has not finished: the worker after a resume never saw the stop string."""

    def __init__(self, token_ids):
        self.events = [worker_pb2.TokenEvent(token_ids=[t]) for t in token_ids]
        self.cancelled = False

    def __iter__(self):
        return iter(self.events)

    def cancel(self):
        self.cancelled = True


def test_stop_string_across_the_resume_point_ends_the_stream_at_the_router(model_dir):
    tokenizer = load_tokenizer(model_dir)
    text = TextStream(tokenizer, [3], True, ("t6 t7",), include_stop_str=False)
    sent = [5, 6]  # streamed before the resume; "t6", maybe the start of the stop, is held back
    assert text.add(sent) == " t5 "
    leg = Leg(1)
    leg.stream_call = FakeStream([7, 8, 9])
    legs = Legs(pool=None, executor=None, options=None)
    run = legs.stream(Inflight("r"), leg, [text], [sent])  # sequence 0 of 1
    responses = []
    with pytest.raises(StopIteration) as done:
        while True:
            responses.append(next(run))
    final, error = done.value.value
    assert error is None and final.finish_reason == "stop" and final.stop_str == "t6 t7"
    assert leg.stream_call.cancelled and sent == [5, 6, 7]  # 8 and 9 never reach the client
    assert [list(r.delta.token_ids) for r in responses] == [[7]] and text.flush() == ""


def test_closing_the_legs_waits_for_the_abort_calls_under_way():
    # the router closes the workers' channels right after: the Aborts under way finish first
    legs = Legs(pool=None, executor=None, options=None)
    started, done = threading.Event(), []
    legs._run_later(lambda: (started.set(), time.sleep(0.2), done.append(1)))
    assert started.wait(5)
    legs.close()
    assert done == [1]
    legs._run_later(lambda: done.append(2))  # after the close: refused, never run
    assert done == [1]


def test_a_reserve_given_up_is_aborted_and_its_id_never_sent_again(monkeypatch):
    # a Reserve that did not answer in time may still reserve: the router aborts its id, and the
    # worker refuses that id's Reserve should it come after the Abort (decode_worker/handoff.py);
    # the leg may try the same worker again later (a full pool's queue), so it takes a new id
    pool = SimpleNamespace(is_member=lambda w: True, on_drop=lambda fn: None, name=lambda w: "d0")
    late = RouterStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")  # as a worker's error
    expired = SimpleNamespace(result=lambda: (_ for _ in ()).throw(late), cancel=lambda: 0)
    reserve = SimpleNamespace(future=lambda request, timeout, **kw: expired)
    worker = type("Worker", (), {"stub": SimpleNamespace(Reserve=reserve)})()  # hashable
    options = SimpleNamespace(rpc_timeout_s=1.0, abort_timeout_s=0.1)
    legs = Legs(pool=pool, executor=None, options=options)
    later, aborted = [], []
    monkeypatch.setattr(legs, "_run_later", later.append)
    monkeypatch.setattr(legs, "abort_until_answered", lambda w, rid: aborted.append(rid))
    leg = Leg(1)
    first = leg.request_id
    request = worker_pb2.ReserveRequest(request_id=first)
    with pytest.raises(RouterStatus, match="did not answer Reserve"):
        legs._reserve_on(worker, leg, request, deadline=time.monotonic() + 30)
    for fn in later:
        fn()
    assert aborted == [first] and leg.request_id not in ("", first)
    legs.close()


def test_a_leg_is_aborted_on_its_prefill_worker_before_its_decode_worker():
    # a prefill step under way still pushes KV into the reservation (in place over shm): the
    # decode worker must free it only once the prefill worker let go of the request
    calls = []

    def worker(name):
        def abort(request, timeout):
            calls.append((name, request.request_id))
            return worker_pb2.WorkerAbortResponse(found=True)

        return SimpleNamespace(stub=SimpleNamespace(Abort=abort))

    legs = Legs(pool=None, executor=None, options=SimpleNamespace(abort_timeout_s=1.0))
    leg = Leg(1)
    leg.prefill, leg.decode = worker("prefill"), worker("decode")
    leg.stream_call = SimpleNamespace(cancel=lambda: calls.append(("stream", "cancel")))
    assert legs.abort(leg, cancel_stream=True)
    rid = leg.request_id
    assert calls == [("prefill", rid), ("stream", "cancel"), ("decode", rid)]
    # once its Prefill call ended (answered, or failed and aborted there), only the decode side
    calls.clear()
    leg.prefill_future = SimpleNamespace(done=lambda: True)
    assert legs.abort(leg)
    assert calls == [("decode", rid)]
    legs.close()
