"""The Triton fused kernels (engine/kernels/fused_triton.py) compiled on CUDA against the torch
ops at a Llama-3-8B layer's shapes (float32 within a bound the summation order and exp explain,
bf16 within a bf16 step of each rounding), captured into a CUDA graph and replayed on new inputs, and the
engine with them on (the default on CUDA) against HF greedy: float32 token for token (a plain
llama and phi3 with partial rotary), bfloat16 up to near ties. Every test also asserts that the
kernels stayed on, so a silent fallback to torch fails here. Skipped without CUDA or triton; on
a GPU machine: `bash scripts/test.sh -m gpu tests/gpu/test_cuda_fused.py`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.arch import build_arch_model
from helpers.engine import greedy
from helpers.gpu import assert_greedy_matches, hf_greedy, hf_on
from helpers.models import random_prompts
from pdserve.engine import LLM
from pdserve.engine.kernels import fused_triton as ft
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.gpu

EPS = 1e-5
ROWS = (1, 3, 257)  # a decode step, a small batch, a prefill chunk
CUDA = dict(device="cuda", kv_cache_memory=1 << 24, max_model_len=512)
NEW = 24
NEAR_TIE = 0.05  # as tests/gpu/test_cuda_engine.py
# bf16 against torch: the kernels round where torch rounds, so a float32 value that differs in
# its last bits (summation order, rsqrt, exp) flips one intermediate rounding at most. The norm
# and silu round twice (the normalized value or silu, then the product): two bf16 steps (2**-7
# relative each at the least). The rotary embedding's products and sum see the same float32
# values as torch's: exact is expected, one step allowed, and, as its sum may cancel, an
# absolute step of a product below 4 in magnitude.
BF16_TWO_STEPS = dict(rtol=2**-6, atol=1e-5)
BF16_ROPE = dict(rtol=2**-7, atol=2**-5)
# float32: the norm's 4096 squares summed in another order (relative error of the mean square
# well below 4096 * 2**-24 in practice, halved by the square root) and torch's approximate
# rsqrtf; silu's exp differs from expf by a few ulps
F32 = dict(rtol=2e-5, atol=1e-6)


@pytest.fixture
def kernels():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ft.reset()
    yield ft
    assert not ft._state["off"], "the kernels switched themselves off (see the warning)"
    ft.reset()


def torch_norm(x, residual, weight):
    norm = RMSNorm(x.shape[-1], EPS).cuda()
    norm.weight.data = weight
    return norm._torch_forward(x, residual)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(kernels, rows, dtype):
    x = torch.randn(rows, 4096, device="cuda").to(dtype)
    residual = torch.randn(rows, 4096, device="cuda").to(dtype)
    weight = (1 + 0.3 * torch.randn(4096, device="cuda")).to(dtype)
    for res in (residual, None):
        want = torch_norm(x, res, weight)
        got = kernels.for_tensor(x).add_rms_norm(x, res, weight, EPS, lambda w=want: w)
        assert got is not None
        assert torch.equal(got[1], want[1])  # the residual sum: one rounding either way
        tol = F32 if dtype == torch.float32 else BF16_TWO_STEPS
        torch.testing.assert_close(got[0].float(), want[0].float(), **tol)


def rope_case(rows, dtype, head_dim=128, rot=128):
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
    rotary = RotaryEmbedding(inv_freq, 1.0, 8192).cuda()
    nq, nk = 32, 8
    qkv = torch.randn(rows, (nq + 2 * nk) * head_dim, device="cuda").to(dtype)
    q = qkv[:, : nq * head_dim].view(rows, nq, head_dim)
    k = qkv[:, nq * head_dim : (nq + nk) * head_dim].view(rows, nk, head_dim)
    positions = torch.randint(0, 8192, (rows,), device="cuda")
    return rotary, positions, q, k


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rot", [(128, 128), (96, 48)])
def test_rope_in_place(kernels, rows, dtype, head_dim, rot):
    rotary, positions, q, k = rope_case(rows, dtype, head_dim, rot)
    want_q, want_k = rotary._rotated_copies(positions, q, k)
    got = rotary(positions, q, k)  # the layer routes to the kernel on CUDA
    assert got[0] is q and got[1] is k
    # each product and the sum rounded as torch rounds them, no fused multiply-add: float32
    # should be exact; the bound leaves room for a compiler that contracts anyway
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else BF16_ROPE
    torch.testing.assert_close(q.float(), want_q.float(), **tol)
    torch.testing.assert_close(k.float(), want_k.float(), **tol)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(kernels, rows, dtype):
    gate_up = (3 * torch.randn(rows, 2 * 14336, device="cuda")).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = kernels.for_tensor(gate_up).silu_mul(gate_up, lambda: want)
    tol = F32 if dtype == torch.float32 else BF16_TWO_STEPS
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_kernels_replay_in_a_cuda_graph(kernels):
    """Warmed up eagerly, captured once, replayed on new inputs: equal to the eager kernels."""
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    residual, weight = torch.randn_like(x), torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    rotary, positions, q, k = rope_case(4, torch.bfloat16)
    gate_up = torch.randn(4, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    norm = RMSNorm(4096, EPS).cuda()
    norm.weight.data = weight

    def silu_ref():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def step():
        out, res = norm(x, residual)
        rotary(positions, q, k)
        return out, res, q.clone(), k.clone(), kernels.silu_mul(gate_up, silu_ref)

    step()  # the first calls compile and check the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t in (x, residual, q, k, gate_up):
        t.copy_(torch.randn_like(t))
    positions.copy_(torch.randint(0, 8192, (4,), device="cuda"))
    q0, k0 = q.clone(), k.clone()
    graph.replay()
    q.copy_(q0), k.copy_(k0)
    eager = step()
    for a, b in zip(captured, eager, strict=True):
        assert torch.equal(a, b)


def test_engine_float32_matches_hf(kernels, tiny_models, tmp_path, monkeypatch):
    counts = count_calls(kernels, monkeypatch)
    llama_dir, llama = tiny_models("llama-gqa")
    phi_dir = tmp_path / "phi3-partial"
    phi = build_arch_model(phi_dir, "phi3-partial")
    ps = random_prompts([3, 17, 40, 64, 1, 100], seed=5)
    for model_dir, hf in ((llama_dir, llama), (str(phi_dir), phi)):
        hf = hf_on(hf, torch.float32)
        llm = LLM(model_dir, dtype="float32", block_size=16, **CUDA)
        try:
            outs = llm.generate(ps, greedy(NEW), use_tqdm=False)
        finally:
            llm.shutdown()
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, NEW)[0] for p in ps]
    assert set(counts) == {"add_rms_norm", "rope_", "silu_mul"}, counts


def test_engine_bfloat16_matches_hf_up_to_near_ties(kernels, tiny_models, monkeypatch):
    counts = count_calls(kernels, monkeypatch)
    model_dir, hf = tiny_models("llama-gqa")
    hf = hf_on(hf, torch.bfloat16)
    ps = random_prompts([3, 17, 40, 64, 1, 100, 9], seed=5)
    llm = LLM(model_dir, dtype="bfloat16", **CUDA)
    try:
        outs = llm.generate(ps, greedy(NEW), use_tqdm=False)
    finally:
        llm.shutdown()
    assert assert_greedy_matches(hf, ps, outs, NEAR_TIE) >= len(ps) - 2
    assert set(counts) == {"add_rms_norm", "rope_", "silu_mul"}, counts


def count_calls(module, monkeypatch) -> dict:
    """A dict counting the kernel calls that ran (gave a result) through the module's entry
    points, from now until the test ends."""
    counts: dict[str, int] = {}
    for name in ("add_rms_norm", "rope_", "silu_mul"):
        real = getattr(module, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            out = _real(*args, **kwargs)
            if out is not None:
                counts[_name] = counts.get(_name, 0) + 1
            return out

        monkeypatch.setattr(module, name, wrapped)
    return counts
