"""Our own products in oneDNN's arithmetic (fused_cpu.cpp bf16_linear and f32_linear,
engine/layers/quant.py own_product): where the compiled kernels have them, a bf16-mode weight's
steps of more than Q4_ROWS rows, and a float32 layer's without bias, take them instead of
oneDNN's, which must give oneDNN's bits exactly, checked here against a oneDNN product made apart;
a part that is not oneDNN's is refused, and without the kernel oneDNN keeps every step."""

from __future__ import annotations

import pytest
import torch

from helpers.marks import needs_onednn_bf16
from pdserve.engine.cpu import cpu_features
from pdserve.engine.kernels import cpu_fused
from pdserve.engine.layers import quant
from pdserve.engine.layers.quant import Bf16Weight, onednn_part

fused = cpu_fused()
# (on a CPU with AMX oneDNN keeps a bf16 weight's every step: quant.own_product)
amx = cpu_features().has("amx_bf16")
needs_own = pytest.mark.skipif(
    fused is None or not fused.bf16_linear_fast() or amx,
    reason="the compiled kernels have no AVX512-BF16 product on this CPU, or it has AMX",
)
needs_own_f32 = pytest.mark.skipif(
    fused is None or not fused.f32_linear_fast(),
    reason="the compiled kernels have no AVX-512 float32 product on this CPU",
)


def onednn_bf16(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    from pdserve.engine.layers.linear import onednn_linear

    packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16), 32)
    return onednn_linear(x.to(torch.bfloat16), packed, None).float()


@needs_onednn_bf16
@needs_own
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (48, 2048), (16, 64), (80, 96)])
def test_its_product_is_onednns_bit_for_bit(shape):
    torch.manual_seed(sum(shape))
    w = torch.randn(*shape) * 0.05
    q = Bf16Weight(w)
    assert q.bp is not None and q.packed is None  # oneDNN's copy let go
    for rows in (9, 16, 17, 33, 100):
        x = torch.randn(rows, shape[1]) * 3
        assert torch.equal(q.matmul(x), onednn_bf16(w, x)), rows
        # a row's result is the same alone as in the batch
        assert torch.equal(q.matmul(x[5:6].expand(rows, -1).contiguous())[0], q.matmul(x)[5])


@needs_onednn_bf16
@needs_own
def test_a_part_that_is_not_onednns_is_refused(monkeypatch):
    k = 1536
    part = onednn_part(k, 64, torch.bfloat16)
    assert quant._own_gives_onednn_bits(k, 64, part, torch.bfloat16)
    wrong = 512 if part != 512 else 1024
    assert not quant._own_gives_onednn_bits(k, 64, wrong, torch.bfloat16)
    monkeypatch.setattr(quant, "onednn_part", lambda *a, **kw: wrong)
    q = Bf16Weight(torch.randn(64, k))
    assert q.bp is None and q.packed is not None  # oneDNN keeps every step


@needs_onednn_bf16
def test_on_a_cpu_with_amx_the_tiles_take_every_bf16_step(monkeypatch):
    """On the Intel Xeon with AMX a bf16 weight takes no AVX512-BF16 product of ours: the tile
    units multiply it, through amx_linear where this process really has them, else oneDNN. A
    float32 layer past its 4-bit blocks keeps oneDNN (ours is no faster there); one without
    blocks keeps ours."""
    from pdserve.engine import cpu

    real = cpu.cpu_features()
    with_amx = type(real)(real.model, real.flags | {"amx_bf16", "amx_tile"})
    monkeypatch.setattr(cpu, "cpu_features", lambda: with_amx)
    monkeypatch.setattr(quant, "cpu_features", lambda: with_amx)
    q = Bf16Weight(torch.randn(32, 64))
    if real.has("amx_bf16") and fused is not None and fused.amx_bf16_ready():
        assert q.bp is not None and q.bp.dtype == torch.bfloat16 and q.packed is None
    else:
        assert q.bp is None and q.packed is not None
    g = torch.Generator().manual_seed(7)
    q = torch.randint(0, 16, (32, 64), generator=g)
    q[:, ::32], q[:, 1::32] = 0, 15  # each block spans 0..15: Q4_1's d 1/16, m -1/2
    blocks = (q * 0.0625 - 0.5).float()
    layer = linear_f32(blocks)
    assert layer._blocks is not None and layer._own is None and layer._packed is not None
    assert Bf16Weight(blocks).q4_rows == 1  # (the 4-bit product leads oneDNN at one row only)
    x = torch.randn(40, 64)
    assert torch.equal(layer(x), onednn_f32(blocks, x))
    if fused is not None and fused.f32_linear_fast():
        assert linear_f32(torch.randn(32, 64))._own is not None


@needs_onednn_bf16
def test_without_the_kernel_onednn_keeps_every_step(monkeypatch):
    class NoOwn:
        def __getattr__(self, name):
            return getattr(fused, name)

        def bf16_linear_fast(self):
            return False

        def amx_bf16_ready(self):
            return False

    monkeypatch.setattr(quant, "cpu_fused", lambda: NoOwn() if fused is not None else None)
    w = torch.randn(32, 64)
    q = Bf16Weight(w)
    assert q.bp is None and q.packed is not None
    x = torch.randn(12, 64)
    assert torch.equal(q.matmul(x), onednn_bf16(w, x))


@needs_own
def test_bad_shapes_are_refused_with_a_message():
    packed = fused.bf16_pack(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="packed int16"):
        fused.bf16_linear(torch.randn(4, 62), packed, 64)
    with pytest.raises(RuntimeError, match="even"):
        fused.bf16_linear(torch.randn(4, 64), packed, 3)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        fused.bf16_pack(torch.randn(20, 64))


def linear_f32(weight: torch.Tensor, bias: torch.Tensor | None = None):
    from pdserve.engine.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight.data.copy_(weight)
    if bias is not None:
        layer.bias.data.copy_(bias)
    layer.finalize(None, release_dense=False)
    return layer


def onednn_f32(weight, x, bias=None):
    from pdserve.engine.layers.linear import onednn_linear

    return onednn_linear(x, torch.ops.mkldnn._reorder_linear_weight(weight, 32), bias)


@needs_own_f32
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (48, 2048), (80, 96)])
def test_the_float32_product_is_onednns_bit_for_bit(shape):
    torch.manual_seed(sum(shape) + 1)
    w = torch.randn(*shape) * 0.05
    layer = linear_f32(w)
    assert layer._own is not None and layer._packed is None
    for rows in (9, 16, 17, 33, 100):
        x = torch.randn(rows, shape[1]) * 3
        assert torch.equal(layer(x), onednn_f32(w, x)), rows
        assert torch.equal(layer(x[5:6].expand(rows, -1).contiguous())[0], layer(x)[5])


@needs_own_f32
def test_a_float32_layer_with_a_bias_keeps_onednn():
    w, b = torch.randn(32, 64), torch.randn(32)
    layer = linear_f32(w, b)
    assert layer._own is None and layer._packed is not None
    x = torch.randn(12, 64)
    assert torch.equal(layer(x), onednn_f32(w, x, b))
    a_part = onednn_part(1536, 64, torch.float32)
    assert quant._own_gives_onednn_bits(1536, 64, a_part, torch.float32)
    assert not quant._own_gives_onednn_bits(1536, 64, 512 if a_part != 512 else 1024, torch.float32)


needs_amx = pytest.mark.skipif(
    fused is None or not amx or not fused.amx_bf16_ready(),
    reason="this CPU (or process) has no AMX tiles, or the compiled kernels no AMX product",
)


@needs_amx
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (64, 4096), (32, 64)])
def test_the_amx_product_gives_onednns_bits_and_a_rows_bits_alone(shape):
    """amx_linear multiplies as oneDNN's AMX kernel does for steps of up to 32 rows, bit for bit;
    past 32 rows (where oneDNN sums otherwise) each row's bits are its bits alone."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1])) * 0.05
    packed, part = quant.amx_product(w, lambda x: onednn_bf16(w, x))
    assert packed is not None and part == shape[1]
    x = torch.randn(80, shape[1], generator=torch.Generator().manual_seed(1))
    alone = torch.cat([quant.own_linear(x[i : i + 1], packed, part) for i in range(80)])
    for rows in (1, 2, 7, 16, 17, 31, 32, 33, 80):
        got = quant.own_linear(x[:rows], packed, part)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, alone[:rows]), rows
        if rows <= 32:
            assert torch.equal(got.float(), onednn_bf16(w, x[:rows])), rows
    assert torch.equal(Bf16Weight(w).matmul(x[:32]), onednn_bf16(w, x[:32]))


@needs_amx
def test_an_amx_product_that_misses_onednns_bits_is_refused():
    """amx_product compares its bits with the dense product's before a weight takes it: against
    a product one bf16 step off somewhere it keeps oneDNN."""
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(3))

    def off(x):
        y = onednn_bf16(w, x)
        y[0, 5] = torch.nextafter(y[0, 5].bfloat16(), torch.tensor(9.0).bfloat16()).float()
        return y

    assert quant.amx_product(w, off) == (None, 0)
    assert quant.amx_product(w, lambda x: onednn_bf16(w, x))[0] is not None


@needs_amx
def test_on_a_cpu_with_amx_the_head_screens_in_bf16():
    """The screened head's screen is the tiles' bf16 product there: each row's best candidates
    carry float32's logits (so its top token is float32's), the others are the screen's float32
    sums (not rounded to bf16)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(512, 256, generator=g) * 0.05
    x = torch.randn(40, 256, generator=g)
    head = quant.ScreenedHead(w)
    assert isinstance(head.screen, Bf16Weight) and head.screen.bp is not None
    got, exact = head.matmul(x), x @ w.T
    assert torch.equal(got.argmax(dim=1), exact.argmax(dim=1))
    top = exact.topk(3, dim=1).indices
    assert torch.allclose(got.gather(1, top), exact.gather(1, top), rtol=0, atol=1e-5)
    screen = head.screen_logits(x)  # the tiles' float32 sums, which rounded are the product's
    assert torch.equal(screen.bfloat16(), head.screen.matmul(x).bfloat16())
    rescored = torch.zeros_like(got, dtype=torch.bool)
    rescored.scatter_(1, screen.topk(quant.HEAD_RESCORE, dim=1).indices, True)
    assert torch.equal(got[~rescored], screen[~rescored])
    assert torch.allclose(got[rescored], exact[rescored], rtol=0, atol=1e-5)
    assert not torch.allclose(got, exact, rtol=0, atol=1e-5)  # (the others are the screen's)
