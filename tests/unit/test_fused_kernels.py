"""The compiled fused float32 ops (engine/kernels/fused_cpu.cpp) against the torch expressions
they replace, and the layers taking the torch path when the kernels are off."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import cpu_fused

fused = cpu_fused()
pytestmark = pytest.mark.skipif(fused is None, reason="no C++ compiler for the CPU kernels here")


def torch_rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_add_rms_norm(rows):
    g = torch.Generator().manual_seed(rows)
    x, res, w = (
        torch.randn(rows, 96, generator=g),
        torch.randn(rows, 96, generator=g),
        torch.randn(96, generator=g),
    )
    out, same = fused.add_rms_norm(x, None, w, 1e-5)
    assert same.data_ptr() == x.data_ptr()
    torch.testing.assert_close(out, torch_rms(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    want_sum = x + res
    out, summed = fused.add_rms_norm(x, res, w, 1e-5)
    assert summed.data_ptr() == res.data_ptr() and torch.equal(summed, want_sum)  # in place
    torch.testing.assert_close(out, torch_rms(want_sum, w, 1e-5), rtol=1e-5, atol=1e-6)


def test_rope_in_place_equals_rotate_half():
    from pdserve.engine.layers.rotary import RotaryEmbedding, rope_inv_freq

    inv, factor = rope_inv_freq(None, "default", 10000.0, 64)
    rot = RotaryEmbedding(inv, factor, 256)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, (4 + 2 + 2) * 64, generator=g)
    q, k, _ = qkv.split([256, 128, 128], dim=-1)
    q, k = q.view(7, 4, 64), k.reshape(7, 2, 64)  # views with a row stride, as in the model
    pos = torch.tensor([0, 3, 9, 17, 100, 200, 255])
    cos, sin = rot.cos[pos].unsqueeze(1), rot.sin[pos].unsqueeze(1)
    half = lambda t: torch.cat((-t[..., 32:], t[..., :32]), dim=-1)  # noqa: E731
    want_q, want_k = q * cos + half(q) * sin, k * cos + half(k) * sin
    fused.rope_(q, k, pos, rot.cos, rot.sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)  # the same rounding, no FMA


def test_int8_rows_equal_the_torch_expression():
    g = torch.Generator().manual_seed(2)
    x, inv = torch.randn(6, 64, generator=g), torch.rand(64, generator=g) + 0.5
    x[2] = 0.0  # a zero row: its maximum is clamped, not divided by
    span = torch.ones(1, 64)
    span[0, 1::2] = -1
    out, rmax = fused.int8_rows(x, inv, span)
    xs = x * inv
    want_max = xs.abs().amax(dim=1, keepdim=True).clamp(min=1e-6)
    assert torch.equal(rmax, want_max)
    assert torch.equal(out, torch.cat([xs / want_max, span]))
    out, rmax = fused.int8_rows(x, None, span)
    assert torch.equal(rmax, x.abs().amax(dim=1, keepdim=True).clamp(min=1e-6))


def test_layers_fall_back_to_torch_without_kernels(monkeypatch):
    """PDSERVE_CPU_KERNELS=0 (or no compiler) routes every layer through torch: same results."""
    import pdserve.engine.layers.norm as norm_mod
    from pdserve.engine.layers.norm import RMSNorm

    layer = RMSNorm(96, 1e-5)
    layer.weight.data.normal_()
    x, res = torch.randn(3, 96), torch.randn(3, 96)
    with_kernel, s1 = layer(x.clone(), res.clone())
    monkeypatch.setattr(norm_mod, "fused_for", lambda t: None)
    without, s2 = layer(x.clone(), res.clone())
    torch.testing.assert_close(with_kernel, without, rtol=1e-5, atol=1e-6)
    assert torch.equal(s1, s2)


def test_fused_ops_refuse_shapes_they_would_read_past():
    x, w = torch.randn(2, 8), torch.randn(7)
    with pytest.raises(RuntimeError, match="weight"):
        fused.add_rms_norm(x, None, w, 1e-5)
    with pytest.raises(RuntimeError, match="span_row"):
        fused.int8_rows(x, None, torch.ones(1, 7))
    with pytest.raises(RuntimeError, match="inv_smooth"):
        fused.int8_rows(x, torch.ones(7), torch.ones(1, 8))
    table = torch.randn(4, 8)
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="beyond the rotary table"):
        fused.rope_(q, k, torch.tensor([4]), table, table)


@pytest.mark.parametrize("width", [1, 63, 64, 200, 49152])
def test_argmax_rows_is_torch_argmax(width):
    """First index of the maximum, ties and -inf rows included; a NaN wins (its first index)."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=g)
    x[1] = x[1].round()  # many ties
    x[2] = float("-inf")
    if width > 3:
        x[3, width // 2 :] = x[3].max() + 1  # the maximum repeated to the end
        x[4, 2] = float("nan")
        x[4, width - 1] = float("nan")
        x[5, 1] = float("inf")
        x[6, width - 1] = x[6].max() + 1  # the last index
    x[7] = 0.0
    x[7, -1] = -0.0
    assert torch.equal(fused.argmax_rows(x), x.argmax(dim=-1))
    strided = torch.randn(4, width + 7, generator=g)[:, :width]  # rows not packed together
    assert torch.equal(fused.argmax_rows(strided), strided.argmax(dim=-1))


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_silu_mul_bf16_is_torchs_silu_times_up_in_bf16(rows):
    """silu(gate) * up rounded to bf16, as torch computes it in float32 and rounds: the same
    bits but where glibc's expf and torch's differ in the last bit, which moves a bf16 result by
    at most one step; bf16 and float32 inputs of the same values give the same bits."""
    g = torch.Generator().manual_seed(rows)
    gu = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(torch.bfloat16)
    out = fused.silu_mul_bf16(gu)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 1536)
    assert torch.equal(out, fused.silu_mul_bf16(gu.float()))
    gate, up = gu.float().chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
    same = (out == ref).float().mean().item()
    assert same > 0.99, same
    steps = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert steps.max().item() <= 1
    with pytest.raises(RuntimeError, match="gu"):
        fused.silu_mul_bf16(torch.zeros(2, 3))


@pytest.mark.parametrize(
    "src_dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (
            torch.float32,
            torch.bfloat16,
        ),  # rounded as .to(bfloat16) rounds, NaN and halfway included
    ],
)
def test_kv_write_is_index_copy(src_dtype, cache_dtype):
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(40, 3, 64, generator=g).to(cache_dtype)
    want = cache.clone()
    # a step's K rows as the layers give them: a strided view of the qkv output
    qkv = torch.randn(9, 3 * 64 + 2 * 3 * 64, generator=g).to(src_dtype)
    qkv[0, 200] = float("inf")
    qkv[1, 201] = 1.0 + 2.0**-8  # halfway between two bf16 values: to even
    qkv[2, 202] = 1.0 + 3 * 2.0**-8
    k = qkv[:, 192:384].view(9, 3, 64)
    assert not k.is_contiguous()
    slots = torch.tensor([5, 0, 39, 17, 18, 19, 2, 33, 8])
    want.index_copy_(0, slots, k.to(cache_dtype))
    fused.kv_write_(cache, slots, k)
    assert torch.equal(
        cache.view(torch.int16 if cache_dtype == torch.bfloat16 else torch.int32),
        want.view(torch.int16 if cache_dtype == torch.bfloat16 else torch.int32),
    )


def test_kv_write_refuses_what_it_cannot_write():
    cache = torch.zeros(8, 2, 16)
    rows = torch.ones(2, 2, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        fused.kv_write_(cache, torch.tensor([1, 8]), rows)
    with pytest.raises(RuntimeError, match="out of range"):
        fused.kv_write_(cache, torch.tensor([-1, 0]), rows)
    with pytest.raises(RuntimeError, match="dtype"):
        fused.kv_write_(cache, torch.tensor([1, 2]), rows.bfloat16())  # bf16 into float32
    with pytest.raises(RuntimeError, match="contiguous"):
        fused.kv_write_(cache, torch.tensor([1, 2]), torch.ones(2, 16, 2).transpose(1, 2))
    assert torch.equal(cache, torch.zeros(8, 2, 16))  # nothing written by a refused call


@pytest.mark.parametrize("rows,width,k", [(32, 49152, 8), (3, 100, 8), (2, 17, 17), (4, 1000, 1)])
def test_topk_rows_is_torchs_topk_set(rows, width, k):
    y = torch.randn(rows, width, generator=torch.Generator().manual_seed(width))
    got = fused.topk_rows(y, k)
    want = y.topk(k, dim=1, sorted=False).indices
    assert torch.equal(got.sort(1).values, want.sort(1).values)


def test_topk_rows_ties_and_nans():
    y = torch.zeros(2, 200)
    y[0, 150] = 5.0
    y[0, 3] = float("nan")
    y[1, :] = float("nan")
    y[1, 7] = 1.0
    got = fused.topk_rows(y, 4)
    # equal values: the earliest indices; a NaN is never a candidate while numbers remain
    assert sorted(got[0].tolist()) == [0, 1, 2, 150]
    # fewer numbers than k: the NaNs' indices fill the rest, in order
    assert sorted(got[1].tolist()) == [0, 1, 2, 7]
    with pytest.raises(RuntimeError, match="k in"):
        fused.topk_rows(y, 0)
    with pytest.raises(RuntimeError, match="k in"):
        fused.topk_rows(torch.zeros(1, 5), 6)
