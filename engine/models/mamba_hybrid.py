"""Mamba2 models and hybrids: IBM's Granite 4.0 (GraniteMoeHybrid: 4.0-H's Mamba2 layers among
attention ones, each layer's MLP a mixture of experts beside a shared one, or the shared one
alone; 4.0's dense models are the same class with attention everywhere) and Bamba, NVIDIA's
Nemotron-H (Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano), TII's Falcon-H1 (attention and Mamba2
side by side) and Mamba2 alone. The first Mamba's families are in engine/models/mamba.py. Each
class's docstring says its own.

The Mamba2 layers (the config's layer_types "linear_attention"; engine/layers/mamba2.py) keep
per-sequence state in the engine's slots (engine/recurrent_state.py); the attention layers use
the paged KV cache, which holds only them (ModelConfig.kv_layer_index). Granite 4.0 is Granite's
model (engine/models/granite.py: the embedding, attention, residual and logits scalars) with
either mixer in its layers and the MoE block of GraniteMoe (softmax over each token's top-k
router logits: the renormalized top-k of the softmax); its attention has no position encoding
unless the config's position_embedding_type is "rope" (4.0-H's is none). Bamba is Llama's layer
with a Mamba2 mixer in place of attention where its config says (rotating half of each head).
Each family's checkpoint names (the mixer under `mamba.`, the MLPs' fused input_linear) map onto
Llama's modules here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from pdserve.engine.layers.mamba2 import Mamba2Mixer
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.deepseek import DeepseekGate, DeepseekMoeSpec
from pdserve.engine.models.granite import GraniteDecoderLayer, GraniteForCausalLM, GraniteModel
from pdserve.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from pdserve.engine.models.moe import per_expert, sparse_mlp

# each family's config keys for (heads, head_dim, state_size, groups, kernel, conv bias, proj bias)
_MAMBA_KEYS = {
    "granite": (
        "mamba_n_heads",
        "mamba_d_head",
        "mamba_d_state",
        "mamba_n_groups",
        "mamba_d_conv",
        "mamba_conv_bias",
        "mamba_proj_bias",
    ),
    "nemotron": (
        "mamba_num_heads",
        "mamba_head_dim",
        "ssm_state_size",
        "n_groups",
        "conv_kernel",
        "use_conv_bias",
        "use_bias",
    ),
    "mamba2": (
        "num_heads",
        "head_dim",
        "state_size",
        "n_groups",
        "conv_kernel",
        "use_conv_bias",
        "use_bias",
    ),
}


def mamba_geometry(hf, keys: str = "granite") -> dict:
    """Mamba2Mixer's (and its state_layout's) geometry from a config, by the family's key names."""
    heads, head_dim, state, groups, kernel, _, _ = (getattr(hf, k) for k in _MAMBA_KEYS[keys])
    return dict(heads=heads, head_dim=head_dim, state_size=state, groups=groups, kernel=kernel)


def mamba_mixer(cfg: ModelConfig, layer_idx: int, keys: str = "granite") -> Mamba2Mixer:
    hf = cfg.hf_config
    conv_bias, proj_bias = (getattr(hf, k) for k in _MAMBA_KEYS[keys][5:])
    limit = getattr(hf, "time_step_limit", None) or (0.0, math.inf)
    return Mamba2Mixer(
        cfg.hidden_size,
        **mamba_geometry(hf, keys),
        state_index=cfg.recurrent_layers.index(layer_idx),
        eps=cfg.rms_norm_eps,
        conv_bias=bool(conv_bias),
        proj_bias=bool(proj_bias),
        dt_limit=tuple(limit),
    )


def mamba_state_layouts(cfg: ModelConfig, keys: str = "granite") -> list:
    """Every Mamba2 layer's state (engine/recurrent_state.py StateLayout)."""
    layout = Mamba2Mixer.state_layout(**mamba_geometry(cfg.hf_config, keys))
    return [layout] * len(cfg.recurrent_layers)


# the mixer's checkpoint names -> ours (inside the layer's self_attn)
_MIXER_NAMES = {
    ".conv1d.weight": ".conv_weight",
    ".conv1d.bias": ".conv_bias",
    ".norm.weight": ".norm_weight",
}


def mixer_name(name: str, prefix: str) -> str:
    """A checkpoint name with the mixer under `prefix` (".mamba.", ".mixer.") moved under
    self_attn, its conv and norm renamed; other names as they are."""
    if prefix not in name:
        return name
    name = name.replace(prefix, ".self_attn.")
    for old, new in _MIXER_NAMES.items():
        if name.endswith(old):
            return name[: -len(old)] + new
    return name


class GraniteHybridLayer(GraniteDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm=None):
        nn.Module.__init__(self)
        hf = cfg.hf_config
        if layer_idx in cfg.recurrent_layers:
            self.self_attn = mamba_mixer(cfg, layer_idx)
        else:
            scale = float(hf.attention_multiplier)
            self.self_attn = LlamaAttention(cfg, layer_idx, rotary, scale=scale)
        if hf.num_local_experts > 0:
            self.mlp = sparse_mlp(cfg, granite_moe_spec(cfg), shared_gated=False)
        else:
            self.mlp = LlamaMLP(dataclasses.replace(cfg, intermediate_size=_shared_size(hf)))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = float(hf.residual_multiplier)


@dataclasses.dataclass(frozen=True)
class PlainMoeSpec:
    """A mixture of experts behind a plain softmax router (sparse_mlp's fields): Granite's,
    Jamba's (engine/models/mamba.py)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_intermediate_size: int


def granite_moe_spec(cfg: ModelConfig) -> PlainMoeSpec:
    hf = cfg.hf_config
    return PlainMoeSpec(
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=cfg.intermediate_size,
        renormalize=True,  # (softmax over the top-k logits)
        shared_intermediate_size=_shared_size(hf),
    )


def _shared_size(hf) -> int:
    return int(getattr(hf, "shared_intermediate_size", 0) or 0)


class GraniteHybridModel(GraniteModel):
    layer_class = GraniteHybridLayer

    def layer_rotaries(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> list:
        """RoPE only where position_embedding_type says "rope" (Granite 4.0-H's says none)."""
        rope = getattr(cfg.hf_config, "position_embedding_type", None) == "rope"
        return [rotary if rope else None] * cfg.num_layers


class GraniteMoeHybridForCausalLM(GraniteForCausalLM):
    supports_pp = False
    model_class = GraniteHybridModel

    def state_layouts(self) -> list:
        return mamba_state_layouts(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        hf = self.config.hf_config
        renamed = self._renamed(weights, moe=hf.num_local_experts > 0)
        super().load_weights(per_expert(renamed, self.config.intermediate_size, hf.hidden_size))

    @staticmethod
    def _renamed(weights, moe: bool):
        """The hub's names as Llama's modules have them: the mixer under self_attn; the MoE
        block's router and fused experts as a FusedMoE's; the shared MLP's fused input_linear
        split into gate and up rows (the shared expert's where the layer has experts, else the
        dense MLP's)."""
        shared = ".mlp.shared_expert." if moe else ".mlp."
        for name, tensor in weights:
            name = mixer_name(name, ".mamba.")
            name = name.replace(".block_sparse_moe.router.layer.", ".mlp.gate.")
            name = name.replace(
                ".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"
            )
            name = name.replace(".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj")
            if ".shared_mlp.input_linear." in name:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".shared_mlp.input_linear.", f"{shared}gate_proj."), gate
                yield name.replace(".shared_mlp.input_linear.", f"{shared}up_proj."), up
                continue
            yield name.replace(".shared_mlp.output_linear.", f"{shared}down_proj."), tensor


class BambaLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm=None):
        attn = mamba_mixer(cfg, layer_idx) if layer_idx in cfg.recurrent_layers else None
        super().__init__(cfg, layer_idx, rotary, attn=attn)


class BambaModel(LlamaModel):
    layer_class = BambaLayer


# the names Bamba, Falcon-H1 and Jamba give Llama's MLP and norms -> Llama's
PRE_FF_NAMES = {
    ".feed_forward.": ".mlp.",
    ".pre_ff_layernorm.": ".post_attention_layernorm.",
    "model.final_layernorm.": "model.norm.",
}


class BambaForCausalLM(LlamaForCausalLM):
    supports_pp = False
    model_class = BambaModel

    def state_layouts(self) -> list:
        return mamba_state_layouts(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed():
            for name, tensor in weights:
                for old, new in PRE_FF_NAMES.items():
                    name = name.replace(old, new)
                yield mixer_name(name, ".mamba."), tensor

        super().load_weights(renamed())


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Nemotron-H's activation: ReLU, squared."""
    return torch.relu(x).square()


class ReluSquaredMLP(nn.Module):
    """Nemotron-H's MLP: up, ReLU squared, down (no gate)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


def nemotron_moe_spec(cfg: ModelConfig) -> DeepseekMoeSpec:
    """Nemotron-H's sparse MLP: DeepSeek V3's sigmoid gate (a per-expert bias on the choice,
    expert groups, renormalized and scaled weights), experts and a shared one without gates."""
    hf = cfg.hf_config
    if getattr(hf, "moe_latent_size", None) is not None:
        raise ValueError(
            "Nemotron-H's latent MoE projection (moe_latent_size) is not supported; "
            "serve a checkpoint whose config sets moe_latent_size to null"
        )
    experts = int(hf.n_routed_experts)
    groups = int(getattr(hf, "n_group", 1) or 1)
    if experts % groups:
        raise ValueError(f"n_group={groups} must divide n_routed_experts={experts}")
    return DeepseekMoeSpec(
        num_experts=experts,
        top_k=int(hf.num_experts_per_tok),
        intermediate_size=int(hf.moe_intermediate_size),
        shared_intermediate_size=int(hf.moe_shared_expert_intermediate_size)
        * int(getattr(hf, "n_shared_experts", 1) or 0),
        sigmoid=True,
        groups=groups,
        topk_group=int(getattr(hf, "topk_group", 1) or 1),
        renormalize=bool(hf.norm_topk_prob),
        scale=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
        sparse_layers=frozenset(cfg.mlp_only_layers),
    )


class NemotronHBlock(nn.Module):
    """One Nemotron-H layer: a norm, then one mixer (Mamba2, attention without position
    encoding, a ReLU-squared MLP, or a mixture of such experts), added to the residual."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm=None):
        super().__init__()
        hf = cfg.hf_config
        kind = hf.layer_types[layer_idx]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == "linear_attention":
            self.mixer = mamba_mixer(cfg, layer_idx, keys="nemotron")
        elif kind == "mlp":
            bias = bool(getattr(hf, "mlp_bias", False))
            self.mixer = ReluSquaredMLP(cfg.hidden_size, hf.intermediate_size, bias)
        elif kind == "moe":
            spec = nemotron_moe_spec(cfg)
            gate = DeepseekGate(cfg.hidden_size, spec)
            self.mixer = sparse_mlp(
                cfg, spec, router=gate, shared_gated=False, gated=False, expert_act=relu2
            )
        else:
            self.mixer = LlamaAttention(cfg, layer_idx, None)
        self.takes_positions = kind in ("linear_attention", "full_attention")

    def forward(self, positions, hidden, residual):
        hidden, residual = self.norm(hidden, residual)
        if self.takes_positions:
            return self.mixer(positions, hidden), residual
        return self.mixer(hidden), residual


class NemotronHModel(LlamaModel):
    layer_class = NemotronHBlock


# the hub's names -> ours
_NEMOTRON_NAMES = {
    "backbone.embeddings.": "model.embed_tokens.",
    "backbone.norm_f.": "model.norm.",
    "backbone.": "model.",
    ".mixer.shared_experts.": ".mixer.shared_expert.",
}


class NemotronHForCausalLM(LlamaForCausalLM):
    supports_pp = False
    model_class = NemotronHModel
    # (only attention's projections merge: the MLPs' up_proj has no gate to join)
    packed = {
        k: v for k, v in LlamaForCausalLM.packed.items() if k in ("q_proj", "k_proj", "v_proj")
    }

    def state_layouts(self) -> list:
        return mamba_state_layouts(self.config, keys="nemotron")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        mamba = {f"model.layers.{i}.mixer." for i in self.config.recurrent_layers}

        def renamed():
            for name, tensor in weights:
                if name.startswith("mtp."):  # (multi-token prediction: not used)
                    continue
                for old, new in _NEMOTRON_NAMES.items():
                    if name.startswith(old) or (old[0] == "." and old in name):
                        name = name.replace(old, new, 1)
                prefix = name[: name.index(".mixer.") + 7] if ".mixer." in name else ""
                if prefix in mamba:
                    for old, new in _MIXER_NAMES.items():
                        if name.endswith(old):
                            name = name[: -len(old)] + new
                yield name, tensor

        super().load_weights(renamed())


class ParallelMixers(nn.Module):
    """Falcon-H1's token mixing: attention and a Mamba2 mixer side by side on the same normed
    input, their outputs summed (each layer keeps KV and state both)."""

    def __init__(self, attn: nn.Module, mamba: Mamba2Mixer):
        super().__init__()
        self.attn, self.mamba = attn, mamba

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attn(positions, x) + self.mamba(positions, x)


def _falcon_norm(hf) -> str:
    if not getattr(hf, "mamba_rms_norm", False):
        return "none"
    return "before_gate" if getattr(hf, "mamba_norm_before_gate", True) else "after_gate"


class FalconH1Layer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm=None):
        hf = cfg.hf_config
        geometry = mamba_geometry(hf)
        inner = getattr(hf, "mamba_d_ssm", None) or int(hf.mamba_expand * cfg.hidden_size)
        if inner != geometry["heads"] * geometry["head_dim"]:
            raise ValueError(
                f"Falcon-H1's mamba_d_ssm={inner} must equal mamba_n_heads x mamba_d_head"
            )
        limit = getattr(hf, "time_step_limit", None) or (0.0, math.inf)
        mamba = Mamba2Mixer(
            cfg.hidden_size,
            **geometry,
            state_index=layer_idx,
            eps=cfg.rms_norm_eps,
            conv_bias=bool(hf.mamba_conv_bias),
            proj_bias=bool(hf.mamba_proj_bias),
            out_bias=bool(getattr(hf, "projectors_bias", False)),
            dt_limit=tuple(limit),
            norm=_falcon_norm(hf),
        )
        attn = ParallelMixers(LlamaAttention(cfg, layer_idx, rotary), mamba)
        super().__init__(cfg, layer_idx, rotary, attn=attn)


class FalconH1Model(LlamaModel):
    layer_class = FalconH1Layer


class FalconH1ForCausalLM(LlamaForCausalLM):
    """Falcon-H1 (TII's 0.5B to 34B, and Falcon-H1R): every layer runs attention and Mamba2 in
    parallel (ModelConfig.recurrent_attends), then Llama's MLP. Its muP multipliers are folded
    into the weights at load (a scalar or a per-row factor of a linear's input or output is one
    of its weight's and bias's), but the embedding's (applied to the embeddings, which the LM
    head may share) and the LM head's (applied to the logits)."""

    supports_pp = False
    model_class = FalconH1Model

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__(cfg, rotary)
        hf = cfg.hf_config
        self.model.embedding_multiplier = float(getattr(hf, "embedding_multiplier", 1.0))
        self.lm_head_multiplier = float(getattr(hf, "lm_head_multiplier", 1.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        if logits is None or self.lm_head_multiplier == 1.0:
            return logits
        return logits * self.lm_head_multiplier

    def state_layouts(self) -> list:
        return mamba_state_layouts(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        scales = _falcon_scales(self.config.hf_config)
        renamed = ((_falcon_name(n), t) for n, t in weights)
        super().load_weights((n, _scaled(n, t, scales)) for n, t in renamed)


def _falcon_name(name: str) -> str:
    """A checkpoint name as our modules have it: the MLP and norms under Llama's names, the
    attention and the mixer under the layer's ParallelMixers (self_attn.attn, self_attn.mamba,
    the mixer's conv and norm renamed as mixer_name does)."""
    for old, new in PRE_FF_NAMES.items():
        name = name.replace(old, new)
    if ".mamba." in name:
        return mixer_name(name, ".mamba.").replace(".self_attn.", ".self_attn.mamba.", 1)
    return name.replace(".self_attn.", ".self_attn.attn.", 1)


def _falcon_scales(hf) -> dict:
    """The muP multipliers by what they scale (FalconH1ForCausalLM's docstring)."""
    m = [float(v) for v in getattr(hf, "ssm_multipliers", None) or [1.0] * 5]
    gate, down = (float(v) for v in getattr(hf, "mlp_multipliers", None) or (1.0, 1.0))
    return {
        "ssm": m,  # z, x, B, C, dt rows of in_proj
        "ssm_in": float(getattr(hf, "ssm_in_multiplier", 1.0)),
        "ssm_out": float(getattr(hf, "ssm_out_multiplier", 1.0)),
        "attn_in": float(getattr(hf, "attention_in_multiplier", 1.0)),
        "attn_out": float(getattr(hf, "attention_out_multiplier", 1.0)),
        "key": float(getattr(hf, "key_multiplier", 1.0)),
        "gate": gate,
        "down": down,
        "geometry": mamba_geometry(hf),
    }


def _scaled(name: str, tensor: torch.Tensor, s: dict) -> torch.Tensor:
    """`tensor` with the muP multipliers that apply to it folded in (a weight by its input's
    and output's factors, a bias by its output's)."""
    bias = name.endswith(".bias")
    if ".self_attn.mamba.in_proj." in name:  # (x * ssm_in) @ W, then each section's factor
        g = s["geometry"]
        inner, bc = g["heads"] * g["head_dim"], g["groups"] * g["state_size"]
        sizes = [inner, inner, bc, bc, g["heads"]]
        rows = torch.cat([torch.full((n,), f) for n, f in zip(sizes, s["ssm"])])
        factor = rows if bias else rows * s["ssm_in"]
        return tensor * factor.to(tensor.dtype).view(-1, *([1] * (tensor.dim() - 1)))
    factor = 1.0
    if ".self_attn.mamba.out_proj." in name:
        factor = s["ssm_out"]
    elif ".self_attn.attn." in name:
        if not bias and any(f".{p}_proj." in name for p in "qkv"):
            factor *= s["attn_in"]
        if ".k_proj." in name:
            factor *= s["key"]
        if ".o_proj." in name:
            factor *= s["attn_out"]
    elif ".mlp.gate_proj." in name:
        factor = s["gate"]
    elif ".mlp.down_proj." in name:
        factor = s["down"]
    return tensor if factor == 1.0 else tensor * factor


class Mamba2Layer(NemotronHBlock):
    """A pure Mamba2 model's layer (Mamba2ForCausalLM: Mamba-Codestral, the state-spaces
    models): a norm and the mixer, as Nemotron-H's Mamba2 layers."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm=None):
        nn.Module.__init__(self)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = mamba_mixer(cfg, layer_idx, keys="mamba2")
        self.takes_positions = True


class Mamba2Model(LlamaModel):
    layer_class = Mamba2Layer


class Mamba2ForCausalLM(NemotronHForCausalLM):
    """Mamba2 alone: no layer attends, so none keeps KV (the block manager still counts
    positions); the checkpoint's names are Nemotron-H's."""

    model_class = Mamba2Model

    def state_layouts(self) -> list:
        return mamba_state_layouts(self.config, keys="mamba2")
