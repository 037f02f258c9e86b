"""BigCode's StarCoder2 (3B, 7B, 15B): Llama's attention with a bias on every projection and an
optional sliding window (ModelConfig.layer_windows), LayerNorms with biases (layers/norm.py
LayerNorm), and a plain MLP: c_fc, GELU (tanh approximation), c_proj, with biases. The
embedding is tied to the LM head; Llama's stages, loading and TP sharding otherwise (a row-parallel
bias is added once, after the reduction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from pdserve.engine.layers.norm import LayerNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Starcoder2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool):
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm=None):
        bias = bool(getattr(cfg.hf_config, "use_bias", True))
        super().__init__(cfg, layer_idx, rotary, mlp=Starcoder2MLP(cfg, bias))
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, bias=True)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, bias=True)


class Starcoder2Model(LlamaModel):
    layer_class = Starcoder2DecoderLayer

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, qk_norm=None):
        super().__init__(cfg, rotary, qk_norm)
        if self.norm is not None:  # (the last stage's)
            self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, bias=True)

    def prepare_decode_stack(self) -> None:
        self._stack = None  # (its norms and MLP are not the compiled stack's)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_class = Starcoder2Model
