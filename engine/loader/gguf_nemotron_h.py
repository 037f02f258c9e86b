"""Nemotron-H GGUFs in GGUF conversion (engine/loader/gguf_convert.py): llama.cpp's architectures
"nemotron_h" (Nemotron-H, Nemotron Nano 2: Mamba2, attention and ReLU-squared MLP layers) and
"nemotron_h_moe" (Nemotron 3 Nano: MLP layers of experts), which its convert_hf_to_gguf.py
(NemotronHModel) writes.

transformers' GGUF loader refuses both, so `nemotron_h_config` builds a NemotronHConfig. A
layer's kind comes from the per-layer arrays: kv heads > 0 attention, an MLP width > 0 an MLP
(of experts in a nemotron_h_moe file), neither a Mamba2 layer; the Mamba geometry is read off
the tensors as for Granite 4.0-H (engine/loader/gguf_granite.py), and so is the converter's
placeholder context (2**20, written for a model without RoPE), read as 131072. The expert
groups the choice is limited to are written without the groups a token may use; those are
taken as 1, as every released model has them.

Tensors (`NemotronHTensors`), back to the hub's names (`backbone.*`, each layer's one `mixer`):
the Mamba2 ones as Granite 4.0-H's (gguf_granite.mamba_tensor), `ssm_dt.bias` the dt_bias,
ffn_up/ffn_down the MLP, the router, its `exp_probs_b` bias (e_score_correction_bias), the
shared expert and the stacked experts split per expert. The attention's q/k rows were permuted
as llama's (the converter's Granite base), which its attention without position encoding does
not see; they are un-permuted all the same.
"""

from __future__ import annotations

import re

import numpy as np
from gguf import GGUFReader

from .gguf_fields import field_value
from .gguf_granite import mamba_geometry, mamba_tensor, per_layer, shapes_of

NEMOTRON_H_ARCHITECTURES = ("nemotron_h", "nemotron_h_moe")
_NOPE_CONTEXT, _CONTEXT = 2**20, 131072
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_GLOBAL = {
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
    "output.weight": "lm_head.weight",
}
# GGUF name after blk.N. -> the hub's after backbone.layers.N.
_LAYER = {
    "attn_norm.weight": "norm.weight",
    "attn_q.weight": "mixer.q_proj.weight",
    "attn_k.weight": "mixer.k_proj.weight",
    "attn_v.weight": "mixer.v_proj.weight",
    "attn_output.weight": "mixer.o_proj.weight",
    "ssm_in.weight": "mixer.in_proj.weight",
    "ssm_in.bias": "mixer.in_proj.bias",
    "ssm_out.weight": "mixer.out_proj.weight",
    "ssm_out.bias": "mixer.out_proj.bias",
    "ssm_conv1d.bias": "mixer.conv1d.bias",
    "ssm_dt.bias": "mixer.dt_bias",
    "ffn_up.weight": "mixer.up_proj.weight",
    "ffn_down.weight": "mixer.down_proj.weight",
    "ffn_gate_inp.weight": "mixer.gate.weight",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
}
_EXPERTS = {"ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}


def nemotron_h_config(reader: GGUFReader, arch: str):
    """The NemotronHConfig of a nemotron_h or nemotron_h_moe GGUF (module docstring)."""
    from transformers import NemotronHConfig

    def value(key: str, default=None):
        found = field_value(reader, f"{arch}.{key}")
        return default if found is None else found

    def token_id(key: str):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else int(field.parts[field.data[0]][0])

    if value("moe_latent_size") is not None:
        raise ValueError(f"{arch} GGUF: a latent MoE projection (moe_latent_size) is not supported")
    shapes = shapes_of(reader)
    layers = int(value("block_count"))
    hidden = int(value("embedding_length"))
    kv = per_layer(reader, arch, "attention.head_count_kv", layers)
    ff = per_layer(reader, arch, "feed_forward_length", layers)
    mlp = "moe" if arch == "nemotron_h_moe" else "mlp"
    kinds = ["attention" if k else mlp if f else "mamba" for k, f in zip(kv, ff)]
    context = int(value("context_length", _CONTEXT))
    keys = dict(
        vocab_size=int(value("vocab_size") or shapes["token_embd.weight"][0]),
        hidden_size=hidden,
        num_hidden_layers=layers,
        layers_block_type=kinds,
        num_attention_heads=int(value("attention.head_count")),
        num_key_value_heads=max(kv) or 1,
        head_dim=int(value("attention.key_length") or hidden // int(value("attention.head_count"))),
        max_position_embeddings=_CONTEXT if context == _NOPE_CONTEXT else context,
        layer_norm_epsilon=float(value("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("padding_token_id"),
        architectures=["NemotronHForCausalLM"],
    )
    if "mamba" in kinds:
        g = mamba_geometry(reader, arch, shapes, kinds.index("mamba"))
        keys.update(
            mamba_num_heads=g["heads"],
            mamba_head_dim=g["head_dim"],
            ssm_state_size=g["state"],
            n_groups=g["groups"],
            conv_kernel=g["kernel"],
            use_conv_bias=g["conv_bias"],
            use_bias=g["proj_bias"],
        )
    if mlp == "moe":
        keys.update(
            n_routed_experts=int(value("expert_count")),
            num_experts_per_tok=int(value("expert_used_count")),
            moe_intermediate_size=int(value("expert_feed_forward_length")),
            moe_shared_expert_intermediate_size=int(value("expert_shared_feed_forward_length", 0)),
            n_shared_experts=int(value("expert_shared_count", 1)),
            norm_topk_prob=bool(value("expert_weights_norm", False)),
            routed_scaling_factor=float(value("expert_weights_scale", 1.0)),
            n_group=int(value("expert_group_count", 1)),
            topk_group=int(value("expert_group_used_count", 1)),
        )
    elif any(ff):
        keys["intermediate_size"] = max(ff)
    return NemotronHConfig(**keys)


class NemotronHTensors:
    """gguf_convert's family converter: `convert(name, arr)` -> [(hub name, array)], its q/k
    rows un-permuted by the caller's `unpermute(arr, which)`."""

    def __init__(self, unpermute):
        self.unpermute = unpermute

    def convert(self, name: str, arr: np.ndarray):
        if name in _GLOBAL:
            return [(_GLOBAL[name], arr)]
        match = _BLOCK_RE.match(name)
        if match is None:
            raise ValueError(f"nemotron_h GGUF tensor {name!r} is not one this loader knows")
        prefix, rest = f"backbone.layers.{match.group(1)}.", match.group(2)
        if rest in _EXPERTS:  # [experts, out, in]: one tensor per expert
            which = _EXPERTS[rest]
            return [
                (f"{prefix}mixer.experts.{e}.{which}.weight", arr[e]) for e in range(arr.shape[0])
            ]
        if rest in ("attn_q.weight", "attn_k.weight"):
            arr = self.unpermute(arr, rest[5])
        mixer = mamba_tensor(name, rest, arr)
        if mixer is not None:
            return [(prefix + "mixer." + mixer[0], mixer[1])]
        if rest not in _LAYER:
            raise ValueError(f"nemotron_h GGUF tensor {name!r} is not one this loader knows")
        return [(prefix + _LAYER[rest], arr)]

    def check_complete(self) -> None:
        pass
