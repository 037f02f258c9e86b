"""Cohere's Command R7B and Command A (Cohere2ForCausalLM): a parallel block under one LayerNorm,
sliding layers with rotary beside full-attention layers without it, and scaled logits.

Each layer normalizes its input once (a LayerNorm: the mean taken out, a weight, no bias) and
feeds it to attention and the MLP side by side; both outputs join the residual stream together.
Three layers of four slide (their window, ModelConfig.layer_windows) and rotate queries and keys;
the fourth attends the whole context with no position encoding at all. Cohere's rotary turns
neighbouring pairs of values, so the loader reorders each query and key head into the halves
Llama's RotaryEmbedding turns (rotary.py pairs_as_halves). The logits are the tied embedding's
times `logit_scale`. Llama's attention, gated MLP, embedding, stages and loading otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.norm import LayerNorm
from pdserve.engine.layers.rotary import RotaryEmbedding, pairs_as_halves
from pdserve.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel


class Cohere2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary, qk_norm=None):
        super().__init__()
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary)  # (rotary None: no position)
        self.mlp = LlamaMLP(cfg)

    def forward(self, positions, hidden, residual):
        """(hidden, residual) in and out, as Llama's layers pass them: the stream is their sum."""
        normed, stream = self.input_layernorm(hidden, residual)
        return self.self_attn(positions, normed) + self.mlp(normed), stream


class Cohere2Model(LlamaModel):
    layer_class = Cohere2DecoderLayer

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, qk_norm=None):
        super().__init__(cfg, rotary, qk_norm)
        if self.norm is not None:  # (the last stage's: LayerNorm, not RMSNorm)
            self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def layer_rotaries(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> list:
        """The sliding layers rotate; the full-attention ones have no position encoding."""
        return [rotary if window else None for window in cfg.layer_windows]

    def prepare_decode_stack(self) -> None:
        self._stack = None  # (its layers are not the compiled stack's)


class Cohere2ForCausalLM(LlamaForCausalLM):
    model_class = Cohere2Model

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__(cfg, rotary)
        self.logit_scale = float(getattr(cfg.hf_config, "logit_scale", 1.0) or 1.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return None if logits is None else logits * self.logit_scale

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._halved(weights))

    def _halved(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
                tensor = pairs_as_halves(tensor, self.config.head_dim)
            yield name, tensor
