"""Llama 4 (Scout, Maverick) text decoders: Meta's mixture of experts with chunked attention.

Three kinds of layer meet here. Attention: most layers rotate queries and keys and attend in
chunks (a query sees the keys from the start of its own aligned chunk of
`attention_chunk_size` positions, ModelConfig.layer_chunks: engine/attention.py), then scale
each query and key head to unit RMS (a norm without weights, `use_qk_norm`); every fourth layer
(`no_rope_layers`) has no rotary, attends the whole context, and scales its queries up with the
position (attention temperature tuning: 1 + attn_scale x log(1 + floor((position + 1) /
floor_scale))). Llama 4 rotates each pair of neighbouring head values (the complex form); the
loader reorders every query and key head's rows into the halves Llama's rotary turns (even
values, then odd ones), which leaves every score as it was. Feed-forward: the layers in
`moe_layers` (every one for Scout, every other for Maverick) route each token to its top-k
experts by a sigmoid of the router's top logits, weighing the token's input to the expert
(FusedMoE weigh_inputs), and add a shared expert, ungated; the others are dense MLPs of
`intermediate_size_mlp`. Checkpoints keep the experts fused ([E, H, 2I] and [E, I, H]), split
per expert on the way in (MoeForCausalLM).

A Llama4ForConditionalGeneration checkpoint (the released Instruct ones) is served by this
class for its text: engine/config.py reads its language model, and its vision tower is left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.moe import RouterLinear
from pdserve.engine.layers.rotary import RotaryEmbedding, pairs_as_halves
from pdserve.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    query_temperature,
)
from pdserve.engine.models.moe import MoeForCausalLM, MoeModel, MoeSpec, sparse_mlp


class Llama4Attention(LlamaAttention):
    """Llama's attention with Llama 4's weightless q/k norm after the rotary (rotary layers)
    and its temperature tuning of the queries (layers without rotary)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(cfg, layer_idx, rotary)
        hf = cfg.hf_config
        self.eps = cfg.rms_norm_eps
        self.unit_qk = bool(getattr(hf, "use_qk_norm", True)) and self.rotary is not None
        self.temperature = None  # (query_temperature's arguments: the layers without rotary)
        if self.rotary is None and getattr(hf, "attn_temperature_tuning", True):
            self.temperature = (1.0, float(hf.floor_scale), float(hf.attn_scale))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        if self.unit_qk:
            q, k = _unit_rms(q, self.eps), _unit_rms(k, self.eps)
        if self.temperature is not None:
            q = (q * query_temperature(positions, *self.temperature)[:, None, None]).to(q.dtype)
        return self.o_proj(self.attn(q, k, v))


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head's values over their RMS (in float32, as transformers' weightless norm)."""
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Router(RouterLinear):
    """Llama 4's router: each token's top-k experts by logit, weighed by the sigmoid of their
    logits (no softmax over the experts, no renormalizing)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__(hidden_size, num_experts, bias=False)
        self.top_k = top_k

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.sigmoid(top.float()), ids


def llama4_spec(cfg: ModelConfig) -> MoeSpec:
    hf = cfg.hf_config
    return MoeSpec(
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.intermediate_size,
        renormalize=False,
        shared_intermediate_size=hf.intermediate_size,
        sparse_layers=frozenset(hf.moe_layers),
    )


def llama4_layer(cfg: ModelConfig, spec: MoeSpec, layer_idx: int, rotary, qk_norm=None):
    """A Llama 4 layer: its attention, and experts (with a shared one) or a dense MLP."""
    if layer_idx in spec.sparse_layers:
        router = Llama4Router(cfg.hidden_size, spec.num_experts, spec.top_k)
        mlp = sparse_mlp(cfg, spec, router=router, shared_gated=False, weigh_inputs=True)
    else:
        dense = dataclasses.replace(cfg, intermediate_size=cfg.hf_config.intermediate_size_mlp)
        mlp = LlamaMLP(dense)
    attn = Llama4Attention(cfg, layer_idx, rotary)
    return LlamaDecoderLayer(cfg, layer_idx, rotary, mlp=mlp, attn=attn)


class Llama4Model(MoeModel):
    make_layer = staticmethod(llama4_layer)


class Llama4ForCausalLM(MoeForCausalLM):
    model_class = Llama4Model
    spec = staticmethod(llama4_spec)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._renamed(weights))

    def _renamed(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Llama 4's names as the MoE family's (feed_forward -> mlp, router -> gate), each
        query and key head's rows in halves (rotary.py pairs_as_halves)."""
        for name, tensor in weights:
            name = name.replace(".feed_forward.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
            if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
                tensor = pairs_as_halves(tensor, self.config.head_dim)
            yield name, tensor
