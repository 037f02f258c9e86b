"""The mixtures of experts in GGUF conversion (engine/loader/gguf_convert.py).

Qwen2-MoE and Qwen3-MoE GGUFs (architectures "qwen2moe", "qwen3moe"): transformers' GGUF config
mapping reads the expert count and top-k; the expert and shared-expert widths, which it leaves at
its defaults, are read here from the tensors, and the layers without a router become
`mlp_only_layers` (llama.cpp's own graphs make every layer sparse, so its GGUFs have none).
Qwen3-MoE renormalizes its top-k weights (transformers' GGUF default, and llama.cpp's), Qwen2-MoE
does not, unless the GGUF says otherwise (`expert_weights_norm`).

Mixtral: llama.cpp writes it as architecture "llama" with `llama.expert_count`, which transformers
reads as a dense Llama (or Mistral) config; `mixtral_config` rebuilds it as a MixtralConfig from
those keys and the GGUF's expert fields. Its q/k are permuted as llama's are.

llama.cpp stacks each layer's experts into 3-D tensors (`blk.N.ffn_{gate,up,down}_exps`, numpy
shape [experts, out, in]); older Mixtral GGUFs have one tensor per expert (`blk.N.ffn_gate.E`).
Both are written out per expert under the hub's names (`mlp.experts.E.gate_proj` for Qwen,
`block_sparse_moe.experts.E.w1` for Mixtral), which transformers and the engine both load.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
from gguf import GGUFReader

from .gguf_fields import field_value

MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe")

# llama.cpp module -> (Qwen's per-expert name, Mixtral's)
_EXPERTS = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
_STACKED_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_PER_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
# layer modules of the sparse MLPs (merged over gguf_convert's dense ones)
QWEN_LAYER_MODULES = {
    "ffn_gate_inp": "mlp.gate",  # the router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
MIXTRAL_LAYER_MODULES = {"ffn_gate_inp": "block_sparse_moe.gate"}
# what a Mixtral config takes over from the dense config transformers reads
_MIXTRAL_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def _int_field(reader: GGUFReader, key: str) -> int | None:
    value = field_value(reader, key)
    return None if value is None else int(value)


def is_mixtral(reader: GGUFReader, arch: str) -> bool:
    """A llama GGUF with experts (llama.cpp's Mixtral)."""
    return arch == "llama" and (_int_field(reader, "llama.expert_count") or 0) > 0


def layer_modules(arch: str, mixtral: bool) -> dict[str, str]:
    if mixtral:
        return MIXTRAL_LAYER_MODULES
    return QWEN_LAYER_MODULES if arch in MOE_ARCHITECTURES else {}


def expert_tensors(name: str, arr: np.ndarray, mixtral: bool) -> Iterator[tuple[str, np.ndarray]]:
    """The per-expert HF tensors of an expert GGUF tensor; nothing if `name` is not one."""
    stacked, single = _STACKED_RE.match(name), _PER_EXPERT_RE.match(name)
    if stacked is None and single is None:
        return
    layer, which = (stacked or single).group(1), (stacked or single).group(2)
    module = "block_sparse_moe" if mixtral else "mlp"
    leaf = _EXPERTS[which][1 if mixtral else 0]
    if single is not None:
        yield f"model.layers.{layer}.{module}.experts.{single.group(3)}.{leaf}.weight", arr
        return
    if arr.ndim != 3:
        raise ValueError(
            f"GGUF tensor {name!r}: expected 3 dims (experts stacked), got {arr.shape}"
        )
    for e in range(arr.shape[0]):
        # a copy each: safetensors refuses tensors that share memory
        yield f"model.layers.{layer}.{module}.experts.{e}.{leaf}.weight", arr[e].copy()


def is_expert_tensor(name: str) -> bool:
    return bool(_STACKED_RE.match(name) or _PER_EXPERT_RE.match(name))


def reshape_moe(name: str, arr: np.ndarray) -> np.ndarray:
    """llama.cpp writes Qwen2-MoE's shared-expert gate ([1, hidden] in HF) squeezed to 1-D."""
    if name.endswith(".ffn_gate_inp_shexp.weight") and arr.ndim == 1:
        return arr.reshape(1, -1)
    return arr


def _router_layers(reader: GGUFReader) -> set[int]:
    return {
        int(t.name.split(".")[1])
        for t in reader.tensors
        if re.match(r"^blk\.\d+\.ffn_gate_inp\.weight$", t.name)
    }


def _expert_width(reader: GGUFReader, module: str) -> int | None:
    """The output width of an expert tensor kind (`ffn_gate_exps`, `ffn_gate_shexp`, ...)."""
    for t in reader.tensors:
        if re.match(rf"^blk\.\d+\.{module}\.weight$", t.name):
            return int(t.shape[1])  # GGUF dims are fastest-first: [in, out(, experts)]
    return None


def complete_qwen_moe(reader: GGUFReader, arch: str, config) -> None:
    """Sets what transformers' GGUF mapping of Qwen2/3-MoE leaves at the defaults."""
    width = _expert_width(reader, "ffn_gate_exps") or _int_field(
        reader, f"{arch}.expert_feed_forward_length"
    )
    if width:
        config.moe_intermediate_size = width
    if arch == "qwen2moe":
        shared = _expert_width(reader, "ffn_gate_shexp") or _int_field(
            reader, f"{arch}.expert_shared_feed_forward_length"
        )
        config.shared_expert_intermediate_size = shared or 0
    norm = _int_field(reader, f"{arch}.expert_weights_norm")
    if norm is not None:
        config.norm_topk_prob = bool(norm)
    if getattr(config, "head_dim", None) is None:
        # transformers' Qwen2-MoE attention takes a head_dim of None as it is
        config.head_dim = config.hidden_size // config.num_attention_heads
    sparse = _router_layers(reader)
    config.decoder_sparse_step = 1
    config.mlp_only_layers = [i for i in range(config.num_hidden_layers) if i not in sparse]


def mixtral_config(reader: GGUFReader, dense):
    """A MixtralConfig from the Llama/Mistral config transformers reads for a llama GGUF with
    experts, and the GGUF's expert fields."""
    from transformers import MixtralConfig

    n_layers = int(dense.num_hidden_layers)
    missing = sorted(set(range(n_layers)) - _router_layers(reader))
    if missing:
        raise ValueError(f"Mixtral GGUF: layers {missing} have no router (ffn_gate_inp)")
    used = _int_field(reader, "llama.expert_used_count")
    if not used:
        raise ValueError("Mixtral GGUF: no llama.expert_used_count (experts per token)")
    keys = {k: getattr(dense, k) for k in _MIXTRAL_KEYS if getattr(dense, k, None) is not None}
    width = _expert_width(reader, "ffn_gate_exps")
    if width is None:  # the older one-tensor-per-expert layout
        width = _expert_width(reader, r"ffn_gate\.0")
    return MixtralConfig(
        **keys,
        intermediate_size=width or int(dense.intermediate_size),
        num_local_experts=_int_field(reader, "llama.expert_count"),
        num_experts_per_tok=used,
        architectures=["MixtralForCausalLM"],
    )
