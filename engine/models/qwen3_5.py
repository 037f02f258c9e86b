"""Qwen3.5: a hybrid of Gated DeltaNet linear attention and gated full attention.

Three of every four layers (the config's layer_types: "linear_attention") mix tokens with Gated
DeltaNet (engine/layers/gated_delta.py), whose per-sequence state lives in the engine's slots
(engine/recurrent_state.py); the others attend over the paged KV cache, which holds only them
(ModelConfig.kv_layer_index). The full attention is Qwen3's (per-head q/k RMSNorms before a
partial rotary) with an output gate: q_proj yields each head's query followed by its gate, and
the attention's output is multiplied by sigmoid(gate) before o_proj. Every RMSNorm but the
linear layers' gated one computes x * (1 + w), as Gemma's. Qwen3.5's released checkpoints are
vision-language ones (Qwen3_5ForConditionalGeneration); their language model serves text here.
The checkpoint's fused in_proj_qkv is loaded as three shards of one merged projection with
in_proj_z, in_proj_b and in_proj_a, so tensor parallelism splits each part by heads. The
multi-token-prediction weights (mtp.*) are not used.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.gated_delta import GatedDeltaNet, state_layout
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.gemma import GemmaRMSNorm
from pdserve.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from pdserve.engine.models.moe import MoeSpec, per_expert, sparse_mlp


class GatedAttention(LlamaAttention):
    """Full attention whose output each head gates with sigmoid of its own projection."""

    query_parts = 2

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        hd, heads = self.head_dim, self.num_heads
        q_size, kv_size = 2 * heads * hd, self.num_kv_heads * hd
        qg, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        qg = qg.view(-1, heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(-1, heads * hd)
        k = k.reshape(-1, self.num_kv_heads, hd)
        q, k = self.normed_heads(q, k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v.reshape(-1, self.num_kv_heads, hd))
        return self.o_proj(out * torch.sigmoid(gate))


class HybridDecoderLayer(LlamaDecoderLayer):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm, mlp=None
    ):
        if layer_idx in cfg.recurrent_layers:
            attn = GatedDeltaNet(cfg.hf_config, cfg.recurrent_layers.index(layer_idx))
        else:
            attn = GatedAttention(cfg, layer_idx, rotary, qk_norm=GemmaRMSNorm)
        super().__init__(cfg, layer_idx, rotary, mlp=mlp, attn=attn)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3_5Model(LlamaModel):
    layer_class = HybridDecoderLayer

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, qk_norm=None):
        super().__init__(cfg, rotary, qk_norm)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# a linear layer's checkpoint names -> ours (the fused input projection's parts as shards)
_LINEAR_NAMES = {
    "linear_attn.conv1d.weight": "self_attn.conv_weight",
    "linear_attn.norm.weight": "self_attn.norm_weight",
    "linear_attn.A_log": "self_attn.A_log",
    "linear_attn.dt_bias": "self_attn.dt_bias",
    "linear_attn.out_proj.": "self_attn.out_proj.",
    "linear_attn.in_proj_z.": "self_attn.in_proj_z.",
    "linear_attn.in_proj_b.": "self_attn.in_proj_b.",
    "linear_attn.in_proj_a.": "self_attn.in_proj_a.",
}


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    supports_pp = False
    model_class = Qwen3_5Model
    packed = {
        **LlamaForCausalLM.packed,
        "in_proj_q": ("in_proj", 0),
        "in_proj_k": ("in_proj", 1),
        "in_proj_v": ("in_proj", 2),
        "in_proj_z": ("in_proj", 3),
        "in_proj_b": ("in_proj", 4),
        "in_proj_a": ("in_proj", 5),
    }

    def state_layouts(self) -> list:
        """Each linear-attention layer's state (engine/recurrent_state.py StateLayout)."""
        return [state_layout(self.config.hf_config)] * len(self.config.recurrent_layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._linear_names(weights))

    def _linear_names(self, weights):
        """The checkpoint's names as our modules have them: the linear layers' under self_attn,
        in_proj_qkv split into its q, k and v rows; the multi-token prediction's dropped."""
        hf = self.config.hf_config
        key = hf.linear_num_key_heads * hf.linear_key_head_dim
        value = hf.linear_num_value_heads * hf.linear_value_head_dim
        for name, tensor in weights:
            if name.startswith("mtp."):
                continue
            if ".linear_attn.in_proj_qkv." in name:
                base = name.replace(".linear_attn.in_proj_qkv.", ".self_attn.in_proj_{}.")
                for part, rows in zip("qkv", tensor.split([key, key, value])):
                    yield base.format(part), rows
                continue
            for old, new in _LINEAR_NAMES.items():
                if f".{old}" in name:
                    name = name.replace(f".{old}", f".{new}")
                    break
            yield name, tensor


class HybridMoeDecoderLayer(HybridDecoderLayer):
    """A layer of Qwen3.5-MoE or Qwen3-Next: the sparse MLP (softmax top-k, renormalized, beside
    a shared expert behind a sigmoid gate) where the config makes the layer sparse."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm):
        spec = MoeSpec.from_hf(cfg)
        mlp = sparse_mlp(cfg, spec) if layer_idx in spec.sparse_layers else None
        super().__init__(cfg, layer_idx, rotary, qk_norm, mlp=mlp)


class Qwen3_5MoeModel(Qwen3_5Model):
    layer_class = HybridMoeDecoderLayer


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    model_class = Qwen3_5MoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        size = MoeSpec.from_hf(self.config).intermediate_size
        super().load_weights(per_expert(weights, size, self.config.hidden_size))


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen3-Next: Qwen3.5-MoE's layers with the linear layers' input projections fused per key
    head (in_proj_qkvz: each key head's q, k, then its value heads' v and z rows; in_proj_ba:
    its value heads' b, then their a), regrouped here into Qwen3.5's four projections."""

    def _linear_names(self, weights):
        return super()._linear_names(self._regrouped(weights))

    def _regrouped(self, weights):
        hf = self.config.hf_config
        hk, dk, dv = hf.linear_num_key_heads, hf.linear_key_head_dim, hf.linear_value_head_dim
        per = hf.linear_num_value_heads // hk  # value heads per key head
        for name, tensor in weights:
            if ".linear_attn.in_proj_qkvz." in name:
                q, k, v, z = tensor.reshape(hk, -1, tensor.shape[-1]).split(
                    [dk, dk, per * dv, per * dv], dim=1
                )
                rows = [t.reshape(-1, tensor.shape[-1]) for t in (q, k, v, z)]
                yield name.replace("in_proj_qkvz", "in_proj_qkv"), torch.cat(rows[:3])
                yield name.replace("in_proj_qkvz", "in_proj_z"), rows[3]
            elif ".linear_attn.in_proj_ba." in name:
                b, a = tensor.reshape(hk, 2 * per, -1).split([per, per], dim=1)
                yield name.replace("in_proj_ba", "in_proj_b"), b.reshape(-1, tensor.shape[-1])
                yield name.replace("in_proj_ba", "in_proj_a"), a.reshape(-1, tensor.shape[-1])
            else:
                yield name, tensor
