"""The Triton fused kernels (engine/kernels/fused_triton.py) under Triton's interpreter on CPU,
against the torch ops the layers run otherwise, and a tiny llama through LLM(...) with them
forced on against HF greedy. The interpreter computes in numpy, so float32 is exact wherever
the op order is the torch path's (the residual sum, the rotary embedding, the norm of rows whose
squares sum exactly); the norm of random rows differs only by the order of its sum of squares
and silu by the last bit of exp, which the bounds below hold. bf16 is compared loosely: the
interpreter rounds to bf16 differently from a GPU. The GPU side is tests/gpu/test_cuda_fused.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from helpers.triton_interp import interpreted_triton
from pdserve.engine.kernels import fused_triton as ft
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding

EPS = 1e-6


@pytest.fixture
def interpreted(monkeypatch):
    """The kernels rebuilt under TRITON_INTERPRET=1 and forced onto CPU tensors; both undone
    after the test, so no other test sees them."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("PDSERVE_FUSED_TRITON", raising=False)
    interpreted_triton()
    ft.reset()
    monkeypatch.setattr(ft, "FORCE", True)
    yield ft
    ft.reset()


def torch_norm(x, residual, weight):
    """The norm layer's torch path (RMSNorm._torch_forward)."""
    norm = RMSNorm(x.shape[-1], EPS)
    norm.weight.data = weight
    return norm._torch_forward(x, residual)


def test_cpu_tensors_never_route_without_force():
    ft.reset()
    assert ft.for_tensor(torch.zeros(2, 4)) is None


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_float32_exact_where_the_sum_is(interpreted, with_residual):
    # small integers: every square and partial sum is exact, so any summation order agrees
    x = torch.randint(-8, 9, (5, 96)).float()
    residual = torch.randint(-8, 9, (5, 96)).float() if with_residual else None
    weight = torch.randn(96)
    want = torch_norm(x, residual, weight)
    got = ft.for_tensor(x).add_rms_norm(x, residual, weight, EPS, lambda: want)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_add_rms_norm_float32_random_rows(interpreted):
    x, residual, weight = torch.randn(7, 200), torch.randn(7, 200), torch.randn(200)
    want = torch_norm(x, residual, weight)
    got = ft.for_tensor(x).add_rms_norm(x, residual, weight, EPS, lambda: want)
    assert torch.equal(got[1], want[1])  # the residual sum: one rounding either way
    # only the order of 200 float32 additions differs: a relative error of the mean square
    # below 200 * 2**-24, half that through the square root, a few ulps of each output
    torch.testing.assert_close(got[0], want[0], rtol=4e-6, atol=1e-6)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_bf16(interpreted, weight_dtype):
    x = torch.randn(4, 128).bfloat16()
    residual = torch.randn(4, 128).bfloat16()
    weight = torch.randn(128).to(weight_dtype)
    want = torch_norm(x, residual, weight)
    got = ft.for_tensor(x).add_rms_norm(x, residual, weight, EPS, lambda: want)
    assert got[0].dtype == want[0].dtype  # a float32 weight promotes the output, as in torch
    # the interpreter truncates to bf16 where torch rounds: the sum within one bf16 step
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)


def rope_case(head_dim: int, rot: int, dtype):
    torch.manual_seed(3)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
    rotary = RotaryEmbedding(inv_freq, 1.0, 64)
    tokens, nq, nk = 6, 4, 2
    qkv = torch.randn(tokens, (nq + 2 * nk) * head_dim).to(dtype)
    q = qkv[:, : nq * head_dim].view(tokens, nq, head_dim)  # strided views, as the layer has
    k = qkv[:, nq * head_dim : (nq + nk) * head_dim].view(tokens, nk, head_dim)
    positions = torch.tensor([0, 5, 9, 17, 40, 63])
    return rotary, positions, q, k


@pytest.mark.parametrize("head_dim,rot", [(16, 16), (24, 16)])  # full and partial rotary
def test_rope_float32_exact_in_place(interpreted, head_dim, rot):
    rotary, positions, q, k = rope_case(head_dim, rot, torch.float32)
    want_q, want_k = rotary._rotated_copies(positions, q, k)
    got = ft.for_tensor(q).rope_(q, k, positions, rotary.cos, rotary.sin, lambda: (want_q, want_k))
    assert got is not None and got[0] is q and got[1] is k
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_rope_bf16(interpreted):
    rotary, positions, q, k = rope_case(16, 16, torch.bfloat16)
    want_q, want_k = rotary._rotated_copies(positions, q, k)
    assert rotary(positions, q, k)[0] is q  # the layer routes to the kernel, in place
    torch.testing.assert_close(q.float(), want_q.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(k.float(), want_k.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_silu_mul(interpreted, dtype, tol):
    gate_up = (torch.randn(5, 2 * 1100) * 3).to(dtype)  # wider than one block of columns
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = ft.for_tensor(gate_up).silu_mul(gate_up, lambda: want)
    # float32: numpy's exp and torch's differ in the last bit at most, a few ulps of silu
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_a_wrong_result_switches_off_with_one_warning(interpreted, caplog):
    gate_up = torch.randn(3, 64)
    with caplog.at_level(logging.WARNING, logger=ft.__name__):
        assert ft.for_tensor(gate_up).silu_mul(gate_up, lambda: torch.zeros(3, 32) + 5) is None
        assert ft.for_tensor(gate_up) is None  # off for the process, every kernel
    assert len([r for r in caplog.records if "switched off" in r.getMessage()]) == 1


def test_a_failing_kernel_switches_off_and_the_layer_runs_torch(interpreted, monkeypatch):
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    ft.for_tensor(x)  # built
    monkeypatch.setitem(ft._state["kernels"], "norm", None)  # launching it raises
    norm = RMSNorm(32, EPS)
    want = norm._torch_forward(x, residual.clone())
    got = norm(x, residual)  # (the CPU kernel it falls back to writes the sum into residual)
    assert torch.equal(got[0], want[0]) and ft._state["off"]


def test_engine_greedy_matches_hf_with_the_kernels(interpreted, tmp_path_factory, monkeypatch):
    """A tiny llama through LLM(...) in float32 with every kernel interpreted equals HF greedy."""
    from helpers.arch import arch_refs
    from helpers.engine import KV, greedy
    from pdserve.engine import LLM
    from pdserve.engine.models.llama import LlamaModel

    # the layers one by one, not the compiled CPU decode stack, which runs none of them
    monkeypatch.setattr(LlamaModel, "prepare_decode_stack", lambda self: None)
    calls: dict[str, int] = {}
    for name in ("add_rms_norm", "rope_", "silu_mul"):
        real = getattr(ft, name)
        monkeypatch.setattr(ft, name, counting(real, name, calls))
    model_dir, _, prompts, want = arch_refs(tmp_path_factory, {}, "llama")
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=4, dtype="float32")
    try:
        outs = llm.generate(prompts[:3], greedy(16), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [w[:16] for w in want.tokens()[:3]]
    assert set(calls) == {"add_rms_norm", "rope_", "silu_mul"} and not ft._state["off"]


def counting(fn, name: str, calls: dict):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        if out is not None:
            calls[name] = calls.get(name, 0) + 1
        return out

    return wrapped
