"""The decode worker's Stream (decode_worker/service.py) with fakes and no sockets: outputs that
carry only what is new (the engine's DELTA outputs) become token events with nothing repeated,
the hand-off's first token included once, and outputs that queued up while the stream was behind
go out as one event per sequence."""

from __future__ import annotations

from pdserve.decode_worker.handoff import CommitOutput, HandoffTimings
from pdserve.decode_worker.service import DecodeServiceOptions, DecodeWorkerServicer, _Stream
from pdserve.engine.request import CompletionOutput, RequestOutput
from pdserve.engine.sampler import TokenLogprob
from pdserve.protos.pdserve.v1 import worker_pb2


class Context:
    def is_active(self) -> bool:
        return True

    def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def output(pieces: dict[int, list[int]], finished=False, reason=None) -> RequestOutput:
    comps = [
        CompletionOutput(i, "", ids, reason if finished else None, logprobs=[-0.5] * len(ids))
        for i, ids in pieces.items()
    ]
    return RequestOutput("r1", None, [1, 2], comps, finished)


class Loop:
    def every(self, period, fn):
        pass


def stream_of(outputs, n: int = 1) -> list[worker_pb2.TokenEvent]:
    servicer = DecodeWorkerServicer(Loop(), handoff=None, options=DecodeServiceOptions())
    stream = _Stream(n=n)
    for out in outputs:
        stream.outputs.put(out)
    servicer._streams["r1"] = stream
    return list(servicer.Stream(worker_pb2.StreamRequest(request_id="r1"), Context()))


def committed_first_token() -> CommitOutput:
    """The hand-off's first output: token 5, its logprob without top logprobs."""
    return CommitOutput(
        "r1",
        None,
        [],
        [CompletionOutput(0, "", [5], None, logprobs=[-0.25])],
        finished=False,
        timings=HandoffTimings(1, 2),
    )


def test_queued_outputs_go_out_as_one_event_per_sequence():
    events = stream_of(
        [
            output({0: [5], 1: [6]}),
            output({0: [7, 8], 1: []}),
            output({0: [9], 1: [10]}, finished=True, reason="length"),
        ],
        n=2,
    )
    assert [(e.index, list(e.token_ids), e.finish_reason) for e in events] == [
        (0, [5, 7, 8, 9], "length"),
        (1, [6, 10], "length"),
    ]
    assert [len(e.logprobs) for e in events] == [4, 2]


def test_the_hand_off_first_token_goes_out_once():
    # the engine's first delta output holds the committed token again, then what follows
    events = stream_of(
        [committed_first_token(), output({0: [5, 7]}), output({0: [8]}, True, "stop")]
    )
    assert [list(e.token_ids) for e in events] == [[5, 7, 8]]
    assert list(events[0].logprobs) == [-0.25, -0.5, -0.5]
    assert events[0].finish_reason == "stop"


def test_an_abort_ends_every_sequence():
    events = stream_of(
        [output({0: [5], 1: [6]}), RequestOutput.aborted("r1", "the client left")], n=2
    )
    assert [(e.index, list(e.token_ids), e.finish_reason) for e in events] == [
        (0, [5], "abort"),
        (1, [6], "abort"),
    ]
    assert all(e.stop_str == "the client left" for e in events)


def test_tokens_with_top_logprobs_are_not_merged_into_tokens_without():
    """A committed first token has no top logprobs (the prefill worker's answer carries them):
    the router pairs each event's top logprobs with its tokens, so such a token keeps its own
    event when the outputs behind it have theirs."""
    top = [TokenLogprob(-0.5, {7: -0.5, 3: -1.0}), TokenLogprob(-0.75, {8: -0.75, 2: -1.5})]
    later = RequestOutput(
        "r1", None, [1, 2], [CompletionOutput(0, "", [5, 7], None, logprobs=[-0.25, top[0]])], False
    )
    last = RequestOutput(
        "r1", None, [1, 2], [CompletionOutput(0, "", [8], "stop", logprobs=[top[1]])], True
    )
    events = stream_of([committed_first_token(), later, last])
    assert [(list(e.token_ids), len(e.logprobs), len(e.top_logprobs)) for e in events] == [
        ([5], 1, 0),
        ([7, 8], 2, 2),
    ]
    assert events[-1].finish_reason == "stop"
