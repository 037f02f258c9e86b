"""A prefill worker and a decode worker as two processes on one GPU: the KV leaves the prefill
engine's CUDA cache, crosses through host memory over the gRPC KV backend and lands in the decode
engine's CUDA cache; the tokens equal one engine's on the same GPU. Skipped without CUDA."""

from __future__ import annotations

import multiprocessing as mp

import grpc
import pytest

from helpers.engine import greedy
from helpers.models import random_prompts
from helpers.worker import MAX_MODEL_LEN, Cluster, start_decode, start_prefill
from pdserve.engine import LLM
from pdserve.protos.pdserve.v1 import worker_pb2_grpc

pytestmark = pytest.mark.gpu

ENGINE = dict(device="cuda", dtype="float32", kv_cache_memory=1 << 24, max_model_len=MAX_MODEL_LEN)
NEW = 8  # helpers.worker.GREEDY's max_tokens


def _decode_process(model_dir: str, conn) -> None:
    """The decode worker's own process: serves until the parent sends anything."""
    worker = start_decode(model_dir, engine=dict(ENGINE, block_size=16), lease_ms=10_000)
    conn.send(worker.address)
    conn.recv()
    worker.stop()


class TwoProcessCluster(Cluster):
    def __init__(self, model_dir):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_process, args=(model_dir, child), daemon=True)
        self.proc.start()
        if not self.conn.poll(300):
            self.proc.kill()
            raise RuntimeError("the decode worker's process did not start in 300 s")
        decode_address = self.conn.recv()
        self.prefill = start_prefill(model_dir, engine=dict(ENGINE, block_size=4))
        self.channels = [grpc.insecure_channel(a) for a in (decode_address, self.prefill.address)]
        self.d = worker_pb2_grpc.DecodeWorkerStub(self.channels[0])
        self.p = worker_pb2_grpc.PrefillWorkerStub(self.channels[1])

    def stop(self):
        for ch in self.channels:
            ch.close()
        self.prefill.stop()
        self.conn.send("stop")
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


def test_handoff_between_two_processes_on_one_gpu(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    prompts = random_prompts([5, 23, 40], seed=3)
    alone = LLM(model_dir, **ENGINE)
    expected = [
        o.outputs[0].token_ids for o in alone.generate(prompts, greedy(NEW), use_tqdm=False)
    ]
    del alone
    cluster = TwoProcessCluster(model_dir)
    try:
        got = [cluster.generate(f"r{i}", p) for i, p in enumerate(prompts)]
    finally:
        cluster.stop()
    assert got == expected
