"""The int8 path's arithmetic pinned against a reference that does not use the CPU's int8 kernels
(issue #48 item 3): what int8 serves must not depend on which CPU runs it.

The reference, `reference_matmul`, emulates in plain float32/float64 torch exactly the quantization
Int8Weight.matmul does (engine/layers/quant.py): each row smoothed and scaled to [-1, 1], the span
row pinning the range, activations quantized to u8 by fbgemm's rule (scale and zero point from
ChooseQuantizationParams over [-1, 1], round half to even of x / scale + zero point), int8 weights
per output channel, an exact integer accumulate (float64 holds every sum exactly) and the
dequantization. A CPU whose kernel rounds differently, takes a narrower activation range
(reduce_range: 7 bits instead of 8) or saturates its accumulate in int16 (fbgemm's path without
VNNI, unless the weight is spread: quant.py) fails these tests. Mode bf16 runs the decoder's
linears as `Bf16Weight` and the head as
`ScreenedHead` (an int8 screen, its best candidates rescored in float32); their references are
plain float64 sums of bf16-rounded operands, and the int8 reference above with an exact rescore.
The engine's prompt logprobs on a tiny random llama, in modes int8 and bf16, are then compared to
the same model run with the references in place of every linear (the compiled decode stack,
which calls the kernels from C++, is switched off for the reference run only).
"""

from __future__ import annotations

import pytest
import torch

from helpers.engine import needs_x86_int8
from helpers.marks import BF16_MODE, needs_onednn_bf16
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.layers import quant
from pdserve.engine.layers.quant import Bf16Weight, Int8Weight, ScreenedHead

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_x86_int8]


def choose_qparams(lo: float, hi: float, qmin: int, qmax: int) -> tuple[float, int]:
    """fbgemm's/ATen's ChooseQuantizationParams (no sparsity, no power-of-two scale), in Python:
    the range widened to hold 0, the scale in double then stored as float, the zero point from the
    end with the smaller error, rounded half to even and clamped."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / (qmax - qmin)
    from_min, from_max = qmin - lo / scale, qmax - hi / scale
    err_min, err_max = abs(qmin) - abs(lo / scale), abs(qmax) - abs(hi / scale)
    zp = from_min if err_min < err_max else from_max
    zp = qmin if zp < qmin else qmax if zp > qmax else int(torch.tensor(zp).round().item())
    return float(torch.tensor(scale, dtype=torch.float32).item()), zp


def unpacked(q: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 weight [out, in] as stored (int_repr) and its per-channel scales; a spread one
    (quant.py: a zero column after each input column) with its zero columns checked and dropped."""
    wq = torch.ops.quantized.linear_unpack(q.packed)[0]
    w_int = wq.int_repr()
    if q.spread:
        assert not w_int[:, 1::2].any()
        w_int = w_int[:, 0::2]
    return w_int, wq.q_per_channel_scales()


def reference_matmul(q: Int8Weight, x2d: torch.Tensor, reduce_range: bool = False) -> torch.Tensor:
    """What Int8Weight.matmul computes, without any int8 kernel (see the module docstring)."""
    x = x2d.float() if q.inv_smooth is None else x2d.float() * q.inv_smooth
    rmax = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-6)
    x = x / rmax  # each row in [-1, 1]; the span row makes the range exactly [-1, 1]
    qmax = 127 if reduce_range else 255
    a_scale, a_zp = choose_qparams(-1.0, 1.0, 0, qmax)
    inv = torch.tensor(1.0 / a_scale, dtype=torch.float32)
    # fbgemm's AVX2 quantizer: fma(x, 1/scale, zero point) in float32, then round half to even
    t = (x.double() * inv.double() + a_zp).float()
    xq = t.round().clamp(0, qmax).double()
    # per-channel int8 weights: torch.quantize_per_channel's result, unpacked as stored
    w_int, w_scale = unpacked(q)
    w_int, w_scale = w_int.double(), w_scale.float()
    acc = (xq - a_zp) @ w_int.T  # exact: every partial sum is an integer below 2**53
    y = acc.float() * (a_scale * w_scale.double()).float()
    return (y * rmax).to(x2d.dtype)


@pytest.fixture(autouse=True)
def bf16_weights_kept(monkeypatch):
    """Bf16Weight keeps only oneDNN's packed (opaque) weight: here each also keeps its bf16
    weight, for reference_bf16."""
    init = Bf16Weight.__init__

    def keeping(self, weight):
        init(self, weight)
        self.weight_bf16 = weight.detach().to(torch.bfloat16)

    monkeypatch.setattr(Bf16Weight, "__init__", keeping)


def reference_bf16(q: Bf16Weight, x2d: torch.Tensor) -> torch.Tensor:
    """What Bf16Weight.matmul computes, without a bf16 kernel: both operands rounded to bf16
    (nearest even), the products summed in float64, the sum rounded to bf16 (oneDNN's output)."""
    y = x2d.to(torch.bfloat16).double() @ q.weight_bf16.double().T
    return y.to(torch.bfloat16).to(x2d.dtype)


def reference_head(q: ScreenedHead, x2d: torch.Tensor, reduce_range: bool = False):
    """What ScreenedHead.matmul computes: the screen's reference (int8's, or bf16's on a CPU with
    AMX), then each row's HEAD_RESCORE best candidates replaced by their float64 logits (rounded
    to float32)."""
    if isinstance(q.screen, Bf16Weight):  # its float32 sums, not rounded to bf16
        w = q.screen.weight_bf16.double()
        y = (x2d.to(torch.bfloat16).double() @ w.T).float()
    else:
        y = reference_matmul(q.screen, x2d, reduce_range).float()
    top = y.topk(min(quant.HEAD_RESCORE, y.shape[1]), dim=1).indices
    exact = (x2d.double() @ q.weight.double().T).float()
    return y.scatter(1, top, exact.gather(1, top)).to(x2d.dtype)


def weight_input(rows: int, n: int = 96, k: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g)
    x[0] *= 300.0  # an outlier row (the first token)
    x[:, 3] *= 40.0  # an outlier channel, which smoothing evens out
    return w, x


def rel_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_the_qparams_rule_is_atens():
    """The reference's scale and zero point are the ones ATen's own rule gives for [-1, 1]."""
    for reduce_range, qmax in ((False, 255), (True, 127)):
        scale, zp = torch._choose_qparams_per_tensor(torch.tensor([-1.0, 1.0]), reduce_range)
        assert choose_qparams(-1.0, 1.0, 0, qmax) == (pytest.approx(scale, rel=1e-7), zp)


def test_the_weights_are_round_to_nearest_per_channel():
    """The unpacked int8 weight the reference reads is our own round(w / scale) per channel."""
    w, x = weight_input(4)
    q = Int8Weight(w)
    w_int, _ = unpacked(q)
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    mine = (w / scale[:, None]).round().clamp(-128, 127)
    assert (w_int.float() - mine).abs().max().item() <= 1  # a tie may round either way
    assert (w_int.float() != mine).float().mean().item() < 1e-3


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("smooth", [False, True])
def test_int8_matmul_matches_the_reference(rows, smooth, monkeypatch):
    """Both paths (the compiled int8_rows and the torch one) give the reference's numbers up to
    float32 rounding of the dequantization; 7-bit activations are ~100x further off."""
    w, x = weight_input(rows)
    q = Int8Weight(w, act_absmax=x.abs().amax(dim=0) if smooth else None)
    want = reference_matmul(q, x, reduce_range=False)
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(quant, "fused_for", lambda t: None)
        got = q.matmul(x)
        assert rel_gap(got, want) < 1e-5, (fused, q.spread, rel_gap(got, want))
    assert rel_gap(reference_matmul(q, x, reduce_range=True), want) > 1e-3


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_bf16_matmul_matches_the_reference(rows):
    """oneDNN's bf16 product is the bf16 rounding of the exact sum of bf16 operands: off only by
    the float32 summation order, which moves an output by at most one bf16 step (2**-8 of it)."""
    w, x = weight_input(rows)
    x[0] /= 300.0  # bf16 has an exponent per value: outliers need no evening out
    q = Bf16Weight(w)
    got, want = q.matmul(x), reference_bf16(q, x)
    step = want.abs() * 2.0**-7 + 1e-30
    assert ((got - want).abs() <= step).all()
    assert (got == want).float().mean().item() > 0.95


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_screened_head_rescores_the_screens_best_exactly(rows):
    """Each row's HEAD_RESCORE best candidates of the int8 screen carry float32's logits (so the
    row's top token is float32's), and the other logits are the int8 screen's."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(500, 256, generator=g) * 0.05
    x = torch.randn(rows, 256, generator=g)
    q = ScreenedHead(w, screen="int8")  # (the CPU's choice: bf16 on one with AMX)
    got, want = q.matmul(x), reference_head(q, x)
    exact = x @ w.T
    assert rel_gap(got, want) < 1e-5
    assert torch.equal(got.argmax(dim=1), exact.argmax(dim=1))
    top = exact.topk(3, dim=1).indices
    assert torch.allclose(got.gather(1, top), exact.gather(1, top), rtol=0, atol=1e-5)
    screen = q.screen.matmul(x)
    others = ~torch.isclose(got, exact, rtol=0, atol=1e-5)
    assert others.sum(dim=1).min().item() >= 500 - quant.HEAD_RESCORE - 5
    assert torch.equal(got[others], screen[others])


def test_the_kernel_accumulates_exactly_on_this_cpu(monkeypatch):
    """The pairs fbgemm's kernel without VNNI sums in int16 (255 * 127 * 2 > 32767): where the
    kernel saturates, Int8Weight spreads its weight (a zero column after each input column) and
    its product is exact again; where it does not, nothing is spread. Either way, on a case made
    to saturate, both paths give the 8-bit reference's product."""
    w = torch.full((16, 64), 0.5)
    x = torch.ones(2, 64)
    q = Int8Weight(w)
    exact = reference_matmul(q, x, reduce_range=False)
    qw = torch.quantize_per_channel(
        w, torch.full((16,), 0.5 / 127, dtype=torch.double), torch.zeros(16).long(), 0, torch.qint8
    )
    span = torch.tensor([1.0, -1.0]).repeat(32)[None]
    raw = torch.ops.quantized.linear_dynamic(
        torch.cat([x, span]), torch.ops.quantized.linear_prepack(qw, None), False
    )[:-1]  # the weight as it is, never spread
    assert q.spread == (rel_gap(raw, exact) > 1e-3) == quant.int8_kernel_saturates()
    assert rel_gap(q.matmul(x), exact) < 1e-5
    monkeypatch.setattr(quant, "fused_for", lambda t: None)
    assert rel_gap(q.matmul(x), exact) < 1e-5


def prompt_logprobs(llm, prompts) -> list[list[float]]:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[o.prompt_logprobs[i][p[i]] for i in range(1, len(p))] for o, p in zip(outs, prompts)]


# The largest prompt-logprob gap to the reference allowed, per mode: int8's sums are exact, and
# only the dequantization's float32 rounding differs; bf16's outputs may differ by one bf16 step
# where the float32 sums' order puts them on either side of a rounding boundary.
TOL = {"int8": 2e-4, "bf16": 2e-3}
# The prepared weights each mode serves: its decoder's linears and its head.
KINDS = {"int8": {Int8Weight}, "bf16": {Bf16Weight, ScreenedHead}}


@pytest.mark.parametrize("mode", ["int8", BF16_MODE])
def test_prompt_logprobs_match_the_reference(tiny_models, monkeypatch, mode):
    """The served model (decode stack and all, prompt chunks of 16 tokens) against the same
    weights with the references in every linear: equal within TOL[mode] nats per token, where
    7-bit activations in the int8 kernels (what reduce_range would serve) are far outside it."""
    model_dir, _ = tiny_models("llama-gqa")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 250, (n,), generator=g).tolist() for n in (40, 23, 64)]
    kw = dict(dtype="float32", quantization=mode, enable_prefix_caching=False)
    llm = LLM(model_dir, max_num_batched_tokens=16, **kw)
    try:
        model = llm.engine.runner.model
        kinds = {type(m._quant) for m in model.modules() if getattr(m, "_quant", None)}
        assert kinds == KINDS[mode], kinds
        # (the bf16 mode's only int8 is its head's screen, bf16 on a CPU with AMX)
        int8 = any(
            isinstance(getattr(m._quant, "screen", m._quant), Int8Weight)
            for m in model.modules()
            if getattr(m, "_quant", None)
        )
        got = prompt_logprobs(llm, prompts)
        monkeypatch.setattr(model.model, "_stack", None)
        gaps = {}
        for rr in (False, True):
            with monkeypatch.context() as m:
                m.setattr(Int8Weight, "matmul", lambda q, x, rr=rr: reference_matmul(q, x, rr))
                m.setattr(Bf16Weight, "matmul", reference_bf16)
                m.setattr(ScreenedHead, "matmul", lambda q, x, rr=rr: reference_head(q, x, rr))
                want = prompt_logprobs(llm, prompts)
            gaps[rr] = max(abs(a - b) for ga, wa in zip(got, want) for a, b in zip(ga, wa))
    finally:
        llm.shutdown()
    print(f"\nlargest prompt-logprob gap to the reference ({mode}): {gaps}")
    assert gaps[False] < TOL[mode], gaps
    if int8:  # (7-bit activations are told apart)
        assert gaps[True] > 10 * TOL[mode], gaps
