"""Hand-off lifecycle between a prefill and a decode engine over a loopback transport.

reserve -> push -> commit; abort at every stage; lease expiry; a prefill that dies mid-transfer;
a bad frame. After each: the decode pool's used blocks are back to zero, and nothing waits
without a deadline (every wait here has a timeout).
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from helpers.models import random_prompts
from pdserve.decode_worker.handoff import DecodeHandoff
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.engine_loop import EngineLoop
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.transport import Destination, Transport
from pdserve.kvtransfer.wire import ChunkHeader
from pdserve.prefill_worker.handoff import PushSink
from pdserve.worker_common.early_aborts import AbortedEarly

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


class LoopbackTransport(Transport):
    """Frames delivered in order on their own thread, like a real channel. `hold` pauses delivery;
    `die_after` drops everything after N frames (a prefill worker that died mid-transfer)."""

    def __init__(self, handler, die_after: int | None = None):
        self.handler, self.die_after, self.sent = handler, die_after, 0
        self.hold = threading.Event()
        self.hold.set()
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while (item := self.q.get()) is not None:
            self.hold.wait(10)
            self.handler(*item)
            self.q.task_done()
        self.q.task_done()

    def send(self, header, data, dest):
        self.sent += 1
        if self.die_after is None or self.sent <= self.die_after:
            self.q.put((header, data))

    def flush(self, timeout):
        deadline = time.monotonic() + timeout
        while self.q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.q.unfinished_tasks:
            raise TimeoutError("loopback frames not delivered")

    def close(self):
        self.q.put(None)
        self.thread.join(5)


class Collector:
    def __init__(self):
        self.outputs, self.done = [], threading.Event()

    def __call__(self, out):
        self.outputs.append(out)
        if out.finished:
            self.done.set()

    def final(self, timeout=20):
        assert self.done.wait(timeout), "request never finished"
        return self.outputs[-1].outputs[0]


@pytest.fixture
def pair(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    prefill = EngineLoop(LLM(model_dir, kv_cache_memory=1 << 22, block_size=4).engine).start()
    decode = EngineLoop(LLM(model_dir, kv_cache_memory=1 << 22, block_size=16).engine).start()
    mc = decode.engine.model_config
    layouts = {
        bs: KVLayout("tiny", "float32", mc.num_layers, mc.num_kv_heads, mc.head_dim, bs)
        for bs in (4, 16)
    }
    handoff = DecodeHandoff(decode, layouts[16], lease_s=5.0, sweep_s=0.05)
    yield prefill, decode, handoff, layouts
    for loop in (prefill, decode):
        used = loop.call(lambda: loop.engine.block_manager.num_used_blocks)
        loop.stop()
        assert used == 0, f"{used} KV blocks still held"


def start_prefill(prefill, handoff, layouts, rid, prompt, reserved, transport):
    sink = PushSink(
        rid,
        layouts[4],
        transport,
        Destination(reserved.block_ids, layouts[16]),
        reserved.num_cached_tokens,
    )

    def on_output(out):
        if out.finished and out.outputs[0].finish_reason == "prefill_done":
            sink.commit(out.outputs[0].token_ids[:1])

    prefill.add_request(rid, prompt, PARAMS, on_output, prefill_only=True, kv_sink=sink)
    return sink


def test_reserve_push_commit_matches_engine_alone(pair, tiny_models):
    prefill, decode, handoff, layouts = pair
    prompts = random_prompts([30, 7, 61], seed=11)
    expected = LLM(tiny_models("llama-gqa")[0], kv_cache_memory=1 << 22).generate(
        prompts, PARAMS, use_tqdm=False
    )
    transport = LoopbackTransport(handoff.on_frame)
    collectors = []
    for i, prompt in enumerate(prompts):
        c = Collector()
        reserved = handoff.reserve(f"r{i}", prompt, PARAMS, c)
        start_prefill(prefill, handoff, layouts, f"r{i}", prompt, reserved, transport)
        collectors.append(c)
    for c, want in zip(collectors, expected):
        assert c.final().token_ids == want.outputs[0].token_ids
    transport.close()
    assert handoff.num_reserved == 0


def test_abort_at_every_stage(pair):
    prefill, decode, handoff, layouts = pair
    prompt = random_prompts([40], seed=3)[0]
    # 1. reserved, nothing sent yet
    c = Collector()
    handoff.reserve("a1", prompt, PARAMS, c)
    assert handoff.abort("a1") and c.final().finish_reason == "abort"
    # 2. mid-transfer: frames held in the channel, then released after the abort
    c = Collector()
    transport = LoopbackTransport(handoff.on_frame)
    transport.hold.clear()
    reserved = handoff.reserve("a2", prompt, PARAMS, c)
    start_prefill(prefill, handoff, layouts, "a2", prompt, reserved, transport)
    deadline = time.monotonic() + 10
    while transport.sent == 0 and time.monotonic() < deadline:  # KV is on its way, held
        time.sleep(0.005)
    assert transport.sent > 0
    assert handoff.abort("a2") and c.final().finish_reason == "abort"
    transport.hold.set()
    transport.flush(10)  # late frames for a freed reservation are dropped, not written
    assert handoff.num_unknown_frames > 0
    # 3. committed and decoding
    c = Collector()
    transport2 = LoopbackTransport(handoff.on_frame)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    reserved = handoff.reserve("a3", prompt, params, c)
    sink = PushSink("a3", layouts[4], transport2, Destination(reserved.block_ids, layouts[16]), 0)
    prefill.add_request(
        "a3",
        prompt,
        params,
        lambda o: o.finished and sink.commit(o.outputs[0].token_ids[:1]),
        prefill_only=True,
        kv_sink=sink,
    )
    deadline = time.monotonic() + 10
    while not c.outputs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.outputs, "decode never started"
    assert handoff.abort("a3")
    assert c.final().finish_reason == "abort"
    # 4. already finished: nothing to abort
    assert not handoff.abort("a3")
    for t in (transport, transport2):
        t.close()


def test_an_abort_that_overtakes_its_reserve_refuses_the_reserve(pair):
    # the router gives up on a Reserve under way (a role flip moves the call, the worker does not
    # answer in time) and sends Abort: if the Abort lands first, the Reserve must not then hold
    # blocks for a lease of the client's whole deadline that nobody fills
    prefill, decode, handoff, layouts = pair
    prompt = random_prompts([40], seed=5)[0]
    assert not handoff.abort("early")  # nothing here yet: remembered
    with pytest.raises(AbortedEarly, match="aborted before"):
        handoff.reserve("early", prompt, PARAMS, Collector())
    assert handoff.num_reserved == 0
    c = Collector()  # refused once: the id is forgotten, so a later Reserve of it is served
    handoff.reserve("early", prompt, PARAMS, c)
    assert handoff.abort("early") and c.final().finish_reason == "abort"
    # bounded: the oldest ids go first past its cap, and every id after its TTL
    handoff.aborted_early.cap = 3
    for rid in ("e1", "e2", "e3", "e4"):
        assert not handoff.abort(rid)
    decode.call(handoff.refuse_if_aborted, "e1")  # dropped: nothing raised
    with pytest.raises(AbortedEarly):
        decode.call(handoff.refuse_if_aborted, "e2")
    handoff.aborted_early.ttl_s = 0.0
    deadline = time.monotonic() + 5
    while decode.call(lambda: len(handoff.aborted_early)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert decode.call(lambda: len(handoff.aborted_early)) == 0


def test_lease_expiry_frees_a_reservation_whose_prefill_died(pair):
    prefill, decode, handoff, layouts = pair
    handoff.lease_s = 0.3
    prompt = random_prompts([50], seed=4)[0]
    c = Collector()
    transport = LoopbackTransport(handoff.on_frame, die_after=1)  # one layer, then silence
    reserved = handoff.reserve("d1", prompt, PARAMS, c)
    start_prefill(prefill, handoff, layouts, "d1", prompt, reserved, transport)
    out = c.final(timeout=5)
    assert out.finish_reason == "abort" and "lease expired" in out.stop_reason
    assert handoff.num_expired == 1
    transport.close()


def test_bad_frame_fails_only_its_request(pair):
    prefill, decode, handoff, layouts = pair
    prompts = random_prompts([20, 20], seed=8)
    bad, good = Collector(), Collector()
    handoff.reserve("bad", prompts[0], PARAMS, bad)
    # a KV chunk (layer 0, token 0, heads 0 and 1) that names another model's fingerprint
    other_model = ChunkHeader(
        "bad", "not-this-model", end=1, head_end=2, head_dim=16, dtype="float32"
    )
    handoff.on_frame(other_model, b"\0" * 256)
    out = bad.final(timeout=5)
    assert out.finish_reason == "abort" and "same model" in out.stop_reason
    transport = LoopbackTransport(handoff.on_frame)
    reserved = handoff.reserve("good", prompts[1], PARAMS, good)
    start_prefill(prefill, handoff, layouts, "good", prompts[1], reserved, transport)
    assert good.final().finish_reason == "length"
    transport.close()


def test_commit_before_all_kv_arrived_is_refused(pair):
    prefill, decode, handoff, layouts = pair
    prompt = random_prompts([24], seed=9)[0]
    c = Collector()
    handoff.reserve("early", prompt, PARAMS, c)
    handoff.on_frame(
        ChunkHeader("early", layouts[16].fingerprint, kind="commit", first_tokens=(5,)), None
    )
    out = c.final(timeout=5)
    assert out.finish_reason == "abort" and "before all KV arrived" in out.stop_reason


class RecordingTransport(Transport):
    def __init__(self):
        self.frames = []

    def send(self, header, data, dest):
        self.frames.append((header.kind, header.layer))

    def flush(self, timeout):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("overlap", [True, False])
def test_push_sink_sends_each_layer_as_it_ends_or_after_the_last(overlap):
    layout = KVLayout("tiny", "float32", num_layers=3, num_kv_heads=2, head_dim=4, block_size=4)
    kv = torch.zeros(2, 4, 4, 2, 4)  # [k/v, blocks, block_size, heads, head_dim]
    transport = RecordingTransport()
    sink = PushSink("r", layout, transport, Destination([0, 1], layout), 0, overlap=overlap)
    sent_after_each = []
    for layer in range(3):
        sink.on_layer(layer, kv, [0, 1], 0, 6)
        sent_after_each.append(len(transport.frames))
    assert sent_after_each == ([1, 2, 3] if overlap else [0, 0, 3])
    assert transport.frames == [("kv", 0), ("kv", 1), ("kv", 2)]


def test_push_sink_defers_when_the_compute_takes_every_core(monkeypatch):
    from pdserve.prefill_worker import handoff as prefill_handoff

    cores = 4
    monkeypatch.setattr(prefill_handoff.os, "sched_getaffinity", lambda pid: set(range(cores)))
    for threads, overlap in ((cores, False), (cores - 1, True)):
        monkeypatch.setattr(prefill_handoff.torch, "get_num_threads", lambda: threads)
        layout = KVLayout("tiny", "float32", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
        sink = PushSink("r", layout, RecordingTransport(), Destination([0], layout), 0)
        sink.on_layer(0, torch.zeros(2, 1, 4, 2, 4), [0], 0, 4)
        assert sink.overlap is overlap


def test_the_prefill_start_is_the_engine_steps_where_it_says_so():
    """A prefill's compute start (Timings.prefill_start_unix_ns) is the first step's start as
    the engine reports it (on_step_start); only a sink that never heard it estimates it from
    its layers' ends, which comes out late where the first KV layer is not the first layer (a
    hybrid's) or is published a layer late (tensor parallelism)."""
    from pdserve.prefill_worker.handoff import GuardedSink, HandoffTimings

    timings = HandoffTimings(arrival_unix_ns=100, num_layers=2)
    sink = GuardedSink(object(), timings)
    sink.on_step_start()
    stamp = timings.step_start_unix_ns
    sink.on_step_start()  # (a later chunk's step: the first one's stays)
    timings.first_layer_unix_ns, timings.first_step_end_unix_ns = 10_000, 10_100
    assert timings.step_start_unix_ns == stamp > 0
    assert timings.to_proto().prefill_start_unix_ns == stamp
    timings.step_start_unix_ns = 0  # (the estimate: the first layer's end less one layer)
    assert timings.to_proto().prefill_start_unix_ns == 9_900
