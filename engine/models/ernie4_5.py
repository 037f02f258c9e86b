"""Baidu's ERNIE 4.5 text models: the dense 0.3B (Ernie4_5ForCausalLM) and the mixtures of experts
21B-A3B and 300B-A47B (Ernie4_5_MoeForCausalLM).

Both are Llama's layers with a rotary that turns neighbouring pairs of every head's values
(GLM's style), which the loader reorders into the halves Llama's RotaryEmbedding turns
(rotary.py pairs_as_halves). The mixture of experts routes by a softmax over the experts,
chooses each token's top-k by probability plus a per-expert correction bias
(`moe_statics.e_score_correction_bias`), weighs them by their probabilities renormalized (a sum
kept above moe_norm_min), and adds the shared experts (one MLP of moe_num_shared_experts x
moe_intermediate_size, ungated). The layers from moe_layer_start_index to moe_layer_end_index,
every moe_layer_interval-th, are sparse; the others dense. Experts load as the MoE family's
(engine/models/moe.py: per-expert names, or transformers' fused tensors).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.moe import RouterLinear
from pdserve.engine.layers.rotary import pairs_as_halves
from pdserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pdserve.engine.models.moe import MoeForCausalLM, MoeModel, MoeSpec, sparse_mlp


def _halved(
    weights: Iterable[tuple[str, torch.Tensor]], head_dim: int
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            tensor = pairs_as_halves(tensor, head_dim)
        yield name, tensor


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_halved(weights, self.config.head_dim))


class ErnieRouter(RouterLinear):
    """ERNIE 4.5's router (module docstring): softmax probabilities, the choice biased."""

    def __init__(self, hidden_size: int, spec: MoeSpec, norm_min: float):
        super().__init__(hidden_size, spec.num_experts, bias=False)
        self.top_k, self.norm_min = spec.top_k, norm_min
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(spec.num_experts), requires_grad=False
        )
        self.e_score_correction_bias.weight_loader = self._load_bias

    @staticmethod
    def _load_bias(param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.reshape(-1))  # (the checkpoint's is [1, experts])

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits.float(), dim=-1)
        ids = torch.topk(probs + self.e_score_correction_bias.float(), self.top_k, dim=-1)[1]
        weights = probs.gather(1, ids)
        return weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min), ids


def ernie_spec(cfg: ModelConfig) -> MoeSpec:
    hf = cfg.hf_config
    end = hf.moe_layer_end_index
    end = cfg.num_layers - 1 if end == -1 else end
    return MoeSpec(
        num_experts=hf.moe_num_experts,
        top_k=hf.moe_k,
        intermediate_size=hf.moe_intermediate_size,
        renormalize=True,
        shared_intermediate_size=hf.moe_intermediate_size * (hf.moe_num_shared_experts or 0),
        sparse_layers=frozenset(
            i
            for i in range(cfg.num_layers)
            if (i + 1) % hf.moe_layer_interval == 0 and hf.moe_layer_start_index <= i <= end
        ),
    )


def ernie_layer(cfg: ModelConfig, spec: MoeSpec, layer_idx: int, rotary, qk_norm=None):
    mlp = None  # (dense: Llama's)
    if layer_idx in spec.sparse_layers:
        router = ErnieRouter(cfg.hidden_size, spec, float(cfg.hf_config.moe_norm_min))
        mlp = sparse_mlp(cfg, spec, router=router, shared_gated=False)
    return LlamaDecoderLayer(cfg, layer_idx, rotary, mlp=mlp)


class Ernie4_5_MoeModel(MoeModel):
    make_layer = staticmethod(ernie_layer)


class Ernie4_5_MoeForCausalLM(MoeForCausalLM):
    model_class = Ernie4_5_MoeModel
    spec = staticmethod(ernie_spec)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._renamed(_halved(weights, self.config.head_dim)))

    @staticmethod
    def _renamed(
        weights: Iterable[tuple[str, torch.Tensor]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The correction bias (the hub's `mlp.moe_statics.`, transformers' in-memory
        `mlp.gate.moe_statics.`) as the router's own; the shared experts as FusedMoE's one."""
        for name, tensor in weights:
            name = name.replace(".gate.moe_statics.", ".gate.").replace(".moe_statics.", ".gate.")
            yield name.replace(".mlp.shared_experts.", ".mlp.shared_expert."), tensor
