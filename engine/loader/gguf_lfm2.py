"""LFM2 GGUFs in GGUF conversion (engine/loader/gguf_convert.py): llama.cpp's architecture "lfm2",
which Liquid AI publishes for LFM2 (350M to 2.6B) and llama.cpp's convert_hf_to_gguf.py
(LFM2Model) writes: gated short convolutions beside attention.

transformers reads the config from the file (the attention layers are those with kv heads in the
per-layer `attention.head_count_kv`, the MLP width as written, unadjusted); the conv's bias
flag, which the file does not carry, is set where its tensors have biases (`complete_config`).
Tensors (`Lfm2Tensors`), back to the hub's names: the short convolution's `shortconv.*` (its
weight [hidden, L] gets its middle axis back), `token_embd_norm` (LFM2's final norm,
embedding_norm), the norms and MLP under LFM2's names (operator_norm, ffn_norm, w1/w3/w2) and the
attention's out_proj and q/k layernorms. Nothing is permuted.
"""

from __future__ import annotations

import re

import numpy as np

LFM2_ARCHITECTURES = ("lfm2",)
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "token_embd_norm.weight": "model.embedding_norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF layer module -> the hub's (under model.layers.N.), weight and bias alike
_LAYER = {
    "attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
}


def complete_config(reader, config) -> None:
    """The conv's bias flag, from its tensors (the file has no key for it)."""
    config.conv_bias = any(t.name.endswith("shortconv.in_proj.bias") for t in reader.tensors)


class Lfm2Tensors:
    """gguf_convert's family converter: `convert(name, arr)` -> [(hub name, array)]."""

    def convert(self, name: str, arr: np.ndarray):
        if name in _GLOBAL:
            return [(_GLOBAL[name], arr)]
        match = _BLOCK_RE.match(name)
        module, _, kind = (match.group(2) if match else "").rpartition(".")
        if match is None or module not in _LAYER or kind not in ("weight", "bias"):
            raise ValueError(f"lfm2 GGUF tensor {name!r} is not one this loader knows")
        if module == "shortconv.conv" and kind == "weight":  # [hidden, L] -> [hidden, 1, L]
            arr = arr[:, None, :]
        return [(f"model.layers.{match.group(1)}.{_LAYER[module]}.{kind}", arr)]

    def check_complete(self) -> None:
        pass
