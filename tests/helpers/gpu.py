"""What the tests under tests/gpu share: the device they run on, HF's own greedy decoding on that
device with its logits, and the comparison that tells a real divergence from a near tie.

DEVICE is "cuda" unless PDSERVE_GPU_TEST_DEVICE says otherwise: with `cpu` the gpu tests run
here as a dry run of their own logic (`PDSERVE_GPU_TEST_DEVICE=cpu bash scripts/test.sh -m gpu
tests/gpu/<file>`), the assertions about CUDA graphs skipped; without CUDA and without the
variable they are skipped (tests/conftest.py). Not a test module: `from helpers.gpu import ...`.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os

import grpc
import torch

from helpers.worker import MAX_MODEL_LEN, Cluster, start_decode, start_prefill
from pdserve.protos.pdserve.v1 import worker_pb2_grpc

DEVICE = os.environ.get("PDSERVE_GPU_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"
# a worker's engine on the GPU (float32: its tokens compare with one engine's exactly)
WORKER_ENGINE = dict(
    device="cuda", dtype="float32", kv_cache_memory=1 << 24, max_model_len=MAX_MODEL_LEN
)


def hf_on(hf, dtype: torch.dtype = torch.float32):
    """A copy of a session's HF model on DEVICE in `dtype`. A copy: `.to()` converts in place,
    and a model once rounded to bf16 and back is no longer the checkpoint the engine loads."""
    return copy.deepcopy(hf).to(device=DEVICE, dtype=dtype).eval()


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy continuation of `prompt` on its device (its own KV cache) and its logits at
    each step."""
    dev = next(hf.parameters()).device
    ids, past, out, logits = torch.tensor([prompt], device=dev), None, [], []
    with torch.inference_mode():
        for _ in range(n):
            step = hf(ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
            past = step.past_key_values
            logits.append(step.logits[0, -1].float())
            out.append(int(logits[-1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]], device=dev)], dim=1)
    return out, logits


def divergence_gap(hf, prompt: list[int], mine: list[int]) -> float | None:
    """None where `mine` is HF's greedy continuation, else HF's logit gap between its choice
    and ours at the first token where they part (0 where ours is HF's equal first)."""
    ref, logits = hf_greedy(hf, prompt, len(mine))
    if mine == ref:
        return None
    d = next(i for i, (a, b) in enumerate(zip(mine, ref)) if a != b)
    return abs(float(logits[d][ref[d]] - logits[d][mine[d]]))


def assert_greedy_matches(hf, prompts, outs, tie: float) -> int:
    """Every output is HF's greedy continuation, or parts from it only where HF's own logits put
    the two tokens within `tie` of each other. Returns how many matched exactly."""
    gaps = [divergence_gap(hf, p, o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    assert all(g is None or g <= tie for g in gaps), gaps
    return gaps.count(None)


def _decode_process(model_dir: str, config: dict, conn) -> None:
    """The decode worker's own process: serves until the parent sends anything."""
    worker = start_decode(
        model_dir, engine=dict(WORKER_ENGINE, block_size=16), lease_ms=10_000, **config
    )
    conn.send(worker.address)
    conn.recv()
    worker.stop()


class TwoProcessCluster(Cluster):
    """A decode worker in a process of its own and a prefill worker in this one, both on the
    GPU; `decode_config`: more DecodeWorkerConfig fields (kv_backend, say)."""

    def __init__(self, model_dir, **decode_config):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_decode_process, args=(model_dir, decode_config, child), daemon=True
        )
        self.proc.start()
        if not self.conn.poll(300):
            self.proc.kill()
            raise RuntimeError("the decode worker's process did not start in 300 s")
        decode_address = self.conn.recv()
        self.prefill = start_prefill(model_dir, engine=dict(WORKER_ENGINE, block_size=4))
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


def engine_tokens(model_dir, prompts, new: int) -> list[list[int]]:
    """One engine's greedy tokens for `prompts` on the GPU: what a cluster must give."""
    from helpers.engine import greedy
    from pdserve.engine import LLM

    llm = LLM(model_dir, **WORKER_ENGINE)
    params = greedy(new)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
