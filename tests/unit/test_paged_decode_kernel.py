"""The compiled CPU decode kernel against a plain torch reference over the same paged cache. Its
build in a process of its own: tests/integration/test_paged_decode_kernel_build.py."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import cpu_paged_decode

kernel = cpu_paged_decode()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ toolchain: the torch path is used")


def reference(q, layer_kv, block_tables, context_lens, scale):
    n, hq, d = q.shape
    hkv = layer_kv.shape[3]
    out = torch.empty_like(q)
    for i in range(n):
        length = int(context_lens[i])
        kv = layer_kv[:, block_tables[i]].reshape(2, -1, hkv, d)[:, :length]  # [2, L, Hkv, D]
        k = kv[0].repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v = kv[1].repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i], k) * scale, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", p, v)
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "n,hkv,group,d,bs",
    [
        (1, 3, 3, 64, 16),  # one sequence: fewer tasks than threads, split by head
        (7, 3, 3, 64, 16),  # the SmolLM2 shape
        (5, 1, 4, 128, 4),  # MQA, head_dim 128, small blocks
        (4, 4, 1, 64, 8),  # no GQA
        (3, 2, 2, 16, 16),
    ],
)
def test_kernel_matches_reference(threads, n, hkv, group, d, bs):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(n * 100 + d)
        num_blocks, max_blocks = 64, 9
        layer_kv = torch.randn(2, num_blocks, bs, hkv, d, generator=g)
        q = torch.randn(n, hkv * group, d, generator=g)
        tables = torch.stack(
            [torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in range(n)]
        )
        lens = torch.randint(1, max_blocks * bs + 1, (n,), generator=g)
        lens[0] = 1  # a prompt of one token
        lens[-1] = max_blocks * bs  # a completely full block table
        got = kernel(q, layer_kv, tables, lens, d**-0.5)
        torch.testing.assert_close(
            got, reference(q, layer_kv, tables, lens, d**-0.5), rtol=1e-5, atol=1e-5
        )
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_cache_reads_as_its_float32_values(threads):
    """A bf16 KV cache (kv_cache_dtype="bfloat16") is widened exactly: the same result as the
    float32 kernel over the same values."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(5)
        layer_kv = torch.randn(2, 32, 16, 3, 64, generator=g).bfloat16()
        q = torch.randn(4, 9, 64, generator=g)
        tables = torch.stack([torch.randperm(32, generator=g)[:6] for _ in range(4)])
        lens = torch.tensor([1, 17, 50, 96])
        got = kernel(q, layer_kv, tables, lens, 0.125)
        assert torch.equal(got, kernel(q, layer_kv.float(), tables, lens, 0.125))
        torch.testing.assert_close(
            got, reference(q, layer_kv.float(), tables, lens, 0.125), rtol=1e-5, atol=1e-5
        )
    finally:
        torch.set_num_threads(old)


def test_kernel_rejects_bad_inputs():
    q = torch.randn(2, 4, 64)
    kv = torch.randn(2, 8, 16, 2, 64)
    tables = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="context length"):
        kernel(q, kv, tables, torch.tensor([5, 33]), 0.1)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(q.double(), kv, tables, torch.tensor([5, 3]), 0.1)
    with pytest.raises(RuntimeError, match="power of two"):  # (slots by shift and mask)
        kernel(q, torch.randn(2, 8, 12, 2, 64), tables, torch.tensor([5, 3]), 0.1)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel(torch.randn(2, 4, 8), torch.randn(2, 8, 16, 2, 8), tables, torch.tensor([5, 3]), 0.1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "hkv,group,d,bs,first,rows",
    [
        (3, 3, 64, 16, 1, 37),  # SmolLM2: a prompt chunk from its first token
        (3, 3, 64, 16, 200, 21),  # a chunk after a cached prefix
        (1, 4, 128, 4, 3, 9),
        (2, 8, 128, 16, 5, 8),
        (4, 1, 64, 8, 1, 64),
        (2, 2, 16, 16, 30, 5),
    ],
)
def test_rows_of_a_chunk_get_the_bits_they_get_alone(
    threads, kv_dtype, hkv, group, d, bs, first, rows
):
    """A prompt chunk's rows (one block list, context lengths one apart) attend together in
    tiles; each row's result must be the one it gets alone, bit for bit (batch invariance: a
    prompt's logits do not depend on how it was cut into chunks or what shared its step). Rows
    of other sequences in the same call keep theirs too."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(first * 7 + rows)
        width = (first + rows + bs - 1) // bs + 1
        layer_kv = torch.randn(2, 2 * width + 4, bs, hkv, d, generator=g).to(kv_dtype)
        blocks = torch.randperm(2 * width + 4, generator=g)[:width]
        other = torch.randperm(2 * width + 4, generator=g)[:width]
        # a decode row of another sequence, the chunk's rows, another decode row
        tables = torch.stack([other] + [blocks] * rows + [other])
        lens = torch.cat([torch.tensor([7]), torch.arange(first, first + rows), torch.tensor([3])])
        q = torch.randn(rows + 2, hkv * group, d, generator=g)
        got = kernel(q, layer_kv, tables, lens, d**-0.5)
        alone = torch.cat(
            [
                kernel(q[i : i + 1], layer_kv, tables[i : i + 1], lens[i : i + 1], d**-0.5)
                for i in range(rows + 2)
            ]
        )
        assert torch.equal(got, alone)
        torch.testing.assert_close(
            got, reference(q, layer_kv.float(), tables, lens, d**-0.5), rtol=1e-5, atol=1e-5
        )
    finally:
        torch.set_num_threads(old)
