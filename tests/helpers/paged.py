"""Paged-decode cases for the Triton kernel's tests (tests/unit/test_paged_decode_triton.py under
the interpreter, tests/gpu/test_cuda_paged_decode.py compiled): a KV cache of NaN but for each
row's own tokens, scattered over the pool, and a float64 reference. Not a test module."""

from __future__ import annotations

import torch


def reference(q, cache, tables, lens, scale, window=None, softcap=None):
    n, hq, d = q.shape
    _, _, bs, hkv, _ = cache.shape
    out = torch.empty(n, hq, d, dtype=torch.float64)
    for r in range(n):
        length = int(lens[r])
        toks = torch.arange(length)
        k = cache[0][tables[r][toks // bs], toks % bs].double()
        v = cache[1][tables[r][toks // bs], toks % bs].double()
        lo = max(length - window, 0) if window else 0
        for h in range(hq):
            s = (k[lo:, h // (hq // hkv)] @ q[r, h].double()) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            out[r, h] = torch.softmax(s, 0) @ v[lo:, h // (hq // hkv)]
    return out


def paged_case(hq, hkv, d, bs, width, lens, dtype=torch.float32, seed=0):
    """A cache of NaN but for each row's own tokens, in blocks scattered over the pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // bs) for n in lens) + 3
    cache = torch.full((2, blocks, bs, hkv, d), float("nan"), dtype=dtype)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    order = torch.randperm(blocks, generator=gen).tolist()
    for r, n in enumerate(lens):
        for i in range(-(-n // bs)):
            tables[r, i] = order.pop()
        for t in range(n):
            cache[:, tables[r, t // bs], t % bs] = torch.randn(2, hkv, d, generator=gen)
    q = torch.randn(len(lens), hq, d, generator=gen)
    return q, cache, tables, torch.tensor(lens)


# (q heads, kv heads, head size, block size, table width, lengths, window, softcap)
CASES = {
    "gqa": (4, 2, 16, 16, 4, [1, 17, 64], None, None),
    "mqa-small-blocks": (8, 1, 64, 4, 16, [3, 40, 64], None, None),
    "plain-heads": (4, 4, 32, 16, 8, [5, 100, 128], None, None),
    "head-48-window": (6, 2, 48, 16, 8, [20, 33, 120], 32, None),
    "softcap": (4, 2, 16, 16, 8, [9, 70, 128], None, 30.0),
    "window-softcap-split": (4, 2, 16, 16, 64, [1000, 300, 1024], 200, 50.0),
    "group-3-split": (9, 3, 64, 16, 64, [1, 513, 1024], None, None),
}
