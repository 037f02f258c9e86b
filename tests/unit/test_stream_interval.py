"""A decode worker's stream interval (decode_worker/streams.py Interval), on a request's engine
outputs without an engine: the first output goes at once, then the outputs are held until they
carry the interval's worth of new tokens and go together, in order; the last goes at once with
what is held; the hand-off's first output (whose token the engine's first output repeats) does
not count that token twice; n > 1 counts the longest sequence. Through a router and workers:
tests/integration/test_router.py."""

from __future__ import annotations

from pdserve.decode_worker.handoff import CommitOutput
from pdserve.decode_worker.streams import Interval
from pdserve.engine.request import CompletionOutput, RequestOutput


def output(*per_sequence: list[int], finished=False, kind=RequestOutput) -> RequestOutput:
    outs = [
        CompletionOutput(i, "", ids, "length" if finished else None)
        for i, ids in enumerate(per_sequence)
    ]
    return kind("r", None, [1, 2], outs, finished)


def released(interval: Interval, outputs) -> list[list[int]]:
    """For each output taken, the first token of each output that went with it ([] held)."""
    return [[o.outputs[0].token_ids[0] for o in interval.take(out)] for out in outputs]


def test_first_alone_then_groups_of_the_interval_then_the_end():
    outs = [output([t]) for t in range(10, 19)] + [output([19], finished=True)]
    assert released(Interval(4), outs) == [
        [10],
        [],
        [],
        [],
        [11, 12, 13, 14],
        [],
        [],
        [],
        [15, 16, 17, 18],
        [19],
    ]


def test_the_end_takes_what_is_held():
    outs = [output([1]), output([2]), output([3]), output([4], finished=True)]
    assert released(Interval(8), outs) == [[1], [], [], [2, 3, 4]]


def test_outputs_of_several_tokens_count_each():
    # prompt lookup's steps: a group goes once it holds at least the interval's tokens
    outs = [output([1]), output([2, 3, 4]), output([5, 6]), output([7]), output([8, 9, 10, 11])]
    assert released(Interval(4), outs) == [[1], [], [2, 5], [], [7, 8]]


def test_the_handoffs_repeated_first_token_is_not_new():
    commit = output([7], kind=CommitOutput)
    engine_first = output([7, 8])  # the engine's first output holds the committed token again
    outs = [commit, engine_first, output([9]), output([10]), output([11])]
    assert released(Interval(4), outs) == [[7], [], [], [], [7, 9, 10, 11]]


def test_several_sequences_count_the_longest():
    outs = [output([1], [2]), output([3], [4, 5]), output([6], [7])]
    assert released(Interval(3), outs) == [[1], [], [3, 6]]
