"""GLM-4 dense (GLM-4-0414 9B and 32B, GLM-Z1): Llama's attention (q/k/v biases) and gated MLP
inside Gemma's sandwich of four norms a layer (each branch's output normalized again before it
joins the residual stream: post_self_attn_layernorm, post_mlp_layernorm), with a partial rotary
(half of each head) that turns neighbouring pairs of values.

The loader reorders the rotated part of every query and key head (its rows and biases) from
neighbouring pairs (2i, 2i + 1) into halves (i, i + rot / 2), the pairs Llama's RotaryEmbedding
turns by the same frequency; the values that pass through unrotated keep their places. Queries
and keys reordered alike keep every score. The checkpoint's fused gate_up_proj is split as
Phi-3's. The mixtures of experts GLM-4.5/4.6 are engine/models/deepseek.py's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding, pairs_as_halves
from pdserve.engine.models.llama import LlamaAttention, LlamaMLP, LlamaModel, Phi3ForCausalLM


class Glm4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm=None):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary)
        self.mlp = LlamaMLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, positions, hidden, residual):
        """(hidden, residual) in and out: the residual stream is their sum (or hidden alone)."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(positions, hidden))[0]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden))[0], residual


class Glm4Model(LlamaModel):
    layer_class = Glm4DecoderLayer


class Glm4ForCausalLM(Phi3ForCausalLM):
    model_class = Glm4Model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._halved(weights))

    def _halved(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        rot = self.model.rotary.cos.shape[-1]  # (the rotated values of a head)
        for name, tensor in weights:
            if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
                tensor = pairs_as_halves(tensor, self.config.head_dim, rot)
            yield name, tensor
