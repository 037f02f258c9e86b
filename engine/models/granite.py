"""IBM's Granite (3.x and later dense models): Llama with four scalars from its config. The
embeddings are multiplied by `embedding_multiplier`, the attention scale is
`attention_multiplier` (not head_dim ** -0.5), each layer's attention and MLP outputs are
multiplied by `residual_multiplier` before they join the residual stream, and the logits are
divided by `logits_scaling`. Everything else (weights, sharding under tensor parallelism,
pipeline stages, quantized modes) is LlamaForCausalLM's; the compiled decode stack, which knows
none of the scalars, is not used.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm=None):
        nn.Module.__init__(self)
        hf = cfg.hf_config
        scale = float(hf.attention_multiplier)
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary, qk_norm=qk_norm, scale=scale)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = float(hf.residual_multiplier)

    def forward(self, positions, hidden, residual):
        """As Llama's, each branch's output scaled before the next norm adds it to the residual
        stream (the final norm adds the last layer's)."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    layer_class = GraniteDecoderLayer

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, qk_norm=None):
        super().__init__(cfg, rotary, qk_norm)
        self.embedding_multiplier = float(cfg.hf_config.embedding_multiplier)


class GraniteForCausalLM(LlamaForCausalLM):
    model_class = GraniteModel

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__(cfg, rotary)
        self.logits_scaling = float(cfg.hf_config.logits_scaling)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        return None if logits is None else logits / self.logits_scaling
