"""Falcon-H1 GGUFs in GGUF conversion (engine/loader/gguf_convert.py): llama.cpp's architecture
"falcon-h1", which its converter (FalconH1Model over Mamba2Model) writes for TII's Falcon-H1 and
Falcon-H1R: attention and a Mamba2 mixer side by side on each layer's normed input, then an MLP.

transformers' GGUF loader reads no falcon-h1 config or tensors (5.25 knows only the pre-tokenizer
name), so `falcon_h1_config` builds the FalconH1Config: the attention's geometry from
`attention.*` (the head size `key_length`), Mamba2's from `ssm.*` (the heads from `ssm_a`'s rows,
the width `ssm.inner_size`), the conv bias and the gated norm from the tensors that are there.
The converter folds every muP multiplier into the weights and writes no key for any: the
embedding's into token_embd, the LM head's into output, attention_in into q, k and v (and the key
multiplier into k), attention_out into attn_output, the MLP's two into ffn_gate and ffn_down,
ssm_in and the five ssm_multipliers (z, x, B, C, dt rows) into ssm_in, ssm_out into ssm_out. So
the config sets every multiplier to 1.0, or they would be applied twice. A file without
`output.weight` (a tied checkpoint) has the LM head read from token_embd, embedding multiplier
and all, as llama.cpp does.
llama.cpp applies the gated norm after the gate and the file has no key for the order, so
`mamba_norm_before_gate` is False.

Tensors (`FalconH1Tensors`) get their hub names back through the inverse of gguf-py's own name
map (its key for the MLP's norm keeps ".weight", so that tensor is `blk.N.ffn_norm`), and the
Mamba2 edits undone as Granite 4.0-H's (gguf_granite.mamba_tensor): the conv's middle axis back,
A_log = log(-ssm_a), D and the norm [groups, inner / groups] flattened; `ssm_dt.bias` is the
dt_bias. Nothing is permuted (llama.cpp's rope for falcon-h1 rotates half-head pairs, as HF's).
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader

from .gguf_fields import LayerTensors, arch_field, as_written, field_value
from .gguf_granite import mamba_tensor, shapes_of

FALCON_H1_ARCHITECTURES = ("falcon-h1",)
_ARCH = "falcon-h1"
# the hub's names of a Falcon-H1 checkpoint, looked up in gguf-py's map
_GLOBAL_HUB = ("model.embed_tokens.weight", "model.final_layernorm.weight", "lm_head.weight")
_LAYER_HUB = (  # (under model.layers.0.)
    "input_layernorm.weight",
    "pre_ff_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mamba.in_proj.weight",
    "mamba.out_proj.weight",
    "mamba.conv1d.bias",
    "mamba.dt_proj.bias",  # (the converter's name for dt_bias)
    "feed_forward.gate_proj.weight",
    "feed_forward.up_proj.weight",
    "feed_forward.down_proj.weight",
)
# every muP multiplier at 1.0: the converter folded them into the weights (module docstring)
_NO_MULTIPLIERS = dict(
    embedding_multiplier=1.0,
    lm_head_multiplier=1.0,
    key_multiplier=1.0,
    attention_in_multiplier=1.0,
    attention_out_multiplier=1.0,
    mlp_multipliers=[1.0, 1.0],
    ssm_multipliers=[1.0, 1.0, 1.0, 1.0, 1.0],
    ssm_in_multiplier=1.0,
    ssm_out_multiplier=1.0,
)


def falcon_h1_config(reader: GGUFReader):
    """The FalconH1Config of a falcon-h1 GGUF (module docstring)."""
    from transformers import FalconH1Config

    def value(key: str, default=None):
        return arch_field(reader, _ARCH, key, default)

    def token_id(key: str):
        return field_value(reader, f"tokenizer.ggml.{key}")

    shapes = shapes_of(reader)
    if "blk.0.ssm_a" not in shapes:
        raise ValueError("falcon-h1 GGUF: no blk.0.ssm_a (every layer has a Mamba2 mixer)")
    heads = shapes["blk.0.ssm_a"][0]
    inner = int(value("ssm.inner_size"))
    rank = field_value(reader, f"{_ARCH}.ssm.time_step_rank")
    if inner % heads or (rank is not None and int(rank) != heads):
        raise ValueError(
            f"falcon-h1 GGUF: {heads} Mamba2 heads (ssm_a's rows) do not divide ssm.inner_size "
            f"{inner} or disagree with ssm.time_step_rank {rank}"
        )
    hidden = int(value("embedding_length"))
    attention_heads = int(value("attention.head_count"))
    keys = dict(
        vocab_size=shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=int(value("feed_forward_length")),
        num_hidden_layers=int(value("block_count")),
        num_attention_heads=attention_heads,
        num_key_value_heads=int(value("attention.head_count_kv", attention_heads)),
        head_dim=int(value("attention.key_length", hidden // attention_heads)),
        rms_norm_eps=as_written(value("attention.layer_norm_rms_epsilon")),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": as_written(value("rope.freq_base", 10000.0)),
        },
        mamba_d_ssm=inner,
        mamba_n_heads=heads,
        mamba_d_head=inner // heads,
        mamba_n_groups=int(value("ssm.group_count", 1)),
        mamba_d_state=int(value("ssm.state_size")),
        mamba_d_conv=int(value("ssm.conv_kernel")),
        mamba_conv_bias="blk.0.ssm_conv1d.bias" in shapes,
        mamba_proj_bias=False,  # (the converter's in_proj scaling indexes [rows, :]: no bias)
        mamba_rms_norm="blk.0.ssm_norm.weight" in shapes,
        mamba_norm_before_gate=False,  # (llama.cpp's order: module docstring)
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("padding_token_id"),
        architectures=["FalconH1ForCausalLM"],
        **_NO_MULTIPLIERS,
    )
    context = int(value("context_length", 0))
    if context:  # (the converter writes 0 for a config without one: FalconH1Config's default)
        keys["max_position_embeddings"] = context
    return FalconH1Config(**keys)


def _hub_names() -> dict[str, str]:
    """GGUF name -> the hub's: a global one whole, a layer's after `blk.0.` / `model.layers.0.`,
    from gguf-py's map (the names llama.cpp's converter writes with)."""
    import gguf

    if not hasattr(gguf.MODEL_ARCH, "FALCON_H1"):
        raise ValueError("a falcon-h1 GGUF needs a newer gguf package (its MODEL_ARCH has none)")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON_H1, 1)
    inverse = {}
    for hub in (*_GLOBAL_HUB, *(f"model.layers.0.{leaf}" for leaf in _LAYER_HUB)):
        found = names.get_name(hub, try_suffixes=(".weight", ".bias"))
        if found is not None:
            leaf = hub.removeprefix("model.layers.0.").replace("dt_proj.bias", "dt_bias")
            inverse.setdefault(found.removeprefix("blk.0."), leaf)
    return inverse


class FalconH1Tensors(LayerTensors):
    """gguf_convert's family converter (gguf_fields.LayerTensors)."""

    family = "falcon-h1"

    def __init__(self, config: dict):
        super().__init__(_hub_names(), int(config["num_hidden_layers"]))

    def layer_tensors(self, name: str, prefix: str, rest: str, arr: np.ndarray) -> list:
        mixer = mamba_tensor(name, rest, arr)  # (the conv, ssm_a, ssm_d and the gated norm)
        if mixer is not None:
            return [(prefix + "mamba." + mixer[0], mixer[1])]
        if rest not in self.names:
            raise self.unknown(name)
        return [(prefix + self.names[rest], arr)]
