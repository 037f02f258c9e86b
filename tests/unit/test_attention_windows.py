"""Sliding windows, logit soft-capping and attention sinks in PagedAttention's decode, on both of
its paths (the compiled kernel's paged_decode_ex and the torch gather + mask), against a plain
reference (a sink as one more logit, dropped after the softmax, as transformers' gpt-oss); and the
promise the sliding-window KV bound relies on: a windowed decode never lets a position before
its window count, even a NaN there (the compiled kernel reads no block wholly before the window,
and of the window's first block only the K rows, whose scores it then masks)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import PagedAttention
from pdserve.engine.forward_context import AttentionMetadata, forward_context
from pdserve.engine.kernels import cpu_paged_decode_ex

NO_SINKS = torch.empty(0)


def reference(q, layer_kv, tables, lens, scale, window, softcap, sinks=None):
    n, hq, d = q.shape
    hkv = layer_kv.shape[3]
    out = torch.empty_like(q)
    for i in range(n):
        length = int(lens[i])
        start = max(0, length - window) if window else 0
        kv = layer_kv[:, tables[i]].reshape(2, -1, hkv, d)[:, start:length]
        k = kv[0].repeat_interleave(hq // hkv, dim=1)
        v = kv[1].repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,lhd->hl", q[i], k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if sinks is not None:
            s = torch.cat((s, sinks[:, None]), dim=-1)
        p = torch.softmax(s, dim=-1)[:, : v.shape[0]]
        out[i] = torch.einsum("hl,lhd->hd", p, v)
    return out


def case(seed, n, hkv, group, d, bs, max_blocks=9, num_blocks=64):
    g = torch.Generator().manual_seed(seed)
    layer_kv = torch.randn(2, num_blocks, bs, hkv, d, generator=g)
    q = torch.randn(n, hkv * group, d, generator=g) * 3  # large scores: the cap matters
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in range(n)])
    lens = torch.randint(1, max_blocks * bs + 1, (n,), generator=g)
    lens[0] = 1
    lens[-1] = max_blocks * bs
    return q, layer_kv, tables, lens


def poison_before_windows(layer_kv, tables, lens, bs, window):
    """NaN in every slot of each sequence's table before its window (blocks may be shared: only
    slots no sequence's window covers are poisoned)."""
    kv = layer_kv.clone()
    needed = set()
    for t, length in zip(tables.tolist(), lens.tolist()):
        needed |= {t[p // bs] * bs + p % bs for p in range(max(0, length - window), length)}
    flat = kv.view(2, -1, *kv.shape[3:])
    for t, length in zip(tables.tolist(), lens.tolist()):
        for p in range(max(0, length - window)):
            slot = t[p // bs] * bs + p % bs
            if slot not in needed:
                flat[:, slot] = float("nan")
    return kv


SHAPES = [(5, 2, 2, 16, 4), (7, 3, 3, 64, 16), (3, 1, 5, 32, 8), (4, 4, 1, 128, 16)]


@pytest.mark.skipif(cpu_paged_decode_ex() is None, reason="no C++ toolchain")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (32, 0.0), (0, 5.0), (20, 5.0)])
@pytest.mark.parametrize("n,hkv,group,d,bs", SHAPES)
def test_kernel_window_and_softcap(threads, window, softcap, n, hkv, group, d, bs):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kv, tables, lens = case(n * 7 + d, n, hkv, group, d, bs)
        want = reference(q, kv, tables, lens, d**-0.5, window, softcap)
        if window:  # positions before the window are never read
            kv = poison_before_windows(kv, tables, lens, bs, window)
        got = cpu_paged_decode_ex()(q, kv, tables, lens, d**-0.5, window, softcap, NO_SINKS)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(cpu_paged_decode_ex() is None, reason="no C++ toolchain")
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("n,hkv,group,d,bs", SHAPES)
def test_kernel_sinks(window, n, hkv, group, d, bs):
    """Each query head's sink joins its softmax: on single rows (register kernels for head dims
    16-128, the generic one for a group of 5) and on a prompt chunk's tiled rows."""
    q, kv, tables, lens = case(n * 5 + d, n, hkv, group, d, bs)
    sinks = torch.linspace(-3.0, 6.0, hkv * group)  # from no effect to most of the mass
    kernel = cpu_paged_decode_ex()
    got = kernel(q, kv, tables, lens, d**-0.5, window, 0.0, sinks)
    want = reference(q, kv, tables, lens, d**-0.5, window, 0.0, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rows = 9  # a prompt chunk: one block list, lengths one apart (attend_rows' tiles)
    tiled = tables[-1:].repeat(rows, 1).contiguous()
    tiled_lens = torch.arange(20, 20 + rows)
    tiled_q = torch.randn(rows, hkv * group, d, generator=torch.Generator().manual_seed(d))
    got = kernel(tiled_q, kv, tiled, tiled_lens, d**-0.5, window, 0.0, sinks)
    want = reference(tiled_q, kv, tiled, tiled_lens, d**-0.5, window, 0.0, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def decode_with(attn: PagedAttention, q, kv, tables, lens, bs, torch_path: bool):
    """PagedAttention's decode of q over one layer's cache (writing q's own K/V is skipped: the
    cache is the test's)."""
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        num_decode_tokens=q.shape[0],
        decode_block_tables=tables,
        decode_context_lens=lens,
        kv_cache=kv.unsqueeze(0),
    )
    if torch_path:
        span = torch.arange(tables.shape[1] * bs)
        meta.decode_mask = (span[None, :] < lens[:, None])[:, None, None, :]
    with forward_context(meta):
        return attn._decode(q, kv, meta)


@pytest.mark.parametrize("torch_path", [True, False])
@pytest.mark.parametrize(
    "window,softcap,sinks",
    [
        (None, None, False),
        (7, None, False),
        (None, 4.0, False),
        (30, 4.0, False),
        (None, None, True),
        (7, None, True),
    ],
)
def test_paged_attention_decode_paths(torch_path, window, softcap, sinks):
    if not torch_path and cpu_paged_decode_ex() is None:
        pytest.skip("no C++ toolchain")
    n, hkv, group, d, bs = 6, 2, 2, 16, 4
    q, kv, tables, lens = case(11, n, hkv, group, d, bs)
    attn = PagedAttention(
        0, hkv * group, hkv, d, scale=0.3, window=window, softcap=softcap, sinks=sinks
    )
    if sinks:
        attn.sinks.data.copy_(torch.tensor([-2.0, 0.5, 2.0, 5.0]))
    sink_logits = attn.sinks.detach() if sinks else None
    want = reference(q, kv, tables, lens, 0.3, window or 0, softcap or 0.0, sink_logits)
    if window and not torch_path:
        kv = poison_before_windows(kv, tables, lens, bs, window)
    elif window:  # the torch path gathers them, masked: finite garbage must not count
        kv = kv.clone()
        for t, length in zip(tables.tolist(), lens.tolist()):
            for p in range(max(0, length - window)):
                kv[:, t[p // bs], p % bs] += 1000.0 * (p % 3 - 1)
        want = reference(q, kv, tables, lens, 0.3, window, softcap or 0.0, sink_logits)
    got = decode_with(attn, q, kv, tables, lens, bs, torch_path)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
