"""A pipelined prefill worker's stage failing mid-push, and a cancel mid-push (issue #53,
must-show b): each stage pushes its own layers (engine/kv_publish.py), so a later stage's rank
can die while its frames are on their way. Then the Prefill call fails UNAVAILABLE without an
abort frame, the decode side keeps the reservation only until the router's retry fills it (a
prefill on another worker covers every layer again) or its lease runs out, and it holds nothing
afterwards; through a router, the client gets the same tokens from the other prefill worker. A
cancel (Abort) mid-push frees the request on both sides, and the worker serves the next request
as before.

The hook: the decode worker runs in this process, so the test wraps WorkerReceiver.on_frame and
acts when the first frame of a later stage's layer arrives: that stage is then surely still in
its step (it flushes its frames, and the flush waits for this very frame)."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from helpers.models import make_tiny_model, random_prompts
from helpers.router import generate_call, start_router, stop_router
from helpers.threads import wait_until
from helpers.worker import GREEDY, Cluster, start_decode, start_prefill
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.parallel import stage_layers
from pdserve.kvtransfer.receiver import WorkerReceiver
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_MODEL_LEN = 64  # the test router's (helpers/router.py)
LAYERS = 5
STAGE1_FIRST = stage_layers(LAYERS, 1, 2)[0]  # the first layer the second of 2 stages runs


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny5-stage-fail"))
    make_tiny_model(path, "llama-gqa", seed=5, num_hidden_layers=LAYERS)
    prompts = random_prompts([45, 30], seed=37)
    llm = LLM(path, kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
    outs = llm.generate(prompts, SamplingParams(**sampling_kwargs(GREEDY)), use_tqdm=False)
    llm.shutdown()
    return path, prompts, [o.outputs[0].token_ids for o in outs]


class TwoPrefills(Cluster):
    """A decode worker, a prefill worker of 2 stages (prompts in chunks of `chunk` tokens), and
    a prefill worker of one stage for the retry."""

    def __init__(self, model_dir, lease_ms: int, chunk: int | None = None):
        engine = dict(kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
        staged = dict(pipeline_parallel_size=2)
        if chunk is not None:
            staged.update(max_num_batched_tokens=chunk, max_num_seqs=4)
        self.workers = [start_decode(model_dir, engine=engine, lease_ms=lease_ms)]
        try:
            self.workers.append(start_prefill(model_dir, "p-staged", engine=staged))
            self.workers.append(start_prefill(model_dir, "p-plain"))
        except BaseException:
            for w in self.workers:
                w.stop()
            raise
        self.decode, self.prefill, self.plain = self.workers
        self.channels = [grpc.insecure_channel(w.address) for w in self.workers]
        self.d = worker_pb2_grpc.DecodeWorkerStub(self.channels[0])
        self.p = worker_pb2_grpc.PrefillWorkerStub(self.channels[1])
        self.p_plain = worker_pb2_grpc.PrefillWorkerStub(self.channels[2])

    def stop(self):
        for c in self.channels:
            c.close()
        for w in self.workers:
            w.stop()

    def idle(self) -> bool:
        s = self.stats()
        return s.num_free_blocks == s.num_total_blocks and s.num_reserved == 0


def on_first_stage1_frame(monkeypatch, action):
    """Runs `action()` once, on the decode side's transport thread, when the first KV frame of
    a layer of the second stage arrives (before that frame is written)."""
    original, fired = WorkerReceiver.on_frame, threading.Event()

    def hooked(self, header, payload):
        if header.kind == "kv" and header.layer >= STAGE1_FIRST and not fired.is_set():
            fired.set()
            action()
        return original(self, header, payload)

    monkeypatch.setattr(WorkerReceiver, "on_frame", hooked)
    return fired


def kill_stage1(cluster):
    (proc,) = cluster.prefill.loop.engine.tp.procs  # rank 1: the second stage
    return lambda: os.kill(proc.pid, signal.SIGKILL)


def test_a_stage_killed_mid_push_is_served_again_on_retry(five_layers, monkeypatch):
    path, prompts, want = five_layers
    cluster = TwoPrefills(path, lease_ms=60_000)
    try:
        fired = on_first_stage1_frame(monkeypatch, kill_stage1(cluster))
        reservation = cluster.reserve("r0", prompts[0])
        with pytest.raises(grpc.RpcError) as e:
            cluster.prefill_req("r0", prompts[0], reservation)
        assert fired.is_set()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        # no abort frame: the reservation waits for the router's retry on another worker
        assert cluster.stats().num_reserved == 1
        first = cluster.p_plain.Prefill(
            worker_pb2.PrefillRequest(
                request_id="r0",
                prompt_token_ids=prompts[0],
                sampling=GREEDY,
                reservation=reservation,
            ),
            timeout=60,
        )
        tokens = [t for ev in cluster.stream("r0") for t in ev.token_ids]
        assert tokens[0] == first.first_tokens[0]
        assert tokens == want[0]
        wait_until(cluster.idle, 10, f"decode pool not back to idle: {cluster.stats()}")
    finally:
        cluster.stop()


def test_a_stage_killed_mid_push_leaves_nothing_reserved_after_the_lease(five_layers, monkeypatch):
    path, prompts, _ = five_layers
    cluster = TwoPrefills(path, lease_ms=1500)
    try:
        fired = on_first_stage1_frame(monkeypatch, kill_stage1(cluster))
        reservation = cluster.reserve("r1", prompts[0])
        with pytest.raises(grpc.RpcError) as e:
            cluster.prefill_req("r1", prompts[0], reservation)
        assert fired.is_set() and e.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_until(cluster.idle, 30, f"decode pool not back to idle: {cluster.stats()}")
        assert cluster.stats().leases_expired == 1
    finally:
        cluster.stop()


def test_a_cancel_mid_push_leaks_nothing_on_either_side(five_layers, monkeypatch):
    path, prompts, want = five_layers
    # 45 tokens in 6 steps: rank 0 runs at most one step ahead of the held stage (it does not
    # wait for its push reports, engine/tp.py), so the Abort reaches the engine loop before the
    # step that samples
    cluster = TwoPrefills(path, lease_ms=60_000, chunk=8)
    try:
        aborts = []

        def cancel():  # from another thread: this one holds the stage's flush meanwhile
            call = threading.Thread(
                target=lambda: aborts.append(
                    cluster.p.Abort(worker_pb2.WorkerAbortRequest(request_id="c0"), timeout=30)
                )
            )
            call.start()
            time.sleep(1.0)  # the Abort reaches the engine loop before the step ends

        fired = on_first_stage1_frame(monkeypatch, cancel)
        reservation = cluster.reserve("c0", prompts[0])
        with pytest.raises(grpc.RpcError) as e:
            cluster.prefill_req("c0", prompts[0], reservation)
        assert fired.is_set() and e.value.code() == grpc.StatusCode.ABORTED, e.value.details()
        wait_until(lambda: aborts, 30, "the Abort call did not return")
        assert aborts[0].found
        wait_until(cluster.idle, 10, f"decode pool not back to idle: {cluster.stats()}")
        p = cluster.p.Stats(worker_pb2.StatsRequest(), timeout=30)
        assert p.num_free_blocks == p.num_total_blocks and p.num_running == 0
        # the staged worker serves the next request as before
        assert cluster.generate("c1", prompts[1]) == want[1]
        wait_until(cluster.idle, 10, f"decode pool not back to idle: {cluster.stats()}")
    finally:
        cluster.stop()


def test_through_the_router_a_stage_killed_mid_push_is_retried_elsewhere(five_layers, monkeypatch):
    path, prompts, want = five_layers
    cluster = TwoPrefills(path, lease_ms=60_000)
    router = start_router(
        path, [cluster.prefill.address, cluster.plain.address], [cluster.decode.address]
    )
    try:
        fired = on_first_stage1_frame(monkeypatch, kill_stage1(cluster))
        for prompt, tokens in zip(prompts, want):  # round-robin: one of them goes to p-staged
            got, served_by = [], None
            for r in generate_call(router, prompt, GREEDY):
                if r.HasField("delta"):
                    got += r.delta.token_ids
                else:
                    served_by = r.finish.timings.prefill_worker
            assert got == tokens and served_by == "p-plain"
        assert fired.is_set() and "a rank of its engine died" in cluster.prefill.loop.broken
        wait_until(cluster.idle, 10, f"decode pool not back to idle: {cluster.stats()}")
    finally:
        stop_router(router)
        cluster.stop()
