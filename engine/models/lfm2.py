"""LFM2 (Liquid AI's LFM2-350M to 2.6B): short gated convolutions beside grouped-query attention.

Most layers (layer_types' "conv") mix tokens with a gated short convolution: one projection
gives B, C and x over the hidden size, B * x goes through a causal depthwise convolution of
conv_L_cache taps (3), and C gates its output before out_proj. Its state is the convolution's
last taps - 1 inputs per sequence, in the engine's slots (engine/recurrent_state.py; no matrix
state: the ssm part is empty), through the same conv helpers as Qwen3.5's Gated DeltaNet
(engine/layers/gated_delta.py conv_step, conv_span). The other layers attend over the paged KV
cache, which holds only them, with Qwen3's per-head q/k RMSNorms before the rotary. Llama's
pre-norm layers otherwise (operator_norm, ffn_norm, a SwiGLU feed_forward whose size the config
adjusts as transformers does), the final norm named embedding_norm, the LM head tied.
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
from pdserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pdserve.engine.parallel import divide, tp_rank, tp_size


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
        for start, length, slot in meta.state_spans:
            rows = slice(start, start + length)
            y[rows] = conv_span(bx[rows], conv, slot, w, bias, act=False)
        return self.out_proj(c * y)


def _load_channels(param, loaded, shard_id=None) -> None:
    """The conv's weight [hidden, 1, taps] (or bias [hidden]): this rank's channels."""
    n = param.shape[0]
    param.data.copy_(loaded[tp_rank() * n : (tp_rank() + 1) * n].reshape(param.shape))


class Lfm2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm):
        attn = None
        if layer_idx in cfg.recurrent_layers:
            attn = ShortConv(cfg, cfg.recurrent_layers.index(layer_idx))
        super().__init__(cfg, layer_idx, rotary, qk_norm=RMSNorm, attn=attn)


class Lfm2Model(LlamaModel):
    layer_class = Lfm2DecoderLayer

    def prepare_decode_stack(self) -> None:
        """No fused decode stack: it knows attention layers only."""
        self._stack = None


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

    def state_shapes(self) -> list[tuple[tuple, tuple]]:
        """Each convolution layer's (conv, ssm) state shape on this rank (no matrix state)."""
        hf = self.config.hf_config
        local = divide(self.config.hidden_size, tp_size(), "the hidden size")
        return [((hf.conv_L_cache - 1, local), (0,))] * len(self.config.recurrent_layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._renamed(weights))

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
