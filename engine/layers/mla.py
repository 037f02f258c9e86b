"""Multi-head latent attention (DeepSeek V2 and V3, Kimi K2) over the paged KV cache.

An MLA layer caches one latent per token instead of per-head keys and values: the normalized
compression `c` (kv_lora_rank values) and the rotated positional key `k_pe` (qk_rope_head_dim
values, shared by every head), 576 values a token a layer for DeepSeek V3, where its 128 heads
of 192/128 dims would cache 40,960. That is what makes a disaggregated hand-off of an MLA model
cheap, and the engine keeps it so: the latent's first half lives in the cache's K plane and its
second half in the V plane (ModelConfig.kv_latent_dim: one "KV head" of half the latent), so the
block manager, prefix cache, host and disk tiers and every KV transport move it unchanged.

Two equal ways to attend it, each where it costs least (vLLM's and SGLang's choice too):
- a prompt chunk expands its context's latents into per-head keys and values with kv_b_proj and
  attends them as ordinary attention (a chunk's FLOPs dominate; the expanded heads are small);
- a decode row absorbs kv_b_proj into the query (q_nope @ W_UK per head) and attends the latents
  themselves as one shared key/value head (multi-query attention over 576 values), then applies
  W_UV to the result; a step reads each cached latent once instead of expanding it.
kv_b_proj keeps its dense weight in the model's dtype (no quantization) for the absorbed path.
Under tensor parallelism each rank holds its share of the heads (q_proj or q_b_proj, kv_b_proj
and o_proj sharded as Llama's) and the whole latent, which every rank computes alike
(kv_a_proj_with_mqa is replicated): a hand-off sends it from one rank and writes it into every
rank (kvtransfer/layout.py `replicas`). CUDA is refused for now (not run on a GPU yet).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.parallel import divide, stage_layers, tp_size

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's (the reference's default)


def softmax_scale(hf_config, qk_dim: int) -> float:
    """qk_dim ** -0.5, times YaRN's mscale squared where the rope is scaled with mscale_all_dim
    (DeepSeek's reference scales the scores' non-rotary dims too, as transformers does)."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    rope = rope or {}
    scale = qk_dim**-0.5
    kind = rope.get("rope_type", rope.get("type", "default"))
    factor, mscale_all_dim = float(rope.get("factor") or 1.0), rope.get("mscale_all_dim")
    if kind != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentUpProjection(ColumnParallelLinear):
    """kv_b_proj: each head's key (no position) and value from the latent. Decode rows use its
    per-head slices directly (the absorbed form), so it keeps its dense weight in the model's
    dtype under every quantization mode (a prompt chunk's expansion multiplies the same values)."""

    def finalize(self, quantization: str | None = None, release_dense: bool = True) -> None:
        super().finalize(None, release_dense=False)


class MLAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        hf = cfg.hf_config
        self.num_heads = divide(cfg.num_heads, tp_size(), "the attention heads")
        self.nope, self.rope = int(hf.qk_nope_head_dim), int(hf.qk_rope_head_dim)
        self.v_dim, self.rank = int(hf.v_head_dim), int(hf.kv_lora_rank)
        qk_dim = self.nope + self.rope
        bias = bool(getattr(hf, "attention_bias", False))
        heads = cfg.num_heads
        q_rank = getattr(hf, "q_lora_rank", None)
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if q_rank:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, q_rank, bias)
            self.q_a_layernorm = RMSNorm(q_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(q_rank, heads * qk_dim)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, heads * qk_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, self.rank + self.rope, bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(self.rank, heads * (self.nope + self.v_dim))
        self.o_proj = RowParallelLinear(heads * self.v_dim, cfg.hidden_size, bias)
        self.rotary = rotary
        # DeepSeek V3 lays each rotary pair out side by side (rope_interleave, its default);
        # V2 always does. Deinterleaving queries and keys alike leaves every score unchanged.
        self.interleaved = bool(getattr(hf, "rope_interleave", True))
        self.scale = softmax_scale(hf, qk_dim)
        self.layer = layer_idx - stage_layers(cfg.num_layers)[0]

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])
        q = q.view(-1, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())[0]
        q_pe, k_pe = self._rotate(positions, q_pe, k_pe.unsqueeze(1))
        latent = torch.cat((c, k_pe.squeeze(1)), dim=-1)
        return self.o_proj(self._attend(q_nope, q_pe, latent))

    def _rotate(self, positions, q_pe, k_pe):
        if self.interleaved:
            q_pe = torch.cat((q_pe[..., 0::2], q_pe[..., 1::2]), dim=-1)
            k_pe = torch.cat((k_pe[..., 0::2], k_pe[..., 1::2]), dim=-1)
        return self.rotary(positions, q_pe.contiguous(), k_pe.contiguous())

    def _attend(self, q_nope, q_pe, latent):
        """[T, heads * v_head_dim]: the step's tokens attend their context's latents, this
        step's written first."""
        meta = get_forward_context()
        cache = meta.kv_cache[self.layer]  # [2, num_blocks, block_size, 1, latent / 2]
        half = cache.shape[-1]
        flat = cache.view(2, -1, half)
        if flat.dtype != latent.dtype and meta.prefills:
            # a prompt chunk attends its own latents as the cache will hold them (rounded), as
            # later chunks and decodes read them (engine/attention.py says why)
            latent = latent.to(flat.dtype).to(latent.dtype)
        flat[0].index_copy_(0, meta.slot_mapping, latent[:, :half].to(flat.dtype))
        flat[1].index_copy_(0, meta.slot_mapping, latent[:, half:].to(flat.dtype))
        if meta.on_layer_done is not None:  # this layer's KV is final: it may leave now
            meta.on_layer_done(self.layer)
        n, nd = q_nope.shape[0], meta.num_decode_tokens
        out = q_nope.new_empty(n, self.num_heads, self.v_dim)
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], cache, meta)
        for span in meta.prefills:
            sl = slice(span.q_start, span.q_start + span.q_len)
            out[sl] = self._prefill(q_nope[sl], q_pe[sl], latent[sl], cache, span)
        return out.view(n, -1)

    def _up_weights(self):
        """(W_UK [heads, nope, rank], W_UV [heads, v_dim, rank]): kv_b_proj's per-head slices."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def _decode(self, q_nope, q_pe, cache, meta):
        """Absorbed: scores over the latents themselves, one key/value head for all queries.
        Each plane is multiplied where it lies (one gather of both, no joined copy): a score is
        the first half of the query against the K plane plus the second against the V plane,
        and the output's first `rank` dims are the weighted K plane and the V plane's head."""
        w_uk, w_uv = self._up_weights()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [n, heads, rank]
        q_full = torch.cat((q_lat, q_pe), dim=-1)  # [n, heads, latent]
        n, half = q_nope.shape[0], cache.shape[-1]
        tables = meta.decode_block_tables
        planes = cache.view(2, cache.shape[1], -1).index_select(1, tables.reshape(-1))
        k0, k1 = planes.view(2, n, -1, half).to(q_nope.dtype).unbind(0)  # [n, S, half] each
        scores = torch.bmm(q_full[..., :half], k0.transpose(1, 2))
        scores.baddbmm_(q_full[..., half:], k1.transpose(1, 2)).mul_(self.scale)  # [n, heads, S]
        scores.masked_fill_(~meta.decode_mask.view(n, 1, -1), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_nope.dtype)
        if self.rank <= half:  # (every released model's rank is past half the latent)
            o = torch.bmm(probs, k0[..., : self.rank])
        else:
            o = torch.cat((torch.bmm(probs, k0), torch.bmm(probs, k1[..., : self.rank - half])), -1)
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(self, q_nope, q_pe, latent, cache, span):
        """Expanded: each context latent becomes per-head keys and values (kv_b_proj)."""
        mask, causal = None, True
        if span.causal_mask is not None:  # a chunk after a cached context: read it all back
            kv = cache[:, span.block_ids].view(2, -1, cache.shape[-1])[:, : span.context_len]
            latent = torch.cat((kv[0], kv[1]), dim=-1).to(q_nope.dtype)
            mask, causal = span.causal_mask, False
        c, k_pe = latent.split([self.rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c.contiguous()).view(-1, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        # values widened with zeros to the queries' width (torch's fused CPU attention takes equal
        # widths only, else it runs unfused: 2.2x slower on a 2048-token prompt); cut after
        v = F.pad(v, (0, q.shape[-1] - self.v_dim))
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
        )  # [1, heads, q_len, qk_dim]
        return o.squeeze(0).transpose(0, 1)[..., : self.v_dim]
