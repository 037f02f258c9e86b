"""GGUF -> HF-format directory (config.json, tokenizer files, model.safetensors).

Supported: llama (and mistral), qwen2, qwen3, phi3, gemma2 and gemma3 GGUFs, the dense families
transformers' own GGUF loader maps, the mixtures of experts qwen2moe, qwen3moe and Mixtral (a
llama GGUF with experts), whose details are in engine/loader/gguf_moe.py, and llama.cpp's
deepseek2 (DeepSeek V2/V3, R1, Kimi K2), whose config transformers' GGUF loader does not read:
engine/loader/gguf_deepseek.py builds it and names the tensors (the tokenizer is read with the
fast tokenizer class, which takes any architecture's), and llama.cpp's gpt-oss (gpt-oss-20b and
-120b, their experts in MXFP4), whose config transformers misreads: engine/loader/gguf_gpt_oss.py
builds it and re-fuses the experts' gate and up, and llama.cpp's qwen35 and qwen35moe (Qwen3.5,
dense and MoE), whose config and tensors engine/loader/gguf_qwen35.py reads, and llama.cpp's
lfm2moe (LFM2-MoE, LFM2-8B-A1B), which transformers' GGUF loader does not read:
engine/loader/gguf_lfm2moe.py builds its config and names its tensors, and llama.cpp's falcon-h1
(Falcon-H1, Falcon-H1R), which it does not read either: engine/loader/gguf_falcon_h1.py builds
its config (the muP multipliers at 1.0: the converter folded them into the weights) and names its
tensors. Quantized tensors are dequantized to float32, so the result is a plain HF checkpoint
that the engine (or transformers) loads like any other. A change to what a conversion writes
bumps resolve.py's CONVERTER_VERSION, so the cache does not serve directories an older
converter wrote.

Family details undone here as transformers does: llama.cpp stores Gemma's norm weights as 1 + w
(so 1 is subtracted), Phi-3's fused qkv and gate/up tensors keep their HF names (attn_qkv,
ffn_up), and Gemma's four norms per layer have their own names. What transformers' GGUF config
mapping leaves out is read here: Gemma 2's soft-capping and its query scale (llama.cpp derives the
scale from the model size; so does this, for Gemma 3 too), Gemma 3's linear rope scaling. A
longrope Phi-3 (rope factor tensors) is refused, as the engine refuses longrope.
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

from . import (
    gguf_deepseek,
    gguf_falcon_h1,
    gguf_gpt_oss,
    gguf_granite,
    gguf_lfm2,
    gguf_lfm2moe,
    gguf_moe,
    gguf_nemotron_h,
    gguf_qwen35,
)
from .gguf_deepseek import DEEPSEEK_ARCHITECTURES
from .gguf_falcon_h1 import FALCON_H1_ARCHITECTURES
from .gguf_fields import field_value
from .gguf_gpt_oss import GPT_OSS_ARCHITECTURES
from .gguf_granite import GRANITE_ARCHITECTURES
from .gguf_lfm2 import LFM2_ARCHITECTURES
from .gguf_lfm2moe import LFM2MOE_ARCHITECTURES
from .gguf_moe import MOE_ARCHITECTURES
from .gguf_nemotron_h import NEMOTRON_H_ARCHITECTURES
from .gguf_qwen35 import QWEN35_ARCHITECTURES

SUPPORTED_ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3",
    *MOE_ARCHITECTURES,
    *DEEPSEEK_ARCHITECTURES,
    *FALCON_H1_ARCHITECTURES,
    *GPT_OSS_ARCHITECTURES,
    *GRANITE_ARCHITECTURES,
    *LFM2_ARCHITECTURES,
    *LFM2MOE_ARCHITECTURES,
    *NEMOTRON_H_ARCHITECTURES,
    *QWEN35_ARCHITECTURES,
)
# the families whose config is built here (transformers' GGUF loader refuses deepseek2,
# falcon-h1, granitehybrid, lfm2moe and nemotron_h, misreads gpt-oss, and reads qwen35 only in its
# newest releases) and whose tokenizer is read with the fast tokenizer class
_OWN_CONFIG_ARCHITECTURES = (
    *DEEPSEEK_ARCHITECTURES,
    *FALCON_H1_ARCHITECTURES,
    *GPT_OSS_ARCHITECTURES,
    *GRANITE_ARCHITECTURES,
    *LFM2MOE_ARCHITECTURES,
    *NEMOTRON_H_ARCHITECTURES,
    *QWEN35_ARCHITECTURES,
)
# llama.cpp's convert_hf_to_gguf.py permutes q/k rows for "llama" only (its rotary kernel pairs
# adjacent dims, HF pairs dims half a head apart; Mixtral too, as a llama); the qwen families are
# written unpermuted, and deepseek2 too (DeepSeek's rope pairs adjacent dims, as llama.cpp's does),
# and gpt-oss (llama.cpp's NEOX rope rotates half-head pairs, as HF's does).
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
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
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
    "attn_q_norm": "self_attn.q_norm",  # qwen3, gemma3
    "attn_k_norm": "self_attn.k_norm",
}
# per architecture, the layer names that differ from the llama ones above
_ARCH_LAYER_MODULES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_ARCH_LAYER_MODULES["gemma3"] = _ARCH_LAYER_MODULES["gemma2"]
_ARCH_LAYER_MODULES["deepseek2"] = gguf_deepseek.LAYER_MODULES
_ARCH_LAYER_MODULES["gpt-oss"] = gguf_gpt_oss.LAYER_MODULES
# llama.cpp's Gemma converters write every norm weight as 1 + w
_NORM_PLUS_ONE = frozenset({"gemma2", "gemma3"})
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Llama-3 GGUFs carry precomputed rope frequencies; HF recomputes them from config.rope_parameters.
_IGNORED = frozenset({"rope_freqs.weight"})


def gguf_to_hf_name(name: str, arch: str = "llama", mixtral: bool = False) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    modules = {
        **_LAYER_MODULES,
        **_ARCH_LAYER_MODULES.get(arch, {}),
        **gguf_moe.layer_modules(arch, mixtral),
    }
    m = _LAYER_RE.match(name)
    if m and m.group(2) in modules:
        layer, module, kind = m.groups()
        return f"model.layers.{layer}.{modules[module]}.{kind}"
    raise ValueError(
        f"GGUF tensor {name!r} has no known HF name for a {arch} GGUF "
        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}, and Mixtral as llama)"
    )


def reverse_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """Undo llama.cpp's LlamaModel.permute; mirrors transformers' _reverse_permute_weights.

    For k, llama.cpp permutes with the kv head count, so callers pass n_head_kv for k.
    """
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """`path`'s GGUFReader; a file the reader cannot parse (a download cut short, another format)
    is a ValueError that says so, rather than the reader's own words about array shapes or an
    index out of bounds. A file that cannot be opened keeps its OSError."""
    try:
        return GGUFReader(path)
    except OSError:
        raise
    except Exception as e:  # the reader raises ValueError, IndexError, KeyError, ... on bad bytes
        size = os.path.getsize(path)
        raise ValueError(
            f"{os.fspath(path)} is not a complete GGUF file ({size:,} bytes; {type(e).__name__}: "
            f"{str(e)[:200]}): a download cut short, or not a GGUF; fetch it again"
        ) from None


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
    reader = reader_or_path if isinstance(reader_or_path, GGUFReader) else open_gguf(reader_or_path)
    arch = supported_architecture(reader)
    mixtral = gguf_moe.is_mixtral(reader, arch)
    n_head = int(config_dict["num_attention_heads"])
    n_head_kv = int(config_dict.get("num_key_value_heads") or n_head)
    family = _family_tensors(arch, reader, config_dict)

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
        if t.name.startswith("rope_factors_"):
            raise ValueError(
                f"GGUF tensor {t.name!r}: a longrope model, which is not supported (its rope "
                "frequencies change with the sequence length)"
            )
        arr = _to_float32(t)
        if family is not None:
            named = family.convert(t.name, arr)
            if named is not None:
                for name, part in named:
                    tensors[name] = torch.from_numpy(np.ascontiguousarray(part))
                continue
        if gguf_moe.is_expert_tensor(t.name) and (mixtral or arch in MOE_ARCHITECTURES):
            for name, part in gguf_moe.expert_tensors(t.name, arr, mixtral):
                tensors[name] = torch.from_numpy(np.ascontiguousarray(part))
            continue
        hf_name = gguf_to_hf_name(t.name, arch, mixtral)
        arr = gguf_moe.reshape_moe(t.name, arr)
        if arch in _NORM_PLUS_ONE and t.name.endswith("norm.weight"):
            arr = arr - np.float32(1.0)
        if arch in _PERMUTED_ARCHITECTURES:
            if ".attn_q." in t.name:
                arr = reverse_permute(arr, n_head, n_head)
            elif ".attn_k." in t.name:
                arr = reverse_permute(arr, n_head, n_head_kv)
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(arr))
    if family is not None:
        family.check_complete()
    # transformers refuses safetensors files whose metadata lacks format=pt.
    save_file(tensors, str(out_path), metadata={"format": "pt"})
    return list(tensors)


def _family_tensors(arch: str, reader: GGUFReader, config_dict: dict):
    """The family module's tensor converter (`convert(name, arr)`, `check_complete()`) for the
    families whose tensors gguf_convert's names do not cover, else None."""
    if arch in DEEPSEEK_ARCHITECTURES:
        return gguf_deepseek.DeepseekTensors(reader, int(config_dict["num_hidden_layers"]))
    if arch in GPT_OSS_ARCHITECTURES:
        return gguf_gpt_oss.GptOssTensors()
    if arch in (*GRANITE_ARCHITECTURES, *NEMOTRON_H_ARCHITECTURES):
        # (q/k permuted as llama's: convert_hf_to_gguf's undo_permute of its Granite models)
        heads = int(config_dict["num_attention_heads"])
        kv = int(config_dict.get("num_key_value_heads") or heads)

        def unpermute(arr, which):
            return reverse_permute(arr, heads, heads if which == "q" else kv)

        if arch in NEMOTRON_H_ARCHITECTURES:
            return gguf_nemotron_h.NemotronHTensors(unpermute)
        return gguf_granite.GraniteHybridTensors(unpermute)
    if arch in LFM2_ARCHITECTURES:
        return gguf_lfm2.Lfm2Tensors()
    if arch in LFM2MOE_ARCHITECTURES:
        return gguf_lfm2moe.Lfm2MoeTensors(config_dict)
    if arch in FALCON_H1_ARCHITECTURES:
        return gguf_falcon_h1.FalconH1Tensors(config_dict)
    if arch in QWEN35_ARCHITECTURES:
        return gguf_qwen35.Qwen35Tensors(arch, config_dict)
    return None


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Write a complete HF-format model directory for `gguf_path` into the existing `out_dir`."""
    # transformers is slow to import; only a conversion needs it.
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    gguf_path = pathlib.Path(gguf_path)
    out_dir = pathlib.Path(out_dir)
    # Parse the header first so an unsupported file fails before the slower transformers passes.
    reader = open_gguf(gguf_path)
    arch = supported_architecture(reader)

    if arch in DEEPSEEK_ARCHITECTURES:  # (transformers' GGUF loader refuses it)
        config = gguf_deepseek.deepseek_config(reader)
    elif arch in GPT_OSS_ARCHITECTURES:  # (transformers misreads its window, rope, experts)
        config = gguf_gpt_oss.gpt_oss_config(reader)
    elif arch in GRANITE_ARCHITECTURES:  # (transformers' GGUF loader refuses it)
        config = gguf_granite.granite_hybrid_config(reader)
    elif arch in NEMOTRON_H_ARCHITECTURES:  # (and these)
        config = gguf_nemotron_h.nemotron_h_config(reader, arch)
    elif arch in QWEN35_ARCHITECTURES:  # (only transformers' newest releases read it)
        config = gguf_qwen35.qwen35_config(reader, arch)
    elif arch in LFM2MOE_ARCHITECTURES:  # (transformers' GGUF loader refuses it)
        config = gguf_lfm2moe.lfm2moe_config(reader)
    elif arch in FALCON_H1_ARCHITECTURES:  # (and this)
        config = gguf_falcon_h1.falcon_h1_config(reader)
    else:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if gguf_moe.is_mixtral(reader, read_architecture(reader)):
        # transformers reads it as a dense llama (or mistral)
        config = gguf_moe.mixtral_config(reader, config)
    arch_class = _ARCHITECTURE_CLASSES.get(config.model_type)
    if arch_class and not getattr(config, "architectures", None):
        # GGUF configs come back without it; engines dispatch on it as they do for HF checkpoints.
        config.architectures = [arch_class]
    _complete_config(reader, read_architecture(reader), config)
    # The weights below are float32; without this, consumers would guess the dtype.
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    _force_float32_in_saved_config(out_dir / "config.json")

    # the fast tokenizer reads any architecture's; AutoTokenizer asks for a config it maps first
    tokenizer_class = (
        PreTrainedTokenizerFast if arch in _OWN_CONFIG_ARCHITECTURES else AutoTokenizer
    )
    tokenizer = tokenizer_class.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if arch in QWEN35_ARCHITECTURES:  # (a Qwen pre-tokenizer name transformers does not know)
        gguf_qwen35.fix_pre_tokenizer(reader, tokenizer)
    max_len = getattr(config, "max_position_embeddings", None)
    if max_len:
        # The GGUF tokenizer otherwise reports an effectively infinite model_max_length.
        tokenizer.model_max_length = int(max_len)
    tokenizer.save_pretrained(out_dir)

    generation = GenerationConfig.from_model_config(config)
    if arch in GPT_OSS_ARCHITECTURES:  # (its end-of-turn tokens, as the hub's file lists them)
        generation.eos_token_id = gguf_gpt_oss.stop_token_ids(tokenizer, config.eos_token_id)
    generation.save_pretrained(out_dir)

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


def _complete_config(reader: GGUFReader, arch: str, config) -> None:
    """Sets what transformers' GGUF config mapping leaves at its defaults for these families."""
    key_length = field_value(reader, f"{arch}.attention.key_length")
    if key_length is not None and arch in ("qwen3", *MOE_ARCHITECTURES, "phi3", "gemma2", "gemma3"):
        config.head_dim = int(key_length)  # (Qwen3's is not hidden_size / heads)
    if arch in MOE_ARCHITECTURES:
        gguf_moe.complete_qwen_moe(reader, arch, config)
    if arch in LFM2_ARCHITECTURES:
        gguf_lfm2.complete_config(reader, config)
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = field_value(reader, f"gemma2.{key}")
            if value is not None:
                setattr(config, key, float(value))
    if arch in ("gemma2", "gemma3"):
        # not in the GGUF: llama.cpp takes hidden_size / heads for the 27B models (46 layers of
        # Gemma 2, 62 of Gemma 3), else head_dim, as their HF checkpoints set it
        heads, layers_27b = config.num_attention_heads, {"gemma2": 46, "gemma3": 62}[arch]
        config.query_pre_attn_scalar = (
            config.hidden_size // heads
            if config.num_hidden_layers == layers_27b
            else config.head_dim
        )
    if arch == "gemma3":
        kind = field_value(reader, "gemma3.rope.scaling.type")
        factor = field_value(reader, "gemma3.rope.scaling.factor")
        rope = getattr(config, "rope_parameters", None)
        if kind == "linear" and factor and isinstance(rope, dict) and "full_attention" in rope:
            rope["full_attention"] = dict(
                rope["full_attention"], rope_type="linear", factor=float(factor)
            )
