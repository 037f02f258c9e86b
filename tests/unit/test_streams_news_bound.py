"""A Streams caller that sends and never reads holds a bounded share of the decode worker's
memory (decode_worker/service.py `_read_requests`, decode_worker/streams.py `Connection`): once
MAX_PENDING_NEWS of its news wait for the handler, the call's request reader reads no more of its
messages until the handler took them; nothing is lost. A refused id is echoed cut to the id
limit. With fakes and no sockets (the fakes of tests/unit/test_decode_streams.py)."""

from __future__ import annotations

import grpc

from helpers.threads import wait_until
from pdserve.decode_worker import service, streams
from pdserve.decode_worker.service import (
    MAX_STREAMS_IDS,
    DecodeServiceOptions,
    DecodeWorkerServicer,
)
from pdserve.protos.limits import MAX_ID_CHARS
from pdserve.protos.pdserve.v1 import worker_pb2

# the bound the fix sets (streams.MAX_PENDING_NEWS); the same number without it, so that the
# test fails on what it checks rather than on a name
BOUND = getattr(streams, "MAX_PENDING_NEWS", 8192)


class Loop:
    def every(self, period, fn):
        pass


class Handoff:
    def abort(self, rid, reason=""):
        pass


class Context:
    def is_active(self):
        return True


def servicer() -> DecodeWorkerServicer:
    return DecodeWorkerServicer(
        Loop(), handoff=Handoff(), options=DecodeServiceOptions(poll_s=0.01)
    )


def refusals(responses) -> list:
    return [item for r in responses for item in r.requests]


def test_a_caller_that_never_reads_holds_a_bounded_amount_of_news(monkeypatch):
    conns = []

    class Recorded(streams.Connection):
        def __init__(self):
            super().__init__()
            conns.append(self)

    monkeypatch.setattr(service, "Connection", Recorded)
    messages, pulled = 6, []

    def requests():  # each of its ids unknown here: a refusal apiece
        for i in range(messages):
            pulled.append(i)
            yield worker_pb2.StreamsRequest(attach=[f"m{i}-{j}" for j in range(MAX_STREAMS_IDS)])

    calls = DecodeWorkerServicer.Streams(servicer(), requests(), Context())
    first = next(calls)  # a round went out; the handler now waits in its yield: nobody reads
    [conn] = conns

    def pending() -> list:
        with conn._cond:
            return list(conn._news)

    def reader_stopped() -> bool:  # it waits for room, or it read every message
        return getattr(conn, "num_waits", 0) > 0 or any(k == "input_done" for k, _, _ in pending())

    wait_until(reader_stopped, 30, "the request reader waits or is done")
    assert len(pending()) <= BOUND
    assert len(pulled) < messages  # the caller's later messages stay unread meanwhile
    rest = list(calls)  # the caller reads again: everything comes, in order
    items = refusals([first, *rest])
    assert len(items) == messages * MAX_STREAMS_IDS
    assert [item.request_id for item in items] == [
        f"m{i}-{j}" for i in range(messages) for j in range(MAX_STREAMS_IDS)
    ]
    assert all(item.error_code == grpc.StatusCode.NOT_FOUND.value[0] for item in items)


def test_a_refused_long_id_is_echoed_cut_to_the_id_limit():
    long_id = "x" * 5000
    responses = list(
        DecodeWorkerServicer.Streams(
            servicer(), iter([worker_pb2.StreamsRequest(attach=[long_id])]), Context()
        )
    )
    [item] = refusals(responses)
    assert item.request_id == long_id[:MAX_ID_CHARS]
    assert item.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert f"at most {MAX_ID_CHARS}" in item.error
