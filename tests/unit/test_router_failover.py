"""The pieces of a resume, for a request that outlives its decode worker, without a worker: the
lowered token budgets, and a stop string across the resume point that ends the stream at the
router. The resume itself, over real workers: tests/integration/test_router_failover_workers.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.engine.tokenizer import load_tokenizer
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.router.call import resume_sampling
from pdserve.router.legs import Inflight, Leg, Legs
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
