"""Attention over the paged KV cache (torch implementation; runs on CPU and CUDA).

Decodes are batched. On CPU in float32 a compiled kernel (engine/kernels) reads their blocks in
place; otherwise their blocks are gathered with one index op per layer and attended with one SDPA
call. A prompt chunk with no cached context attends its own fresh K/V with a causal kernel
and skips the gather entirely; a chunk after a cached prefix gathers its context once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.kernels import cpu_paged_decode


def decode_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype | None = None
):
    """The compiled paged decode kernel where it applies (float32 queries, a float32 or bf16 KV
    cache), else None (use the torch path)."""
    kv_ok = kv_dtype in (None, torch.float32, torch.bfloat16)
    if device.type == "cpu" and dtype == torch.float32 and kv_ok and head_dim % 16 == 0:
        return cpu_paged_decode()
    return None


class PagedAttention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim]."""
        meta = get_forward_context()
        cache = meta.kv_cache[self.layer_idx]  # [2, num_blocks, block_size, H, D]
        flat = cache.view(2, -1, self.num_kv_heads, self.head_dim)
        narrow = flat.dtype != k.dtype  # a KV cache kept narrower than the activations
        flat[0].index_copy_(0, meta.slot_mapping, k.to(flat.dtype) if narrow else k)
        flat[1].index_copy_(0, meta.slot_mapping, v.to(flat.dtype) if narrow else v)
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:  # a decode-only step: no output buffer to assemble
            return self._decode(q, cache, meta).reshape(nd, -1)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], cache, meta)
        for span in meta.prefills:
            sl = slice(span.q_start, span.q_start + span.q_len)
            out[sl] = self._prefill(q[sl], k[sl], v[sl], cache, span)
        return out.view(q.shape[0], -1)

    def _decode(self, q, cache, meta):
        if meta.decode_mask is None:
            kernel = decode_kernel(q.device, q.dtype, self.head_dim, cache.dtype)
            with torch.profiler.record_function("pdserve::paged_decode"):
                return kernel(
                    q.contiguous(),
                    cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    self.scale,
                )
        n = q.shape[0]
        kv = cache[:, meta.decode_block_tables]  # [2, n, max_blocks, block_size, H, D]
        kv = kv.view(2, n, -1, self.num_kv_heads, self.head_dim).transpose(2, 3).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            kv[0],
            kv[1],
            attn_mask=meta.decode_mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)

    def _prefill(self, q, k, v, cache, span):
        if span.causal_mask is None:  # no cached context: attend the fresh K/V directly
            keys, values, mask, causal = k, v, None, True
        else:
            kv = cache[:, span.block_ids].view(2, -1, self.num_kv_heads, self.head_dim)
            keys, values = kv[0, : span.context_len], kv[1, : span.context_len]
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            mask, causal = span.causal_mask, False
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)
