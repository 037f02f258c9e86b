"""The compiled decode attention kernel gives the same bits whatever vector width it was built for:
on an AVX-512 machine, a second build without AVX-512 (its AVX2 paths, as an AMD EPYC without
AVX-512 compiles it) must return exactly what the native build returns, for float32 and bf16
caches, decode rows and prompt-chunk tiles, GQA groups 1-8, sliding windows and soft-caps. The
paths differ in layout (engine/kernels/paged_decode_cpu.cpp); the sums, their trees and the
exponential are the same. Integration lane: the second build compiles for about a minute."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import kernels
from pdserve.engine.cpu import cpu_features, kernel_cflags

native = kernels.cpu_paged_decode_ex()
pytestmark = [
    pytest.mark.skipif(native is None, reason="no C++ toolchain: the torch path is used"),
    pytest.mark.skipif(
        not cpu_features().has("avx512f") or bool(kernel_cflags()),
        reason="not an AVX-512 build here: there is no second vector width to compare with",
    ),
]


@pytest.fixture(scope="module")
def avx2():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_KERNEL_CFLAGS", "-mno-avx512f")
        module = kernels._build("paged_decode", kernels._SRC, [])
    assert module is not None, "the AVX2 build of the kernel failed"
    return module.paged_decode_ex


def cases():
    """(q, layer_kv, block_tables, context_lens, window, cap) covering both kernels' paths."""
    g = torch.Generator().manual_seed(7)
    for kv_dtype in (torch.float32, torch.bfloat16):
        for d, hq, hkv in (
            (64, 9, 3),
            (64, 8, 8),
            (128, 8, 2),
            (128, 8, 1),
            (32, 4, 2),
            (48, 4, 2),
        ):
            bs, blocks = 16, 64
            layer_kv = torch.randn(2, blocks, bs, hkv, d, generator=g).to(kv_dtype)
            # decode rows of every length class (under 4, under 16, 17, long), each its own blocks
            lens = [1, 3, 16, 17, 33, 100, 301]
            tables = torch.stack([torch.randperm(blocks, generator=g)[:20] for _ in lens])
            q = torch.randn(len(lens), hq, d, generator=g)
            for window, cap in ((0, 0.0), (40, 0.0), (0, 30.0)):
                yield q, layer_kv, tables, torch.tensor(lens), window, cap
            # a prompt chunk: rows over one block list whose lengths go up by one (tiles)
            rows = 19
            tables = torch.randperm(blocks, generator=g)[:20].repeat(rows, 1).contiguous()
            q = torch.randn(rows, hq, d, generator=g)
            yield q, layer_kv, tables, torch.arange(200, 200 + rows), 0, 0.0


@pytest.mark.parametrize("threads", [1, 2])
def test_the_avx2_build_gives_the_native_builds_bits(avx2, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 0
        for q, kv, tables, lens, window, cap in cases():
            want = native(q, kv, tables, lens, 0.125, window, cap, torch.empty(0))
            got = avx2(q, kv, tables, lens, 0.125, window, cap, torch.empty(0))
            assert torch.equal(got, want), (
                f"case {n}: {kv.dtype} head_dim {q.shape[2]}, {q.shape[1]}/{kv.shape[3]} heads, "
                f"window {window}, cap {cap}: max difference {(got - want).abs().max().item()}"
            )
            n += 1
        assert n == 48
    finally:
        torch.set_num_threads(old)
