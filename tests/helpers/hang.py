"""Real workers in this process for the tests of workers that hang or stop (tests/integration/
test_router_hung_workers.py, tests/chaos/test_stopped_workers.py): a decode worker whose steps are
slowed so that streams are mid-way when something happens, a prefill worker, the engine's own
greedy output to compare with, and Generate calls running on threads.

Not a test module: imported as `from helpers.hang import ...` (tests/helpers/ is a package on pytest's sys.path, as
helpers/router.py).
"""

from __future__ import annotations

import threading
import time

import grpc

from helpers.router import LONG_GREEDY, MAX_MODEL_LEN, RPC_TIMEOUT
from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
from pdserve.engine import LLM, SamplingParams
from pdserve.prefill_worker.server import PrefillWorker, PrefillWorkerConfig
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc

ENGINE = dict(max_model_len=MAX_MODEL_LEN, kv_cache_memory=1 << 20)
DECODE_STEP_S = 0.05  # decode steps slowed so that the streams are mid-way when a worker hangs


def with_stub(worker, stub_class):
    worker.channel = grpc.insecure_channel(worker.address)
    worker.stub = stub_class(worker.channel)
    return worker


def start_decode(model_dir, worker_id: str, registry_address: str = "") -> DecodeWorker:
    worker = DecodeWorker(
        DecodeWorkerConfig(
            model=model_dir,
            worker_id=worker_id,
            lease_ms=5000,
            stop_grace_s=0,
            engine_kwargs=dict(block_size=16, **ENGINE),
            registry_address=registry_address,
        )
    ).start()
    step = worker.loop.engine.step
    worker.loop.engine.step = lambda: (time.sleep(DECODE_STEP_S), step())[1]
    return with_stub(worker, worker_pb2_grpc.DecodeWorkerStub)


def start_prefill(model_dir, worker_id: str, registry_address: str = "") -> PrefillWorker:
    worker = PrefillWorker(
        PrefillWorkerConfig(
            model=model_dir,
            worker_id=worker_id,
            engine_kwargs=dict(block_size=4, **ENGINE),
            registry_address=registry_address,
        )
    ).start()
    return with_stub(worker, worker_pb2_grpc.PrefillWorkerStub)


def stop_workers(*workers) -> None:
    for worker in workers:
        worker.channel.close()
        worker.stop()


def blocks_free(worker) -> bool:
    s = worker.stub.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)
    return s.num_free_blocks == s.num_total_blocks and s.num_running == 0 and s.num_reserved == 0


def greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    """The engine's own greedy continuations of `prompts`."""
    llm = LLM(model_dir, **ENGINE)
    outs = llm.generate(prompts, SamplingParams(**sampling_kwargs(LONG_GREEDY)), use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outs]


STREAM_DEADLINE_S = 90.0


class Streams:
    """Generate calls running on threads: each one's token ids, token arrival times
    (time.monotonic()), last response and error."""

    def __init__(self, router, prompts):
        self.ids = [[] for _ in prompts]
        self.times = [[] for _ in prompts]
        self.last = [None] * len(prompts)
        self.errors = [None] * len(prompts)
        self.threads = [
            threading.Thread(target=self._run, args=(router, i, p), daemon=True)
            for i, p in enumerate(prompts)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, router, i, prompt):
        try:
            # the client's deadline is not what these tests judge (they bound each stream's gap
            # after a hang): long enough for a loaded machine's whole stream and its resume
            request = pdserve_pb2.GenerateRequest(
                token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=LONG_GREEDY
            )
            for response in router.api.Generate(request, timeout=STREAM_DEADLINE_S):
                self.last[i] = response
                if response.HasField("delta") and response.delta.token_ids:
                    self.ids[i] += response.delta.token_ids
                    self.times[i].append(time.monotonic())
        except grpc.RpcError as e:
            self.errors[i] = e

    def join(self, timeout: float) -> bool:
        """True when every call ended within `timeout` seconds."""
        end = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)
