"""Attention over the paged KV cache (torch implementation; runs on CPU and CUDA).

Decode rows are batched. On CUDA a Triton kernel (engine/kernels/paged_decode_triton.py) reads
their blocks in place through the block tables; on CPU in float32 a compiled kernel does, and
there every token of a step is such a row, prompt chunks included (ModelRunner._attention_inputs):
a row's result depends on its position and context only, never on how its prompt was cut into
chunks or what else shared the step. Otherwise decode rows' blocks are
gathered with one index op per layer and attended with one SDPA call, a prompt chunk with no
cached context attends its own fresh K/V with a causal kernel and skips the gather, and a chunk
after a cached prefix gathers its context once. A chunk's mask may let a query see keys after its
own (Gemma 3's image tokens see their whole image: model_runner.py _prefill_span); such a chunk
is always a span, and a sliding window bounds its mask from below only. A layer with chunked
attention (Llama 4) sees keys from the start of the query's own chunk of positions only; it runs
on the torch path (masks), never the compiled or Triton kernels.

A layer may have its own scale, a sliding window (a query sees itself and the window - 1 tokens
before it; older positions are masked, and the compiled decode kernel reads no block wholly before
the window, so such blocks may be handed to other sequences) and logit soft-capping
(Gemma 2: scores become cap * tanh(score / cap); SDPA cannot do that, so such a layer's prefill
and torch-path decode attend with explicit matmuls), or a learned sink logit per head (gpt-oss:
one more score in each query's softmax, of a key with no value, so a head may attend to almost
nothing): the torch path attends without it and scales each row by sigmoid(logsumexp - sink), the
share of the mass the keys keep; the compiled kernel adds it to the softmax's maximum and sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.kernels import (
    cpu_fused,
    cpu_paged_decode,
    cpu_paged_decode_ex,
    paged_decode_triton as paged_triton,
)
from pdserve.engine.parallel import tp_rank

_NO_SINKS = torch.empty(0)  # (paged_decode_ex's sinks argument for a layer without them)


def decode_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype | None = None
):
    """The compiled paged decode kernel where it applies (float32 queries, a float32 or bf16 KV
    cache), else None (use the torch path)."""
    kv_ok = kv_dtype in (None, torch.float32, torch.bfloat16)
    if device.type == "cpu" and dtype == torch.float32 and kv_ok and head_dim % 16 == 0:
        return cpu_paged_decode()
    return None


def model_decode_kernel(model_config, device, dtype, kv_dtype=None):
    """decode_kernel for a model's attention layers: None for an MLA model, whose layers attend
    their latents with their own code (engine/layers/mla.py), and for one with chunked
    attention (Llama 4: the kernels know no per-row chunk; every layer takes the torch path)."""
    if model_config.kv_latent_dim or any(model_config.layer_chunks):
        return None
    return decode_kernel(device, dtype, model_config.head_dim, kv_dtype)


def _write_kv(flat: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k and v into the cache's slots: on CPU by the compiled row copy (fused_cpu.cpp kv_write_,
    which rounds float32 into a bf16 cache as .to(bfloat16) does) where it takes the tensors,
    else by index_copy_."""
    fused = cpu_fused() if flat.device.type == "cpu" else None
    for half, x in ((flat[0], k), (flat[1], v)):
        if (
            fused is not None
            and (
                x.dtype == flat.dtype or (x.dtype == torch.float32 and flat.dtype == torch.bfloat16)
            )
            and x.stride(-1) == 1
            and x.stride(-2) == x.shape[-1]
        ):
            fused.kv_write_(half, slots, x)
        else:
            half.index_copy_(0, slots, x.to(flat.dtype))


class PagedAttention(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        chunk: int | None = None,
    ):
        """sinks: each head has a learned sink logit (`sinks`, this rank's heads of the
        checkpoint's `self_attn.sinks`); chunk: chunked attention (Llama 4), a query sees the
        keys from the start of its own chunk of positions (a multiple of `chunk`) up to itself,
        on the torch path only (the model's decode kernel is None: model_decode_kernel)."""
        super().__init__()
        if sinks and softcap:
            raise ValueError("attention sinks with logit soft-capping are not supported")
        if chunk and window:
            raise ValueError("a layer has a sliding window or an attention chunk, not both")
        self.chunk = int(chunk) if chunk else None
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        self.window = int(window) if window else None
        self.softcap = float(softcap) if softcap else None
        self.sinks = None
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[0]  # this rank's heads
        param.data.copy_(loaded.narrow(0, tp_rank() * n, n))

    @property
    def plain(self) -> bool:
        """No window, no soft-capping, no sinks, the default scale: what the fused decode stack
        runs."""
        return (
            self.window is None
            and self.chunk is None
            and self.softcap is None
            and self.sinks is None
            and self.scale == self.head_dim**-0.5
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim]."""
        meta = get_forward_context()
        cache = meta.kv_cache[self.layer_idx]  # [2, num_blocks, block_size, H, D]
        flat = cache.view(2, -1, self.num_kv_heads, self.head_dim)
        narrow = flat.dtype != k.dtype  # a KV cache kept narrower than the activations
        # Only prompt chunks attended by SDPA (meta.prefills) read k and v after this; every other
        # row reads its K/V from the cache.
        narrow_read = narrow and bool(meta.prefills)
        if narrow_read:
            # A prompt chunk attends its own K/V as the cache will hold them (rounded), as later
            # chunks and decodes read them: else where a prompt is cut into chunks (the step's
            # budget, what else runs in the step) would change its logits.
            k, v = k.to(flat.dtype), v.to(flat.dtype)
        _write_kv(flat, meta.slot_mapping, k, v)
        if meta.on_layer_done is not None:  # this layer's KV is final: it may leave now
            meta.on_layer_done(self.layer_idx)
        if narrow_read:
            k, v = k.to(q.dtype), v.to(q.dtype)
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
        if self.chunk is None and paged_triton.applies(q):
            try:
                return paged_triton.paged_decode(
                    q,
                    cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    self.scale,
                    self.window,
                    self.softcap,
                )
            except Exception as err:  # a compiler or launch failure: the torch path from now
                paged_triton.switch_off(err)
        if meta.decode_mask is None:
            with torch.profiler.record_function("pdserve::paged_decode"):
                if self.window is None and self.softcap is None and self.sinks is None:
                    kernel = decode_kernel(q.device, q.dtype, self.head_dim, cache.dtype)
                    return kernel(
                        q.contiguous(),
                        cache,
                        meta.decode_block_tables,
                        meta.decode_context_lens,
                        self.scale,
                    )
                return cpu_paged_decode_ex()(
                    q.contiguous(),
                    cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    self.scale,
                    self.window or 0,
                    self.softcap or 0.0,
                    _NO_SINKS if self.sinks is None else self.sinks.detach(),
                )
        n = q.shape[0]
        kv = cache[:, meta.decode_block_tables]  # [2, n, max_blocks, block_size, H, D]
        kv = kv.view(2, n, -1, self.num_kv_heads, self.head_dim).transpose(2, 3).to(q.dtype)
        mask = meta.decode_mask
        if self.window is not None:  # [n, 1, 1, S]: also nothing before the window
            start = (meta.decode_context_lens - self.window)[:, None, None, None]
            mask = mask & (torch.arange(mask.shape[-1], device=mask.device) >= start)
        if self.chunk is not None:  # nor before the row's own chunk
            start = ((meta.decode_context_lens - 1) // self.chunk * self.chunk)[:, None, None, None]
            mask = mask & (torch.arange(mask.shape[-1], device=mask.device) >= start)
        o = self._attend(q.unsqueeze(2), kv[0], kv[1], mask, False)
        return o.squeeze(2)

    def _prefill(self, q, k, v, cache, span):
        if span.causal_mask is None:  # no cached context: attend the fresh K/V directly
            keys, values, mask, causal = k, v, None, True
            if self.window is not None:
                pos = torch.arange(span.q_len, device=q.device)
                mask = _window_mask(pos, pos, self.window)
                causal = False
            elif self.chunk is not None:
                pos = torch.arange(span.q_len, device=q.device)
                mask = _chunk_floor(pos, pos, self.chunk) & (pos[:, None] >= pos[None, :])
                causal = False
        else:
            kv = cache[:, span.block_ids].view(2, -1, self.num_kv_heads, self.head_dim)
            keys, values = kv[0, : span.context_len], kv[1, : span.context_len]
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            mask, causal = span.causal_mask, False
            if self.window is not None:
                q_pos = torch.arange(
                    span.context_len - span.q_len, span.context_len, device=q.device
                )
                k_pos = torch.arange(span.context_len, device=q.device)
                # the window's floor only: the span's mask says what is visible above it (Gemma
                # 3's image tokens see their whole image, later tokens too, as transformers'
                # sliding mask over its bidirectional image blocks)
                mask = mask & (q_pos[:, None] - k_pos[None, :] < self.window)
            if self.chunk is not None:
                q_pos = torch.arange(
                    span.context_len - span.q_len, span.context_len, device=q.device
                )
                k_pos = torch.arange(span.context_len, device=q.device)
                mask = mask & _chunk_floor(q_pos, k_pos, self.chunk)
        o = self._attend(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            mask,
            causal,
        )
        return o.squeeze(0).transpose(0, 1)

    def _attend(self, q, k, v, mask, causal):
        """q [B, Hq, Tq, D], k and v [B, Hkv, Tk, D], mask broadcastable to [B, Hq, Tq, Tk]."""
        if self.sinks is not None:
            return self._attend_sinks(q, k, v, mask, causal)
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True
            )
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:
            tq, tk = scores.shape[-2:]
            mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)

    def _attend_sinks(self, q, k, v, mask, causal):
        """_attend with each head's sink logit in its softmax: torch's CPU flash attention gives
        the keys' logsumexp beside its output, and a row keeps sigmoid(lse - sink) of its mass."""
        if mask is not None and mask.dtype == torch.bool:  # (the op takes an additive mask)
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~mask, float("-inf")
            )
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=self.scale
        )
        keep = torch.sigmoid(lse.float() - self.sinks.float().view(1, -1, 1))
        return o * keep.unsqueeze(-1).to(o.dtype)


def _chunk_floor(q_pos: torch.Tensor, k_pos: torch.Tensor, chunk: int) -> torch.Tensor:
    """[len(q_pos), len(k_pos)]: the key is not before the start of the query's chunk."""
    return k_pos[None, :] >= (q_pos // chunk * chunk)[:, None]


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[len(q_pos), len(k_pos)]: causal and within the window (k > q - window)."""
    diff = q_pos[:, None] - k_pos[None, :]
    return (diff >= 0) & (diff < window)
