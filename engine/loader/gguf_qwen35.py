"""Qwen3.5 GGUFs in GGUF conversion (engine/loader/gguf_convert.py): llama.cpp's architectures
"qwen35" (Qwen3.5, dense) and "qwen35moe" (Qwen3.5-MoE), which its converter (Qwen3_5TextModel,
Qwen3_5MoeTextModel over Qwen3NextModel) writes: Gated DeltaNet linear attention in three of
every four layers, gated full attention in the fourth.

`qwen35_config` builds the Qwen3_5TextConfig (or Qwen3_5MoeTextConfig) from the metadata, as
transformers' own GGUF loader does only in its newest releases: the layer kinds from
`full_attention_interval`, the linear attention's geometry from the `ssm.*` keys, the partial
rotary from `rope.dimension_count` over the head, the M-RoPE sections, and the decoder's depth as
`block_count` less the multi-token-prediction blocks (`nextn_predict_layers`) the file appends.

Tensors (`Qwen35Tensors`) get their hub names back through the inverse of gguf-py's own name map
(`gguf.get_tensor_name_map`), and each of the converter's edits undone: the 1 + w norms (every
norm but the linear attention's gated one) less 1, A_log = log(-ssm_a), `ssm_dt.bias` the
dt_bias, the conv's middle axis back ([channels, 1, taps]), and the value heads put back from the
converter's tiled order (K0v0, K1v0, ..., K0v1, ...) into the hub's grouped one (K0v0, K0v1, ...,
K1v0, ...) wherever a tensor has a row or column per value head or channel: the v rows of
in_proj_qkv and the conv, in_proj_z, in_proj_a, in_proj_b, A_log, dt_bias and out_proj's columns.
The experts, stacked per layer (gate and up apart, or fused as `ffn_gate_up_exps`), are split per
expert; the MTP blocks are dropped (the engine's MTP layer reads a safetensors checkpoint). A
pre-tokenizer name of a Qwen that transformers does not know splits text as Qwen3.5's does
(`fix_pre_tokenizer`), not as GPT-2's.
"""

from __future__ import annotations

import re

import numpy as np
from gguf import GGUFReader

from .gguf_fields import arch_field, as_written, field_array, field_value

QWEN35_ARCHITECTURES = ("qwen35", "qwen35moe")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# the hub's names of a Qwen3.5 checkpoint, looked up in gguf-py's map (under model.layers.0.)
_GLOBAL_HUB = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
_LAYER_HUB = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",  # (each head's query, then its gate: kept as it is)
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "linear_attn.in_proj_qkv.weight",
    "linear_attn.in_proj_z.weight",
    "linear_attn.in_proj_a.weight",
    "linear_attn.in_proj_b.weight",
    "linear_attn.conv1d.weight",
    "linear_attn.A_log",
    "linear_attn.dt_proj.bias",  # (the converter's name for dt_bias)
    "linear_attn.norm.weight",
    "linear_attn.out_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "mlp.gate.weight",
    "mlp.shared_expert.gate_proj.weight",
    "mlp.shared_expert.up_proj.weight",
    "mlp.shared_expert.down_proj.weight",
    "mlp.shared_expert_gate.weight",
    "mlp.experts.gate_proj.weight",
    "mlp.experts.up_proj.weight",
    "mlp.experts.down_proj.weight",
    "mlp.experts.gate_up_proj.weight",
)


def _rope(reader: GGUFReader, arch: str, head_dim: int) -> dict:
    """rope_parameters: the theta, the rotary part of each head and the M-RoPE sections (kept
    where they are three that fill the rotary half, as a released checkpoint's are)."""
    rotary = field_value(reader, f"{arch}.rope.dimension_count")
    factor = 0.25 if rotary is None else int(rotary) / head_dim
    sections = [int(s) for s in field_array(reader, f"{arch}.rope.dimension_sections") or [] if s]
    if len(sections) != 3 or 2 * sum(sections) != int(head_dim * factor):
        sections = None
    rope = {
        "rope_type": "default",
        "rope_theta": as_written(field_value(reader, f"{arch}.rope.freq_base") or 10000.0),
        "partial_rotary_factor": factor,
    }
    if sections:
        rope.update(mrope_section=sections, mrope_interleaved=True)
    return rope


def qwen35_config(reader: GGUFReader, arch: str):
    """The Qwen3_5TextConfig (Qwen3_5MoeTextConfig for qwen35moe) of a GGUF (module docstring)."""
    try:
        from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    except ImportError:
        raise ValueError(
            f"a {arch} GGUF needs a transformers that has Qwen3.5 (Qwen3_5TextConfig)"
        ) from None

    def value(key: str, default=None):
        return arch_field(reader, arch, key, default)

    def token_id(key: str):
        return field_value(reader, f"tokenizer.ggml.{key}")

    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    heads = int(value("attention.head_count"))
    hidden = int(value("embedding_length"))
    head_dim = int(value("attention.key_length", hidden // heads))
    layers = int(value("block_count")) - int(value("nextn_predict_layers", 0))
    interval = int(value("full_attention_interval", 4))
    value_heads = int(value("ssm.time_step_rank"))
    keys = dict(
        vocab_size=shapes["token_embd.weight"][0],
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(field_array(reader, f"{arch}.attention.head_count_kv") or [heads]),
        head_dim=head_dim,
        max_position_embeddings=int(value("context_length")),
        rms_norm_eps=as_written(value("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=_rope(reader, arch, head_dim),
        # transformers' own rule (Qwen3_5TextConfig): every interval-th layer attends
        layer_types=[
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ],
        linear_conv_kernel_dim=int(value("ssm.conv_kernel")),
        linear_key_head_dim=int(value("ssm.state_size")),
        linear_num_key_heads=int(value("ssm.group_count")),
        linear_num_value_heads=value_heads,
        linear_value_head_dim=int(value("ssm.inner_size")) // value_heads,
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("padding_token_id"),
    )
    if arch == "qwen35":
        keys.update(intermediate_size=int(value("feed_forward_length")))
        return Qwen3_5TextConfig(**keys, architectures=["Qwen3_5ForCausalLM"])
    shared = shapes.get("blk.0.ffn_gate_shexp.weight", (0,))[0]
    keys.update(
        num_experts=int(value("expert_count")),
        num_experts_per_tok=int(value("expert_used_count")),
        moe_intermediate_size=int(value("expert_feed_forward_length")),
        shared_expert_intermediate_size=int(value("expert_shared_feed_forward_length", shared)),
    )
    return Qwen3_5MoeTextConfig(**keys, architectures=["Qwen3_5MoeForCausalLM"])


def _hub_names(arch: str) -> dict[str, str]:
    """GGUF name -> the hub's: a global one whole, a layer's after `blk.0.` / `model.layers.0.`,
    from gguf-py's map (the names llama.cpp's converter writes with)."""
    import gguf

    by_name = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in by_name:
        raise ValueError(
            f"a {arch} GGUF needs a newer gguf package (this one's MODEL_ARCH has no {arch})"
        )
    names = gguf.get_tensor_name_map(by_name[arch], 1)
    inverse = {}
    for hub in (*_GLOBAL_HUB, *(f"model.layers.0.{leaf}" for leaf in _LAYER_HUB)):
        found = names.get_name(hub, try_suffixes=(".weight", ".bias"))
        if found is not None:
            inverse.setdefault(found.removeprefix("blk.0."), hub.removeprefix("model.layers.0."))
    return inverse


def tiled_to_grouped(arr: np.ndarray, axis: int, geometry: tuple, head_dim: int, offset=0):
    """`arr` with the value heads along `axis` (past its first `offset` entries, the q and k of a
    fused tensor) put back from llama.cpp's tiled order into the hub's grouped one; `geometry`:
    (key heads, value heads per key head)."""
    heads, per = geometry
    if per == 1:
        return arr
    moved = np.moveaxis(arr, axis, 0)
    head, tail = moved[:offset], moved[offset:]
    tail = tail.reshape(per, heads, head_dim, *tail.shape[1:]).swapaxes(0, 1).reshape(tail.shape)
    return np.moveaxis(np.concatenate([head, tail]), 0, axis)


class Qwen35Tensors:
    """gguf_convert's family converter: `convert(name, arr)` -> [(hub name, array)] ([] for an
    MTP block's tensor, which is dropped)."""

    def __init__(self, arch: str, config: dict):
        self.names = _hub_names(arch)
        self.layers = int(config["num_hidden_layers"])
        keys, values = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
        if values % keys:
            raise ValueError(
                f"{arch} GGUF: {values} value heads do not group over {keys} key heads"
            )
        self.geometry = (keys, values // keys)
        self.value_dim = int(config["linear_value_head_dim"])
        self.qk_rows = 2 * keys * int(config["linear_key_head_dim"])
        self.seen: set[int] = set()

    def convert(self, name: str, arr: np.ndarray):
        match = _BLOCK_RE.match(name)
        if match is None:
            if name not in self.names:
                raise ValueError(f"qwen35 GGUF tensor {name!r} is not one this loader knows")
            return [(self.names[name], self._norm(self.names[name], arr))]
        layer, rest = int(match.group(1)), match.group(2)
        if layer >= self.layers:  # a multi-token-prediction block
            return []
        if rest not in self.names:
            raise ValueError(f"qwen35 GGUF tensor {name!r} is not one this loader knows")
        self.seen.add(layer)
        leaf = self.names[rest]
        prefix = f"model.layers.{layer}."
        if leaf.startswith("mlp.experts."):
            return self._experts(prefix, leaf, arr)
        if leaf == "mlp.shared_expert_gate.weight" and arr.ndim == 1:
            arr = arr.reshape(1, -1)  # (an older converter squeezed it)
        leaf, arr = self._linear(leaf, arr)
        return [(prefix + leaf, self._norm(leaf, arr))]

    @staticmethod
    def _norm(leaf: str, arr: np.ndarray) -> np.ndarray:
        """The 1 + w norms back to w (the linear attention's gated norm is stored as it is)."""
        if leaf.endswith("norm.weight") and leaf != "linear_attn.norm.weight":
            return arr - np.float32(1.0)
        return arr

    def _linear(self, leaf: str, arr: np.ndarray) -> tuple[str, np.ndarray]:
        """A linear-attention tensor's hub name and values (module docstring), others as
        they are."""
        g, dv = self.geometry, self.value_dim
        if leaf == "linear_attn.in_proj_qkv.weight":
            arr = tiled_to_grouped(arr, 0, g, dv, self.qk_rows)
        elif leaf == "linear_attn.in_proj_z.weight":
            arr = tiled_to_grouped(arr, 0, g, dv)
        elif leaf in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight"):
            arr = tiled_to_grouped(arr, 0, g, 1)
        elif leaf == "linear_attn.out_proj.weight":
            arr = tiled_to_grouped(arr, 1, g, dv)
        elif leaf == "linear_attn.conv1d.weight":  # [channels, taps] -> [channels, 1, taps]
            arr = tiled_to_grouped(arr.reshape(arr.shape[0], -1), 0, g, dv, self.qk_rows)[:, None]
        elif leaf == "linear_attn.A_log":
            if not np.all(arr < 0):
                raise ValueError("qwen35 GGUF: ssm_a holds values that are not negative")
            arr = tiled_to_grouped(np.log(-arr.reshape(-1)), 0, g, 1)
        elif leaf == "linear_attn.dt_proj.bias":
            leaf, arr = "linear_attn.dt_bias", tiled_to_grouped(arr.reshape(-1), 0, g, 1)
        return leaf, arr

    @staticmethod
    def _experts(prefix: str, leaf: str, arr: np.ndarray):
        """A layer's stacked experts [experts, out, in], one tensor per expert (a copy each:
        safetensors refuses tensors that share memory); the fused gate_up split in its halves."""
        if arr.ndim != 3:
            raise ValueError(f"{prefix}{leaf}: expected 3 dims (experts stacked), got {arr.shape}")
        if leaf == "mlp.experts.gate_up_proj.weight":  # (gate rows, then up rows)
            gate, up = np.split(arr, 2, axis=1)
            return [
                *Qwen35Tensors._experts(prefix, "mlp.experts.gate_proj.weight", gate),
                *Qwen35Tensors._experts(prefix, "mlp.experts.up_proj.weight", up),
            ]
        which = leaf.removeprefix("mlp.experts.")
        return [(f"{prefix}mlp.experts.{e}.{which}", arr[e].copy()) for e in range(arr.shape[0])]

    def check_complete(self) -> None:
        missing = sorted(set(range(self.layers)) - self.seen)
        if missing:
            raise ValueError(f"qwen35 GGUF: layers {missing} have no tensors")


def fix_pre_tokenizer(reader: GGUFReader, tokenizer) -> None:
    """A byte-level BPE whose `tokenizer.ggml.pre` names a Qwen pre-tokenizer transformers does
    not know (a later Qwen's; "qwen35" itself where this transformers predates it) gets Qwen3.5's
    split, or qwen2's where transformers has no Qwen3.5: transformers leaves an unknown name at
    GPT-2's split, which cuts text where Qwen's merges were not learned (a number's digits kept
    together, where Qwen splits them one by one)."""
    pre = field_value(reader, "tokenizer.ggml.pre")
    if field_value(reader, "tokenizer.ggml.model") != "gpt2" or not str(pre).startswith("qwen"):
        return
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS as known,
        )
    except ImportError:
        known = {}
    if pre in known:
        return
    from tokenizers import Regex, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    split = known.get("qwen35", PRETOKENIZE_REGEX)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
