"""Granite 4.0 GGUFs in GGUF conversion (engine/loader/gguf_convert.py): llama.cpp's architecture
"granitehybrid", which its convert_hf_to_gguf.py (GraniteHybridModel) writes for Granite 4.0-H
(Micro, Tiny, Small, 1B, 350M: Mamba2 layers among attention ones, a mixture of experts beside a
shared MLP or the shared MLP alone) and Bamba (whose partial rotary is refused: its safetensors
checkpoint serves).

transformers' GGUF loader refuses the architecture, so `granite_hybrid_config` builds a
GraniteMoeHybridConfig. The file says a layer is Mamba2 by a 0 in its per-layer
`attention.head_count_kv`; the Mamba geometry is read off the tensors where an older converter
wrote a key differently (`ssm.time_step_rank` held 4 in some files, not the head count: the
heads are ssm_a's rows); Granite's four scalars are `embedding_scale`, `residual_scale`,
`attention.scale` and `logit_scale`; RoPE is on only where `rope.scaling.finetuned` says so (the
converter's flag for it: Granite 4.0-H attends without position encoding), and such a file's
context length (the converter's placeholder 2**20) is read as Granite 4.0's 131072.

Tensors (`GraniteHybridTensors`), back to the hub's names (engine/models/mamba_hybrid.py reads
them): ssm_in/ssm_out the mixer's projections; ssm_conv1d [channels, K] gets its middle axis
back; ssm_a holds A = -exp(A_log), so A_log = log(-A); ssm_d and ssm_dt.bias are D and dt_bias;
ssm_norm [groups, inner / groups] is flattened. The stacked experts' gate and up halves and the
shared expert's (or, without experts, the dense MLP's) are joined into the fused input_linear,
the router is block_sparse_moe.router.layer. Attention q/k rows were permuted as llama's are.
"""

from __future__ import annotations

import re

import numpy as np
from gguf import GGUFReader

from .gguf_fields import field_value

GRANITE_ARCHITECTURES = ("granitehybrid",)
_ARCH = "granitehybrid"
_NOPE_CONTEXT = 2**20  # (what the converter writes where there is no rope)
_GRANITE_CONTEXT = 131072
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# layer tensors that map one to one: GGUF name -> the hub's (under model.layers.N.)
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ssm_in.weight": "mamba.in_proj.weight",
    "ssm_in.bias": "mamba.in_proj.bias",
    "ssm_out.weight": "mamba.out_proj.weight",
    "ssm_out.bias": "mamba.out_proj.bias",
    "ssm_conv1d.bias": "mamba.conv1d.bias",
    "ssm_dt.bias": "mamba.dt_bias",
    "ffn_gate_inp.weight": "block_sparse_moe.router.layer.weight",
    "ffn_down_exps.weight": "block_sparse_moe.output_linear.weight",
    "ffn_down_shexp.weight": "shared_mlp.output_linear.weight",
    "ffn_down.weight": "shared_mlp.output_linear.weight",
}
# gate and up halves joined into one fused tensor (gate first): GGUF suffix -> (hub name, half)
_HALVES = {
    "ffn_gate_exps.weight": ("block_sparse_moe.input_linear.weight", 0),
    "ffn_up_exps.weight": ("block_sparse_moe.input_linear.weight", 1),
    "ffn_gate_shexp.weight": ("shared_mlp.input_linear.weight", 0),
    "ffn_up_shexp.weight": ("shared_mlp.input_linear.weight", 1),
    "ffn_gate.weight": ("shared_mlp.input_linear.weight", 0),
    "ffn_up.weight": ("shared_mlp.input_linear.weight", 1),
}


def _value(reader: GGUFReader, key: str):
    return field_value(reader, f"{_ARCH}.{key}")


def shapes_of(reader: GGUFReader) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in numpy (HF) order: GGUF lists dims fastest-first."""
    return {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}


def per_layer(reader: GGUFReader, arch: str, key: str, layers: int) -> list[int]:
    """A per-layer array (kv heads, MLP widths: 0 where the layer has none), a scalar repeated."""
    field = reader.fields.get(f"{arch}.{key}")
    if field is None:
        raise ValueError(f"{arch} GGUF: no {key}")
    values = [int(field.parts[i][0]) for i in field.data]
    if len(values) == 1:
        values = values * layers
    if len(values) != layers:
        raise ValueError(f"{arch} GGUF: {len(values)} values of {key} for {layers} layers")
    return values


def mamba_geometry(reader: GGUFReader, arch: str, shapes: dict, first: int) -> dict:
    """The Mamba2 geometry, read off layer `first`'s tensors: heads, head dim, state size,
    groups, conv taps, inner width and the biases."""
    heads = shapes[f"blk.{first}.ssm_a"][0]
    inner = shapes[f"blk.{first}.ssm_out.weight"][1]
    return {
        "heads": heads,
        "head_dim": inner // heads,
        "state": int(field_value(reader, f"{arch}.ssm.state_size")),
        "groups": int(field_value(reader, f"{arch}.ssm.group_count") or 1),
        "kernel": shapes[f"blk.{first}.ssm_conv1d.weight"][-1],
        "inner": inner,
        "conv_bias": f"blk.{first}.ssm_conv1d.bias" in shapes,
        "proj_bias": f"blk.{first}.ssm_in.bias" in shapes,
    }


def _mamba_keys(reader: GGUFReader, shapes: dict, hidden: int, first: int | None) -> dict:
    """GraniteMoeHybridConfig's Mamba2 keys (None: no Mamba2 layer)."""
    if first is None:
        return {}
    g = mamba_geometry(reader, _ARCH, shapes, first)
    return {
        "mamba_n_heads": g["heads"],
        "mamba_d_head": g["head_dim"],
        "mamba_d_state": g["state"],
        "mamba_n_groups": g["groups"],
        "mamba_d_conv": g["kernel"],
        "mamba_expand": g["inner"] // hidden,
        "mamba_conv_bias": g["conv_bias"],
        "mamba_proj_bias": g["proj_bias"],
    }


def _mlp_keys(reader: GGUFReader, shapes: dict) -> dict:
    """Experts (none: the dense shared MLP alone), their width and the shared MLP's."""
    experts = int(_value(reader, "expert_count") or 0)
    gate = shapes.get("blk.0.ffn_gate_exps.weight")
    shared = shapes.get("blk.0.ffn_gate_shexp.weight") or shapes.get("blk.0.ffn_gate.weight")
    keys = {
        "num_local_experts": experts,
        "num_experts_per_tok": int(_value(reader, "expert_used_count") or 0),
        "shared_intermediate_size": shared[0] if shared else 0,
    }
    keys["intermediate_size"] = gate[1] if gate else keys["shared_intermediate_size"]
    return keys


def granite_hybrid_config(reader: GGUFReader):
    """The GraniteMoeHybridConfig of a granitehybrid GGUF (module docstring)."""
    from transformers import GraniteMoeHybridConfig

    shapes = shapes_of(reader)
    layers = int(_value(reader, "block_count"))
    hidden = int(_value(reader, "embedding_length"))
    kv = per_layer(reader, _ARCH, "attention.head_count_kv", layers)
    rope = bool(_value(reader, "rope.scaling.finetuned") or False)
    context = int(_value(reader, "context_length") or _GRANITE_CONTEXT)
    if not rope and context == _NOPE_CONTEXT:
        context = _GRANITE_CONTEXT
    first_mamba = next((i for i, k in enumerate(kv) if k == 0), None)
    heads = int(_value(reader, "attention.head_count"))
    rotary = _value(reader, "rope.dimension_count")
    if rope and rotary is not None and int(rotary) < hidden // heads:
        raise ValueError(
            f"granitehybrid GGUF with a partial rotary ({rotary} of {hidden // heads} dims, "
            "Bamba's) is not supported: serve the model's safetensors checkpoint instead"
        )

    def token_id(key: str):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else int(field.parts[field.data[0]][0])

    def scalar(key: str, default: float) -> float:
        """A float32 key as the shortest decimal it stores (0.22, not 0.2199999988)."""
        value = _value(reader, key)
        if value is None:
            return default
        return float(np.format_float_positional(np.float32(value), unique=True))

    keys = dict(
        vocab_size=int(_value(reader, "vocab_size") or shapes["token_embd.weight"][0]),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(kv) or 1,
        layer_types=["mamba" if k == 0 else "attention" for k in kv],
        max_position_embeddings=context,
        rms_norm_eps=float(_value(reader, "attention.layer_norm_rms_epsilon") or 1e-6),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(_value(reader, "rope.freq_base") or 10000.0),
        },
        position_embedding_type="rope" if rope else "nope",
        embedding_multiplier=scalar("embedding_scale", 1.0),
        residual_multiplier=scalar("residual_scale", 1.0),
        attention_multiplier=scalar("attention.scale", 1.0),
        logits_scaling=scalar("logit_scale", 1.0),
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("padding_token_id"),
        architectures=["GraniteMoeHybridForCausalLM"],
        **_mamba_keys(reader, shapes, hidden, first_mamba),
        **_mlp_keys(reader, shapes),
    )
    return GraniteMoeHybridConfig(**keys)


def mamba_tensor(name: str, rest: str, arr: np.ndarray):
    """(the mixer's own name, array) of a Mamba2 tensor that llama.cpp's converter reshaped or
    transformed (`rest`: the name after `blk.N.`), else None: the conv's weight gets its middle
    axis back; ssm_a holds A = -exp(A_log) [heads, 1]; D [heads, 1] and the gated norm
    [groups, inner / groups] are flattened."""
    if rest == "ssm_conv1d.weight":
        return "conv1d.weight", arr[:, None, :]
    if rest == "ssm_a":
        if not np.all(arr < 0):
            raise ValueError(f"GGUF tensor {name}: ssm_a holds values that are not negative")
        return "A_log", np.log(-arr.reshape(-1))
    if rest == "ssm_d":
        return "D", arr.reshape(-1)
    if rest == "ssm_norm.weight":
        return "norm.weight", arr.reshape(-1)
    return None


class GraniteHybridTensors:
    """gguf_convert's family converter (`convert(name, arr)`: [(hub name, array)], or [] while
    a half waits for its other; None: not this family's tensor), its q/k rows un-permuted by the
    caller's `unpermute(arr, which)`."""

    def __init__(self, unpermute):
        self.unpermute = unpermute
        self._halves: dict[str, dict[int, np.ndarray]] = {}

    def convert(self, name: str, arr: np.ndarray):
        match = _BLOCK_RE.match(name)
        if match is None:
            return None
        layer, rest = match.group(1), match.group(2)
        prefix = f"model.layers.{layer}."
        if rest in _HALVES:
            hub, half = _HALVES[rest]
            parts = self._halves.setdefault(prefix + hub, {})
            parts[half] = arr
            if len(parts) < 2:
                return []
            del self._halves[prefix + hub]
            return [(prefix + hub, np.concatenate([parts[0], parts[1]], axis=-2))]
        if rest in ("attn_q.weight", "attn_k.weight"):
            arr = self.unpermute(arr, rest[5])
        mixer = mamba_tensor(name, rest, arr)
        if mixer is not None:
            return [(prefix + "mamba." + mixer[0], mixer[1])]
        if rest not in _LAYER:
            raise ValueError(f"granitehybrid GGUF tensor {name!r} is not one this loader knows")
        return [(prefix + _LAYER[rest], arr)]

    def check_complete(self) -> None:
        if self._halves:
            raise ValueError(
                f"granitehybrid GGUF: gate or up halves without their other: {list(self._halves)}"
            )
