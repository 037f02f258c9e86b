"""AllenAI's OLMo 2 and OLMo 3, and LG's EXAONE 4.0: Llama's weights with the norms moved. A layer
has no norm before its attention or MLP; each branch's output is normalized
(post_attention_layernorm, post_feedforward_layernorm) before it joins the residual stream, and the
queries and keys are normalized over the whole projection (q_norm over num_heads x head_dim, k_norm
likewise) before they are split into heads and rotated. OLMo 3 adds sliding-window layers (its
layer_types: ModelConfig.layer_windows) whose rope may have its own parameters (sliding_rotary).
EXAONE 4.0 has the same layers with Qwen3's norm of each query and key head instead, and where it
slides, its full-attention layers have no position encoding (no rotary). OLMoE keeps Llama's
norms before each branch, OLMo 2's attention, and a softmax mixture of experts in every layer
(the MoE family's, engine/models/moe.py; MiniMax-M2's attention is this one too). OLMo Hybrid
puts OLMo 3's attention layers between Gated DeltaNet ones (engine/layers/gated_delta.py, loaded
as Qwen3.5's: engine/models/qwen3_5.py), its released checkpoints without position encoding.

Under tensor parallelism each rank holds its heads' part of a projection, so ShardedRMSNorm sums the
squares on each rank and adds the sums across ranks (one small all-reduce per norm) before it scales
its part with its slice of the weight: the same values as one rank. The model's final norm, the
pipeline stages' (hidden, residual) hand-over and the quantized modes are Llama's; the compiled
decode stack, which knows Llama's norms only, is not used.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.gated_delta import GatedDeltaNet
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding, sliding_rotary
from pdserve.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from pdserve.engine.models.moe import MoeForCausalLM, MoeModel, MoeSpec, sparse_mlp
from pdserve.engine.models.qwen3_5 import Qwen3_5ForCausalLM
from pdserve.engine.parallel import all_reduce, divide, tp_rank, tp_size


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a width split across the tensor-parallel ranks: each rank's input is its
    `width / tp` columns, its weight the same slice of the checkpoint's (OLMo 2's order: the
    weight times the normalized float32 value, then the input's dtype)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.width, self.eps = width, eps
        self.local = divide(width, tp_size(), "the normalized projection's width")
        self.weight = nn.Parameter(torch.ones(self.local), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.narrow(0, tp_rank() * self.local, self.local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if tp_size() > 1:
            squares = all_reduce(squares)
        return (self.weight * (xf * torch.rsqrt(squares / self.width + self.eps))).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(cfg, layer_idx, rotary)
        eps = cfg.rms_norm_eps
        self.q_norm = ShardedRMSNorm(cfg.num_heads * cfg.head_dim, eps)
        self.k_norm = ShardedRMSNorm(cfg.num_kv_heads * cfg.head_dim, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k).reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:  # (OLMo Hybrid's released layers have no position encoding)
            q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Olmo2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm=None):
        nn.Module.__init__(self)
        self.self_attn = Olmo2Attention(cfg, layer_idx, rotary)
        self.mlp = LlamaMLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        """(hidden, residual) in and out, as Llama's layers pass them: the stream is their sum."""
        x = hidden if residual is None else hidden + residual
        x = x + self.post_attention_layernorm(self.self_attn(positions, x))[0]
        return self.post_feedforward_layernorm(self.mlp(x))[0], x


class Olmo2Model(LlamaModel):
    layer_class = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_class = Olmo2Model


class Olmo3Model(Olmo2Model):
    def layer_rotaries(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> list:
        types = getattr(cfg.hf_config, "layer_types", None) or ["full_attention"] * cfg.num_layers
        local = sliding_rotary(cfg, rotary)
        return [local if t == "sliding_attention" else rotary for t in types]


class Olmo3ForCausalLM(LlamaForCausalLM):
    model_class = Olmo3Model


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm=None):
        nn.Module.__init__(self)
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary, qk_norm=RMSNorm)
        self.mlp = LlamaMLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Exaone4Model(Olmo2Model):
    layer_class = Exaone4DecoderLayer

    def layer_rotaries(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> list:
        """Where the model slides, its full-attention layers have no rotary (none: every layer
        rotates)."""
        hf = cfg.hf_config
        types = getattr(hf, "layer_types", None) or ["full_attention"] * cfg.num_layers
        if getattr(hf, "sliding_window", None) is None:
            return [rotary] * cfg.num_layers
        return [rotary if t == "sliding_attention" else None for t in types]


class Exaone4ForCausalLM(LlamaForCausalLM):
    model_class = Exaone4Model


def olmoe_spec(cfg: ModelConfig) -> MoeSpec:
    """OLMoE's sparse MLP: every layer's, softmax top-k (renormalized where norm_topk_prob)."""
    hf = cfg.hf_config
    if getattr(hf, "clip_qkv", None) is not None:
        raise ValueError("OLMoE with clip_qkv is not supported (its released checkpoints set none)")
    return MoeSpec(
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.intermediate_size,
        renormalize=bool(getattr(hf, "norm_topk_prob", False)),
        shared_intermediate_size=0,
        sparse_layers=frozenset(range(cfg.num_layers)),
    )


def olmoe_layer(cfg: ModelConfig, spec: MoeSpec, layer_idx: int, rotary, qk_norm=None):
    """Llama's pre-norm layer with OLMo 2's attention (norms over the whole projections) and
    the sparse MLP."""
    attn = Olmo2Attention(cfg, layer_idx, rotary)
    return LlamaDecoderLayer(cfg, layer_idx, rotary, mlp=sparse_mlp(cfg, spec), attn=attn)


class OlmoeModel(MoeModel):
    make_layer = staticmethod(olmoe_layer)


class OlmoeForCausalLM(MoeForCausalLM):
    model_class = OlmoeModel
    spec = staticmethod(olmoe_spec)


class OlmoHybridLinearLayer(LlamaDecoderLayer):
    """OLMo Hybrid's linear-attention layer: Llama's norms before each branch, Gated DeltaNet
    (engine/layers/gated_delta.py) with beta in (0, 2) where linear_allow_neg_eigval, and its
    output norm's epsilon fixed at 1e-5 (FLA's, as transformers)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm=None):
        hf = cfg.hf_config
        beta = 2.0 if getattr(hf, "linear_allow_neg_eigval", False) else 1.0
        index = cfg.recurrent_layers.index(layer_idx)
        attn = GatedDeltaNet(hf, index, beta_scale=beta, norm_eps=1e-5)
        super().__init__(cfg, layer_idx, rotary, attn=attn)


def olmo_hybrid_layer(cfg: ModelConfig, layer_idx: int, rotary, qk_norm=None) -> nn.Module:
    if layer_idx in cfg.recurrent_layers:
        return OlmoHybridLinearLayer(cfg, layer_idx, rotary)
    return Olmo2DecoderLayer(cfg, layer_idx, rotary)


class OlmoHybridModel(Olmo2Model):
    layer_class = staticmethod(olmo_hybrid_layer)

    def layer_rotaries(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> list:
        """No position encoding where the config names no rope (the released checkpoints)."""
        rope = getattr(cfg.hf_config, "rope_parameters", None) or {}
        return [rotary if rope.get("rope_theta") is not None else None] * cfg.num_layers


# OLMo Hybrid's linear-layer names -> the merged projection's parts (engine/models/qwen3_5.py)
_OLMO_LINEAR = {
    ".linear_attn.q_proj.": ".self_attn.in_proj_q.",
    ".linear_attn.k_proj.": ".self_attn.in_proj_k.",
    ".linear_attn.v_proj.": ".self_attn.in_proj_v.",
    ".linear_attn.g_proj.": ".self_attn.in_proj_z.",
    ".linear_attn.b_proj.": ".self_attn.in_proj_b.",
    ".linear_attn.a_proj.": ".self_attn.in_proj_a.",
    ".linear_attn.o_proj.": ".self_attn.out_proj.",
    ".linear_attn.o_norm.weight": ".self_attn.norm_weight",
}


class OlmoHybridForCausalLM(Qwen3_5ForCausalLM):
    """OLMo Hybrid: OLMo 3's attention layers (norms after each branch, q/k norms over whole
    projections) between Gated DeltaNet layers, whose separate q/k/v/g/b/a projections load as
    Qwen3.5's merged one."""

    model_class = OlmoHybridModel

    def _linear_names(self, weights):
        return super()._linear_names(self._renamed(weights))

    def _renamed(self, weights):
        """The hub's names as transformers loads them: its norms renamed, each linear layer's
        q, k and v convolutions (stored apart) joined into one in q, k, v order."""
        convs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            name = name.replace(".attention_layer_norm.", ".input_layernorm.")
            name = name.replace(".feedforward_layer_norm.", ".post_attention_layernorm.")
            for part in "qkv":
                if name.endswith(f".linear_attn.{part}_conv1d.weight"):
                    prefix = name[: -len(f"{part}_conv1d.weight")]
                    parts = convs.setdefault(prefix, {})
                    parts[part] = tensor
                    if len(parts) == 3:
                        yield prefix + "conv1d.weight", torch.cat([parts[p] for p in "qkv"])
                        del convs[prefix]
                    break
            else:
                for old, new in _OLMO_LINEAR.items():
                    if old in name:
                        name = name.replace(old, new)
                        break
                yield name, tensor
