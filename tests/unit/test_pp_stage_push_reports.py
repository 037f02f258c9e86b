"""The pieces of a pipelined prefill's hand-off where each stage pushes its own layers (issue
#53), without processes: a later stage's rank pushing its layers under their global indices and
reporting each request's bytes or failure (engine/kv_publish.py StageStep), rank 0's sinks
hearing those reports (a failed or silent stage fails the request before its commit:
prefill_worker/handoff.py StagePushError), and the decode side holding a commit marked await_kv
until the other channels' KV has arrived (kvtransfer/receiver.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from helpers.kv import NUM_TOKENS, SRC_BLOCK_IDS, source_cache, src_layout
from pdserve.engine.kv_publish import (
    NOT_PUSHED,
    PUSH_FAILED,
    PUSHED,
    REPLICA,
    LayerPublisher,
    StagePusher,
    report_rows,
)
from pdserve.kvtransfer import ChunkHeader, TransferState
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.reshard import read_chunk
from pdserve.kvtransfer.transport import Destination, Transport
from pdserve.prefill_worker.handoff import (
    GuardedSink,
    HandoffTimings,
    PushSink,
    StagePushError,
)


class FakeStageSink:
    def __init__(self, request_id, fail_flush):
        self.request_id, self.fail_flush = request_id, fail_flush
        self.layers, self.bytes_sent, self.ended = [], 0, 0

    def on_layer(self, layer, kv, block_ids, start, end):
        self.layers.append((layer, tuple(block_ids), start, end))
        self.bytes_sent += kv.numel()

    def end_step(self):
        self.ended += 1


class FakeChannels:
    def __init__(self, fail: set[str]):
        self.fail, self.opened, self.dropped, self.closed = fail, {}, [], False

    def open(self, request_id, spec, tp_size, tp_rank, stage, layers):
        assert (tp_size, tp_rank, stage, layers) == (2, 1, 1, (3, 5))
        assert spec == {"who": request_id}
        if request_id == "no-channel":
            raise ConnectionError("refused")
        sink = self.opened[request_id] = FakeStageSink(request_id, request_id in self.fail)
        return sink

    def flush(self, sink):
        if sink.fail_flush:
            raise TimeoutError("the decode side did not take the frames")

    def failed(self, sink, error):
        assert isinstance(error, Exception)
        self.dropped.append(sink.request_id)

    def close(self):
        self.closed = True


class FakeSender:
    def __init__(self, fail=()):
        self.made = FakeChannels(set(fail))

    def channels(self):
        return self.made


def test_a_later_stages_rank_pushes_its_layers_and_reports_each_request():
    sender = FakeSender(fail={"bad"})
    pusher = StagePusher(sender, first_layer=3, end_layer=5, tp_size=2, tp_rank=1, stage=1)
    kv = torch.ones(2, 2, 4, 1, 1, 1)  # 2 local layers, 8 values each
    pushes = [
        ["good", [0, 1], 0, 8, {"who": "good"}],
        ["bad", [2], 5, 7, {"who": "bad"}],
        ["no-channel", [3], 0, 2, {"who": "no-channel"}],
    ]
    step = pusher.step(pushes, kv)
    step(0)
    step(1)
    rows = report_rows(3, step)
    good = sender.made.opened["good"]
    assert good.layers == [(3, (0, 1), 0, 8), (4, (0, 1), 0, 8)]  # global layer indices
    assert sender.made.opened["bad"].layers == [(3, (2,), 5, 7), (4, (2,), 5, 7)]
    assert good.ended == 1
    assert rows.tolist() == [[16, PUSHED], [16, PUSH_FAILED], [0, PUSH_FAILED]]
    assert sender.made.dropped == ["bad"]  # its channel is closed, the next one opens anew
    assert report_rows(2, None).tolist() == [[0, NOT_PUSHED]] * 2
    pusher.close()
    assert sender.made.closed


class Recorded(Transport):
    def __init__(self):
        self.frames: list[ChunkHeader] = []

    def send(self, header, data, dest):
        self.frames.append(header)

    def flush(self, timeout):
        pass

    def close(self):
        pass


def guarded(request_id="r"):
    layout = src_layout()
    transport = Recorded()
    dest = Destination(list(range(3)), dataclasses.replace(layout, block_size=16))
    push = PushSink(request_id, layout, transport, dest, 0, endpoint=b"\x0a\x04grpc")
    return GuardedSink(push, HandoffTimings(1, layout.num_layers)), transport


def publisher_of(*sinks):
    reqs = [
        SimpleNamespace(request_id=f"r{i}", kv_sink=s, published=0) for i, s in enumerate(sinks)
    ]
    return LayerPublisher(torch.zeros(1), [(r, [0, 1], 8) for r in reqs], lag=False)


def test_stage_reports_reach_the_sinks_and_a_failed_stage_fails_its_request_before_commit():
    ok, ok_tx = guarded("ok")
    bad, bad_tx = guarded("bad")
    silent, _ = guarded("silent")
    pub = publisher_of(ok, bad, silent)
    specs = pub.stage_pushes()
    assert [s[0] for s in specs] == ["r0", "r1", "r2"] and specs[0][1:4] == [[0, 1], 0, 8]
    assert specs[0][4]["endpoint"] == b"\x0a\x04grpc" and specs[0][4]["blocks"] == [0, 1, 2]
    # TP 2 x PP 2: ranks 0 and 1 the first stage, 2 and 3 the second
    reports = torch.tensor(
        [
            [[0, NOT_PUSHED]] * 3,
            [[0, NOT_PUSHED]] * 3,
            [[100, PUSHED], [50, PUSHED], [70, PUSHED]],
            [[100, PUSHED], [50, PUSH_FAILED], [0, NOT_PUSHED]],
        ]
    )
    pub.stage_reports(reports, [0, 0, 1, 1])
    assert ok.error is None and ok.sink.stage_bytes == {1: 200} and ok.sink.bytes_sent == 200
    assert isinstance(bad.error, StagePushError) and "stage 1" in str(bad.error)
    assert isinstance(silent.error, StagePushError)  # a later stage's rank that pushed nothing
    ok.commit([5])
    bad.commit([5])
    assert [(h.kind, h.await_kv) for h in ok_tx.frames] == [("commit", True)]
    assert bad_tx.frames == []  # no commit: the reservation waits for a retry or its lease


def test_a_replica_rank_of_a_later_stage_pushes_nothing_and_fails_nothing():
    """An MLA model under TP x PP: every rank holds the latent, the first of a stage pushes it
    and the other reports REPLICA, which is not a failure (NOT_PUSHED is)."""
    assert report_rows(2, None, replica=True).tolist() == [[0, REPLICA]] * 2
    ok, _ = guarded("ok")
    pub = publisher_of(ok)
    reports = torch.tensor([[[0, NOT_PUSHED]], [[0, NOT_PUSHED]], [[80, PUSHED]], [[0, REPLICA]]])
    pub.stage_reports(reports, [0, 0, 1, 1])
    assert ok.error is None and ok.sink.stage_bytes == {1: 80}


def frames(layers):
    cache, layout = source_cache(3), src_layout()
    return [
        read_chunk(cache[layer], layout, "r", layer, SRC_BLOCK_IDS, 0, NUM_TOKENS)
        for layer in layers
    ]


@pytest.fixture
def receiver():
    layout = dataclasses.replace(src_layout(), block_size=16)
    return KVReceiver("r", torch.zeros(3, 2, 4, 16, 2, 8), layout, [0, 1, 2], 0, NUM_TOKENS)


def test_a_commit_marked_await_kv_is_held_until_every_layer_arrived(receiver):
    (h0, d0), (h1, d1), (h2, d2) = frames([0, 1, 2])
    commit = ChunkHeader("r", h0.fingerprint, kind="commit", first_tokens=(9,), await_kv=True)
    assert receiver.on_frame(h0, d0) == TransferState.TRANSFERRING
    assert receiver.on_frame(commit, None) == TransferState.TRANSFERRING
    assert receiver.on_frame(h2, d2) == TransferState.TRANSFERRING
    assert receiver.on_frame(h1, d1) == TransferState.DONE
    assert receiver.first_tokens == (9,)


def test_an_early_commit_still_fails_unless_marked_and_a_second_one_fails(receiver):
    (h0, d0), (h1, d1), (h2, d2) = frames([0, 1, 2])
    commit = ChunkHeader("r", h0.fingerprint, kind="commit", first_tokens=(9,))
    receiver.on_frame(h0, d0)
    assert receiver.on_frame(commit, None) == TransferState.FAILED
    assert "commit before all KV arrived" in receiver.error
    other = KVReceiver(
        "r", torch.zeros(3, 2, 4, 16, 2, 8), receiver.layout, [0, 1, 2], 0, NUM_TOKENS
    )
    held = dataclasses.replace(commit, await_kv=True)
    assert other.on_frame(held, None) == TransferState.TRANSFERRING
    assert other.on_frame(held, None) == TransferState.FAILED and "second commit" in other.error
