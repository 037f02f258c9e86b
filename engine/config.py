"""Frozen, validated configuration of a model (ModelConfig) and of an engine (EngineConfig).

ModelConfig is read once from a checkpoint's Hugging Face config (`from_hf`): the shapes the
model classes, the KV cache and the transfer layout are built from, the attention windows
of the layers, and the end-of-sequence ids (config.json's and those its generation_config.json
adds: engine/loader/generation_config.py). EngineConfig is what `LLM(...)`, the CLI and a
deployment YAML hand the engine. It is checked field by field when built, so a wrong value is refused before any model loads,
and holds "auto" where the engine may choose. `resolve(model_config)` turns the device, dtype,
speculative_config, max_model_len and kv_cache_memory "auto"s into values, once, before the
engine starts: a started engine's config has no "auto" left but the precision's, which
engine/precision.py and engine/kv_dtype.py choose with the model loaded and which the engine
writes back into its config. Everything here is plain data: it is pickled to tensor-parallel
ranks and worker processes as it is.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field

import torch

from pdserve.engine.image_keys import BIDIRECTIONAL_IMAGE_ARCHITECTURES, MULTIMODAL_ARCHITECTURES
from pdserve.engine.loader import generation_config as gen_config
from pdserve.engine.models import ARCHITECTURES as SUPPORTED_ARCHITECTURES
from pdserve.engine.spec.config import SpeculativeConfig

log = logging.getLogger(__name__)
DEFAULT_CPU_KV_BYTES = 1 << 30
CLASSIFIER_SUFFIX = "ForSequenceClassification"
MAX_LABEL_TOKENS = 64  # classifier_from_token's tokens at most
# what speculative_config "auto" turns on in the default mode: prompt lookup costs no model, and
# the gate (engine/spec/gate.py) turns it off at steps where it would not pay
AUTO_SPECULATION = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the HF name, a key of engine/models ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_type: str
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    # each layer's attention window in tokens (a query sees itself and the window - 1 tokens
    # before it), None for a layer that sees the whole context
    layer_windows: tuple[int | None, ...] = ()
    # per layer, the chunk of chunked attention (Llama 4's rotary layers: a query sees the keys
    # from the start of its own aligned chunk of positions up to itself), or None; empty: none
    layer_chunks: tuple[int | None, ...] = ()
    # whether each layer rotates its queries and keys (SmolLM3's no_rope_layers: every fourth
    # layer has no position encoding); empty: every layer does
    layer_ropes: tuple[bool, ...] = ()
    # a `*ForSequenceClassification` checkpoint's labels (0: a generative checkpoint) and their
    # names (its id2label); it is served by its causal family's class with the LM head tied to the
    # embedding (the checkpoint has none) and runs only pooling requests (engine/score_head.py)
    num_labels: int = 0
    label_names: tuple[str, ...] = ()
    # multi-head latent attention (DeepSeek V2/V3): the KV cache holds one latent per token
    # (kv_lora_rank + qk_rope_head_dim values), its first half in the cache's K plane and its
    # second in the V plane, so num_kv_heads is 1 and head_dim half the latent; 0: K and V heads
    kv_latent_dim: int = 0
    # a generative model's label tokens (classifier_from_token, resolved by the engine): their
    # LM-head logits are the classification head's (engine/score_head.py)
    score_token_ids: tuple[int, ...] = ()
    # a vision-language checkpoint (LLaVA): the id that stands for one image feature in a prompt
    # (the processor writes one per feature), and the checkpoint's whole config, which the image
    # encoder is built from (engine/multimodal.py); hf_config is then its language model's
    image_token_id: int | None = None
    multimodal_config: object = field(repr=False, compare=False, default=None)
    # a vision-language checkpoint served for its text alone (its architecture, in
    # TEXT_ONLY_ARCHITECTURES): hf_config is its language model's, and images are refused
    text_only_of: str | None = None
    hf_config: object = field(repr=False, compare=False, default=None)
    # Qwen2-VL's 3-D rotary positions (M-RoPE): how many of the head's frequency pairs follow
    # each of a token's frame, row and column positions (engine/layers/rotary.py); empty: one
    # position a token. Qwen2-VL's sections are runs of pairs; Qwen3-VL's interleave, pair by
    # pair (frame, row, column, frame, ...), until the row's and the column's run out
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    # Gemma 3's images: each image's tokens attend to the whole image, both ways, in a prompt
    # (a chunk never ends inside an image: engine/request.py Sequence.fit_chunk)
    image_attention_bidirectional: bool = False
    # a hybrid model's recurrent layers (RECURRENT_LAYER_TYPES: Qwen3.5's, Qwen3-Next's and OLMo
    # Hybrid's linear attention, LFM2's short convolutions): they keep per-sequence state
    # (engine/recurrent_state.py) and no KV; empty: every layer attends over the KV cache
    recurrent_layers: tuple[int, ...] = ()
    # layers of an MLP alone (Nemotron-H's "mlp" and "moe" layer types): neither KV nor state
    mlp_only_layers: tuple[int, ...] = ()
    # the recurrent layers attend too, beside their recurrent mixer (Falcon-H1's every layer):
    # they keep KV as well as state
    recurrent_attends: bool = False

    @property
    def num_kv_layers(self) -> int:
        """The layers that keep KV in the cache (all but a hybrid model's linear ones and its
        layers of an MLP alone)."""
        return self.num_layers - len(self._kv_free_layers)

    def kv_layer_index(self, layer: int) -> int:
        """Layer `layer`'s place among the layers that keep KV (itself where all do)."""
        return layer - sum(1 for r in self._kv_free_layers if r < layer)

    @property
    def _kv_free_layers(self) -> tuple[int, ...]:
        recurrent = () if self.recurrent_attends else self.recurrent_layers
        return (*recurrent, *self.mlp_only_layers)

    @property
    def why_no_images(self) -> str:
        """Why a model without an image encoder refuses images, for its error message."""
        if self.text_only_of:
            return f"{self.text_only_of}'s images are not served yet"
        return "not a vision-language model"

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention's output projection has a bias: attention_bias's, as
        transformers builds Llama, Qwen3, Granite, OLMo, Gemma and gpt-oss; the families in
        QKV_BIAS_ONLY bias their q, k and v projections alone; a config with its own
        attention_out_bias (Seed-OSS) says."""
        own = getattr(self.hf_config, "attention_out_bias", None)
        if own is not None:
            return bool(own)
        return self.attention_bias and self.architecture not in QKV_BIAS_ONLY

    @property
    def attention_sinks(self) -> bool:
        """Whether every attention head has a learned sink logit (gpt-oss): a score that joins
        each query's softmax as one more key with no value (engine/attention.py)."""
        return self.architecture in SINK_ARCHITECTURES

    @property
    def classifies(self) -> bool:
        """Whether the model has a classification head (pooling "classify" works)."""
        return bool(self.num_labels or self.score_token_ids)

    @property
    def generation_eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence ids generation_config.json adds to config.json's (the last ones of
        eos_token_ids). vLLM stops at these as stop tokens (stop_reason the id), where the
        engine's scheduler stops at every eos_token_ids id with stop_reason None."""
        own = _listed_ids(getattr(self.hf_config, "eos_token_id", None))
        return tuple(t for t in self.eos_token_ids if t not in own) if self.hf_config else ()

    @classmethod
    def from_hf(cls, hf_config, generation_config: str = "auto") -> ModelConfig:
        """The model config of `hf_config` (transformers' config of a checkpoint). Its
        end-of-sequence ids are config.json's and, after them, those of the generation config
        `generation_config` names (engine/loader/generation_config.py: "auto" and "vllm" read
        the file in the folder hf_config was loaded from, a path reads that folder's)."""
        archs = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
        arch = archs[0]
        multimodal, image_token_id, outer, text_of = None, None, None, None
        if arch in MULTIMODAL_ARCHITECTURES:  # the language model's config and family serve it
            multimodal, image_token_id, outer = hf_config, _image_token_id(hf_config), hf_config
            arch, hf_config = _language_model(hf_config)
        elif arch in TEXT_ONLY_ARCHITECTURES:  # its language model serves text; images refused
            outer, text_of = hf_config, arch
            arch, hf_config = _language_model(hf_config)
        num_labels, labels = 0, ()
        if arch.endswith(CLASSIFIER_SUFFIX):
            # the same family's causal class reads the backbone (engine/score_head.py the head)
            arch = arch.removesuffix(CLASSIFIER_SUFFIX) + "ForCausalLM"
            num_labels = int(getattr(hf_config, "num_labels", 0) or 0)
            names = getattr(hf_config, "id2label", None) or {}
            labels = tuple(str(names.get(i, names.get(str(i), i))) for i in range(num_labels))
            if num_labels < 1:
                raise ValueError(f"{archs[0]} config has num_labels {num_labels}: need 1 or more")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model architecture {archs[0]!r} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}, and their "
                f"*{CLASSIFIER_SUFFIX} classifiers"
            )
        rope = getattr(hf_config, "rope_parameters", None) or {}
        if isinstance(rope.get("full_attention"), dict):  # one per layer type (Gemma 3)
            rope = rope["full_attention"]  # (the model builds the sliding layers' own)
        if not rope:  # transformers < 5 keeps these as two attributes
            rope = dict(getattr(hf_config, "rope_scaling", None) or {})
            rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos_ids = _eos_ids(hf_config, generation_config, outer)
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        latent = _kv_latent_dim(hf_config, arch)
        if latent:
            num_kv_heads, head_dim = 1, latent // 2
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            # (0 for a model whose every MLP is a mixture of experts: Qwen3.5-MoE's config has none)
            intermediate_size=getattr(hf_config, "intermediate_size", None) or 0,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_norm_eps(hf_config),
            rope_type=rope_type,
            # (None: no position encoding, OLMo Hybrid's releases; a family's model says so)
            rope_theta=float(rope.get("rope_theta") or 10000.0),
            max_position_embeddings=hf_config.max_position_embeddings,
            # (a classifier has no LM head: it shares the embedding's, and never samples)
            tie_word_embeddings=bool(num_labels or _tied(hf_config, outer)),
            attention_bias=_attention_bias(hf_config, arch),
            eos_token_ids=eos_ids,
            layer_windows=_layer_windows(hf_config),
            layer_chunks=_layer_chunks(hf_config),
            layer_ropes=tuple(bool(r) for r in getattr(hf_config, "no_rope_layers", None) or ()),
            num_labels=num_labels,
            label_names=labels,
            kv_latent_dim=latent,
            image_token_id=image_token_id,
            multimodal_config=multimodal,
            text_only_of=text_of,
            hf_config=hf_config,
            mrope_section=_mrope_section(multimodal, rope, head_dim),
            mrope_interleaved=bool(multimodal and multimodal.architectures[0] in INTERLEAVED_MROPE),
            image_attention_bidirectional=bool(
                multimodal and multimodal.architectures[0] in BIDIRECTIONAL_IMAGE_ARCHITECTURES
            ),
            **_state_layers(hf_config),
        )

    @property
    def kv_window(self) -> int | None:
        """The window when every layer slides (a sequence's KV older than it is never read
        again), else None."""
        windows = set(self.layer_windows)
        if len(windows) == 1 and None not in windows:
            return windows.pop()
        return None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


SINK_ARCHITECTURES = ("GptOssForCausalLM",)
# vision-language checkpoints whose language model the engine serves but not yet their images
# (Llama 4's released Instruct checkpoints; Mistral 3's: Mistral Small 3.1/3.2, Ministral 3.
# Their transformers processors need torchvision, which the project's CPU machines cannot
# install, so their image path has never run here)
TEXT_ONLY_ARCHITECTURES = ("Llama4ForConditionalGeneration", "Mistral3ForConditionalGeneration")
# a language model's family by its config's model_type, where its config names no architecture
_TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_vl_text": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
    "qwen3_vl_text": "Qwen3ForCausalLM",
    "qwen3_vl_moe_text": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
# vision-language checkpoints whose language model places tokens in 3-D (M-RoPE), with the
# sections transformers reads where a config names none; those whose sections interleave
MROPE_ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": (16, 24, 24),
    "Qwen2_5_VLForConditionalGeneration": (16, 24, 24),
    "Qwen3VLForConditionalGeneration": (24, 20, 20),
    "Qwen3VLMoeForConditionalGeneration": (24, 20, 20),
    "Qwen3_5ForConditionalGeneration": (11, 11, 10),
    "Qwen3_5MoeForConditionalGeneration": (11, 11, 10),
}
INTERLEAVED_MROPE = (
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


def _tied(hf_config, multimodal) -> bool:
    """Whether the LM head is the embedding: the model's config says, for a vision-language
    checkpoint its whole config, as transformers 5 ties them (Qwen2-VL-2B's text config has no
    say; Qwen3-VL-MoE's says True by default, beside a whole config's False and an LM head)."""
    if multimodal is not None:
        tied = getattr(multimodal, "tie_word_embeddings", None)
        if tied is not None:
            return bool(tied)
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def _mrope_section(multimodal, rope: dict, head_dim: int) -> tuple[int, ...]:
    """A Qwen2-VL, Qwen3-VL or Qwen3.5 checkpoint's M-RoPE sections (its rope's mrope_section,
    or transformers' default for the class where a config has none), over the values of each
    head that turn (Qwen3.5 turns a quarter: partial_rotary_factor); () for any other
    checkpoint."""
    arch = multimodal.architectures[0] if multimodal is not None else None
    if arch not in MROPE_ARCHITECTURES:
        return ()
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    section = tuple(int(n) for n in rope.get("mrope_section") or MROPE_ARCHITECTURES[arch])
    if len(section) != 3 or 2 * sum(section) != rotary_dim or min(section) < 1:
        raise ValueError(
            f"{multimodal.architectures[0]} config's mrope_section {list(section)} must be "
            f"three positive counts that add up to half the rotary dims ({rotary_dim // 2})"
        )
    return section


def _image_token_id(hf_config) -> int:
    """The image placeholder's id (transformers 5 names it image_token_id, 4.x
    image_token_index)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError(f"{hf_config.architectures[0]} config has no image_token_id")


def _language_model(hf_config) -> tuple[str, object]:
    """A vision-language checkpoint's language model: its family's architecture and config."""
    text = hf_config.text_config
    named = getattr(text, "architectures", None) or []
    arch = named[0] if named else _TEXT_ARCHITECTURES.get(getattr(text, "model_type", ""), "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{hf_config.architectures[0]}'s language model ({getattr(text, 'model_type', '?')}) "
            f"is not one the engine serves with images; supported: "
            f"{sorted(set(_TEXT_ARCHITECTURES.values()))}"
        )
    return arch, text


QKV_BIAS_ONLY = (
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Glm4MoeForCausalLM",
    "Glm4ForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Exaone4ForCausalLM",
    "Phi3ForCausalLM",
)
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")


def _kv_latent_dim(hf_config, arch: str) -> int:
    """An MLA model's cached latent per token and layer (kv_lora_rank + qk_rope_head_dim), else
    0. The cache splits it into two equal planes, so it must be even (every released model's is:
    512 + 64)."""
    if arch not in MLA_ARCHITECTURES:
        return 0
    latent = int(hf_config.kv_lora_rank) + int(hf_config.qk_rope_head_dim)
    if latent % 2:
        raise ValueError(
            f"kv_lora_rank + qk_rope_head_dim = {latent} is odd: the engine's KV cache holds an "
            f"MLA latent as two equal halves"
        )
    return latent


def _listed_ids(eos) -> tuple[int, ...]:
    """A config's eos_token_id (an id, a list of them or None) as a tuple."""
    return tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))


def _eos_ids(hf_config, generation_config: str, outer=None) -> tuple[int, ...]:
    """config.json's end-of-sequence ids, then the ones the generation config adds (vLLM's
    update_from_generation_config): an id past the vocabulary, which no step can sample, is
    left out with a warning. `outer`: a vision-language checkpoint's config, whose language
    model's config is `hf_config` (its folder is the outer one's; its ids are either's)."""
    own = _listed_ids(getattr(hf_config, "eos_token_id", None))  # (Qwen3-VL's may have none)
    if outer is not None:
        own = own or _listed_ids(getattr(outer, "eos_token_id", None))
    folder = getattr(outer if outer is not None else hf_config, "_name_or_path", "") or None
    added = [t for t in gen_config.eos_token_ids(folder, generation_config) if t not in own]
    vocab = hf_config.vocab_size
    if any(t >= vocab for t in added):
        log.warning(
            "%s: end-of-sequence ids %s ignored: past the vocabulary of %d tokens",
            gen_config.FILE_NAME,
            [t for t in added if t >= vocab][:8],
            vocab,
        )
    return own + tuple(t for t in added if t < vocab)


def _layer_windows(hf_config) -> tuple[int | None, ...]:
    """Per layer, the sliding window or None, from `layer_types` where the config has them
    (transformers 5: Qwen2, Gemma 2/3, ...), else from `sliding_window` alone (Mistral, Mixtral:
    every layer slides when it is set)."""
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None) or None
    types = getattr(hf_config, "layer_types", None)
    if window is None:
        return (None,) * n
    if types is None:
        return (int(window),) * n
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _norm_eps(hf_config) -> float:
    """The layers' norm epsilon: rms_norm_eps, or a LayerNorm's (Cohere's layer_norm_eps,
    StarCoder2's norm_epsilon), or LFM2's norm_eps, or Nemotron-H's layer_norm_epsilon."""
    for name in (
        "rms_norm_eps",
        "layer_norm_eps",
        "norm_epsilon",
        "norm_eps",
        "layer_norm_epsilon",
    ):
        eps = getattr(hf_config, name, None)
        if eps is not None:
            return float(eps)
    raise ValueError(f"{hf_config.architectures[0]} config names no norm epsilon")


def _attention_bias(hf_config, arch: str) -> bool:
    """Whether the attention's projections have biases: attention_bias, or a family's one flag
    for every linear (StarCoder2's and ERNIE 4.5's use_bias); Qwen2's always."""
    for name in ("attention_bias", "use_bias"):
        value = getattr(hf_config, name, None)
        if value is not None:
            return bool(value)
    return arch == "Qwen2ForCausalLM"


# layer_types that keep per-sequence state instead of KV: Gated DeltaNet (Qwen3.5, Qwen3-Next,
# OLMo Hybrid), Mamba2 (Granite 4.0-H, Bamba, Nemotron-H), LFM2's short convolutions
RECURRENT_LAYER_TYPES = ("linear_attention", "conv")
# layer_types of a layer that is an MLP alone (Nemotron-H's)
MLP_ONLY_LAYER_TYPES = ("mlp", "moe")


def _state_layers(hf_config) -> dict:
    """ModelConfig's recurrent_layers, mlp_only_layers and recurrent_attends: from layer_types,
    or every layer for Falcon-H1 (attention and Mamba2 side by side in each) and Mamba2."""
    every = tuple(range(hf_config.num_hidden_layers))
    kind = getattr(hf_config, "model_type", "")
    if kind == "falcon_h1":
        return dict(recurrent_layers=every, recurrent_attends=True)
    if kind == "mamba2":  # (no attention at all: no layer keeps KV)
        return dict(recurrent_layers=every)
    return dict(
        recurrent_layers=_layers_of(hf_config, RECURRENT_LAYER_TYPES),
        mlp_only_layers=_layers_of(hf_config, MLP_ONLY_LAYER_TYPES),
    )


def _layers_of(hf_config, kinds: tuple[str, ...]) -> tuple[int, ...]:
    """The layers whose layer_types entry is one of `kinds`, else ()."""
    types = getattr(hf_config, "layer_types", None) or ()
    return tuple(i for i, t in enumerate(types) if t in kinds)


def _layer_chunks(hf_config) -> tuple[int | None, ...]:
    """Per layer, the chunk of chunked attention (layer_types' "chunked_attention": Llama 4's
    rotary layers, attention_chunk_size), else None; () where no layer chunks."""
    chunk = getattr(hf_config, "attention_chunk_size", None)
    types = getattr(hf_config, "layer_types", None) or ()
    if not chunk or "chunked_attention" not in types:
        return ()
    return tuple(int(chunk) if t == "chunked_attention" else None for t in types)


_QUANTIZATIONS = (None, "int8", "int4", "bf16", "auto")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _checker(config):
    """check(ok, name, rule): raises ValueError naming `config`'s field `name` unless ok."""

    def check(ok: bool, name: str, rule: str):
        if not ok:
            raise ValueError(f"{name} must be {rule}, got {getattr(config, name)!r}")

    return check


@dataclass(frozen=True)
class EngineConfig:
    """What `LLM(...)` accepts. "auto" values are resolved by `resolve()` into a new config."""

    model: str
    dtype: str = "auto"
    # None, "int8" (weights int8, activations quantized per row at run time), "int4" (weights
    # int4 in groups of 32, bf16 activations) or "auto": the fastest that passes a quality probe
    # (engine/quality.py). dtype="auto" on CPU means float32 activations with quantization="auto".
    quantization: str | None = None
    # the KV cache's dtype: "auto" follows the activations (dtype), except under quantization
    # "auto" on a CPU (dtype="auto" there), where the same probe may choose bfloat16
    # (engine/kv_dtype.py); "bfloat16" halves the cache (and the bytes decode attention reads)
    # under float32 activations (vLLM's kv_cache_dtype)
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    # the decoder's layers in this many stages, each run by tensor_parallel_size ranks, one after
    # another (engine/parallel.py; vLLM's name); 1: one stage
    pipeline_parallel_size: int = 1
    kv_cache_memory: int | float | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    # bytes of host memory for evicted prefix-cache blocks (engine/kv_host_tier.py), restored
    # when a later prompt needs them; 0: off. Needs the prefix cache, one pipeline stage, and
    # with tensor parallelism kv_cache_shared_dir (rank 0 copies every rank's shard)
    kv_host_tier_bytes: int = 0
    # bytes of files for the blocks the host tier pushes out (engine/kv_disk_tier.py), read back
    # when a later prompt needs them; 0: off. Needs kv_host_tier_bytes > 0. kv_disk_tier_dir:
    # where each worker makes its own directory of them; None: the pdserve cache dir's
    # kv-disk-tier/
    kv_disk_tier_bytes: int = 0
    kv_disk_tier_dir: str | None = None
    max_num_batched_tokens: int = 2048
    # a long prefill (more tokens left than this many seconds of steps compute, measured) runs
    # in chunks of about this many seconds, and short prompts that arrive meanwhile go first
    # (engine/scheduler.py's module docstring); 0: off, a prompt takes the whole token budget
    prefill_step_target_s: float = 0.5
    # a step that decodes running streams computes at most about this fraction of a plain decode
    # step's time in prompt tokens besides (their chunk sized from measured step costs:
    # engine/scheduler.py's module docstring), so a prefill beside them (a decode worker's local
    # prefill) slows their steps to about (1 + this); 0: off, prompts take the whole token budget
    max_step_slowdown: float = 0.0
    max_num_seqs: int = 128
    max_model_len: int | None = None
    seed: int = 0
    # a directory (e.g. /dev/shm): each rank's KV pool lives in a file there, so other processes
    # on this host can map it (the KV hand-off writes into a decode worker's pool in place, and
    # rank 0 of a tensor-parallel worker reads and writes every rank's pool); None: private memory
    kv_cache_shared_dir: str | None = None
    # a private CPU pool (kv_cache_shared_dir None) on transparent huge pages (kvpool,
    # new_private_pool): a decode worker on the nixl backend sets it, since a sender on its host
    # writes into the pool by the kernel's cross-memory copy, faster into 2 MiB pages; elsewhere
    # it bought nothing measured, and a pool's first fill on huge pages took longer here
    kv_cache_huge_pages: bool = False
    # not a setting: a prefill worker sets it when its engine runs in pipeline stages. A picklable
    # object whose channels() the ranks of the later stages use to push their own layers' KV
    # into the decode side's reservation (engine/kv_publish.py; prefill_worker/stage_push.py);
    # None: those ranks push nothing, and a prefill-only request with a kv_sink is refused
    kv_stage_sender: object | None = None
    # record decode-only steps as CUDA graphs (engine/cuda_graphs.py); used on CUDA with one TP
    # rank, ignored elsewhere
    cuda_graphs: bool = True
    # with decode graphs, up to this many all-greedy decode steps run back to back on the device
    # (engine/cuda_graphs.py run_burst); 1: every step waits for the host
    decode_burst: int = 8
    # "auto": read the checkpoint's weights; "dummy": small random weights of the checkpoint's
    # shape (config.json alone is enough), for timing a model without its weights
    load_format: str = "auto"
    # the model's generation config (engine/loader/generation_config.py; vLLM's
    # --generation-config): "auto" reads the model folder's generation_config.json, "vllm" keeps
    # vLLM's neutral sampling defaults, a folder path reads its generation_config.json instead.
    # Its end-of-sequence ids end sequences under every mode (ModelConfig.from_hf); its sampling
    # defaults are what a request leaves unset runs with (the router, LLM)
    generation_config: str = "auto"
    # speculative decoding (engine/spec/config.py): vLLM's mapping, e.g. {"method": "ngram",
    # "num_speculative_tokens": 4}, held as a SpeculativeConfig once checked; None: off; "auto":
    # prompt lookup where the default mode runs (dtype "auto" on a CPU: its gate speculates only
    # when it measures a gain, engine/spec/gate.py), else off
    speculative_config: SpeculativeConfig | dict | str | None = "auto"
    # LoRA adapters (engine/lora.py; vLLM's names): enable_lora turns them on; lora_modules are
    # the adapters registered at start, {name: PEFT directory} (held as (name, path) pairs);
    # max_loras bounds the adapters one step runs (engine/scheduler.py) and those whose weights
    # are resident at once (least recently used evicted, read from disk again when needed),
    # max_lora_rank the rank an adapter may have
    enable_lora: bool = False
    lora_modules: dict | tuple = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    # a generative model served as a classifier (vLLM's hf_overrides key): the tokens, each one
    # token of the vocabulary, whose logits at a prompt's last position are its labels' (["no",
    # "yes"] for Qwen3-Reranker; engine/score_head.py); held as a tuple
    classifier_from_token: tuple | list = ()

    def __post_init__(self):
        check = _checker(self)
        tokens = self.classifier_from_token
        check(
            isinstance(tokens, tuple | list)
            and len(tokens) <= MAX_LABEL_TOKENS
            and all(isinstance(t, str) and t for t in tokens),
            "classifier_from_token",
            f"a list of at most {MAX_LABEL_TOKENS} non-empty token strings",
        )
        object.__setattr__(self, "classifier_from_token", tuple(tokens))
        check(isinstance(self.model, str) and bool(self.model), "model", "a non-empty string")
        check(
            self.dtype == "auto" or self.dtype in _DTYPES,
            "dtype",
            f"'auto' or one of {sorted(_DTYPES)}",
        )
        check(
            self.quantization in _QUANTIZATIONS,
            "quantization",
            f"one of {', '.join(map(repr, _QUANTIZATIONS))}",
        )
        check(
            self.kv_cache_dtype == "auto" or self.kv_cache_dtype in _DTYPES,
            "kv_cache_dtype",
            f"'auto' or one of {sorted(_DTYPES)}",
        )
        check(self.device in ("auto", "cpu", "cuda"), "device", "'auto', 'cpu' or 'cuda'")
        self._check_graphs_and_lora(check)
        check(self.load_format in ("auto", "dummy"), "load_format", "'auto' or 'dummy'")
        gen_config.check_mode(self.generation_config)
        if self.speculative_config != "auto":
            object.__setattr__(
                self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
            )
        check(
            _is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            "an integer >= 1",
        )
        check(
            _is_int(self.pipeline_parallel_size) and self.pipeline_parallel_size >= 1,
            "pipeline_parallel_size",
            "an integer >= 1",
        )
        check(
            _is_int(self.block_size)
            and self.block_size >= 1
            and self.block_size & (self.block_size - 1) == 0,
            "block_size",
            "a power of two >= 1",
        )
        kv = self.kv_cache_memory
        check(
            kv is None or (_is_int(kv) and kv > 0) or (isinstance(kv, float) and 0 < kv <= 1),
            "kv_cache_memory",
            "bytes (an integer > 0) or a fraction of free memory in (0, 1]",
        )
        self._check_host_tier(check)
        self._check_disk_tier(check)
        self._check_step_sizes(check)
        check(
            self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 1),
            "max_model_len",
            "None or an integer >= 1",
        )
        check(
            self.kv_cache_shared_dir is None
            or (
                isinstance(self.kv_cache_shared_dir, str)
                and os.path.isdir(self.kv_cache_shared_dir)
            ),
            "kv_cache_shared_dir",
            "None or an existing directory",
        )
        check(isinstance(self.kv_cache_huge_pages, bool), "kv_cache_huge_pages", "True or False")
        self._check_stage_sender(check)

    def _check_step_sizes(self, check) -> None:
        """What one scheduler step may hold and how long it may take."""
        check(
            _is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            "an integer >= 1",
        )
        check(
            _is_int(self.max_num_seqs) and self.max_num_seqs >= 1, "max_num_seqs", "an integer >= 1"
        )
        check(
            isinstance(self.prefill_step_target_s, int | float)
            and not isinstance(self.prefill_step_target_s, bool)
            and 0 <= self.prefill_step_target_s < float("inf"),
            "prefill_step_target_s",
            "a number of seconds >= 0 (0: off)",
        )
        check(
            isinstance(self.max_step_slowdown, int | float)
            and not isinstance(self.max_step_slowdown, bool)
            and 0 <= self.max_step_slowdown < float("inf"),
            "max_step_slowdown",
            "a number >= 0 (0: off)",
        )

    def _check_stage_sender(self, check) -> None:
        sender = self.kv_stage_sender
        check(
            sender is None or callable(getattr(sender, "channels", None)),
            "kv_stage_sender",
            "None or an object with a channels() method (prefill_worker/stage_push.py)",
        )

    def _check_graphs_and_lora(self, check) -> None:
        """cuda_graphs, enable_lora, max_loras, max_lora_rank and lora_modules (normalized to
        (name, path) pairs)."""
        check(isinstance(self.cuda_graphs, bool), "cuda_graphs", "True or False")
        check(
            _is_int(self.decode_burst) and 1 <= self.decode_burst <= 64,
            "decode_burst",
            "an integer in [1, 64]",
        )
        check(isinstance(self.enable_lora, bool), "enable_lora", "True or False")
        check(_is_int(self.max_loras) and self.max_loras >= 1, "max_loras", "an integer >= 1")
        check(
            _is_int(self.max_lora_rank) and 1 <= self.max_lora_rank <= 1024,
            "max_lora_rank",
            "an integer in [1, 1024]",
        )
        modules = self.lora_modules
        pairs = tuple(modules.items()) if isinstance(modules, dict) else modules
        check(
            isinstance(pairs, tuple | list)
            and all(
                isinstance(p, tuple | list)
                and len(p) == 2
                and all(isinstance(v, str) and v for v in p)
                for p in pairs
            ),
            "lora_modules",
            "a mapping of adapter names to PEFT directories",
        )
        object.__setattr__(self, "lora_modules", tuple((n, p) for n, p in pairs))
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora=True")

    def _check_host_tier(self, check) -> None:
        """kv_host_tier_bytes: bytes >= 0, and with a tier, what it needs."""
        check(
            _is_int(self.kv_host_tier_bytes) and self.kv_host_tier_bytes >= 0,
            "kv_host_tier_bytes",
            "bytes, an integer >= 0 (0: off)",
        )
        if not self.kv_host_tier_bytes:
            return
        check(
            self.enable_prefix_caching,
            "kv_host_tier_bytes",
            "0 while enable_prefix_caching is off (the tier holds prefix-cache blocks)",
        )
        check(
            self.pipeline_parallel_size == 1,
            "kv_host_tier_bytes",
            "0 with pipeline_parallel_size > 1 (not built for pipelined engines)",
        )
        check(
            self.tensor_parallel_size == 1 or self.kv_cache_shared_dir is not None,
            "kv_host_tier_bytes",
            "0 with tensor_parallel_size > 1 unless kv_cache_shared_dir is set (rank 0 copies "
            "every rank's shard)",
        )

    def _check_disk_tier(self, check) -> None:
        """kv_disk_tier_bytes: bytes >= 0, only below a host tier; kv_disk_tier_dir: a path."""
        check(
            _is_int(self.kv_disk_tier_bytes) and self.kv_disk_tier_bytes >= 0,
            "kv_disk_tier_bytes",
            "bytes, an integer >= 0 (0: off)",
        )
        check(
            self.kv_disk_tier_dir is None
            or (isinstance(self.kv_disk_tier_dir, str) and bool(self.kv_disk_tier_dir)),
            "kv_disk_tier_dir",
            "a directory path (a non-empty string) or None (the pdserve cache dir)",
        )
        if self.kv_disk_tier_bytes:
            check(
                bool(self.kv_host_tier_bytes),
                "kv_disk_tier_bytes",
                "0 while kv_host_tier_bytes is 0 (the disk tier holds what the host tier pushes "
                "out)",
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """Under "auto", the activations' dtype until an engine starts: a started engine's config
        names its cache's dtype (engine/kv_dtype.py may choose bfloat16)."""
        return _DTYPES[self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype]

    def resolve(self, model_config: ModelConfig) -> EngineConfig:
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype, quantization = self.dtype, self.quantization
        if dtype == "auto":
            # GPUs: bf16. CPUs: float32 activations; the weights as fast as quality allows
            dtype = "bfloat16" if device == "cuda" else "float32"
            if device == "cpu" and quantization is None:
                quantization = "auto"
        if quantization is not None and device != "cpu":
            if quantization != "auto":
                raise ValueError(
                    f"quantization={quantization!r} runs on CPU only; on {device} use "
                    "dtype='bfloat16' or 'float16'"
                )
            quantization = None
        spec = self.speculative_config
        if spec == "auto":
            spec = AUTO_SPECULATION if device == "cpu" and self.dtype == "auto" else None
        if self.pipeline_parallel_size > 1:
            _check_pipeline(self, model_config)
        if model_config.kv_latent_dim:
            _check_latent(self, model_config, device)
        if model_config.attention_sinks and device != "cpu":
            raise ValueError(
                f"{model_config.architecture} (attention sinks) runs on device='cpu' only for now"
            )
        if any(model_config.layer_chunks) and device != "cpu":  # (not run on a GPU yet)
            raise ValueError(
                f"{model_config.architecture} (chunked attention) runs on device='cpu' only for now"
            )
        if model_config.recurrent_layers:
            spec = _check_recurrent(self, model_config, device, spec)
        limit = model_config.max_position_embeddings
        max_len = self.max_model_len or limit
        if max_len > limit:
            raise ValueError(
                f"max_model_len must be <= the model's max_position_embeddings "
                f"({limit}), got {max_len}"
            )
        kv = self.kv_cache_memory
        if kv is None:
            kv = DEFAULT_CPU_KV_BYTES if device == "cpu" else 0.85
        if isinstance(kv, float):  # fixed once here, so every TP rank gets the same block count
            kv = int(kv * available_memory_bytes(device))
        return dataclasses.replace(
            self,
            device=device,
            dtype=dtype,
            quantization=quantization,
            max_model_len=max_len,
            kv_cache_memory=kv,
            speculative_config=spec,
        )


def _check_pipeline(config: EngineConfig, model_config: ModelConfig) -> None:
    """What pipeline_parallel_size > 1 does not run yet, refused before any rank starts."""
    pp = config.pipeline_parallel_size
    if pp > model_config.num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} exceeds the model's {model_config.num_layers} decoder "
            f"layers: every stage runs at least one"
        )
    from pdserve.engine.models import model_class

    if not getattr(model_class(model_config.architecture), "supports_pp", False):
        raise ValueError(
            f"pipeline_parallel_size={pp}: {model_config.architecture} runs in one stage only "
            f"for now; use pipeline_parallel_size=1"
        )


def _check_recurrent(config: EngineConfig, model_config: ModelConfig, device: str, spec):
    """What a hybrid model (recurrent layers with per-sequence state) does not run yet,
    refused before any rank starts; the speculation it runs with: what it is given, but none by
    default (a step that checks guesses copies the state first, and one that rejects any computes
    the kept tokens again: engine/scheduler.py plan_rollbacks; not yet measured on a released
    hybrid)."""
    arch = model_config.architecture
    if device != "cpu":
        raise ValueError(f"{arch} (recurrent layers) runs on device='cpu' only for now")
    from pdserve.engine.lora import LORA_HYBRIDS

    if config.enable_lora and arch not in LORA_HYBRIDS:
        raise ValueError(
            f"enable_lora: LoRA adapters on {arch} are not supported yet (on the hybrids "
            f"{', '.join(LORA_HYBRIDS)} they are)"
        )
    if config.kv_disk_tier_bytes:
        raise ValueError(
            f"kv_disk_tier_bytes must be 0 for {arch}: its recurrent layers' states are kept in "
            f"host memory only (kv_host_tier_bytes), and a block on disk without one is never "
            f"reused"
        )
    return None if config.speculative_config == "auto" else spec


def _check_latent(config: EngineConfig, model_config: ModelConfig, device: str) -> None:
    """What an MLA model (engine/layers/mla.py) does not run yet, refused before any rank
    starts."""
    arch = model_config.architecture
    if device != "cpu":
        raise ValueError(f"{arch} (multi-head latent attention) runs on device='cpu' only for now")
    if config.enable_lora:
        raise ValueError(f"enable_lora: LoRA adapters on {arch} are not supported yet")


def available_memory_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
