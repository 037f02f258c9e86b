"""The @triton.jit kernels of engine/kernels/fused_triton.py, which owns their launches, checks
and the switch. Lifecycle: fused_triton imports this module on the first use of a kernel (and
again after its reset()), so that triton reads TRITON_INTERPRET then; nothing else imports it.
Each kernel keeps the torch path's float32 arithmetic and its roundings to the activations' dtype
(see the comments); the launches pass enable_fp_fusion=False, so no product is fused into a sum.
"""

import triton
import triton.language as tl


@triton.jit
def norm(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, x_stride, res_stride, n, n_f, eps,
         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RES:  # the sum rounds to the activations' dtype, as torch's x + residual does
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean = tl.math.div_rn(tl.sum(xf * xf, axis=0), n_f)
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean + eps))
    y = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotate_heads(base, head_stride, n_heads, c1, c2, s1, s2,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < n_heads) & (d < HALF)
    p1 = base + h * head_stride + d
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    # q * cos + rotate_half(q) * sin, each product and the sum rounded to q's dtype
    lo = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
    hi = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(p1, lo.to(dt), mask=mask)
    tl.store(p1 + HALF, hi.to(dt), mask=mask)


@triton.jit
def rope(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, q_tok, q_head, k_tok, k_head, cos_row,
         n_q, n_k, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    dm = d < HALF
    dt = q_ptr.dtype.element_ty
    # the cache rows are cast to q's dtype first, as the torch path's .to(q.dtype)
    c1 = tl.load(cos_ptr + pos * cos_row + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * cos_row + HALF + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * cos_row + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * cos_row + HALF + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    rotate_heads(q_ptr + tok * q_tok, q_head, n_q, c1, c2, s1, s2, HALF, BLOCK_H, BLOCK_D)
    rotate_heads(k_ptr + tok * k_tok, k_head, n_k, c1, c2, s1, s2, HALF, BLOCK_H, BLOCK_D)


@triton.jit
def silu(gu_ptr, out_ptr, gu_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * gu_stride + width + cols, mask=mask, other=0.0)
    dt = g.dtype
    gf = g.to(tl.float32)
    # F.silu in float32, rounded to the dtype, then the product rounded again
    s = tl.math.div_rn(gf, 1.0 + tl.exp(-gf)).to(dt).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (s * u.to(tl.float32)).to(dt), mask=mask)
