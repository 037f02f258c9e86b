"""The first Mamba's families (engine/layers/mamba1.py: a selective scan with a state vector per
channel): Mamba (state-spaces' models), Falcon Mamba (B, C and the time step RMS-normed without
weights) and AI21's Jamba (normed with weights; Mamba beside attention without position
encoding and a mixture of experts, as the config's periods and offsets place them).

Mamba and Falcon Mamba are Nemotron-H's layer shape (a norm and one mixer, the hub's `backbone.*`
names: engine/models/mamba_hybrid.py) with no attention anywhere, so no layer keeps KV; Jamba is
Llama's layer with the mixer in place of attention where its config says. Their states live in
the engine's slots (engine/recurrent_state.py) and their prompts run token by token through the
compiled scan.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.mamba1 import Mamba1Mixer
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pdserve.engine.models.mamba_hybrid import (
    PRE_FF_NAMES,
    NemotronHBlock,
    NemotronHForCausalLM,
    PlainMoeSpec,
    mixer_name,
)
from pdserve.engine.models.moe import per_expert, sparse_mlp


def mamba1_mixer(cfg: ModelConfig, layer_idx: int) -> Mamba1Mixer:
    hf = cfg.hf_config
    eps = getattr(hf, "mixer_rms_eps", None) if hf.model_type == "falcon_mamba" else None
    return Mamba1Mixer(
        cfg.hidden_size,
        **_mamba1_geometry(hf),
        state_index=cfg.recurrent_layers.index(layer_idx),
        conv_bias=bool(hf.use_conv_bias),
        proj_bias=bool(hf.use_bias),
        bcdt_eps=None if eps is None else float(eps),
    )


def _mamba1_geometry(hf) -> dict:
    return dict(
        inner=int(hf.intermediate_size),
        state_size=int(hf.state_size),
        rank=int(hf.time_step_rank),
        kernel=int(hf.conv_kernel),
    )


class MambaLayer(NemotronHBlock):
    """Mamba's (and Falcon Mamba's) layer: a norm and the selective-scan mixer."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm=None):
        nn.Module.__init__(self)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = mamba1_mixer(cfg, layer_idx)
        self.takes_positions = True


class MambaModel(LlamaModel):
    layer_class = MambaLayer


class MambaForCausalLM(NemotronHForCausalLM):
    """Mamba (state-spaces' Mamba, Falcon Mamba's class too): no layer attends, so none keeps
    KV; the checkpoint's names are Nemotron-H's."""

    model_class = MambaModel

    def state_layouts(self) -> list:
        layout = Mamba1Mixer.state_layout(
            **{k: v for k, v in _mamba1_geometry(self.config.hf_config).items() if k != "rank"}
        )
        return [layout] * len(self.config.recurrent_layers)


class JambaLayer(LlamaDecoderLayer):
    """Jamba's layer (AI21's Jamba, Jamba Reasoning): Mamba (its B, C and time step normed with
    weights) or attention without position encoding, then a dense MLP or a mixture of experts
    (softmax top-k, the weights not renormalized), as the config's periods and offsets say."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm=None):
        hf = cfg.hf_config
        attn = None
        if layer_idx in cfg.recurrent_layers:
            attn = Mamba1Mixer(
                cfg.hidden_size,
                inner=int(hf.mamba_expand * hf.hidden_size),
                state_size=int(hf.mamba_d_state),
                rank=int(hf.mamba_dt_rank),
                kernel=int(hf.mamba_d_conv),
                state_index=cfg.recurrent_layers.index(layer_idx),
                conv_bias=bool(hf.mamba_conv_bias),
                proj_bias=bool(hf.mamba_proj_bias),
                bcdt_eps=cfg.rms_norm_eps,
                bcdt_weights=True,
            )
        mlp = None
        every, offset = int(hf.expert_layer_period), int(hf.expert_layer_offset)
        if hf.num_experts > 1 and layer_idx % every == offset:
            mlp = sparse_mlp(cfg, _jamba_moe_spec(cfg))
        super().__init__(cfg, layer_idx, rotary, mlp=mlp, attn=attn)


def _jamba_moe_spec(cfg: ModelConfig) -> PlainMoeSpec:
    hf = cfg.hf_config
    return PlainMoeSpec(
        num_experts=int(hf.num_experts),
        top_k=int(hf.num_experts_per_tok),
        intermediate_size=cfg.intermediate_size,
        renormalize=False,
        shared_intermediate_size=0,
    )


class JambaModel(LlamaModel):
    layer_class = JambaLayer

    def layer_rotaries(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> list:
        """No position encoding: Jamba's attention has none (its Mamba layers give order)."""
        return [None] * cfg.num_layers


_JAMBA_NAMES = {
    ".feed_forward.router.": ".mlp.gate.",  # (before PRE_FF_NAMES' feed_forward)
    **PRE_FF_NAMES,
    ".mamba.dt_layernorm.weight": ".self_attn.dt_norm",
    ".mamba.b_layernorm.weight": ".self_attn.b_norm",
    ".mamba.c_layernorm.weight": ".self_attn.c_norm",
}


class JambaForCausalLM(LlamaForCausalLM):
    supports_pp = False
    model_class = JambaModel

    def state_layouts(self) -> list:
        hf = self.config.hf_config
        layout = Mamba1Mixer.state_layout(
            inner=int(hf.mamba_expand * hf.hidden_size),
            state_size=int(hf.mamba_d_state),
            kernel=int(hf.mamba_d_conv),
        )
        return [layout] * len(self.config.recurrent_layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed():
            for name, tensor in weights:
                for old, new in _JAMBA_NAMES.items():
                    name = name.replace(old, new)
                yield mixer_name(name, ".mamba."), tensor

        size = self.config.intermediate_size
        super().load_weights(per_expert(renamed(), size, self.config.hidden_size))
