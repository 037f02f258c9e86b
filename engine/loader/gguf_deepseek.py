"""DeepSeek GGUFs in GGUF conversion (engine/loader/gguf_convert.py): llama.cpp's architecture
"deepseek2", which its convert_hf_to_gguf.py (DeepseekV2Model) writes for DeepSeek V2, V2-Lite,
V3, R1 and Kimi K2 alike.

transformers' GGUF loader refuses the architecture (gguf_convert reads the tokenizer with the
fast tokenizer class, which takes any architecture's), so `deepseek_config` builds the config:
DeepseekV3ForCausalLM when the file is V3-like (sigmoid gating, `expert_gating_func` 2, or
`exp_probs_b` tensors), else DeepseekV2ForCausalLM (files with no gating key are V2's softmax, as
llama.cpp reads them). The attention widths are read off the tensors, which every generation of
the converter writes alike (its key_length/value_length keys changed meaning when MLA came: the
latent's widths, with the heads' in *_mla). The expert groups (`expert_group_count`,
`expert_group_used_count`) are in newer files only; without them every expert is open to each
token, as llama.cpp runs such files. llama.cpp stores YaRN's mscale_all_dim as 0.1 times it
(`rope.scaling.yarn_log_multiplier`; its loader divides the 0.1 back out); `mscale` is not stored
and is taken equal to it, as in every released model.

Tensors (`DeepseekTensors`): the hub's names for q (`attn_q`, or `attn_q_a`, `attn_q_a_norm`,
`attn_q_b`), `attn_kv_a_mqa`, `attn_kv_a_norm`, the router, `exp_probs_b.bias` (V3's
e_score_correction_bias), the shared experts and the stacked experts (split per expert as
gguf_moe.py does). kv_b_proj comes in two layouts: one `attn_kv_b` tensor in older files; newer
ones split it per head into `attn_k_b` (the key rows, transposed: [heads, kv_lora_rank, nope] in
numpy order) and `attn_v_b` ([heads, v_head_dim, kv_lora_rank]), which are joined back. No q/k
rows are permuted: DeepSeek's rope is pairwise already, as llama.cpp's NORM rope is. Layers past
the config's (multi-token prediction, `nextn_predict_layers`) are left out, as transformers does.
"""

from __future__ import annotations

import re

import numpy as np
from gguf import GGUFReader

from . import gguf_moe
from .gguf_fields import field_value

DEEPSEEK_ARCHITECTURES = ("deepseek2",)
_ARCH = "deepseek2"
# layer modules over gguf_convert's dense ones (attn_q, attn_output, norms, the dense MLP)
LAYER_MODULES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
_KV_HALF_RE = re.compile(r"^blk\.(\d+)\.attn_(k|v)_b\.weight$")


def _value(reader: GGUFReader, key: str):
    """A scalar `deepseek2.*` metadata value (a string decoded), or None."""
    return field_value(reader, f"{_ARCH}.{key}")


def _shapes(reader: GGUFReader) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in numpy (HF) order: GGUF lists dims fastest-first."""
    return {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}


def _widths(shapes: dict[str, tuple[int, ...]], heads: int) -> dict:
    """The attention's widths, read off layer 0's tensors."""
    if "blk.0.attn_kv_a_norm.weight" not in shapes:
        raise ValueError("deepseek2 GGUF: no blk.0.attn_kv_a_norm (not a latent-attention model)")
    rank = shapes["blk.0.attn_kv_a_norm.weight"][0]
    rope = shapes["blk.0.attn_kv_a_mqa.weight"][0] - rank
    q_rows = shapes.get("blk.0.attn_q_b.weight", shapes.get("blk.0.attn_q.weight"))
    if q_rows is None:
        raise ValueError("deepseek2 GGUF: layer 0 has neither attn_q nor attn_q_b")
    q_lora = shapes.get("blk.0.attn_q_a.weight")
    return {
        "kv_lora_rank": rank,
        "q_lora_rank": q_lora[0] if q_lora else None,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": q_rows[0] // heads - rope,
        "v_head_dim": shapes["blk.0.attn_output.weight"][1] // heads,
    }


def _rope_parameters(reader: GGUFReader) -> dict:
    theta = float(_value(reader, "rope.freq_base") or 10000.0)
    if _value(reader, "rope.scaling.type") != "yarn":
        return {"rope_type": "default", "rope_theta": theta}
    rope = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(_value(reader, "rope.scaling.factor")),
        "original_max_position_embeddings": int(
            _value(reader, "rope.scaling.original_context_length")
        ),
        "beta_fast": float(_value(reader, "rope.scaling.yarn_beta_fast") or 32.0),
        "beta_slow": float(_value(reader, "rope.scaling.yarn_beta_slow") or 1.0),
    }
    log_mul = _value(reader, "rope.scaling.yarn_log_multiplier")
    if log_mul is not None:  # written as 0.1 * mscale_all_dim
        rope["mscale"] = rope["mscale_all_dim"] = round(float(log_mul) / 0.1, 6)
    return rope


def _moe_keys(reader: GGUFReader, shapes: dict[str, tuple[int, ...]], layers: int) -> dict:
    experts = int(_value(reader, "expert_count") or 0)
    dense = _value(reader, "leading_dense_block_count")
    width = next((s[1] for n, s in shapes.items() if n.endswith(".ffn_gate_exps.weight")), None)
    width = width or _value(reader, "expert_feed_forward_length")
    keys = {
        "num_experts_per_tok": int(_value(reader, "expert_used_count") or 0) or None,
        "n_shared_experts": int(_value(reader, "expert_shared_count") or 0),
        "first_k_dense_replace": int(dense) if dense is not None else (0 if experts else layers),
        "routed_scaling_factor": float(_value(reader, "expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(_value(reader, "expert_weights_norm") or False),
        "n_group": int(_value(reader, "expert_group_count") or 1),
        "topk_group": int(_value(reader, "expert_group_used_count") or 1),
    }
    if experts:  # (else a model without experts: every layer dense)
        keys["n_routed_experts"] = experts
    if width:
        keys["moe_intermediate_size"] = int(width)
    return keys


def is_v3(reader: GGUFReader) -> bool:
    """Sigmoid gating (V3, R1, Kimi K2), said by the gating key or V3's e_score_correction_bias."""
    return _value(reader, "expert_gating_func") == _SIGMOID or any(
        t.name.endswith(".exp_probs_b.bias") for t in reader.tensors
    )


def deepseek_config(reader: GGUFReader):
    """The DeepseekV2Config or DeepseekV3Config of a deepseek2 GGUF (module docstring)."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    shapes = _shapes(reader)
    heads = int(_value(reader, "attention.head_count"))
    layers = int(_value(reader, "block_count")) - int(_value(reader, "nextn_predict_layers") or 0)
    vocab = _value(reader, "vocab_size") or shapes["token_embd.weight"][0]

    def token_id(key: str):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else int(field.parts[field.data[0]][0])

    keys = dict(
        vocab_size=int(vocab),
        hidden_size=int(_value(reader, "embedding_length")),
        intermediate_size=int(_value(reader, "feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,  # (the GGUF's 1 is MLA run as one latent head)
        max_position_embeddings=int(_value(reader, "context_length")),
        rms_norm_eps=float(_value(reader, "attention.layer_norm_rms_epsilon") or 1e-6),
        tie_word_embeddings="output.weight" not in shapes,
        rope_parameters=_rope_parameters(reader),
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("padding_token_id"),
        **_widths(shapes, heads),
        **_moe_keys(reader, shapes, layers),
    )
    if is_v3(reader):
        return DeepseekV3Config(**keys, architectures=["DeepseekV3ForCausalLM"])
    method = "group_limited_greedy" if keys["n_group"] > 1 else "greedy"
    return DeepseekV2Config(**keys, topk_method=method, architectures=["DeepseekV2ForCausalLM"])


def kv_b_from_halves(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """kv_b_proj ([heads * (nope + v), kv_lora_rank]) from llama.cpp's split halves: its
    converter views kv_b_proj as [heads, nope + v, rank], splits the nope rows off as k_b and
    transposes them ([heads, rank, nope]), the v rows as v_b ([heads, v, rank])."""
    heads, rank, _ = k_b.shape
    if v_b.shape[0] != heads or v_b.shape[2] != rank:
        raise ValueError(f"attn_k_b {k_b.shape} and attn_v_b {v_b.shape} do not pair up")
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, rank)


class DeepseekTensors:
    """The hub's tensors for the deepseek2 tensors that gguf_convert's names do not cover."""

    def __init__(self, reader: GGUFReader, num_layers: int):
        self.num_layers = num_layers
        # a file with both layouts (none known) keeps its attn_kv_b
        self.whole_kv_b = {
            int(m.group(1))
            for t in reader.tensors
            if (m := re.match(r"^blk\.(\d+)\.attn_kv_b\.weight$", t.name))
        }
        self.halves: dict[int, dict[str, np.ndarray]] = {}

    def convert(self, name: str, arr: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        """(HF name, array) pairs for `name` (none while half of a kv_b waits for the other),
        or None for a tensor gguf_convert names itself."""
        block = _BLOCK_RE.match(name)
        if block and int(block.group(1)) >= self.num_layers:
            return []  # multi-token prediction layers
        if gguf_moe.is_expert_tensor(name):
            return list(gguf_moe.expert_tensors(name, arr, mixtral=False))
        if name.endswith(".exp_probs_b.bias"):
            return [(f"model.layers.{block.group(1)}.mlp.gate.e_score_correction_bias", arr)]
        half = _KV_HALF_RE.match(name)
        if half is None:
            return None
        layer = int(half.group(1))
        if layer in self.whole_kv_b:
            return []
        pair = self.halves.setdefault(layer, {})
        pair[half.group(2)] = arr
        if len(pair) < 2:
            return []
        del self.halves[layer]
        kv_b = kv_b_from_halves(pair["k"], pair["v"])
        return [(f"model.layers.{layer}.self_attn.kv_b_proj.weight", kv_b)]

    def check_complete(self) -> None:
        if self.halves:
            layer, pair = next(iter(self.halves.items()))
            missing = "attn_v_b" if "k" in pair else "attn_k_b"
            raise ValueError(f"deepseek2 GGUF: layer {layer} has no {missing} to pair")
