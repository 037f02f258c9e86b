"""LFM2 (Liquid AI's LFM2-350M to 2.6B, and LFM2-8B-A1B, its mixture of experts): short gated
convolutions beside grouped-query attention.

Most layers (layer_types' "conv") mix tokens with a gated short convolution: one projection
gives B, C and x over the hidden size, B * x goes through a causal depthwise convolution of
conv_L_cache taps (3), and C gates its output before out_proj. Its state is the convolution's
last taps - 1 inputs per sequence, in the engine's slots (engine/recurrent_state.py; no matrix
state: the ssm part is empty), through the same conv helpers as Qwen3.5's Gated DeltaNet
(engine/layers/gated_delta.py conv_step, conv_span). The other layers attend over the paged KV
cache, which holds only them, with Qwen3's per-head q/k RMSNorms before the rotary. Llama's
pre-norm layers otherwise (operator_norm, ffn_norm, a SwiGLU feed_forward whose size the config
adjusts as transformers does), the final norm named embedding_norm, the LM head tied. LFM2-MoE
keeps its first layers dense and routes the others by DeepSeek V3's sigmoid gate without groups
(engine/models/deepseek.py DeepseekGate; transformers adds 1e-6 to the renormalizing sum, the
gate 1e-20: a difference far below float32's resolution of the weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.layers.gated_delta import conv_span, conv_step
from pdserve.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.deepseek import DeepseekGate, DeepseekMoeSpec
from pdserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pdserve.engine.models.moe import per_expert, sparse_mlp
from pdserve.engine.parallel import divide, tp_rank, tp_size
from pdserve.engine.recurrent_state import StateLayout


class ShortConv(nn.Module):
    def __init__(self, cfg: ModelConfig, state_index: int):
        super().__init__()
        hf, hidden = cfg.hf_config, cfg.hidden_size
        self.state_index = state_index
        bias = bool(getattr(hf, "conv_bias", False))
        self.in_proj = MergedColumnParallelLinear(hidden, [hidden] * 3, bias=bias)  # B, C, x
        local = divide(hidden, tp_size(), "the hidden size")
        self.conv_weight = nn.Parameter(torch.zeros(local, hf.conv_L_cache), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.zeros(local), requires_grad=False) if bias else None
        for p in (self.conv_weight, self.conv_bias):
            if p is not None:
                p.weight_loader = _load_channels
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        conv = meta.states.conv[self.state_index]
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        bx = b * h
        y = torch.empty_like(bx)
        nd = 0 if meta.state_slots is None else meta.state_slots.numel()
        w, bias = self.conv_weight, self.conv_bias
        if nd:
            y[:nd] = conv_step(bx[:nd], conv, meta.state_slots, w, bias, act=False)
        for start, length, slot, keep in meta.state_spans:
            rows = slice(start, start + length)
            y[rows] = conv_span(bx[rows], conv, slot, w, bias, act=False)
            if keep >= 0:
                conv[keep].copy_(conv[slot])
        return self.out_proj(c * y)


def _load_channels(param, loaded, shard_id=None) -> None:
    """The conv's weight [hidden, 1, taps] (or bias [hidden]): this rank's channels."""
    n = param.shape[0]
    param.data.copy_(loaded[tp_rank() * n : (tp_rank() + 1) * n].reshape(param.shape))


class Lfm2DecoderLayer(LlamaDecoderLayer):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm, mlp=None
    ):
        attn = None
        if layer_idx in cfg.recurrent_layers:
            attn = ShortConv(cfg, cfg.recurrent_layers.index(layer_idx))
        super().__init__(cfg, layer_idx, rotary, qk_norm=RMSNorm, mlp=mlp, attn=attn)


class Lfm2MoeDecoderLayer(Lfm2DecoderLayer):
    """LFM2-MoE's: dense for the first num_dense_layers, then DeepSeek V3's router without
    groups (sigmoid scores, the choice by score plus `expert_bias` where the config uses it,
    renormalized, scaled)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm):
        spec, mlp = lfm2_moe_spec(cfg), None
        if layer_idx in spec.sparse_layers:
            gate = DeepseekGate(cfg.hidden_size, spec)
            if not cfg.hf_config.use_expert_bias:
                gate.e_score_correction_bias = None
            mlp = sparse_mlp(cfg, spec, router=gate)
        super().__init__(cfg, layer_idx, rotary, qk_norm, mlp=mlp)


def lfm2_moe_spec(cfg: ModelConfig) -> DeepseekMoeSpec:
    hf = cfg.hf_config
    return DeepseekMoeSpec(
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.moe_intermediate_size,
        shared_intermediate_size=0,
        sigmoid=True,
        groups=1,
        topk_group=1,
        renormalize=bool(hf.norm_topk_prob),
        scale=float(hf.routed_scaling_factor),
        sparse_layers=frozenset(range(hf.num_dense_layers, cfg.num_layers)),
    )


class Lfm2Model(LlamaModel):
    layer_class = Lfm2DecoderLayer


# checkpoint name fragments -> ours
_NAMES = {
    ".conv.conv.weight": ".self_attn.conv_weight",
    ".conv.conv.bias": ".self_attn.conv_bias",
    ".conv.in_proj.": ".self_attn.in_proj.",
    ".conv.out_proj.": ".self_attn.out_proj.",
    ".self_attn.out_proj.": ".self_attn.o_proj.",
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    ".operator_norm.": ".input_layernorm.",
    ".ffn_norm.": ".post_attention_layernorm.",
    ".feed_forward.w1.": ".mlp.gate_proj.",
    ".feed_forward.w3.": ".mlp.up_proj.",
    ".feed_forward.w2.": ".mlp.down_proj.",
    ".feed_forward.expert_bias": ".mlp.gate.e_score_correction_bias",
    ".feed_forward.": ".mlp.",  # (LFM2-MoE's router and experts)
    "model.embedding_norm.": "model.norm.",
}


class Lfm2ForCausalLM(LlamaForCausalLM):
    supports_pp = False
    model_class = Lfm2Model
    packed = {
        **LlamaForCausalLM.packed,
        "in_proj_b": ("in_proj", 0),
        "in_proj_c": ("in_proj", 1),
        "in_proj_x": ("in_proj", 2),
    }

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__(
            dataclasses.replace(cfg, intermediate_size=_ff_size(cfg.hf_config)), rotary
        )

    def state_layouts(self) -> list[StateLayout]:
        """Each convolution layer's state: its window of channels, split by channel (and no
        matrix state: an empty ssm)."""
        hidden = self.config.hidden_size
        divide(hidden, tp_size(), "the hidden size")
        layout = StateLayout(
            self.config.hf_config.conv_L_cache - 1, ((hidden, False),), ((0, False),)
        )
        return [layout] * len(self.config.recurrent_layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._prepared(weights))

    def _prepared(self, weights):
        """The checkpoint's tensors under our names (a family's subclass splits more)."""
        return self._renamed(weights)

    def _renamed(self, weights):
        for name, tensor in weights:
            for old, new in _NAMES.items():
                if old in name:
                    name = name.replace(old, new)
                    break
            if ".self_attn.in_proj." in name:  # B, C and x rows: three shards
                for part, rows in zip("bcx", tensor.chunk(3, dim=0)):
                    yield name.replace(".in_proj.", f".in_proj_{part}."), rows
                continue
            yield name, tensor


def _ff_size(hf) -> int:
    """The SwiGLU's width as transformers sizes it (Lfm2MLP): 2/3 of intermediate_size, times
    block_ffn_dim_multiplier, rounded up to block_multiple_of, where block_auto_adjust_ff_dim."""
    size = hf.intermediate_size
    if not getattr(hf, "block_auto_adjust_ff_dim", False):
        return size
    size = int(2 * size / 3)
    multiplier = getattr(hf, "block_ffn_dim_multiplier", None)
    if multiplier is not None:
        size = int(multiplier * size)
        step = hf.block_multiple_of
        size = step * ((size + step - 1) // step)
    return size


class Lfm2MoeModel(Lfm2Model):
    layer_class = Lfm2MoeDecoderLayer


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE (LFM2-8B-A1B): LFM2's layers over a sigmoid-routed mixture of experts (its dense
    layers' MLP is intermediate_size wide, unadjusted)."""

    model_class = Lfm2MoeModel

    def _prepared(self, weights):
        """As LFM2's, the experts' fused tensors split (engine/models/moe.py per_expert)."""
        size = self.config.hf_config.moe_intermediate_size
        return per_expert(self._renamed(weights), size, self.config.hidden_size)
