"""Tencent's Hunyuan dense models (Hunyuan-0.5B to 7B Instruct: HunYuanDenseV1ForCausalLM).

Llama's layers with Qwen3's per-head RMSNorms of the queries and keys applied after the rotary
rather than before (`norm_after_rotary`; the checkpoint names them query_layernorm and
key_layernorm), and a rotary whose config says "dynamic" with a fixed `alpha`: NTK's stretch of
the base, the same at every length (engine/layers/rotary.py rope_inv_freq). Llama's loading,
stages and TP otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class HunYuanAttention(LlamaAttention):
    norm_after_rotary = True


class HunYuanDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg, layer_idx: int, rotary, qk_norm=None):
        super().__init__(cfg, layer_idx, rotary)
        self.self_attn = HunYuanAttention(cfg, layer_idx, rotary, qk_norm=RMSNorm)


class HunYuanModel(LlamaModel):
    layer_class = HunYuanDecoderLayer


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    model_class = HunYuanModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._renamed(weights))

    @staticmethod
    def _renamed(
        weights: Iterable[tuple[str, torch.Tensor]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.replace(".self_attn.query_layernorm.", ".self_attn.q_norm.")
            yield name.replace(".self_attn.key_layernorm.", ".self_attn.k_norm."), tensor
