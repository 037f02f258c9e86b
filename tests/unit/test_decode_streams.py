"""Many requests' token events on one call, both ends, with fakes and no sockets: the decode
worker's Streams (decode_worker/service.py, decode_worker/streams.py) attaches the requests its
caller names, sends each round's news in one message, refuses what it cannot attach and aborts
what its caller detaches or leaves behind; the router's DecodeStreams (router/decode_streams.py)
hands each leg its events, closes the call when no leg is left, and fails every leg with the
call's status when the call breaks. Served end to end by every router test."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest

from helpers.decode_streams import Stub, event, wait_for
from pdserve.decode_worker.service import DecodeServiceOptions, DecodeWorkerServicer, _Stream
from pdserve.engine.request import CompletionOutput, RequestOutput
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router.decode_streams import DecodeStreams


# ---- the worker's end -----------------------------------------------------------------------
class Loop:
    def every(self, period, fn):
        pass


class Handoff:
    def __init__(self):
        self.aborted = []

    def abort(self, rid, reason=""):
        self.aborted.append(rid)


class Context:
    def __init__(self):
        self.active = True

    def is_active(self):
        return self.active


def output(rid: str, ids: list[int], finished=False) -> RequestOutput:
    comp = CompletionOutput(0, "", ids, "length" if finished else None)
    return RequestOutput(rid, None, [1], [comp], finished)


def servicer_with(streams: dict[str, list[RequestOutput]]):
    servicer = DecodeWorkerServicer(
        Loop(), handoff=Handoff(), options=DecodeServiceOptions(poll_s=0.01)
    )
    for rid, outs in streams.items():
        stream = servicer._streams[rid] = _Stream()
        for out in outs:
            stream.outputs.put(out)
    return servicer


def run_streams(servicer, requests, context=None) -> list[worker_pb2.StreamsResponse]:
    return list(servicer.Streams(iter(requests), context or Context()))


def test_the_worker_sends_each_round_in_one_message_and_refuses_what_it_cannot_attach():
    servicer = servicer_with(
        {
            "a": [output("a", [5]), output("a", [6, 7], finished=True)],
            "b": [output("b", [8], finished=True)],
        }
    )
    responses = run_streams(servicer, [worker_pb2.StreamsRequest(attach=["a", "b", "nobody", ""])])
    items = [item for r in responses for item in r.requests]
    by_id = {item.request_id: item for item in items}
    assert [t for e in by_id["a"].events for t in e.token_ids] == [5, 6, 7]
    assert by_id["a"].end and by_id["a"].events[-1].finish_reason == "length"
    assert [t for e in by_id["b"].events for t in e.token_ids] == [8] and by_id["b"].end
    assert by_id["nobody"].error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert by_id[""].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert len(responses) == 1  # what was queued went out in one round
    assert servicer._streams == {} and servicer.handoff.aborted == []


def test_an_output_after_the_attach_wakes_the_call():
    servicer = servicer_with({"a": []})
    stream = servicer._streams["a"]
    on_output = servicer._on_output(stream)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    requests.put(worker_pb2.StreamsRequest(attach=["a"]))

    def feed():
        while stream.notify is None:
            time.sleep(0.001)
        on_output(output("a", [9]))
        on_output(output("a", [10], finished=True))
        requests.put(None)

    threading.Thread(target=feed).start()
    responses = list(servicer.Streams(iter(requests.get, None), Context()))
    tokens = [t for r in responses for item in r.requests for e in item.events for t in e.token_ids]
    assert tokens == [9, 10] and responses[-1].requests[-1].end


def test_a_detached_request_and_one_left_when_the_call_ends_are_aborted():
    servicer = servicer_with({"a": [output("a", [5])], "b": [output("b", [6])]})
    requests = [
        worker_pb2.StreamsRequest(attach=["a", "b"]),
        worker_pb2.StreamsRequest(detach=["a"]),
    ]
    context = Context()
    calls = servicer.Streams(iter(requests), context)
    next(calls)  # the first round
    context.active = False  # the caller went away
    assert list(calls) == []
    assert sorted(servicer.handoff.aborted) == ["a", "b"]
    assert servicer._streams == {}


def test_too_many_ids_in_one_message_are_refused():
    servicer = servicer_with({})
    ids = [f"r{i}" for i in range(5000)]
    responses = run_streams(servicer, [worker_pb2.StreamsRequest(attach=ids)])
    [item] = [item for r in responses for item in r.requests]
    assert item.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "at most 4096" in item.error


# ---- the router's end ----------------------------------------------------------------------
class Broken(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the worker died"


def entry(rid, ids=(), end=False, **kw) -> worker_pb2.StreamsResponse:
    events = [worker_pb2.TokenEvent(token_ids=list(ids))] if ids else []
    return worker_pb2.StreamsResponse(
        requests=[worker_pb2.RequestEvents(request_id=rid, events=events, end=end, **kw)]
    )


def test_legs_share_one_call_get_their_own_events_and_the_idle_call_closes():
    stub = Stub()
    streams = DecodeStreams(stub, "d0")
    a, b = streams.open("a", None), streams.open("b", None)
    assert len(stub.calls) == 1
    call = stub.calls[0]
    call.responses.put(entry("b", [7]))
    call.responses.put(entry("a", [5]))
    call.responses.put(entry("a", [6], end=True))
    call.responses.put(entry("b", [8], end=True))
    assert [t for e in a for t in e.token_ids] == [5, 6]  # one event or two: as they queued
    assert [t for e in b for t in e.token_ids] == [7, 8]
    wait_for(lambda: call.sent and len(call.sent) == 2, "both attaches sent, then closed")
    assert [list(r.attach) for r in call.sent] == [["a"], ["b"]]
    c = streams.open("c", None)  # a new leg opens a new call
    assert len(stub.calls) == 2
    c.cancel()
    with pytest.raises(grpc.RpcError) as failed:
        next(c)
    assert failed.value.code() == grpc.StatusCode.CANCELLED
    wait_for(lambda: len(stub.calls[1].sent) == 2, "the cancelled leg detached")
    assert list(stub.calls[1].sent[1].detach) == ["c"]


def test_a_broken_call_fails_every_leg_and_a_refusal_fails_one():
    stub = Stub()
    streams = DecodeStreams(stub, "d0")
    a, b, c = (streams.open(rid, None) for rid in "abc")
    call = stub.calls[0]
    call.responses.put(
        entry("c", end=True, error_code=grpc.StatusCode.NOT_FOUND.value[0], error="no request")
    )
    with pytest.raises(grpc.RpcError) as refused:
        next(c)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert refused.value.details() == "no request"
    call.responses.put(entry("a", [5]))
    assert list(next(a).token_ids) == [5]
    call.responses.put(Broken())
    for leg in (a, b):
        with pytest.raises(grpc.RpcError) as broken:
            list(leg)
        assert broken.value.code() == grpc.StatusCode.UNAVAILABLE
    streams.open("d", None)
    assert len(stub.calls) == 2  # the next leg opens a new call


def test_a_leg_past_its_deadline_fails_and_stays_attached_until_cancelled():
    # a detach frees the reservation on the worker, which a prefill step under way may still
    # be writing: the router cancels the leg once its prefill worker let go (router/legs.py)
    stub = Stub()
    streams = DecodeStreams(stub, "d0")
    leg = streams.open("a", time.monotonic() + 0.05)
    with pytest.raises(grpc.RpcError) as late:
        list(leg)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.1)
    assert len(stub.calls[0].sent) == 1  # the attach alone
    leg.cancel()
    wait_for(lambda: len(stub.calls[0].sent) == 2, "detached")
    assert list(stub.calls[0].sent[1].detach) == ["a"]


def queued(*events, end=True) -> worker_pb2.StreamsResponse:
    return worker_pb2.StreamsResponse(
        requests=[worker_pb2.RequestEvents(request_id="a", events=events, end=end)]
    )


def read_all_queued(response):
    """The leg's reads once the reader thread has queued every event of `response`."""
    stub = Stub()
    leg = DecodeStreams(stub, "d0").open("a", None)
    stub.calls[0].responses.put(response)
    wait_for(lambda: leg._queue.qsize() == len(response.requests[0].events) + 1, "all queued")
    return list(leg)


def test_a_read_takes_every_queued_event_that_continues_the_first_as_one():
    """A leg that fell behind catches up in one event: tokens, logprobs and alternatives joined
    in order, the last event's finish and timings kept."""
    final = event([4], logprobs=[-0.4], tops=[4], finish_reason="length")
    final.timings.last_token_unix_ns = 7
    got = read_all_queued(
        queued(
            event([1, 2], logprobs=[-0.1, -0.2], tops=[1, 2]),
            event([3], logprobs=[-0.3], tops=[3]),
            final,
        )
    )
    assert len(got) == 1
    (e,) = got
    assert list(e.token_ids) == [1, 2, 3, 4]
    assert [round(x, 2) for x in e.logprobs] == [-0.1, -0.2, -0.3, -0.4]
    assert [list(t.token_ids) for t in e.top_logprobs] == [[1], [2], [3], [4]]
    assert e.finish_reason == "length" and e.timings.last_token_unix_ns == 7


def test_sequences_join_apart_and_events_that_cannot_be_one_stay_apart_in_order():
    """n>1: each sequence's queued events join, in their order, the other's waiting. An event
    after a sequence's last, and per-token lists that would no longer line up with the tokens
    joined (a first token without its alternatives, logprobs on one event only) each start a new
    event; nothing is lost, and no sequence's events are reordered."""
    got = read_all_queued(
        queued(event([1], index=0), event([2], index=1), event([3], index=0), event([4], index=1))
    )
    assert [(e.index, list(e.token_ids)) for e in got] == [(0, [1, 3]), (1, [2, 4])]
    got = read_all_queued(
        queued(
            event([1], index=0),
            event([2], index=1),  # another sequence
            event([3], index=1, finish_reason="stop"),
            event([4], index=1),  # after its sequence's last (never sent by a worker)
            event([5, 6], index=0, tops=[6]),  # first token's alternatives elsewhere
            event([7], index=0, tops=[7]),
            event([8], index=0, logprobs=[-0.8]),
            event([9], index=0),
        )
    )
    assert [(e.index, list(e.token_ids)) for e in got] == [
        (0, [1]),
        (1, [2, 3]),
        (1, [4]),
        (0, [5, 6]),
        (0, [7]),
        (0, [8]),
        (0, [9]),
    ]
    assert got[1].finish_reason == "stop"


def test_a_failure_queued_behind_events_comes_after_them():
    stub = Stub()
    leg = DecodeStreams(stub, "d0").open("a", None)
    code = grpc.StatusCode.INTERNAL.value[0]
    stub.calls[0].responses.put(
        worker_pb2.StreamsResponse(
            requests=[
                worker_pb2.RequestEvents(
                    request_id="a",
                    events=[event([1]), event([2])],
                    error_code=code,
                    error="engine failed",
                )
            ]
        )
    )
    wait_for(lambda: leg._queue.qsize() == 3, "all queued")
    assert list(next(leg).token_ids) == [1, 2]
    with pytest.raises(grpc.RpcError) as failed:
        next(leg)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
