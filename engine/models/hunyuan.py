"""Tencent's Hunyuan models: dense (Hunyuan-0.5B to 7B Instruct: HunYuanDenseV1ForCausalLM) and the
mixture of experts Hunyuan-A13B (HunYuanMoEV1ForCausalLM: in every layer a softmax top-k over
the experts, renormalized, beside a shared MLP, ungated; the gate's `wg` and the `shared_mlp` are
renamed to the MoE family's).

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
from pdserve.engine.models.moe import MoeForCausalLM, MoeModel, MoeSpec, sparse_mlp


class HunYuanAttention(LlamaAttention):
    norm_after_rotary = True


class HunYuanDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg, layer_idx: int, rotary, qk_norm=None):
        attn = HunYuanAttention(cfg, layer_idx, rotary, qk_norm=RMSNorm)
        super().__init__(cfg, layer_idx, rotary, attn=attn)


class HunYuanModel(LlamaModel):
    layer_class = HunYuanDecoderLayer


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    model_class = HunYuanModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_our_names(weights))


def _our_names(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hunyuan's names as the engine's: the per-head norms as q_norm and k_norm, and (the MoE's)
    the gate's `wg` as the gate, the shared MLP as FusedMoE's shared expert."""
    for name, tensor in weights:
        for old, new in _NAMES:
            name = name.replace(old, new)
        yield name, tensor


_NAMES = (
    (".self_attn.query_layernorm.", ".self_attn.q_norm."),
    (".self_attn.key_layernorm.", ".self_attn.k_norm."),
    (".mlp.gate.wg.", ".mlp.gate."),
    (".mlp.shared_mlp.", ".mlp.shared_expert."),
)


def hunyuan_moe_spec(cfg) -> MoeSpec:
    """Hunyuan-A13B's sparse MLP: every layer's, softmax top-k renormalized, beside a shared MLP
    of the experts' size (one expert count and top-k for all layers: a list of them, which the
    config allows, is refused)."""
    hf = cfg.hf_config
    if not isinstance(hf.num_experts, int) or not isinstance(hf.moe_topk, int):
        raise ValueError("Hunyuan with a count of experts or a top-k per layer is not supported")
    return MoeSpec(
        num_experts=hf.num_experts,
        top_k=hf.moe_topk,
        intermediate_size=hf.intermediate_size,
        renormalize=True,
        shared_intermediate_size=hf.intermediate_size,
        sparse_layers=frozenset(range(cfg.num_layers)),
    )


def hunyuan_moe_layer(cfg, spec: MoeSpec, layer_idx: int, rotary, qk_norm=None):
    attn = HunYuanAttention(cfg, layer_idx, rotary, qk_norm=RMSNorm)
    mlp = sparse_mlp(cfg, spec, shared_gated=False)
    return LlamaDecoderLayer(cfg, layer_idx, rotary, mlp=mlp, attn=attn)


class HunYuanMoEModel(MoeModel):
    make_layer = staticmethod(hunyuan_moe_layer)


class HunYuanMoEV1ForCausalLM(MoeForCausalLM):
    model_class = HunYuanMoEModel
    spec = staticmethod(hunyuan_moe_spec)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_our_names(weights))
