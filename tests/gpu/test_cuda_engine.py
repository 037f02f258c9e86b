"""The engine on CUDA: tiny random models against HF transformers on the same GPU (float32 token
for token; bfloat16 up to near ties), CUDA-graph decode against eager decode, and the TP code on
CUDA tensors over gloo (NCCL cannot put two ranks on one GPU). Skipped without CUDA; on a GPU
machine: `bash scripts/test.sh -m gpu tests/gpu`."""

from __future__ import annotations

import pytest
import torch

from helpers.engine import greedy
from helpers.gpu import divergence_gap, hf_greedy, hf_on
from helpers.models import random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM

pytestmark = pytest.mark.gpu

KINDS = ["llama-gqa", "llama-mqa-tied", "llama3-rope", "qwen2-bias", "qwen2-yarn"]
NEW = 24
NEAR_TIE = 0.05  # HF's logit gap under which two greedy choices of a bf16 model count as a tie
CUDA = dict(device="cuda", kv_cache_memory=1 << 24, max_model_len=512)


def prompts():
    return random_prompts([3, 17, 40, 64, 1, 100, 9], seed=5)


@pytest.mark.parametrize("kind", KINDS)
def test_float32_matches_hf_on_the_gpu(tiny_models, kind):
    model_dir, hf = tiny_models(kind)
    hf = hf_on(hf, torch.float32)
    llm = LLM(model_dir, dtype="float32", block_size=16, **CUDA)
    assert llm.engine.runner.graphs is not None
    ps = prompts()
    outs = llm.generate(ps, greedy(NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, NEW)[0] for p in ps]
    assert llm.engine.runner.graphs.recorded  # the decodes were replayed from graphs
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-bias"])
def test_bfloat16_matches_hf_up_to_near_ties(tiny_models, kind):
    model_dir, hf = tiny_models(kind)
    hf = hf_on(hf, torch.bfloat16)
    llm = LLM(model_dir, dtype="bfloat16", **CUDA)
    ps = prompts()
    outs = llm.generate(ps, greedy(NEW), use_tqdm=False)
    gaps = [divergence_gap(hf, p, o.outputs[0].token_ids) for p, o in zip(ps, outs)]
    assert all(g is None or g <= NEAR_TIE for g in gaps), gaps
    exact = gaps.count(None)
    assert exact >= len(ps) - 2


def test_graphs_match_eager_decode(tiny_models):
    """Batches that pad to every bucket up to 16, and block tables of several widths: the short
    prompts run alone first, then all of them together."""
    model_dir, _ = tiny_models("llama-gqa")
    ps = random_prompts([5 + 7 * i for i in range(13)], seed=9)
    runs = {}
    for graphs in (True, False):
        llm = LLM(model_dir, dtype="float32", block_size=4, cuda_graphs=graphs, **CUDA)
        runs[graphs] = [
            [o.outputs[0].token_ids for o in llm.generate(batch, greedy(40), use_tqdm=False)]
            for batch in (ps[:3], ps)
        ]
        if graphs:
            recorded = llm.engine.runner.graphs.recorded
            assert len({w for _, w in recorded}) > 1 and len({b for b, _ in recorded}) > 1
    assert runs[True] == runs[False]


def test_tp2_on_one_gpu_over_gloo(tiny_models, monkeypatch):
    """TP=2 over gloo on one GPU (the TP code on CUDA tensors) against HF, token for token."""
    monkeypatch.setenv("PDSERVE_TP_BACKEND", "gloo")
    model_dir, hf = tiny_models("llama-gqa")
    hf = hf_on(hf, torch.float32)
    ps = prompts()[:4]
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=2, **CUDA)
    try:
        outs = llm.generate(ps, greedy(NEW), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    gaps = [divergence_gap(hf, p, o.outputs[0].token_ids) for p, o in zip(ps, outs)]
    assert gaps == [None] * len(ps), gaps


def test_shared_pools_refused_on_cuda(tiny_models, tmp_path):
    model_dir, _ = tiny_models("llama-gqa")
    with pytest.raises(ValueError, match="kv_cache_shared_dir"):
        LLM(model_dir, kv_cache_shared_dir=str(tmp_path), **CUDA)
