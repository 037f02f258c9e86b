"""LFM2-MoE GGUFs in GGUF conversion (engine/loader/gguf_convert.py): llama.cpp's architecture
"lfm2moe", which its convert_hf_to_gguf.py (LFM2MoeModel) writes for Liquid AI's LFM2-8B-A1B:
LFM2's gated short convolutions beside attention, the first layers with a plain MLP and the rest
with a sigmoid-routed mixture of experts.

`lfm2moe_config` builds the Lfm2MoeConfig from the metadata (transformers' GGUF loader reads no
lfm2moe): the attention layers are those with kv heads in the per-layer `attention.head_count_kv`,
the dense layers' count is `leading_dense_block_count`, the experts' width
`expert_feed_forward_length` and the dense MLP's `feed_forward_length`, both as written. The file
has no key for the routing's scale and renormalization; llama.cpp renormalizes always and scales
by `expert_weights_scale` where a file has one, so this reads them the same way (1.0 and True
otherwise, as the released models set them). The conv's bias flag and the expert bias come from
the tensors that are there, and the embedding is tied where the file has no `output.weight`.

Tensors (`Lfm2MoeTensors`) get their hub names back through the inverse of gguf-py's own name map
(`gguf.get_tensor_name_map`), and the converter's edits undone: the conv's weight [hidden, L] gets
its middle axis back, `exp_probs_b.bias` is the router's `expert_bias` again, and each layer's
stacked experts [experts, out, in] are split into the hub's per-expert w1 (gate), w3 (up) and w2
(down). Nothing is permuted.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader

from .gguf_fields import LayerTensors, arch_field, as_written, field_array, field_value

LFM2MOE_ARCHITECTURES = ("lfm2moe",)
# the hub's names of an LFM2-MoE checkpoint, looked up in gguf-py's map
_GLOBAL_HUB = ("model.embed_tokens.weight", "model.embedding_norm.weight")
_LAYER_HUB = (  # (under model.layers.0.)
    "operator_norm.weight",
    "ffn_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.out_proj.weight",
    "self_attn.q_layernorm.weight",
    "self_attn.k_layernorm.weight",
    "conv.conv.weight",
    "conv.conv.bias",
    "conv.in_proj.weight",
    "conv.in_proj.bias",
    "conv.out_proj.weight",
    "conv.out_proj.bias",
    "feed_forward.w1.weight",
    "feed_forward.w3.weight",
    "feed_forward.w2.weight",
    "feed_forward.gate.weight",
    "feed_forward.expert_bias.bias",  # (the converter's name for expert_bias)
)
# the converter stacks a layer's experts under "layers.N." (without "model."), and maps them so
_EXPERTS_HUB = ("w1", "w3", "w2")
_SIGMOID = 2  # gguf.ExpertGatingFuncType.SIGMOID


def lfm2moe_config(reader: GGUFReader):
    """The Lfm2MoeConfig of an lfm2moe GGUF (module docstring)."""
    from transformers import Lfm2MoeConfig

    def value(key: str, default=None):
        return arch_field(reader, "lfm2moe", key, default)

    gating = int(value("expert_gating_func", _SIGMOID))
    if gating != _SIGMOID:
        raise ValueError(f"lfm2moe GGUF: expert gating function {gating}, LFM2-MoE's is sigmoid")
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    kv_heads = field_array(reader, "lfm2moe.attention.head_count_kv")
    if kv_heads is None:
        raise ValueError("lfm2moe GGUF: no lfm2moe.attention.head_count_kv")
    layers = int(value("block_count"))
    if len(kv_heads) == 1:  # (a single count: every layer attends)
        kv_heads = kv_heads * layers
    return Lfm2MoeConfig(
        vocab_size=shapes["token_embd.weight"][0],
        hidden_size=int(value("embedding_length")),
        intermediate_size=int(value("feed_forward_length")),
        moe_intermediate_size=int(value("expert_feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=int(value("attention.head_count")),
        num_key_value_heads=max(int(h) for h in kv_heads),
        layer_types=["full_attention" if h else "conv" for h in kv_heads],
        max_position_embeddings=int(value("context_length")),
        norm_eps=as_written(value("attention.layer_norm_rms_epsilon")),
        conv_L_cache=int(value("shortconv.l_cache")),
        conv_bias=any(n.endswith("shortconv.in_proj.bias") for n in shapes),
        num_dense_layers=int(value("leading_dense_block_count", 0)),
        num_experts=int(value("expert_count")),
        num_experts_per_tok=int(value("expert_used_count")),
        use_expert_bias=any(n.endswith(".exp_probs_b.bias") for n in shapes),
        routed_scaling_factor=as_written(value("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(value("expert_weights_norm", True)),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": as_written(value("rope.freq_base", 1000000.0)),
        },
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field_value(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=field_value(reader, "tokenizer.ggml.padding_token_id"),
        architectures=["Lfm2MoeForCausalLM"],
    )


def _hub_names() -> dict[str, str]:
    """GGUF name -> the hub's: a global one whole, a layer's after `blk.0.` / `model.layers.0.`
    (the stacked experts' as their hub leaf, w1, w3 or w2), from gguf-py's map."""
    import gguf

    if not hasattr(gguf.MODEL_ARCH, "LFM2MOE"):
        raise ValueError("an lfm2moe GGUF needs a newer gguf package (its MODEL_ARCH has none)")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2MOE, 1)
    inverse = {"output.weight": "lm_head.weight"}  # (not in the map: llama.cpp reads it if there)
    for hub in (*_GLOBAL_HUB, *(f"model.layers.0.{leaf}" for leaf in _LAYER_HUB)):
        found = names.get_name(hub, try_suffixes=(".weight", ".bias"))
        if found is not None:
            leaf = hub.removeprefix("model.layers.0.").replace("expert_bias.bias", "expert_bias")
            inverse.setdefault(found.removeprefix("blk.0."), leaf)
    for which in _EXPERTS_HUB:
        found = names.get_name(f"layers.0.feed_forward.experts.{which}.weight", (".weight",))
        if found is not None:
            inverse.setdefault(found.removeprefix("blk.0."), which)
    return inverse


class Lfm2MoeTensors(LayerTensors):
    """gguf_convert's family converter (gguf_fields.LayerTensors)."""

    family = "lfm2moe"

    def __init__(self, config: dict):
        super().__init__(_hub_names(), int(config["num_hidden_layers"]))

    def layer_tensors(self, name: str, prefix: str, rest: str, arr: np.ndarray) -> list:
        if rest not in self.names:
            raise self.unknown(name)
        leaf = self.names[rest]
        if leaf in _EXPERTS_HUB:
            if arr.ndim != 3:
                raise ValueError(f"lfm2moe GGUF tensor {name!r}: expected 3 dims, got {arr.shape}")
            # (a copy each: safetensors refuses tensors that share memory)
            return [
                (f"{prefix}feed_forward.experts.{e}.{leaf}.weight", arr[e].copy())
                for e in range(arr.shape[0])
            ]
        if leaf == "conv.conv.weight":  # [hidden, L] -> [hidden, 1, L]
            arr = arr.reshape(arr.shape[0], -1)[:, None, :]
        elif leaf == "feed_forward.expert_bias":
            arr = arr.reshape(-1)
        return [(prefix + leaf, arr)]
