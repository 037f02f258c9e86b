"""The router's stream_interval (router/legs.py Held), on one leg's token events without a worker:
a sequence's first delta goes out at once, then one per `interval` tokens and one at its end; the
text, logprobs and alternatives the client gets are those of interval 1, lined up with their
tokens; a stream that fails sends what it held first (a resume goes on after those tokens). The
option through a router and workers: tests/integration/test_router.py."""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.tokenizer import load_tokenizer
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.router.decode_streams import LegStreamError
from pdserve.router.legs import Inflight, Leg, Legs
from pdserve.router.service import ServiceOptions
from pdserve.router.text import TextStream


class Events:
    """A decode worker's stream of prepared events, failing with `error` after them (if set)."""

    def __init__(self, events, error: grpc.RpcError | None = None):
        self.events, self.error = events, error

    def __iter__(self):
        yield from self.events
        if self.error is not None:
            raise self.error

    def cancel(self):
        pass


def event(tokens, index=0, final=False, logprobs=False, tops=False):
    e = worker_pb2.TokenEvent(index=index, token_ids=tokens)
    if logprobs:
        e.logprobs.extend([-0.5 - t / 100 for t in tokens])
    if tops:
        for t in tokens:
            e.top_logprobs.add(token_ids=[t, t + 1], logprobs=[-0.1, -2.0])
    if final:
        e.finish_reason = "length"
    return e


def run(model_dir, events, interval: int, n: int = 1):
    """(the client's deltas, what the stream returned, the token ids put on `sent`)."""
    tokenizer = load_tokenizer(model_dir)
    texts = [TextStream(tokenizer, [], True, (), include_stop_str=False) for _ in range(n)]
    sent = [[] for _ in range(n)]
    leg = Leg(1)
    leg.stream_call = events
    options = ServiceOptions("m", 256, 1000, "float32", stream_interval=interval)
    stream = Legs(pool=None, executor=None, options=options).stream(
        Inflight("r"), leg, texts, sent, finish_of=lambda e: pdserve_pb2.GenerateResponse()
    )
    deltas = []
    with pytest.raises(StopIteration) as done:
        while True:
            response = next(stream)
            if response.HasField("delta"):
                deltas.append(response.delta)
    return deltas, done.value.value, sent


def test_tokens_go_out_first_alone_then_in_groups_with_the_same_text(model_dir):
    events = Events([event([t], final=t == 30) for t in range(20, 31)])  # 11 tokens
    ones, final_ones, _ = run(model_dir, events, 1)
    fours, final_fours, sent = run(model_dir, events, 4)
    assert [len(d.token_ids) for d in ones] == [1] * 11
    assert [list(d.token_ids) for d in fours] == [
        [20],
        [21, 22, 23, 24],
        [25, 26, 27, 28],
        [29, 30],
    ]
    assert "".join(d.text for d in fours) == "".join(d.text for d in ones) != ""
    assert final_fours[0].finish_reason == final_ones[0].finish_reason == "length"
    assert sent == [list(range(20, 31))]


def test_logprobs_and_alternatives_stay_one_per_token(model_dir):
    # the leg's first token came from the prefill worker: no alternatives here (router/call.py
    # fills them in), so it goes alone; an event without logprobs does not join those with
    first = event([40], logprobs=True)
    rest = [event([t], logprobs=True, tops=True) for t in range(41, 47)]
    bare = event([47], tops=True)
    last = event([48], final=True, logprobs=True, tops=True)
    deltas, _, _ = run(model_dir, Events([first, *rest, bare, last]), 4)
    assert [list(d.token_ids) for d in deltas] == [[40], [41, 42, 43, 44], [45, 46], [47], [48]]
    for d in deltas[1:]:
        assert [t.token_ids[0] for t in d.top_logprobs] == list(d.token_ids)
    assert [len(d.logprobs) for d in deltas] == [1, 4, 2, 0, 1]
    assert list(deltas[1].logprobs) == pytest.approx([-0.5 - t / 100 for t in range(41, 45)])


def test_a_failed_stream_sends_what_it_held_before_it_ends(model_dir):
    error = LegStreamError(grpc.StatusCode.UNAVAILABLE, "the decode worker is gone")
    deltas, (final, got), sent = run(model_dir, Events([event([t]) for t in range(5)], error), 8)
    assert final is None and got is error
    assert [list(d.token_ids) for d in deltas] == [[0], [1, 2, 3, 4]]
    assert sent == [[0, 1, 2, 3, 4]]  # every token on `sent` reached the client


def test_each_sequence_is_held_on_its_own(model_dir):
    events = [event([10 + t], index=t % 2, final=t >= 8) for t in range(10)]  # 0 and 1 by turns
    deltas, final, sent = run(model_dir, Events(events), 3, n=2)
    by_index = {i: [list(d.token_ids) for d in deltas if d.index == i] for i in (0, 1)}
    assert by_index == {0: [[10], [12, 14, 16], [18]], 1: [[11], [13, 15, 17], [19]]}
    assert final[0].finish_reason == "length" and sent == [
        [10, 12, 14, 16, 18],
        [11, 13, 15, 17, 19],
    ]
