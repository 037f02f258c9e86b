"""The Triton paged-decode kernel (engine/kernels/paged_decode_triton.py) under Triton's
interpreter on CPU tensors: against a float64 reference over GQA, MQA and plain heads, head sizes
that are not powers of two, block sizes below and above its tile, sliding windows, soft-caps, one
split and several, and every cache slot it must not read (other sequences' blocks, slots past a
row's length, tokens before its window) holding NaN. Then a tiny model through the engine with
the interpreted kernel routed in, against HF's greedy tokens. Skipped where Triton is not
installed (CI); tests/gpu/test_cuda_paged_decode.py runs the compiled kernel on a GPU."""

from __future__ import annotations

import sys

import pytest
import torch

from helpers.arch import ARCH_SCALE, build_arch_model
from helpers.engine import KV, greedy
from helpers.gpu import hf_greedy
from helpers.models import random_prompts
from helpers.paged import CASES, paged_case, reference
from helpers.triton_interp import interpreted_triton
from pdserve.engine import LLM
from pdserve.engine.kernels import paged_decode_triton as kernel

pytest.importorskip("triton")  # (CI has none)
_JIT = "pdserve.engine.kernels.paged_decode_jit"


@pytest.fixture(autouse=True)
def interpreted(monkeypatch, one_thread):
    """Triton under its interpreter, and the kernel built against that import of it (another
    test of this process may have imported triton without the interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted_triton()
    kernel._kernel.cache_clear()
    sys.modules.pop(_JIT, None)
    yield
    kernel._kernel.cache_clear()


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_reference_and_reads_no_other_slot(case):
    hq, hkv, d, bs, width, lens, window, softcap = CASES[case]
    q, cache, tables, lens_t = paged_case(hq, hkv, d, bs, width, lens)
    if case.endswith("split"):
        assert kernel.num_splits(len(lens), hkv, width * bs) > 1
    got = kernel.paged_decode(q, cache, tables, lens_t, d**-0.5, window, softcap)
    assert got.dtype == q.dtype and not got.isnan().any()
    want = reference(q, cache, tables, lens_t, d**-0.5, window, softcap)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)


def test_bf16_cache_under_float32_queries():
    """(bf16 queries over a bf16 cache take tensor-core dots, which the interpreter computes
    wrongly, numpy having no bf16: tests/gpu/test_cuda_paged_decode.py checks them.)"""
    q, cache, tables, lens = paged_case(4, 2, 16, 16, 8, [7, 90, 128], dtype=torch.bfloat16)
    want = reference(q, cache.float(), tables, lens, 0.25)
    got = kernel.paged_decode(q, cache, tables, lens, 0.25)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)


def test_splits_come_from_shapes_only():
    assert kernel.num_splits(1, 8, 4096) == kernel.MAX_SPLITS
    assert kernel.num_splits(256, 8, 4096) == 1  # the rows fill the GPU by themselves
    assert kernel.num_splits(4, 2, 64) == 1  # too short to share


@pytest.mark.parametrize("kind", ["gemma2", "mistral-sw"])
def test_engine_with_the_interpreted_kernel_matches_hf(tmp_path, monkeypatch, kind):
    """Windows and soft-caps (kinds whose layers run one by one in Python on CPU, so their
    attention is PagedAttention's), prompts longer than the window."""
    hf = build_arch_model(tmp_path, kind, initializer_range=ARCH_SCALE)
    monkeypatch.setenv("PDSERVE_TRITON_DECODE", "interpret")
    calls = []
    real = kernel.paged_decode
    monkeypatch.setattr(kernel, "paged_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = random_prompts([40, 7], seed=11)
    llm = LLM(str(tmp_path), kv_cache_memory=KV, dtype="float32", speculative_config=None)
    try:
        outs = llm.generate(prompts, greedy(12), use_tqdm=False)
    finally:
        llm.shutdown()
    assert calls, "the interpreted kernel never ran"
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12)[0] for p in prompts]
