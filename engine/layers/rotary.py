"""Rotary position embeddings (HF "rotate half" layout) with a precomputed cos/sin cache.

Scaled variants (linear, llama3, yarn) take their inverse frequencies from transformers' own
`ROPE_INIT_FUNCTIONS`, so they match the reference implementation by construction. Types whose
frequencies change with the live sequence length (dynamic, longrope) do not fit a fixed cache over
paged KV and are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.kernels import fused_for

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(hf_config, rope_type: str, rope_theta: float, head_dim: int):
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {STATIC_ROPE_TYPES}"
        )
    if rope_type == "default":
        inv_freq = 1.0 / (
            rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
        )
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, attention_factor: float, max_position: int):
        super().__init__()
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)
        self._step_positions: torch.Tensor | None = None
        self._step_cos_sin = None

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim]. The compiled path rotates
        q and k in place (they are views of the step's fresh qkv projection)."""
        fused = fused_for(q)
        if fused is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            fused.rope_(q, k, positions, self.cos, self.sin)
            return q, k
        # one module serves every layer: look the step's positions up once, not once per layer
        if positions is not self._step_positions:
            self._step_positions = positions
            self._step_cos_sin = (
                self.cos[positions].unsqueeze(1).to(q.dtype),
                self.sin[positions].unsqueeze(1).to(q.dtype),
            )
        cos, sin = self._step_cos_sin
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
