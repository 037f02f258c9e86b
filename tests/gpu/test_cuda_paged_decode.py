"""The Triton paged-decode kernel compiled for the GPU: the interpreter's cases
(tests/helpers/paged.py) on CUDA tensors against the float64 reference, bf16 caches, a launch
recorded in a CUDA graph and replayed with other lengths, and the engine taking it on CUDA
(no launch failed, so no fallback) with tokens equal to the gather path's."""

from __future__ import annotations

import pytest
import torch

from helpers.engine import greedy
from helpers.models import random_prompts
from helpers.paged import CASES, paged_case, reference
from pdserve.engine import LLM
from pdserve.engine.kernels import paged_decode_triton as kernel

pytestmark = pytest.mark.gpu


def on_cuda(*tensors):
    return [t.cuda() for t in tensors]


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_kernel_matches_the_reference(case):
    hq, hkv, d, bs, width, lens, window, softcap = CASES[case]
    q, cache, tables, lens_t = paged_case(hq, hkv, d, bs, width, lens)
    want = reference(q, cache, tables, lens_t, d**-0.5, window, softcap)
    got = kernel.paged_decode(*on_cuda(q, cache, tables, lens_t), d**-0.5, window, softcap)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qtype", [torch.float32, torch.bfloat16])
def test_bf16_cache(qtype):
    q, cache, tables, lens = paged_case(8, 2, 128, 16, 64, [5, 700, 1024], dtype=torch.bfloat16)
    want = reference(q, cache.float(), tables, lens, 128**-0.5)
    got = kernel.paged_decode(*on_cuda(q.to(qtype), cache, tables, lens), 128**-0.5)
    tol = 1e-5 if qtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)


def test_a_recorded_launch_replays_with_other_lengths():
    q, cache, tables, lens = on_cuda(*paged_case(4, 2, 64, 16, 32, [10, 300, 512]))
    kernel.paged_decode(q, cache, tables, lens, 0.125)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel.paged_decode(q, cache, tables, lens, 0.125)
    lens.copy_(torch.tensor([3, 250, 100]))  # (each row's own tokens only)
    graph.replay()
    torch.cuda.synchronize()
    want = reference(q.cpu(), cache.cpu(), tables.cpu(), lens.cpu(), 0.125)
    torch.testing.assert_close(out.double().cpu(), want, atol=1e-5, rtol=1e-5)


def test_engine_takes_the_kernel_on_cuda_with_the_gather_paths_tokens(tiny_models, monkeypatch):
    model_dir, _ = tiny_models("llama-gqa")
    prompts = random_prompts([3, 40, 100, 17], seed=6)
    engine = dict(device="cuda", dtype="float32", kv_cache_memory=1 << 24, max_model_len=512)
    runs, calls = {}, []
    real = kernel.paged_decode
    monkeypatch.setattr(kernel, "paged_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    for how in ("", "off"):
        monkeypatch.setenv("PDSERVE_TRITON_DECODE", how)
        llm = LLM(model_dir, speculative_config=None, **engine)
        try:
            outs = llm.generate(prompts, greedy(32), use_tqdm=False)
        finally:
            llm.shutdown()
        runs[how] = [o.outputs[0].token_ids for o in outs]
    assert calls and not kernel._off, kernel._off
    assert runs[""] == runs["off"]
