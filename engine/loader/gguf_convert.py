"""GGUF -> HF-format directory (config.json, tokenizer files, model.safetensors).

Only llama and qwen2 GGUFs are supported. Quantized tensors are dequantized to float32, so the
result is a plain HF checkpoint that the engine (or transformers) loads like any other.
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

# Bump whenever the output of a conversion changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# llama.cpp's convert_hf_to_gguf.py permutes q/k rows for "llama" only (its rotary kernel pairs
# adjacent dims, HF pairs dims half a head apart); qwen2 is written unpermuted.
_PERMUTED_ARCHITECTURES = frozenset({"llama"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# transformers maps a llama GGUF whose name mentions mistral to model_type "mistral".
_ARCHITECTURE_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Llama-3 GGUFs carry precomputed rope frequencies; HF recomputes them from config.rope_parameters.
_IGNORED = frozenset({"rope_freqs.weight"})


def gguf_to_hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_MODULES:
        layer, module, kind = m.groups()
        return f"model.layers.{layer}.{_LAYER_MODULES[module]}.{kind}"
    raise ValueError(
        f"GGUF tensor {name!r} has no known HF name (supported: llama/qwen2 dense models)"
    )


def reverse_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """Undo llama.cpp's LlamaModel.permute; mirrors transformers' _reverse_permute_weights.

    For k, llama.cpp permutes with the kv head count, so callers pass n_head_kv for k.
    """
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_architecture(reader: GGUFReader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError("GGUF file has no general.architecture field")
    # Decode by hand rather than ReaderField.contents(), which older gguf releases lack.
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def supported_architecture(reader: GGUFReader) -> str:
    arch = read_architecture(reader)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
        )
    return arch


def _to_float32(tensor) -> np.ndarray:
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        # Reader data is a read-only memmap; astype copies, so torch gets a writable array.
        arr = np.asarray(tensor.data).astype(np.float32)
    else:
        arr = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    # GGUF lists dims fastest-first; numpy/HF order is the reverse.
    return arr.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def convert_gguf_weights(
    reader_or_path: GGUFReader | str | os.PathLike,
    config_dict: dict,
    out_path: str | os.PathLike,
) -> list[str]:
    """Dequantize, un-permute and rename every tensor; write them as one float32 safetensors file.

    `config_dict` needs num_attention_heads and num_key_value_heads (an HF config dict).
    Returns the HF tensor names written.
    """
    reader = (
        reader_or_path if isinstance(reader_or_path, GGUFReader) else GGUFReader(reader_or_path)
    )
    arch = supported_architecture(reader)
    n_head = int(config_dict["num_attention_heads"])
    n_head_kv = int(config_dict.get("num_key_value_heads") or n_head)

    tensors: dict[str, torch.Tensor] = {}
    from tqdm import tqdm

    from .safetensors_io import _progress_disabled

    for t in tqdm(
        reader.tensors,
        desc="converting GGUF to float32",
        unit="tensor",
        leave=False,
        disable=_progress_disabled(),
    ):
        if t.name in _IGNORED:
            continue
        hf_name = gguf_to_hf_name(t.name)
        arr = _to_float32(t)
        if arch in _PERMUTED_ARCHITECTURES:
            if ".attn_q." in t.name:
                arr = reverse_permute(arr, n_head, n_head)
            elif ".attn_k." in t.name:
                arr = reverse_permute(arr, n_head, n_head_kv)
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(arr))
    # transformers refuses safetensors files whose metadata lacks format=pt.
    save_file(tensors, str(out_path), metadata={"format": "pt"})
    return list(tensors)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Write a complete HF-format model directory for `gguf_path` into the existing `out_dir`."""
    # transformers is slow to import; only a conversion needs it.
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    gguf_path = pathlib.Path(gguf_path)
    out_dir = pathlib.Path(out_dir)
    # Parse the header first so an unsupported file fails before the slower transformers passes.
    reader = GGUFReader(gguf_path)
    supported_architecture(reader)

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    arch_class = _ARCHITECTURE_CLASSES.get(config.model_type)
    if arch_class and not getattr(config, "architectures", None):
        # GGUF configs come back without it; engines dispatch on it as they do for HF checkpoints.
        config.architectures = [arch_class]
    # The weights below are float32; without this, consumers would guess the dtype.
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    _force_float32_in_saved_config(out_dir / "config.json")

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    max_len = getattr(config, "max_position_embeddings", None)
    if max_len:
        # The GGUF tokenizer otherwise reports an effectively infinite model_max_length.
        tokenizer.model_max_length = int(max_len)
    tokenizer.save_pretrained(out_dir)

    GenerationConfig.from_model_config(config).save_pretrained(out_dir)

    convert_gguf_weights(reader, config.to_dict(), out_dir / "model.safetensors")


def _force_float32_in_saved_config(path: pathlib.Path) -> None:
    # Older transformers read torch_dtype, newer read dtype; write both so either sees float32.
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["dtype"] = "float32"
    cfg["torch_dtype"] = "float32"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
