"""The Triton source of engine/kernels/paged_decode_triton.py's decode kernel: imported on its
first use (not with the engine), so that Triton is imported only where it is used and reads
TRITON_INTERPRET then. Triton resolves a kernel's callees through its module's globals, which is
why both functions live at this module's top level."""

import triton
import triton.language as tl


@triton.jit
def tile(
    q, m_i, l_i, acc, n0, end, lo, row, kvh, k_ptr, v_ptr, tables_ptr,
    scale, softcap, stride_tab_row, stride_c_tok, stride_c_head, offs_d, dmask,
    BS: tl.constexpr, BLOCK: tl.constexpr, SOFTCAP: tl.constexpr, LOWP: tl.constexpr,
):  # fmt: skip
    """One BLOCK of a row's cached tokens into the running softmax (m_i, l_i, acc)."""
    offs_n = n0 + tl.arange(0, BLOCK)
    valid = (offs_n < end) & (offs_n >= lo)
    blk = tl.load(tables_ptr + row * stride_tab_row + offs_n // BS, mask=valid, other=0)
    tok = blk.to(tl.int64) * BS + (offs_n % BS)
    kv_off = tok[:, None] * stride_c_tok + kvh * stride_c_head + offs_d[None, :]
    kv_mask = valid[:, None] & dmask[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
    if LOWP:  # bf16/fp16 queries and cache: tensor cores, float32 sums
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    s = s * scale
    if SOFTCAP:  # cap * tanh(s / cap), tanh from exp (no libdevice in the interpreter)
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    if LOWP:
        pv = tl.dot(p.to(v.dtype), v)
    else:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def decode(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr,
    scale, softcap, window, chunk, num_q_heads,
    stride_q_row, stride_q_head, stride_tab_row, stride_c_tok, stride_c_head,
    BS: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    DP: tl.constexpr, BLOCK: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    NSPLIT: tl.constexpr, LOWP: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + row).to(tl.int32)
    first = split * chunk
    end = tl.minimum(first + chunk, ctx)
    lo = ctx * 0
    if WINDOW:  # nothing before the window: start at its first tile
        lo = tl.maximum(ctx - window, 0)
        first = tl.maximum(first, (lo // BLOCK) * BLOCK)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)
    gmask = offs_g < GROUP
    dmask = offs_d < D
    q_off = row * stride_q_row + (kvh * GROUP + offs_g)[:, None] * stride_q_head
    q = tl.load(q_ptr + q_off + offs_d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
    if not LOWP:
        q = q.to(tl.float32)
    m_i = tl.full([GP], -1e30, tl.float32)  # finite: a fully masked tile gives exp(-inf) = 0
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    if INTERPRET:  # the interpreter cannot range() over its scalars
        n0 = first
        while n0 < end:
            m_i, l_i, acc = tile(
                q, m_i, l_i, acc, n0, end, lo, row, kvh, k_ptr, v_ptr, tables_ptr,
                scale, softcap, stride_tab_row, stride_c_tok, stride_c_head, offs_d, dmask,
                BS, BLOCK, SOFTCAP, LOWP,
            )  # fmt: skip
            n0 += BLOCK
    else:  # a for loop, which the compiler pipelines (loads of the next tile in flight)
        for n0 in range(first, end, BLOCK):
            m_i, l_i, acc = tile(
                q, m_i, l_i, acc, n0, end, lo, row, kvh, k_ptr, v_ptr, tables_ptr,
                scale, softcap, stride_tab_row, stride_c_tok, stride_c_head, offs_d, dmask,
                BS, BLOCK, SOFTCAP, LOWP,
            )  # fmt: skip
    part = (row * num_q_heads + kvh * GROUP + offs_g) * NSPLIT + split
    tl.store(m_ptr + part, m_i, mask=gmask)
    tl.store(l_ptr + part, l_i, mask=gmask)
    out = acc_ptr + part[:, None] * DP + offs_d[None, :]
    tl.store(out, acc, mask=gmask[:, None] & dmask[None, :])
