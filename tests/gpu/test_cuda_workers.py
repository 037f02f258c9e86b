"""A prefill worker and a decode worker as two processes on one GPU: the KV leaves the prefill
engine's CUDA cache, crosses through host memory over the gRPC KV backend and lands in the decode
engine's CUDA cache; the tokens equal one engine's on the same GPU. Skipped without CUDA."""

from __future__ import annotations

import pytest

from helpers.gpu import TwoProcessCluster, engine_tokens
from helpers.models import random_prompts

pytestmark = pytest.mark.gpu

NEW = 8  # helpers.worker.GREEDY's max_tokens


def test_handoff_between_two_processes_on_one_gpu(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    prompts = random_prompts([5, 23, 40], seed=3)
    expected = engine_tokens(model_dir, prompts, NEW)
    cluster = TwoProcessCluster(model_dir)
    try:
        got = [cluster.generate(f"r{i}", p) for i, p in enumerate(prompts)]
    finally:
        cluster.stop()
    assert got == expected
