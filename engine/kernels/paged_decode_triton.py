"""Decode attention on CUDA that reads the paged KV cache in place: one Triton kernel.

On CUDA, decode rows used to gather each sequence's blocks into a padded tensor and run SDPA on
it, reading every cached K/V twice and writing it once more. `paged_decode` reads each row's
blocks straight from the cache through its block table instead: one program per (row, KV head,
split of the context) loads the query heads that share that KV head, walks the split's tokens
BLOCK_N at a time with an online softmax in float32 (scores, running maximum and sum, the
weighted values), and writes its partial result; a few torch ops then merge the splits
(flash-decoding). The number of splits comes from the shapes only (batch, heads, the block
table's width), never from the context lengths' values, so a CUDA graph can record the launch.
Sliding windows skip the blocks wholly before the window; Gemma's soft-cap is applied to the
scores. All arithmetic is float32 whatever the cache's dtype (`input_precision="ieee"` keeps
tl.dot off TF32).

Lifecycle: `available()` says whether Triton imports; PagedAttention calls `paged_decode` for
its decode rows on CUDA. A first launch that fails (no Triton for this GPU, a compiler error)
raises here, and attention.py switches the kernel off for the process with one warning. With
TRITON_INTERPRET=1 set before Triton is imported the same kernel runs on CPU tensors (tests).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

BLOCK_N = 32  # cache tokens a program loads per iteration
MAX_SPLITS = 32
TOKENS_PER_SPLIT = 128  # the least context worth a program of its own
TARGET_PROGRAMS = 1056  # about eight programs per multiprocessor on an H100/H200 (132)


_off: list[str] = []  # why the kernel was switched off for this process, once it was


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # not installed, or installed without a working backend
        return False
    return True


def applies(q: torch.Tensor) -> bool:
    """Whether decode rows with queries like `q` take this kernel: on CUDA where Triton imports
    and no launch has failed in this process. PDSERVE_TRITON_DECODE=off keeps the torch path;
    =interpret sends CPU rows here too (tests, with TRITON_INTERPRET=1)."""
    if _off or not (q.is_cuda or _mode() == "interpret"):  # (CPU rows: one attribute read)
        return False
    return _mode() != "off" and available()


def _mode() -> str:
    return os.environ.get("PDSERVE_TRITON_DECODE", "")


def switch_off(err: BaseException) -> None:
    """After a failed launch: the torch path for the rest of the process, said once."""
    _off.append(repr(err))
    log.warning("Triton paged decode off for this process (%r); decode gathers blocks", err)


@functools.cache
def _kernel():
    from pdserve.engine.kernels.paged_decode_jit import decode

    return decode


def _pow2(n: int, least: int) -> int:
    p = least
    while p < n:
        p *= 2
    return p


def num_splits(rows: int, kv_heads: int, max_tokens: int) -> int:
    """How many programs share a row's context: enough to fill the GPU when rows x heads do not,
    none holding less than TOKENS_PER_SPLIT tokens. Shapes only (graph-safe)."""
    by_length = -(-max_tokens // TOKENS_PER_SPLIT)
    by_occupancy = -(-TARGET_PROGRAMS // max(rows * kv_heads, 1))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def paged_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [n, Hq, D] (one token a row); cache [2, blocks, block_size, Hkv, D] (one layer's);
    tables [n, width] block ids; lens [n] context lengths (the row's own token included) ->
    [n, Hq, D] in q's dtype."""
    n, hq, d = q.shape
    _, _, bs, hkv, _ = cache.shape
    group = hq // hkv
    q = q.contiguous()
    flat = cache.view(2, -1, hkv, d)
    k, v = flat[0], flat[1]
    max_tokens = tables.shape[1] * bs
    splits = num_splits(n, hkv, max_tokens)
    chunk = -(-max_tokens // splits)
    chunk = -(-chunk // BLOCK_N) * BLOCK_N
    dp = _pow2(d, 16)
    acc = torch.empty(n * hq * splits, dp, dtype=torch.float32, device=q.device)
    m = torch.empty(n * hq * splits, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    _kernel()[(n, hkv, splits)](
        q, k, v, tables, lens, acc, m, l_sum,
        float(scale), float(softcap or 0.0), int(window or 0), chunk, hq,
        q.stride(0), q.stride(1), tables.stride(0), k.stride(0), k.stride(1),
        BS=bs, GROUP=group, GP=_pow2(group, 16), D=d, DP=dp, BLOCK=BLOCK_N,
        SOFTCAP=bool(softcap), WINDOW=bool(window), NSPLIT=splits,
        LOWP=q.dtype == cache.dtype and q.dtype in (torch.bfloat16, torch.float16),
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
    )  # fmt: skip
    m = m.view(n, hq, splits)
    w = torch.exp(m - m.amax(-1, keepdim=True))
    out = (acc.view(n, hq, splits, dp)[..., :d] * w[..., None]).sum(2)
    return (out / (l_sum.view(n, hq, splits) * w).sum(-1, keepdim=True)).to(q.dtype)
