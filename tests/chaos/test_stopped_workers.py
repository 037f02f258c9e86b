"""Workers stopped with SIGSTOP, the CI-sized twin of the chaos benchmark's part h
(benchmarks/robustness/chaos_hangs.py): a stopped process keeps its sockets open and answers nothing.

The router and the surviving workers run in this process; the worker that is stopped runs in a
child process (the same worker code, registered with the router through the Registry, as a
deployment's workers are), so that it can be stopped without stopping the test. A decode worker
stopped mid-stream (1 prefill + 2 decode) and a prefill worker stopped with prefills pending on it
(2 prefill + 1 decode): every stream finishes on the other worker, token-identical to the
engine's own greedy output, with no error; after SIGCONT the stopped worker changes nothing,
frees every block it held and rejoins its pool.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from helpers.hang import DECODE_STEP_S, Streams, greedy, start_decode, start_prefill, stop_workers
from helpers.models import random_prompts
from helpers.router import MAX_MODEL_LEN, RPC_TIMEOUT, start_router, stop_router
from helpers.threads import wait_until
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")

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


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([20, 24, 28, 32, 22, 26], seed=126)


@pytest.fixture(scope="module")
def want(model_dir, prompts):
    return greedy(model_dir, prompts)


def next_token_after(times: list[float], t: float) -> float | None:
    return next((x - t for x in times if x > t), None)


@contextlib.contextmanager
def cluster(model_dir, stopped_role: str):
    """(router, the child worker to stop, the in-process worker of its role, the other role's):
    the child is worker 0 of its role, joined as a deployment's workers join; all torn down after."""
    router = start_router(model_dir, heartbeat_ms=300)  # the default health bounds
    workers, child = [], None
    try:
        if stopped_role == "decode":
            workers += [start_decode(model_dir, "d1", router.address)]
            workers += [start_prefill(model_dir, "p0", router.address)]
            child = ChildWorker("decode", model_dir, router.address, "d0")
        else:
            workers += [start_prefill(model_dir, "p1", router.address)]
            workers += [start_decode(model_dir, "d0", router.address)]
            child = ChildWorker("prefill", model_dir, router.address, "p0")
        wait_until(lambda: serving(router, stopped_role, 2), 30, f"both {stopped_role}s serve")
        yield router, child, workers[0], workers[1]
    finally:
        if child is not None:
            child.close()
        stop_router(router)
        stop_workers(*workers)


def test_a_stopped_decode_worker_s_streams_go_on_on_the_other_one(model_dir, prompts, want):
    with cluster(model_dir, "decode") as (router, child, survivor, _):
        streams = Streams(router, prompts)
        wait_until(lambda: all(len(ids) >= 3 for ids in streams.ids), 30, "every stream started")
        assert stats(child.stub).num_running >= 1, "no stream on the worker to stop"
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
        assert all_free(survivor.stub)
        assert streams.ids == want  # and sent nothing more into them


def test_a_stopped_prefill_worker_s_prefills_are_retried_on_the_other_one(model_dir, prompts, want):
    with cluster(model_dir, "prefill") as (router, child, _, decode):
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
        wait_until(lambda: all_free(decode.stub), 20, "the decode worker freed every block")
        assert streams.ids == want
