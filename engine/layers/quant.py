"""Low-precision weights for the linear layers, on torch's own CPU kernels.

- "int8": weights int8 per output channel (symmetric), activations quantized per row at run time
  (dynamic quantization) by torch's x86 quantized engine (fbgemm for linears on every x86 CPU,
  VNNI where the CPU has it), smoothed per linear (SmoothQuant) with the strength that erred
  least on the calibration text (`smoothing_errors`). Input and output stay in floating point.
- "int4": weights int4 in groups of 32 input features with a scale and a zero point per group
  (asymmetric, the layout of GGUF's Q4_1), activations bf16 (`_weight_int4pack_mm_for_cpu`);
  the LM head stays int8 (`head_quantization`).
  Re-quantizing a weight that came from a Q4_1 GGUF recovers its blocks: where a block spans its
  full 0..15 range, min/max give back the same scale and offset.
- "bf16": the decoder's linears take bf16 weights and bf16 inputs with float32 sums (oneDNN,
  `Bf16Weight`); everything else stays float32. The LM head screens every logit with int8 (bf16
  where the CPU has AMX) and rescores each row's HEAD_RESCORE best candidates exactly in float32
  (`ScreenedHead`): the head's bf16 *output* (logits near 20 rounded to steps of 0.125) is what
  would flip tokens, and the screen keeps float32's top tokens at about int8's cost. It exists because int8 in any one kind
  of SmolLM2's linears, even with finer scales, flips greedy tokens near ties and changes chat
  answers (issue #48; docs/experiments/int8-agreement.md), where bf16 linears keep float32's.
  Fast only on native bf16 units (AVX512-BF16, AMX): quantization="auto" offers it only there.
  Where the weights are exactly a GGUF's 4-bit blocks, steps of few rows read those instead and
  compute oneDNN's bits (Q4Blocks): the mode stays batch-invariant. On AMX the tiles multiply
  the blocks themselves at every step (amx_blocks; 8-bit blocks too), rebuilt in L1:
  amx_linear's bits. The float32 mode does the
  same in float32 arithmetic (engine/layers/linear.py).

What int8 computes does not depend on the CPU: every row is scaled to [-1, 1] and a span row
pins the quantization range to exactly [-1, 1], so the activations' scale (2/255) and zero point
are the same everywhere, fbgemm rounds half to even on every x86 CPU, and the u8 x s8 products are
summed exactly in int32. fbgemm's kernel without VNNI (AVX2, AVX-512 without VNNI) sums adjacent
pairs of products in int16 first, which saturates with 8-bit activations (255 x 127 x 2 > 32767);
where `int8_kernel_saturates` (a measured check, not a CPU flag) finds that, the weight is
*spread*: a zero column after every input column, the activations likewise, so each pair holds
one product and the sums are exact again, at twice the kernel's work. (Its earlier answer there,
7-bit activations, cost SmolLM2 +11% probe perplexity.) The float32 rounding of the
dequantization (fused multiply-add or not) may differ in the last bit.
bf16 rounds to nearest even on every CPU and sums in float32, so only the sums' order may differ.
tests/unit/test_int8_reference.py pins all of it against references without int8 or bf16 kernels.

Only the weight bytes shrink: at batch 1 a decode step streams every weight from memory once, so
its time falls with them. Which mode is fastest, and by how much, depends on the CPU;
`benchmarks/engine/quality.py` measures the quality each costs.
"""

from __future__ import annotations

import functools
import warnings

import torch

from pdserve.engine.cpu import cpu_features
from pdserve.engine.kernels import cpu_fused, fused_for

QUANTIZATIONS = ("int8", "int4", "bf16")
INT4_GROUP = 32
SMOOTH_ALPHA = 0.5  # SmoothQuant's migration strength where no calibration chose one
# The strengths the calibration tries per linear (smoothing_errors): on SmolLM2 it chose 0.45-0.85
# and moved int8's probe perplexity from +0.15..+1.87% of float32 to -0.68..+0.75% over the same
# seven calibration draws (docs/experiments/int8-agreement.md)
SMOOTH_ALPHAS = tuple(round(0.3 + 0.05 * i, 2) for i in range(13))
# The most outputs of a linear the search measures its error on (evenly spaced): a subset of
# rows of a weight quantizes as they do in the whole, and the LM head has 49,152
SMOOTH_SEARCH_OUTPUTS = 1024
# Candidates per row the screened head rescores: the int8 screen's logit errors are small next to
# the gap between a row's top token and its HEAD_RESCORE-th, so float32's top token is among them
# (4, 8 and 16 gave SmolLM2 the same agreement); every rescored logit is float32's.
HEAD_RESCORE = 8
# The most rows a step may have for a linear to multiply its 4-bit blocks (Q4Blocks) rather than
# its bf16 or float32 weight through oneDNN (the same bits either way). Up to here a step is bound
# by the bytes it reads; past it, by arithmetic, where oneDNN's blocking leads. SmolLM2's 120
# decoder linears, one pass from memory (AMD EPYC AVX-512 BF16, 2 threads, 2026-11-30, beside a
# helper's work): 4-bit over bf16 2.5x faster at 1 row, 1.4x at 4, 1.26x at 8, 0.87x at 9. Against
# float32's 4 bytes a weight the blocks lead further (in cache, 576 x 1536, 2 threads: 32 against
# 54 us at 1 row, 74 against 83-89 at 8, even at 12-16).
Q4_ROWS = 8
# On a CPU without AVX-512 a float32 layer's blocks take every step, however many rows: there the
# other path is oneDNN's float32 product at AVX2's width (our own f32_linear needs AVX-512), and the
# blocks' AVX2 tile (a group's weights rebuilt once, six rows at a time over them) leads or is even
# at every size. SmolLM2's 120 decoder linears and its head, one pass (AMD EPYC AVX2, Zen 3, 2
# threads, quiet; best of seven; docs/experiments/engine-decode-step.md), blocks against oneDNN:
# 2026-12-02 on one VM 79-89 against 95-108 ms at 32 rows, 275-294 against 302-319 at 128, even at
# 512; on another 61.5 against 76.2 ms at 32, 198 against 230 at 128, 801 against 892 at 512 and
# 1,592 against 1,766 at 1,024 (a 512-token prompt's first token 746 against 818 ms). So such a
# layer keeps no oneDNN copy at all (engine/layers/linear.py): 4 bytes a weight less.
BLOCKS_EVERY_STEP = 1 << 62
# On a CPU with AMX (the Intel Xeon kind) a float32 layer's blocks lead oneDNN's float32 kernel
# up to here (each block decoded once for every row of a step since 2026-12-04); past it oneDNN
# and our own f32_linear are about even, so oneDNN keeps those steps (the timings:
# docs/experiments/engine-decode-step.md, "The AMX Xeon, a second look").
AMX_FLOAT32_BLOCK_ROWS = 128


def float32_block_rows() -> int:
    """The most rows of a float32 step that a layer's 4- or 8-bit blocks (Q4Blocks, Q8Blocks)
    take on this CPU: Q4_ROWS where AVX-512 runs the dense product (our own f32_linear or
    oneDNN's AVX-512 kernel), AMX_FLOAT32_BLOCK_ROWS where the CPU also has AMX,
    BLOCKS_EVERY_STEP elsewhere. Either path gives the same bits."""
    if cpu_features().has("amx_bf16"):
        return AMX_FLOAT32_BLOCK_ROWS
    return Q4_ROWS if cpu_features().has("avx512f") else BLOCKS_EVERY_STEP


# On a CPU with AMX the tiles' bf16 product (oneDNN's, or amx_linear) is fast at few rows too,
# and the 4-bit product in the tiles' order (two chains of fused multiply-adds, twice
# AVX512-BF16's dot products) leads it only at one row (docs/experiments/engine-decode-step.md,
# "The AMX Xeon": measured against oneDNN's).
AMX_BF16_BLOCK_ROWS = 1


def bf16_block_rows() -> int:
    """The most rows of a bf16-mode step that a layer's 4-bit blocks take on this CPU (the same
    bits as oneDNN's either way): Q4_ROWS, or AMX_BF16_BLOCK_ROWS where the CPU has AMX."""
    return AMX_BF16_BLOCK_ROWS if cpu_features().has("amx_bf16") else Q4_ROWS


def own_product_beside_blocks() -> bool:
    """Whether a float32 layer that has blocks also takes our own product (f32_linear, in place
    of oneDNN's copy) for its larger steps: not on a CPU with AMX, where the blocks take steps of
    up to AMX_FLOAT32_BLOCK_ROWS and ours is no faster than oneDNN's float32 kernel past them
    (within 7% at 192-512 rows, 2026-12-04). A layer without blocks keeps ours there (1.3-1.7x
    oneDNN at 1-64 rows)."""
    return not cpu_features().has("amx_bf16")


def blocks_every_step() -> bool:
    """Whether a float32 layer's blocks take every step on this CPU (float32_block_rows), so
    that such a layer without a bias needs no dense copy."""
    return float32_block_rows() >= BLOCKS_EVERY_STEP


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN's bf16 linear runs on this CPU: torch refuses its bf16 weight reorder where
    the CPU has neither AVX-512 BW/VL/DQ nor AVX-NE-CONVERT (an AMD EPYC with AVX2 only). There
    bf16 weights take torch's own matmul and the bf16 mode is refused with a message."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16), 32)
    except RuntimeError:
        return False
    return True


def auto_candidates() -> list[str]:
    """The modes quantization="auto" tries, fastest first for serving (many rows per step): a
    step of one row is bound by the weight bytes it streams, where int4's half-size weights
    lead, but a serving step has many rows and is bound by compute, where int8's integer
    kernels lead, then bf16's. int8 is offered only where the CPU has int8 dot-product units
    (VNNI, AMX): without them fbgemm's int8 product trails float32's at one row and at many
    (BENCHMARKS.md, the AVX2 EPYC's engine table), so no quality it keeps would buy speed. int4's
    and bf16's activations are bf16: offered only where the CPU computes bf16 natively (and
    oneDNN is there for bf16). None at all on a CPU with neither: float32, no probe of modes."""
    cpu = cpu_features()
    modes = ["int8"] if cpu.int8_units else []
    if cpu.bf16_units:
        modes += ["int4", "bf16"] if onednn_bf16_available() else ["int4"]
    return modes


@functools.cache
def int8_kernel_saturates() -> bool:
    """Whether this CPU's int8 kernel saturates with 8-bit activations, measured once: a row of
    ones (u8 255) times weights of one value (s8 127) makes pairs of products of 64,770, above
    an int16's 32,767, which fbgemm's path without VNNI sums in int16. The exact answer is known,
    so a saturating kernel shows by being off; what cpu_features() says is not trusted for it
    (the kernel fbgemm picks is its own decision)."""
    _use_x86_engine()
    k = 64
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(
            torch.full((8, k), 0.5),
            torch.full((8,), 0.5 / 127, dtype=torch.double),
            torch.zeros(8, dtype=torch.long),
            0,
            torch.qint8,
        )
        packed = torch.ops.quantized.linear_prepack(qw, None)
    x = torch.ones(3, k)
    x[2, 1::2] = -1.0  # the span row: the range is exactly [-1, 1]
    y = torch.ops.quantized.linear_dynamic(x, packed, False)[:2]
    # 1.0 quantizes to 255 - 128 = 127 steps of 2/255 (0.996): 2% off is rounding, a saturated
    # sum is off by about half
    return not torch.allclose(y, torch.full_like(y, 0.5 * k), rtol=0.02)


def _use_x86_engine() -> None:
    engines = torch.backends.quantized.supported_engines
    for name in ("x86", "fbgemm", "onednn"):
        if name in engines:
            if torch.backends.quantized.engine != name:
                torch.backends.quantized.engine = name
            return
    raise RuntimeError(
        f"quantization='int8' needs torch's x86 quantized engine; this torch has {engines}"
    )


def smoothing(w: torch.Tensor, act_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's factor per input channel of a float32 weight [out, in]: a few input channels
    carry activations far larger than the rest, and one int8 scale per row would flatten every
    other channel to a handful of levels. Int8Weight divides channel j by s_j = max|x_j|^alpha /
    max|w_j|^(1 - alpha) at run time and multiplies the weight's column j by it: the product is
    unchanged, the ranges are evened out."""
    return _smoothing(act_absmax.detach().float(), w.abs().amax(dim=0), alpha)


def _smoothing(act_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    a, wmax = act_absmax.clamp(min=1e-5), w_absmax.clamp(min=1e-5)
    return (a.pow(alpha) / wmax.pow(1 - alpha)).clamp(min=1e-5)


# 1 / the activations' int8 step (2 / 255), both as float32: what fbgemm multiplies by
_INT8_ACT_INV = float(1.0 / torch.tensor(2.0 / 255.0, dtype=torch.float32))


def smoothing_errors(
    weight: torch.Tensor, act_absmax: torch.Tensor, x2d: torch.Tensor, alphas=SMOOTH_ALPHAS
) -> torch.Tensor:
    """The summed squared error of Int8Weight's product of x2d [rows, in] against float32's, for
    each smoothing strength in `alphas` (a float64 vector), on at most SMOOTH_SEARCH_OUTPUTS of
    the weight's outputs. Int8Weight's rounding (weights per output channel to -127..127, each
    row scaled to [-1, 1] and rounded to 2/255 steps as fbgemm does) and exact int32 sums, but
    no weight packed per try; the calibration sums these over its text and keeps the strength
    that errs least (precision.calibrate)."""
    w = weight.detach().float()
    if w.shape[0] > SMOOTH_SEARCH_OUTPUTS:
        w = w[torch.linspace(0, w.shape[0] - 1, SMOOTH_SEARCH_OUTPUTS).round().long()]
    x = x2d.detach().float()
    want = x @ w.t()
    w_abs, x_abs = w.abs(), x.abs()  # (the smoothing factors are positive)
    a, w_in = act_absmax.detach().float(), w_abs.amax(dim=0)
    errors = torch.empty(len(alphas), dtype=torch.float64)
    for i, alpha in enumerate(alphas):
        smooth = _smoothing(a, w_in, alpha)
        step = (w_abs * smooth).amax(dim=1).div_(127.0).clamp_(min=1e-12)
        wq = torch.round((w * smooth).div_(step[:, None])).clamp_(-128, 127).to(torch.int8)
        inv = 1.0 / smooth
        rmax = (x_abs * inv).amax(dim=1, keepdim=True).clamp_(min=1e-6)
        # fbgemm's quantizer: x / rmax times 1 / (2 / 255) (127.49999 in float32) plus the zero
        # point 128, rounded once to float32 and then to the nearest even integer
        xn = (x * inv).div_(rmax).double().mul_(_INT8_ACT_INV).add_(128.0).float()
        xq = xn.round_().sub_(128.0).clamp_(-128, 127).to(torch.int8)
        got = _int8_sums(xq, wq).mul_(rmax / _INT8_ACT_INV).mul_(step)
        errors[i] = got.sub_(want).square_().sum().double()
    return errors


def _int8_sums(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """xq [rows, in] times wq [out, in] transposed, both int8: the exact integer sums, then in
    float32. torch's int8 product takes the CPU's int8 dot-product units where it has them (VNNI,
    AMX); without them it is a slow loop, and a float64 product is exact as well (each sum of
    int8 products is an integer far below 2^53) and several times faster."""
    if cpu_features().int8_units:
        return torch._int_mm(xq, wq.t()).float()
    return (xq.double() @ wq.t().double()).float()


class Int8Weight:
    """A weight [out, in] as torch's prepacked dynamic-quantization linear."""

    def __init__(
        self,
        weight: torch.Tensor,
        act_absmax: torch.Tensor | None = None,
        alpha: float = SMOOTH_ALPHA,
    ):
        _use_x86_engine()
        w = weight.detach().float()
        self.inv_smooth = None
        if act_absmax is not None:
            smooth = smoothing(w, act_absmax, alpha)
            w = w * smooth
            self.inv_smooth = 1.0 / smooth
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        # fbgemm's path without VNNI sums u8*s8 pairs in int16 and would saturate: a zero
        # column after each input column keeps one product per pair (the module docstring)
        self.spread = int8_kernel_saturates()
        if self.spread:
            w = torch.stack([w, torch.zeros_like(w)], dim=2).flatten(1)
        # the quantized-tensor constructors are deprecated, not gone
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)
        # as wide as the packed weight: int8_rows spreads the rows when it is twice theirs
        self.span_row = torch.ones(1, w.shape[1])
        self.span_row[0, 1::2] = -1.0
        self.out_features = w.shape[0]

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        fused = fused_for(x2d)
        if fused is not None:  # the same arithmetic as below, in one call
            x, rmax = fused.int8_rows(x2d, self.inv_smooth, self.span_row)
            return torch.ops.quantized.linear_dynamic(x, self.packed, False)[:-1].mul_(rmax)
        x = x2d.float() if self.inv_smooth is None else x2d.float() * self.inv_smooth
        # The kernel quantizes the whole matrix with one range, its min and max, but a few tokens
        # (the first, delimiters) carry activations orders of magnitude larger than the others',
        # which would crush every other row into a few levels. So every row is scaled to
        # [-1, 1] first (and the output row back), and one extra row spanning exactly [-1, 1]
        # pins the range: each row's quantization, hence its result, no longer depends on which
        # other rows share the step (batch-invariant, like float32 here).
        rmax = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-6)
        x = x / rmax
        if self.spread:
            x = torch.stack([x, torch.zeros_like(x)], dim=2).flatten(1)
        x = torch.cat([x, self.span_row])
        y = torch.ops.quantized.linear_dynamic(x, self.packed, False)[:-1].mul_(rmax)
        return y if x2d.dtype == torch.float32 else y.to(x2d.dtype)


class Int4Weight:
    """A weight [out, in] as int4 groups of INT4_GROUP input features (asymmetric, per group)."""

    def __init__(self, weight: torch.Tensor):
        w = weight.detach().float()
        n, k = w.shape
        if k % INT4_GROUP:
            raise ValueError(
                f"quantization='int4' needs in_features divisible by {INT4_GROUP}, got {k}"
            )
        # torch's int4 packing takes rows in sixteens: zero rows pad the last, sliced off the
        # product (a hybrid's merged projection ends with one row a value head for b and a)
        w = torch.cat([w, w.new_zeros((-n) % 16, k)]) if n % 16 else w
        groups = w.view(w.shape[0], k // INT4_GROUP, INT4_GROUP)
        lo = groups.amin(dim=-1, keepdim=True)
        hi = groups.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        rows = w.shape[0]
        q = ((groups - lo) / scale).round().clamp(0, 15).to(torch.int32).view(rows, k)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        # the kernel computes (q - 8) * scale + zero, so zero = lo + 8 * scale
        sz = torch.stack([scale.view(rows, -1), (lo + 8 * scale).view(rows, -1)], dim=-1)
        self.scales_zeros = sz.transpose(0, 1).contiguous().to(torch.bfloat16)
        self.out_features, self.padded = n, rows != n

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(
            x2d.to(torch.bfloat16).contiguous(), self.packed, INT4_GROUP, self.scales_zeros
        )
        return (y if y.shape[1] == self.out_features else y[:, : self.out_features]).to(x2d.dtype)


class Q4Blocks:
    """A float32 weight [out, in] that is exactly 4-bit blocks, kept as such for steps of few rows
    and multiplied to the bit as oneDNN multiplies the weight itself: in bf16 (the bf16 mode's
    Bf16Weight) or in float32 (the float32 mode's dense linears, engine/layers/linear.py).

    A weight that a GGUF file stored as Q4_0 or Q4_1 (the embedded SmolLM2 is Q4_1) dequantizes
    to exactly d * q + m in every block of 32 input features, q in 0..15 and d, m float16 values.
    `of` finds those blocks again (fused_cpu.cpp q4_blocks: Q4_1's m is each block's minimum and
    its span over 15 rounds to d as a float16; Q4_0's m = -8 d is its largest magnitude) and
    keeps them only if every rebuilt weight equals the dense one bit for bit. The compiled
    kernels rebuild them in registers and compute what oneDNN's kernel computes. In bf16
    (q4_linear): weight and activations rounded to bf16, products summed in float32 pair after
    pair in input order, in parts whose sums are added in order, a bf16 result. In float32
    (q4_linear_f32): one chain of fused multiply-adds in input order, in parts likewise.
    oneDNN's parts are measured (onednn_part) and the bits checked on this CPU before use
    (exact_blocks). So a row's logits, and the KV a decode step writes, are the same bits whether
    its step had one row or a hundred, and the same as a prefill of the same tokens writes: greedy
    tokens do not depend on the batch, on speculation or on reusing a turn's cached KV. At 0.625
    bytes a weight, a step of one to a few rows, which streams every weight once and is bound by
    those bytes, runs about 2.5x faster than on the bf16 weight at one row, more against
    float32's 4 bytes (Q4_ROWS)."""

    def __init__(self, blocks: torch.Tensor, part: int, dtype: torch.dtype = torch.bfloat16):
        self.blocks = blocks
        self.part = part
        self.dtype = dtype

    @staticmethod
    def of(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> Q4Blocks | None:
        """The weight's 4-bit blocks for oneDNN's `dtype` arithmetic (bfloat16 or float32), or
        None: not float32 on the CPU, out_features not a multiple of 16 or in_features of 32, a
        block not exactly d * q + m, oneDNN's order of sums not one the kernels reproduce, or no
        compiled kernels."""
        if not _blocks_may_fit(weight):
            return None
        # the blocks first: a weight that is not blocks stops at its first block, unprobed
        blocks = cpu_fused().q4_blocks(weight.detach().contiguous())
        if blocks is None:
            return None
        part = onednn_part(weight.shape[1], probe_outputs(weight), dtype)
        return None if part is None else Q4Blocks(blocks, part, dtype)

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        """x2d [rows, in] (float32 or bf16) times the weight: oneDNN's result in this dtype's
        arithmetic, handed back in x2d's dtype (as Bf16Weight.dense_matmul and the float32
        linear hand theirs back)."""
        if self.dtype == torch.float32:
            return cpu_fused().q4_linear_f32(x2d.float(), self.blocks, self.part).to(x2d.dtype)
        return cpu_fused().q4_linear(x2d, self.blocks, self.part).to(x2d.dtype)


class Q8Blocks:
    """A float32 weight [out, in] that is exactly 8-bit blocks: GGUF's Q8_0, d * q per block of 32
    input features, q in -128..127 and d a float16 value (the embedded SmolLM2's token embedding,
    and so its tied LM head, is Q8_0). Kept for the float32 mode's steps of few rows, multiplied
    by the compiled q8_linear_f32 in oneDNN's float32 arithmetic (the chains Q4Blocks describes)
    at 1.0625 bytes a weight instead of 4: SmolLM2's head is 113 MB in float32, the largest
    single read of a one-row step."""

    dtype = torch.float32

    def __init__(self, blocks: torch.Tensor, part: int):
        self.blocks = blocks
        self.part = part

    @staticmethod
    def of(weight: torch.Tensor) -> Q8Blocks | None:
        """The weight's 8-bit blocks, or None (as Q4Blocks.of, for 8-bit blocks)."""
        if not _blocks_may_fit(weight):
            return None
        blocks = cpu_fused().q8_blocks(weight.detach().contiguous())
        if blocks is None:
            return None
        part = onednn_part(weight.shape[1], probe_outputs(weight), torch.float32)
        return None if part is None else Q8Blocks(blocks, part)

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        return cpu_fused().q8_linear_f32(x2d.float(), self.blocks, self.part).to(x2d.dtype)


def probe_outputs(weight: torch.Tensor) -> int:
    """The outputs the order probes (onednn_part, q4_gives_onednn_bits) run with: the weight's,
    at most 512. Their weight of ones and its packed copy would be 226 MB for SmolLM2's head; the
    random rows exact_blocks multiplies by the weight itself check the whole width anyway."""
    return min(weight.shape[0], 512)


def _blocks_may_fit(weight: torch.Tensor) -> bool:
    """Whether a weight can be 4- or 8-bit blocks the kernels take: float32 on the CPU, out a
    multiple of 16 and in of 32, with compiled kernels and oneDNN present."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % INT4_GROUP == 0
        and weight.numel() > 0
        and cpu_fused() is not None
        and torch.backends.mkldnn.is_available()
    )


def exact_blocks(
    weight: torch.Tensor, dtype: torch.dtype, dense_matmul
) -> Q4Blocks | Q8Blocks | None:
    """The weight's blocks for oneDNN's `dtype` arithmetic (4-bit, or for float32 also 8-bit),
    kept only if their product gives `dense_matmul`'s bits (oneDNN on the weight itself): for
    4-bit blocks on rows that expose the order of the sums (once per shape), then for either on
    Q4_CHECK_ROWS random rows of this weight, in steps of Q4_ROWS rows as a decode step runs it.
    A refusal (another CPU's oneDNN summing otherwise) warns: every step then takes the dense
    weight, slower and the same tokens."""
    blocks = Q4Blocks.of(weight, dtype)
    if blocks is None and dtype == torch.float32:
        blocks = Q8Blocks.of(weight)
    if blocks is None:
        return None
    k, n = weight.shape[1], probe_outputs(weight)
    four = isinstance(blocks, Q4Blocks)
    exact = not four or q4_gives_onednn_bits(k, n, blocks.part, dtype)
    if exact:
        x = torch.randn(Q4_CHECK_ROWS, k, generator=torch.Generator().manual_seed(0))
        exact = torch.equal(
            torch.cat([blocks.matmul(c) for c in x.split(Q4_ROWS)]), dense_matmul(x)
        )
    if exact:
        return blocks
    name = "bf16" if dtype == torch.bfloat16 else "float32"
    warnings.warn(
        f"the {4 if four else 8}-bit product does not give oneDNN's {name} bits on this CPU: "
        "steps of few rows multiply the dense weight (slower, the same tokens)",
        stacklevel=3,
    )
    return None


# Random rows of the check that a weight's 4-bit product gives oneDNN's bits (exact_blocks),
# after the rows built to expose the order of the sums (q4_gives_onednn_bits).
Q4_CHECK_ROWS = 16


def cancelling_rows(in_features: int) -> torch.Tensor:
    """Rows whose sums, on a weight of ones, show how the sums run. For each block boundary c,
    row 2i has +2^24 just before input c, 1 just after and -2^24 after that: summed in one
    running order the 1 vanishes into 2^24 (whose float32 step is 2) before -2^24 cancels it
    (result 0); if a part of the sum starts at c, the 1 meets -2^24 first, exactly (2^24 - 1 is
    a float32), and survives (result 1). Row 2i + 1 puts +2^24 on the first input, 1 after c and
    -2^24 on the last: with the parts added in order the 1 survives only in the last part. (Placed
    so that bf16's pairs of inputs and float32's single chain read them the same way.)"""
    big = 2.0**24
    starts = range(INT4_GROUP, in_features, INT4_GROUP)
    x = torch.zeros(max(2 * len(starts), 2 * Q4_ROWS), in_features)
    for i, c in enumerate(starts):
        # the pairs are (2j, 2j + 1), the odd input's product added first
        x[2 * i, c - 2], x[2 * i, c + 1], x[2 * i, c + 3] = big, 1.0, -big
        x[2 * i + 1, 0], x[2 * i + 1, c + 1], x[2 * i + 1, -1] = big, 1.0, -big
    return x


def tile_rows(in_features: int) -> torch.Tensor:
    """Rows whose sums, on a weight of ones, tell oneDNN's bf16 order within a block and, in the
    tiles' order, its parts. Row 0 (+2^24, -2^24, 1) sums to 1 pair after pair (AVX512-BF16's
    order) and to 0 in the tiles' two chains (AMX's: the even inputs' +2^24 swallows the 1);
    row 1 (+2^24, 1, -2^24) the other way round. In the tiles' order each block of 32 inputs is
    summed from zero, so a part shows only in how block sums meet: for each block start s with a
    block on either side, a row with +2^24 in the block before s, 1 at s and -2^24 in the block
    after it sums to 1 if a part starts at s, else to 0 (the 1 lost to +2^24 first)."""
    big = 2.0**24
    starts = range(INT4_GROUP, in_features - INT4_GROUP, INT4_GROUP)
    x = torch.zeros(2 + len(starts), in_features)
    x[0, 0], x[0, 1], x[0, 2] = big, -big, 1.0
    x[1, 0], x[1, 1], x[1, 2] = big, 1.0, -big
    for i, c in enumerate(starts):
        x[2 + i, c - INT4_GROUP], x[2 + i, c], x[2 + i, c + INT4_GROUP] = big, 1.0, -big
    return x


def _onednn_on_ones(in_features: int, out_features: int, x: torch.Tensor, dtype) -> torch.Tensor:
    """oneDNN's product of x and a weight of ones, in steps of Q4_ROWS rows: the steps the 4-bit
    product stands in for. (oneDNN's AMX bf16 kernel for 33 rows and more sums otherwise than
    for fewer: there a step's bits depend on its size, oneDNN's own doing.)"""
    from pdserve.engine.layers.linear import onednn_linear  # (linear imports this module)

    ones = torch.ones(out_features, in_features, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(ones, 32)
    return torch.cat([onednn_linear(c.to(dtype), packed, None) for c in x.split(Q4_ROWS)])


@functools.cache
def onednn_part(
    in_features: int, out_features: int = 16, dtype: torch.dtype = torch.bfloat16
) -> int | None:
    """How oneDNN's linear of this shape and dtype sums a row's products in a step of at most
    Q4_ROWS rows, measured on oneDNN with cancelling_rows: in input order (bf16: pair after
    pair; float32: one chain), in parts of P inputs (its blocks of the inputs: on the AVX-512
    EPYC 512 up to 1,024 inputs and 1024 past that in both dtypes; with AVX2 only, float32 sums
    up to 1,024 inputs in one part; measured, not assumed), each part from zero, the parts added
    in order. Returns P (in_features: one part), or None if what it does is not that (then no
    4-bit product gives its bits). In bf16 on a CPU with AMX oneDNN sums in the tiles' order
    (tile_rows tells; fused_cpu.cpp q4_linear describes it): then -P, P found by _tiles_part."""
    k = in_features
    if k % INT4_GROUP or (dtype == torch.bfloat16 and not onednn_bf16_available()):
        return None
    starts = list(range(INT4_GROUP, k, INT4_GROUP))
    if dtype == torch.bfloat16:
        got = _onednn_on_ones(k, out_features, tile_rows(k), dtype)[:, 0].float().tolist()
        if got[:2] == [0.0, 1.0]:
            return _tiles_part(k, got[2:])
        if got[:2] != [1.0, 0.0]:
            return None
    if not starts:
        return k
    got = _onednn_on_ones(k, out_features, cancelling_rows(k), dtype)[: 2 * len(starts), 0]
    got = got.float().tolist()
    if any(v not in (0.0, 1.0) for v in got):
        return None
    bounds = [c for c, v in zip(starts, got[0::2]) if v == 1.0]
    part = bounds[0] if bounds else k
    if bounds != list(range(part, k, part)):
        return None
    last = (k - 1) // part * part  # the last part's first input (0: one part, +2^24's too)
    in_order = [1.0 if 0 < last <= c + 1 else 0.0 for c in starts]
    return part if got[1::2] == in_order else None


def _tiles_part(in_features: int, got: list[float]) -> int | None:
    """-P for oneDNN's bf16 sums in the tiles' order in parts of P inputs, from tile_rows' part
    rows (`got`, one a block start), or None if they show no such parts."""
    k = in_features
    starts = range(INT4_GROUP, k - INT4_GROUP, INT4_GROUP)
    if any(v not in (0.0, 1.0) for v in got):
        return None
    bounds = [c for c, v in zip(starts, got) if v == 1.0]
    part = bounds[0] if bounds else k
    return -part if bounds == list(range(part, k - INT4_GROUP, part)) else None


@functools.cache
def q4_gives_onednn_bits(
    in_features: int, out_features: int, part: int, dtype: torch.dtype = torch.bfloat16
) -> bool:
    """Whether the 4-bit product in parts of `part` gives oneDNN's `dtype` bits for this shape
    on cancelling_rows and tile_rows, whose results change with any other order of the sums."""
    ones = torch.ones(out_features, in_features)
    q4 = Q4Blocks(cpu_fused().q4_blocks(ones), part, dtype)
    x = torch.cat([cancelling_rows(in_features), tile_rows(in_features)])
    got = torch.cat([q4.matmul(c) for c in x.split(Q4_ROWS)])
    return torch.equal(got, _onednn_on_ones(in_features, out_features, x, dtype).to(got.dtype))


class Bf16Weight:
    """A weight [out, in] in bf16, packed for oneDNN: inputs rounded to bf16, products summed in
    float32, the result rounded to bf16 (oneDNN's output) and handed back as float32. Where the
    weight is exactly 4-bit blocks (Q4Blocks) and their product gives oneDNN's bits on this CPU
    (checked here, on random rows), a step of at most Q4_ROWS rows (one on a CPU with AMX:
    bf16_block_rows) multiplies those instead: the same bits, fewer bytes read. Where the CPU
    has AMX and fused_cpu.cpp's amx_linear gives oneDNN's bits for this shape (amx_product), or
    the compiled kernels have AVX512-BF16 and their own product (bf16_linear) gives them
    (own_product), every other step takes that product and oneDNN's packed copy is let go: on
    the AMX Xeon 1.4-1.6x faster at 1-32 rows, and batch-invariant past 32 rows where oneDNN is
    not; on the AVX-512 BF16 EPYC the same bits in 12-32% less time at 9-64 rows (oneDNN's at
    512 rows). On AMX a weight that is exactly 4-bit blocks is kept only as those (amx_blocks),
    which the tiles multiply at every step with amx_linear's bits: neither a bf16 copy nor
    Q4Blocks."""

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().to(torch.bfloat16), 32
        )
        self.out_features = weight.shape[0]
        self.bp, self.bp_part = None, 0  # (dense_matmul is oneDNN's while the checks run)
        self.q4 = exact_blocks(weight, torch.bfloat16, self.dense_matmul)
        self.q4_rows = bf16_block_rows()
        self.bp, self.bp_part = amx_product(weight, self.dense_matmul)
        if self.bp is not None:
            blocks = amx_blocks(weight, self.bp)
            if blocks is not None:  # (the same bits at every step size: the blocks take them all)
                self.bp, self.q4 = blocks, None
        if self.bp is None:
            self.bp, self.bp_part = own_product(weight, torch.bfloat16, self.dense_matmul)
        if self.bp is not None:
            self.packed = None  # (dense_matmul takes our product from now on: the same bits)

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.q4 is not None and x2d.shape[0] <= self.q4_rows:
            return self.q4.matmul(x2d)
        return self.dense_matmul(x2d)

    def dense_matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.bp is not None:
            return own_linear(x2d, self.bp, self.bp_part).to(x2d.dtype)
        from pdserve.engine.layers.linear import onednn_linear  # (linear imports this module)

        return onednn_linear(x2d.to(torch.bfloat16), self.packed, None).to(x2d.dtype)


# Row counts amx_blocks checks its product at: each of amx_q4_linear's paths, full or not
AMX_BLOCK_CHECK_ROWS = (1, 17, 32, 33, 80, 81)


def amx_blocks(weight: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
    """The weight's blocks for the tiles where it is exactly 4-bit blocks (a Q4_0 or Q4_1 GGUF's:
    q4_blocks, packed by amx_q4_pack for amx_q4_linear) or 8-bit ones (Q8_0's: q8_blocks, as
    int8, for amx_q8_linear) and that product gives amx_linear's bits on `packed` (amx_product's
    packing of it) on random rows, once per path (AMX_BLOCK_CHECK_ROWS); else None. The tiles
    multiply the blocks rebuilt in L1, reading 0.625 or 1.0625 bytes a weight instead of 2:
    SmolLM2's 120 decoder linears 1.6-1.8x faster than amx_linear at 1-32 rows, 1.1-1.4x at
    33-100, even from 512; its Q8_0 head as the bf16 mode's screen 1.3-1.7x at 1-80 rows, from
    memory (2 threads, the AMX Xeon, 2026-12-04)."""
    fused = cpu_fused()
    if not _blocks_may_fit(weight) or weight.shape[0] % 32 or packed.dtype != torch.bfloat16:
        return None
    w = weight.detach().contiguous()
    blocks = fused.q4_blocks(w)
    if blocks is not None:
        q = fused.amx_q4_pack(blocks)
    else:
        blocks = fused.q8_blocks(w)
        if blocks is None:
            return None
        q = blocks.view(torch.int8)
    gen = torch.Generator().manual_seed(0)
    for rows in AMX_BLOCK_CHECK_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=gen)
        if not torch.equal(amx_sums(x, q, False), fused.amx_linear(x, packed)):
            return None
    return q


def amx_sums(x2d: torch.Tensor, packed: torch.Tensor, float_out: bool) -> torch.Tensor:
    """x2d times a weight packed for the tiles: amx_product's packing (bfloat16) or amx_blocks'
    (uint8: 4-bit blocks, int8: 8-bit ones); bf16, or with float_out the float32 sums."""
    fused = cpu_fused()
    if packed.dtype == torch.uint8:
        return fused.amx_q4_linear(x2d, packed, float_out)
    if packed.dtype == torch.int8:
        return fused.amx_q8_linear(x2d, packed, float_out)
    return fused.amx_linear(x2d, packed, float_out)


# Row counts own_product checks its product at: each remainder of the kernels' 8-row pass
OWN_CHECK_ROWS = (1, 3, 8, 13, 40)
# Row counts amx_product checks its product at against oneDNN's: one or two row tiles, full or
# not. (Past 32 rows oneDNN's AMX kernel sums in another order, amx_linear in the same as here.)
AMX_CHECK_ROWS = (1, 3, 16, 17, 32)


def amx_product(weight: torch.Tensor, dense_matmul) -> tuple[torch.Tensor | None, int]:
    """(the weight packed for fused_cpu.cpp's amx_linear, its part: one, the whole row) where the
    CPU has AMX, the compiled kernels have that product, the shape is a multiple of 32 both ways
    and it gives `dense_matmul`'s bits (oneDNN's bf16 linear, which multiplies on the same tile
    instruction in the same order for steps of up to 32 rows): on rows that expose the order of
    the sums (once per shape, on a weight of ones), then on random rows of this weight in each of
    AMX_CHECK_ROWS row counts; else (None, 0). It streams the weights 1.4-1.6x faster than
    oneDNN's kernel at 1-32 rows and is even to 1.2x faster up to 1,024 rows, 0.74x at 2,048
    (SmolLM2's decoder linears on the AMX Xeon: docs/experiments/engine-decode-step.md), and a
    row's bits do not depend on the step's size."""
    fused = cpu_fused()
    if (
        fused is None
        or not cpu_features().has("amx_bf16")
        or not fused.amx_bf16_ready()
        or weight.dim() != 2
        or weight.shape[0] % 32
        or weight.shape[1] % 32
        or weight.device.type != "cpu"
        or weight.dtype != torch.float32
    ):
        return None, 0
    k, n = weight.shape[1], probe_outputs(weight)
    if not _amx_gives_onednn_bits(k, n):
        return None, 0
    packed = fused.amx_pack(weight.detach())
    gen = torch.Generator().manual_seed(0)
    for rows in AMX_CHECK_ROWS:
        x = torch.randn(rows, k, generator=gen)
        if not torch.equal(fused.amx_linear(x, packed).float(), dense_matmul(x).float()):
            return None, 0
    return packed, k


@functools.cache
def _amx_gives_onednn_bits(in_features: int, out_features: int) -> bool:
    """Whether amx_linear gives oneDNN's bf16 bits for this shape on cancelling_rows, whose
    results change with any other order of the sums."""
    fused = cpu_fused()
    ones = torch.ones(out_features, in_features)
    x = cancelling_rows(in_features)
    got = fused.amx_linear(x, fused.amx_pack(ones))
    return torch.equal(
        got, _onednn_on_ones(in_features, out_features, x, torch.bfloat16).to(got.dtype)
    )


def own_product(
    weight: torch.Tensor, dtype: torch.dtype, dense_matmul
) -> tuple[torch.Tensor | None, int]:
    """(the weight packed for our own product in oneDNN's `dtype` arithmetic, its part):
    fused_cpu.cpp's bf16_linear (bf16) or f32_linear (float32), where the compiled kernels have
    it on this CPU and it gives `dense_matmul`'s bits (oneDNN on the weight itself): on rows that
    expose the order of the sums (once per shape, on a weight of ones), then on random rows of
    this weight in each of OWN_CHECK_ROWS row counts; else (None, 0), and oneDNN keeps every
    step. bf16 not on a CPU with AMX: there the tile units multiply bf16 (oneDNN, or
    amx_product's packing), 4-25x faster than this product at 32-512 rows (SmolLM2's shapes, 2
    threads, 2026-12-04). (For float32 there see own_product_beside_blocks.)"""
    from pdserve.engine.cpu import cpu_features

    fused = cpu_fused()
    bf16 = dtype == torch.bfloat16
    if (
        fused is None
        or not (fused.bf16_linear_fast() if bf16 else fused.f32_linear_fast())
        or (bf16 and (cpu_features().has("amx_bf16") or not onednn_bf16_available()))
        or weight.dim() != 2
        or weight.shape[0] % 16
        or weight.device.type != "cpu"
        or weight.dtype != torch.float32
    ):
        return None, 0
    k, n = weight.shape[1], probe_outputs(weight)
    part = onednn_part(k, n, dtype)
    # (a negative part, the tiles' order, is not this product's)
    if part is None or part < 0 or not _own_gives_onednn_bits(k, n, part, dtype):
        return None, 0
    packed = (fused.bf16_pack if bf16 else fused.f32_pack)(weight.detach())
    gen = torch.Generator().manual_seed(0)
    for rows in OWN_CHECK_ROWS:
        x = torch.randn(rows, k, generator=gen)
        if not torch.equal(own_linear(x, packed, part).float(), dense_matmul(x).float()):
            return None, 0
    return packed, part


def own_linear(x2d: torch.Tensor, packed: torch.Tensor, part: int) -> torch.Tensor:
    """x2d times a weight own_product, amx_product or amx_blocks packed: bf16 out for a bf16
    mode's packing (bf16_linear's int16 bits, amx_linear's bfloat16, the tiles' blocks: uint8 or
    int8), float32 for a float32 one."""
    fused = cpu_fused()
    if packed.dtype in (torch.bfloat16, torch.uint8, torch.int8):
        return amx_sums(x2d, packed, False)  # (amx_product's or amx_blocks' packing: one part)
    if packed.dtype == torch.int16:
        return fused.bf16_linear(x2d, packed, part)
    return fused.f32_linear(x2d.float(), packed, part)


@functools.cache
def _own_gives_onednn_bits(in_features: int, out_features: int, part: int, dtype) -> bool:
    """Whether our own product in parts of `part` gives oneDNN's `dtype` bits for this shape on
    cancelling_rows, whose results change with any other order of the sums."""
    fused = cpu_fused()
    ones = torch.ones(out_features, in_features)
    packed = (fused.bf16_pack if dtype == torch.bfloat16 else fused.f32_pack)(ones)
    x = cancelling_rows(in_features)
    got = own_linear(x, packed, part)
    return torch.equal(got, _onednn_on_ones(in_features, out_features, x, dtype).to(got.dtype))


class ScreenedHead:
    """The LM head as a screen of every logit, then each row's HEAD_RESCORE best candidates
    rescored exactly in float32 from the dense weight (which the tied embedding keeps anyway; an
    untied head keeps its own). A row's top token, the greedy choice and the top-k logprobs are
    float32's; the other logits keep the screen's small error. The screen is int8 (Int8Weight),
    or bf16 (Bf16Weight) where the CPU has AMX: there the tile units screen SmolLM2's head 1.4-2x
    faster than int8's kernel at 32-128 rows (a step with speculation's guesses has that many;
    the weights read from memory, 2026-12-04), and bf16's rounding errs less than int8's."""

    def __init__(
        self,
        weight: torch.Tensor,
        act_absmax: torch.Tensor | None = None,
        screen: str | None = None,
        alpha: float = SMOOTH_ALPHA,
    ):
        if screen is None:  # (the CPU's)
            bf16 = cpu_features().has("amx_bf16") and onednn_bf16_available()
            screen = "bf16" if bf16 else "int8"
        if screen == "bf16":
            self.screen = Bf16Weight(weight)
        else:
            self.screen = Int8Weight(weight, act_absmax, alpha)
        self.weight = weight.detach().float()
        self.out_features = self.screen.out_features

    def screen_logits(self, x2d: torch.Tensor) -> torch.Tensor:
        """Every logit as the screen gives it, float32: a bf16 screen on the tiles hands over its
        float32 sums (amx_linear's float_out), without rounding them to bf16 and back."""
        bp = getattr(self.screen, "bp", None)
        if bp is not None and bp.dtype in (torch.bfloat16, torch.uint8, torch.int8):
            return amx_sums(x2d, bp, True)
        return self.screen.matmul(x2d).float()

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        y = self.screen_logits(x2d)
        k = min(HEAD_RESCORE, y.shape[1])
        if y.shape[0] and k:
            fused = fused_for(y)  # (fused_cpu.cpp topk_rows: one compare pass over each row)
            top = fused.topk_rows(y, k) if fused is not None else y.topk(k, 1, sorted=False).indices
            exact = torch.einsum("rk,rmk->rm", x2d.float(), self.weight[top])
            y.scatter_(1, top, exact)
        return y if x2d.dtype == torch.float32 else y.to(x2d.dtype)


def head_quantization(mode: str | None) -> str | None:
    """The LM head's mode under `mode`: every logit goes through the head. Under int4, int4's
    coarser steps there cost far more perplexity than int8's (the head is the tied embedding,
    stored as Q8_0 in the GGUF), and it stays int8; under bf16 it is the screened head
    ("screened": int8, or bf16 on a CPU with AMX, its best candidates rescored in float32)."""
    if mode == "int4":
        return "int8"
    return "screened" if mode == "bf16" else mode


def quantize_weight(
    mode: str,
    weight: torch.Tensor,
    act_absmax: torch.Tensor | None = None,
    alpha: float | None = None,
):
    """The prepared weight for `mode`: one of QUANTIZATIONS, or the head's own "screened".
    act_absmax and alpha: the calibration's largest input per channel and the smoothing strength
    it chose (None: SMOOTH_ALPHA), where the mode has int8 in it."""
    alpha = SMOOTH_ALPHA if alpha is None else alpha
    if mode == "int8":
        return Int8Weight(weight, act_absmax, alpha)
    if mode == "int4":
        return Int4Weight(weight)
    if mode == "bf16":
        if not onednn_bf16_available():
            raise ValueError(
                "quantization='bf16' needs oneDNN's bf16 linear, which this CPU lacks (it wants "
                "AVX-512 BW/VL/DQ or AVX-NE-CONVERT): use quantization='auto' or none"
            )
        return Bf16Weight(weight)
    if mode == "screened":
        return ScreenedHead(weight, act_absmax, alpha=alpha)
    raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")
