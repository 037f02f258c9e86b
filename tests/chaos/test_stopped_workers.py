"""Workers stopped with SIGSTOP, the CI-sized twin of the chaos benchmark's part h
(benchmarks/chaos_hangs.py): a stopped process keeps its sockets open and answers nothing.

The router and the surviving workers run in this process; the worker that is stopped runs in a
child process (the same worker code, registered with the router through the Registry, as a
deployment's workers are), so that it can be stopped without stopping the test. A decode worker
stopped mid-stream (1 prefill + 2 decode) and a prefill worker stopped with prefills pending on it
(2 prefill + 1 decode): every stream finishes on the other worker, token-identical to the
engine's own greedy output, with no error; after SIGCONT the stopped worker changes nothing,
frees every block it held and rejoins its pool.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from conftest import random_prompts, wait_until
from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
from pdserve.engine import LLM, SamplingParams
from pdserve.prefill_worker.server import PrefillWorker, PrefillWorkerConfig
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router_helpers import (
    LONG_GREEDY,
    MAX_MODEL_LEN,
    RPC_TIMEOUT,
    fixture_model_dir,  # noqa: F401
    generate_call,
    start_router,
    stop_router,
)

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")

ENGINE = dict(max_model_len=MAX_MODEL_LEN, kv_cache_memory=1 << 20)
DECODE_STEP_S = 0.05  # decode steps slowed so that the streams are mid-way at the stop
BOUND_S = 10.0  # every stream on the stopped worker goes on elsewhere within this
CHILD = f"""
import sys, time
from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
from pdserve.prefill_worker.server import PrefillWorker, PrefillWorkerConfig
role, model, registry, worker_id, block_size, step_s = sys.argv[1:7]
engine = dict(max_model_len={MAX_MODEL_LEN}, kv_cache_memory=1 << 20, block_size=int(block_size))
if role == "decode":
    worker = DecodeWorker(DecodeWorkerConfig(model=model, worker_id=worker_id, lease_ms=5000,
        stop_grace_s=0, engine_kwargs=engine, registry_address=registry)).start()
    step = worker.loop.engine.step
    worker.loop.engine.step = lambda: (time.sleep(float(step_s)), step())[1]
else:
    worker = PrefillWorker(PrefillWorkerConfig(model=model, worker_id=worker_id,
        engine_kwargs=engine, registry_address=registry)).start()
print(worker.address, flush=True)
time.sleep(600)
"""


class ChildWorker:
    """A worker in a child process, registered with the router; stop/cont/kill it by signal."""

    def __init__(self, role: str, model_dir: str, registry: str, worker_id: str):
        block_size = "16" if role == "decode" else "4"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                CHILD,
                role,
                model_dir,
                registry,
                worker_id,
                block_size,
                str(DECODE_STEP_S),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.address = self.proc.stdout.readline().strip()
        assert self.address, f"the {role} worker process did not start"
        self.channel = grpc.insecure_channel(self.address)
        stub = (
            worker_pb2_grpc.DecodeWorkerStub
            if role == "decode"
            else worker_pb2_grpc.PrefillWorkerStub
        )
        self.stub = stub(self.channel)

    def signal(self, sig) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        self.channel.close()
        self.signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(10)


def in_process_decode(model_dir, worker_id, registry):
    worker = DecodeWorker(
        DecodeWorkerConfig(
            model=model_dir,
            worker_id=worker_id,
            lease_ms=5000,
            stop_grace_s=0,
            engine_kwargs=dict(block_size=16, **ENGINE),
            registry_address=registry,
        )
    ).start()
    step = worker.loop.engine.step
    worker.loop.engine.step = lambda: (time.sleep(DECODE_STEP_S), step())[1]
    return worker


def in_process_prefill(model_dir, worker_id, registry):
    return PrefillWorker(
        PrefillWorkerConfig(
            model=model_dir,
            worker_id=worker_id,
            engine_kwargs=dict(block_size=4, **ENGINE),
            registry_address=registry,
        )
    ).start()


def serving(router, role: str, n: int, for_s: float = 1.0) -> bool:
    """`n` workers of `role` joined the pool, and none was marked down for `for_s` (a worker's
    first Stats can fail just after it registers, which would send every stream elsewhere)."""
    end = time.monotonic() + for_s
    while time.monotonic() < end:
        workers = getattr(router.pool, role)
        if len(workers) != n or any(w.down or w.num_failures for w in workers):
            return False
        time.sleep(0.02)
    return True


def stats(stub):
    return stub.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)


def all_free(stub) -> bool:
    s = stats(stub)
    return s.num_free_blocks == s.num_total_blocks and not s.num_running and not s.num_reserved


class Streams:
    """Generate calls on threads: each one's token ids, token arrival times, finish, error."""

    def __init__(self, router, prompts):
        n = len(prompts)
        self.ids, self.times = [[] for _ in range(n)], [[] for _ in range(n)]
        self.last, self.errors = [None] * n, [None] * n
        self.threads = [
            threading.Thread(target=self._run, args=(router, i, p), daemon=True)
            for i, p in enumerate(prompts)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, router, i, prompt):
        try:
            for response in generate_call(router, prompt, LONG_GREEDY):
                self.last[i] = response
                if response.HasField("delta") and response.delta.token_ids:
                    self.ids[i] += response.delta.token_ids
                    self.times[i].append(time.monotonic())
        except grpc.RpcError as e:
            self.errors[i] = e

    def join(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([20, 24, 28, 32, 22, 26], seed=126)


@pytest.fixture(scope="module")
def want(model_dir, prompts):
    llm = LLM(model_dir, **ENGINE)
    outs = llm.generate(prompts, SamplingParams(**sampling_kwargs(LONG_GREEDY)), use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outs]


def next_token_after(times: list[float], t: float) -> float | None:
    return next((x - t for x in times if x > t), None)


def test_a_stopped_decode_worker_s_streams_go_on_on_the_other_one(model_dir, prompts, want):
    router = start_router(model_dir, stats_timeout_s=0.5, heartbeat_ms=300)
    workers, child = [], None
    try:
        workers.append(in_process_prefill(model_dir, "p0", router.address))
        workers.append(in_process_decode(model_dir, "d1", router.address))
        child = ChildWorker("decode", model_dir, router.address, "d0")
        wait_until(lambda: serving(router, "decode", 2), 30, "both decode workers serve")
        streams = Streams(router, prompts)
        wait_until(lambda: all(len(ids) >= 3 for ids in streams.ids), 30, "every stream started")
        assert stats(child.stub).num_running >= 1, [
            (w.worker_id, w.down, w.num_free_blocks, w.num_failures) for w in router.pool.decode
        ]
        child.signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert streams.join(BOUND_S + 30), "streams on the stopped worker never finished"
        assert streams.errors == [None] * len(prompts)
        assert streams.ids == want  # nothing lost, repeated or changed
        waits = [next_token_after(t, stopped) for t in streams.times]
        assert all(w is not None and w < BOUND_S for w in waits), waits
        assert {last.finish.timings.decode_worker for last in streams.last} == {"d1"}
        child.signal(signal.SIGCONT)  # back: it frees what the moved streams held, and rejoins
        wait_until(lambda: all_free(child.stub), 20, "the stopped worker freed its blocks")
        wait_until(lambda: router.pool.num_workers("decode") == 2, 20, "it rejoined")
        assert streams.ids == want  # and sent nothing more into them
    finally:
        if child is not None:
            child.close()
        stop_router(router)
        for w in workers:
            w.stop()


def test_a_stopped_prefill_worker_s_prefills_are_retried_on_the_other_one(model_dir, prompts, want):
    router = start_router(model_dir, stats_timeout_s=0.5, heartbeat_ms=300)
    workers, child = [], None
    try:
        decode = in_process_decode(model_dir, "d0", router.address)
        workers.append(decode)
        workers.append(in_process_prefill(model_dir, "p1", router.address))
        child = ChildWorker("prefill", model_dir, router.address, "p0")
        wait_until(
            lambda: router.pool.num_workers("prefill") == 2, 30, "both prefill workers joined"
        )
        child.signal(signal.SIGSTOP)  # stopped before the requests: about half go to it first
        stopped = time.monotonic()
        streams = Streams(router, prompts)
        assert streams.join(BOUND_S + 30), "a prefill on the stopped worker was never retried"
        assert streams.errors == [None] * len(prompts)
        assert streams.ids == want
        firsts = [t[0] - stopped for t in streams.times]
        assert max(firsts) < BOUND_S, firsts
        assert {last.finish.timings.prefill_worker for last in streams.last} == {"p1"}
        child.signal(signal.SIGCONT)
        wait_until(lambda: all_free(child.stub), 20, "the stopped worker freed its blocks")
        channel = grpc.insecure_channel(decode.address)
        try:
            d_stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            wait_until(lambda: all_free(d_stub), 20, "the decode worker freed every block")
        finally:
            channel.close()
        assert streams.ids == want
    finally:
        if child is not None:
            child.close()
        stop_router(router)
        for w in workers:
            w.stop()
