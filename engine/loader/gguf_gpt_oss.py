"""gpt-oss GGUFs in GGUF conversion (engine/loader/gguf_convert.py): llama.cpp's architecture
"gpt-oss" (LLM_ARCH_OPENAI_MOE), which its convert_hf_to_gguf.py (GptOssModel) writes for
gpt-oss-20b and gpt-oss-120b (ggml-org/gpt-oss-*-GGUF), read back as transformers'
GptOssForCausalLM.

transformers' own GGUF mapping of gpt-oss misreads the file (its sliding window and rope scaling
keys, its expert tensors' names), so `gpt_oss_config` builds the GptOssConfig from llama.cpp's
keys as llama.cpp's loader reads them: the sliding window (`attention.sliding_window`, required)
on the layers llama.cpp's pattern makes sliding (`attention.sliding_window_pattern`, a period of 2
when absent: the even layers, as transformers' default layer_types), YaRN from
`rope.scaling.*` (beta_fast and beta_slow 32 and 1 when absent, llama.cpp's defaults; truncate
False, as gpt-oss's config says and no key carries), the expert counts and the head width. The
clamped SwiGLU's alpha and limit are in no key: llama.cpp's graph fixes them at 1.702 and 7.0
(LLM_FFN_SWIGLU_OAI_MOE), transformers' defaults. The tokenizer is read with the fast tokenizer
class (transformers builds the o200k split of the "gpt-4o" pre-tokenizer); the generation config
stops at `<|return|>`, `<|endoftext|>` and `<|call|>` as the hub's gpt-oss and llama.cpp's
end-of-generation tokens do.

Tensors (`GptOssTensors`): q/k/v/o with their biases and the norms keep gguf_convert's llama names
(`post_attention_norm` is the layer's post_attention_layernorm); `attn_sinks` is the attention's
`sinks` and `ffn_gate_inp` the router (weight and bias). llama.cpp splits the hub's fused
`gate_up_proj` ([E, H, 2I], gate at the even columns) into `ffn_gate_exps` and `ffn_up_exps`
([E, I, H] in numpy order; newer converters, with --fuse-gate-up-exps, write one
`ffn_gate_up_exps` [E, 2I, H], gate first) and transposes `down_proj` into `ffn_down_exps`
([E, H, I]); their biases are split the same way. Each pair is interleaved back into the hub's
`experts.gate_up_proj` and `gate_up_proj_bias`, down transposed back. OpenAI's releases keep the
experts in MXFP4, which gguf-py's dequantize reads (gguf_convert's `_to_float32`); nothing is
permuted (llama.cpp's NEOX rope rotates q/k as HF does).
"""

from __future__ import annotations

import re

import numpy as np
from gguf import GGUFReader, GGUFValueType

from .gguf_fields import field_value

GPT_OSS_ARCHITECTURES = ("gpt-oss",)
_ARCH = "gpt-oss"
# layer modules over gguf_convert's llama ones (attention, its biases, attn_norm)
LAYER_MODULES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.router",
}
# llama.cpp's clamped SwiGLU (llama-graph.cpp, LLM_FFN_SWIGLU_OAI_MOE): no GGUF key carries them
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
# the hub's generation_config eos ids of gpt-oss, after config.json's eos
STOP_TOKENS = ("<|return|>", "<|endoftext|>", "<|call|>")
# YaRN keys llama.cpp may write that transformers' gpt-oss rope has no place for
_UNREAD_ROPE_KEYS = ("attn_factor", "yarn_ext_factor", "yarn_log_multiplier")
_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|gate_up|down)_exps\.(weight|bias)$")
_SINKS_RE = re.compile(r"^blk\.(\d+)\.attn_sinks\.weight$")
# every layer's tensors besides the experts', as llama.cpp's loader requires them
_LAYER_TENSORS = tuple(
    f"{module}.{kind}"
    for module, kinds in (
        ("attn_norm", ("weight",)),
        ("post_attention_norm", ("weight",)),
        ("attn_q", ("weight", "bias")),
        ("attn_k", ("weight", "bias")),
        ("attn_v", ("weight", "bias")),
        ("attn_output", ("weight", "bias")),
        ("attn_sinks", ("weight",)),
        ("ffn_gate_inp", ("weight", "bias")),
        ("ffn_down_exps", ("weight", "bias")),
    )
    for kind in kinds
)


def _key(key: str) -> str:
    return f"{_ARCH}.{key}"


def _value(reader: GGUFReader, key: str):
    """A scalar `gpt-oss.*` metadata value (a string decoded), or None."""
    return field_value(reader, _key(key))


def _required(reader: GGUFReader, key: str, what: str):
    value = _value(reader, key)
    if value is None:
        raise ValueError(f"gpt-oss GGUF: no {_key(key)} ({what}), which llama.cpp requires too")
    return value


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-05, not
    9.99999974737875e-06), which is what the hub's config held."""
    return float(str(np.float32(value)))


def _shapes(reader: GGUFReader) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in numpy (HF) order: GGUF lists dims fastest-first."""
    return {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}


def _sliding_layers(reader: GGUFReader, layers: int) -> list[bool]:
    """Which layers slide: llama.cpp's `set_swa_pattern(period)` (layer i slides when
    i % period < period - 1; a period of 0: every layer), the period 2 unless
    `attention.sliding_window_pattern` gives another, or one flag a layer."""
    key = _key("attention.sliding_window_pattern")
    field = reader.fields.get(key)
    if field is None:
        period = 2
    elif field.types and field.types[0] == GGUFValueType.ARRAY:
        flags = [bool(field.parts[i].tolist()[0]) for i in field.data]
        if len(flags) != layers:
            raise ValueError(f"gpt-oss GGUF: {key} has {len(flags)} flags for {layers} layers")
        return flags
    else:
        period = int(field_value(reader, key))
    return [period == 0 or i % period < period - 1 for i in range(layers)]


def _rope_parameters(reader: GGUFReader, context_length: int) -> dict:
    theta = _f32(_value(reader, "rope.freq_base") or 10000.0)  # (llama.cpp's default)
    swa_theta = _value(reader, "rope.freq_base_swa")
    if swa_theta is not None and _f32(swa_theta) != theta:
        raise ValueError(
            f"gpt-oss GGUF: {_key('rope.freq_base_swa')} ({_f32(swa_theta)}) differs from "
            f"{_key('rope.freq_base')} ({theta}); transformers' gpt-oss has one rope for all layers"
        )
    kind = _value(reader, "rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise ValueError(
            f"gpt-oss GGUF: {_key('rope.scaling.type')} is {kind!r}; only 'yarn' (gpt-oss's) or "
            "none can be read"
        )
    for name in _UNREAD_ROPE_KEYS:
        if _value(reader, f"rope.scaling.{name}") is not None:
            raise ValueError(
                f"gpt-oss GGUF: {_key('rope.scaling.' + name)} is set; transformers' gpt-oss "
                "YaRN has no such parameter, so the file cannot be read"
            )
    # llama.cpp takes the training context when the original one is absent
    original = _value(reader, "rope.scaling.original_context_length") or context_length
    rope = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": _f32(_required(reader, "rope.scaling.factor", "YaRN's factor")),
        "original_max_position_embeddings": int(original),
        "beta_fast": _f32(_value(reader, "rope.scaling.yarn_beta_fast") or 32.0),
        "beta_slow": _f32(_value(reader, "rope.scaling.yarn_beta_slow") or 1.0),
        "truncate": False,
    }
    attention_factor = _value(reader, "rope.scaling.yarn_attn_factor")
    if attention_factor is not None:  # (the hub config's attention_factor, when it has one)
        rope["attention_factor"] = _f32(attention_factor)
    return rope


def _check_tensors(shapes: dict[str, tuple[int, ...]], layers: int) -> None:
    """Every tensor llama.cpp's gpt-oss loader requires, by name: a ValueError names the first
    one missing (the output projection may be tied to the embedding)."""
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in shapes:
            raise ValueError(f"gpt-oss GGUF: no tensor {name}")
    for i in range(layers):
        names = [f"blk.{i}.{t}" for t in _LAYER_TENSORS]
        fused = f"blk.{i}.ffn_gate_up_exps.weight" in shapes
        pairs = ("gate_up",) if fused else ("gate", "up")
        names += [f"blk.{i}.ffn_{p}_exps.{kind}" for p in pairs for kind in ("weight", "bias")]
        for name in names:
            if name not in shapes:
                raise ValueError(f"gpt-oss GGUF: layer {i} has no tensor {name}")


def gpt_oss_config(reader: GGUFReader):
    """The GptOssConfig of a gpt-oss GGUF (module docstring)."""
    from transformers import GptOssConfig

    shapes = _shapes(reader)
    layers = int(_required(reader, "block_count", "the layer count"))
    _check_tensors(shapes, layers)
    heads = int(_required(reader, "attention.head_count", "the query heads"))
    kv_heads = int(_value(reader, "attention.head_count_kv") or heads)
    hidden = int(_required(reader, "embedding_length", "the hidden size"))
    head_dim = _value(reader, "attention.key_length")
    head_dim = int(head_dim) if head_dim is not None else shapes["blk.0.attn_q.weight"][0] // heads
    value_length = _value(reader, "attention.value_length")
    if value_length is not None and int(value_length) != head_dim:
        raise ValueError(
            f"gpt-oss GGUF: {_key('attention.value_length')} ({value_length}) differs from the key "
            f"length ({head_dim}); gpt-oss's heads have one width"
        )
    rotary = _value(reader, "rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise ValueError(
            f"gpt-oss GGUF: {_key('rope.dimension_count')} ({rotary}) is not the head width "
            f"({head_dim}); gpt-oss rotates whole heads"
        )
    if shapes["blk.0.attn_q.weight"] != (heads * head_dim, hidden):
        raise ValueError(
            f"gpt-oss GGUF: blk.0.attn_q.weight is {shapes['blk.0.attn_q.weight']}, not "
            f"({heads * head_dim}, {hidden}) for {heads} heads of {head_dim}"
        )
    experts = int(_required(reader, "expert_count", "the experts per layer"))
    if shapes["blk.0.ffn_gate_inp.weight"][0] != experts:
        raise ValueError(
            f"gpt-oss GGUF: blk.0.ffn_gate_inp.weight routes to "
            f"{shapes['blk.0.ffn_gate_inp.weight'][0]} experts, {_key('expert_count')} says {experts}"
        )
    width = shapes["blk.0.ffn_down_exps.weight"][2]  # [E, H, I]
    stated = _value(reader, "expert_feed_forward_length")
    if stated is not None and int(stated) != width:
        raise ValueError(
            f"gpt-oss GGUF: {_key('expert_feed_forward_length')} ({stated}) is not the experts' "
            f"width in blk.0.ffn_down_exps.weight ({width})"
        )
    sliding = _sliding_layers(reader, layers)
    context = int(_required(reader, "context_length", "the training context"))

    def token_id(key: str):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else int(field.parts[field.data[0]][0])

    return GptOssConfig(
        vocab_size=shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_local_experts=experts,
        num_experts_per_tok=int(_required(reader, "expert_used_count", "the experts per token")),
        sliding_window=int(_required(reader, "attention.sliding_window", "the sliding window")),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        max_position_embeddings=context,
        rms_norm_eps=_f32(_required(reader, "attention.layer_norm_rms_epsilon", "the norms' eps")),
        rope_parameters=_rope_parameters(reader, context),
        swiglu_alpha=SWIGLU_ALPHA,
        swiglu_limit=SWIGLU_LIMIT,
        attention_bias=True,
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("padding_token_id"),
        architectures=["GptOssForCausalLM"],
    )


def stop_token_ids(tokenizer, eos_token_id) -> list[int]:
    """The generation config's eos ids: config.json's, then those of STOP_TOKENS the vocabulary
    has (the hub's gpt-oss: <|return|>, <|endoftext|>, <|call|>)."""
    ids = [] if eos_token_id is None else [int(eos_token_id)]
    vocab = tokenizer.get_vocab()
    for token in STOP_TOKENS:
        if token in vocab and vocab[token] not in ids:
            ids.append(int(vocab[token]))
    return ids


def interleave(gate: np.ndarray, up: np.ndarray, name: str) -> np.ndarray:
    """The hub's fused gate_up of llama.cpp's gate and up halves: weights [E, I, H] each give
    [E, H, 2I], biases [E, I] give [E, 2I]; gate at the even columns, up at the odd."""
    if gate.shape != up.shape or gate.ndim not in (2, 3):
        raise ValueError(
            f"GGUF tensor {name!r}: gate {gate.shape} and up {up.shape} do not pair up"
        )
    if gate.ndim == 3:
        gate, up = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
    fused = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), dtype=np.float32)
    fused[..., 0::2], fused[..., 1::2] = gate, up
    return fused


class GptOssTensors:
    """The hub's tensors for the gpt-oss tensors that gguf_convert's names do not cover."""

    def __init__(self):
        self.halves: dict[tuple[str, str], dict[str, np.ndarray]] = {}

    def convert(self, name: str, arr: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        """(HF name, array) pairs for `name` (none while half of a gate/up waits for the other),
        or None for a tensor gguf_convert names itself."""
        sinks = _SINKS_RE.match(name)
        if sinks:
            return [(f"model.layers.{sinks.group(1)}.self_attn.sinks", arr)]
        m = _EXPERT_RE.match(name)
        if m is None:
            return None
        layer, which, kind = m.groups()
        experts = f"model.layers.{layer}.mlp.experts"
        leaf = "gate_up_proj" + ("_bias" if kind == "bias" else "")
        want = 2 if kind == "bias" else 3
        if arr.ndim != want:
            raise ValueError(
                f"GGUF tensor {name!r}: expected {want} dims (experts first), got {arr.shape}"
            )
        if which == "down":
            if kind == "bias":
                return [(f"{experts}.down_proj_bias", arr)]
            return [(f"{experts}.down_proj", np.ascontiguousarray(arr.transpose(0, 2, 1)))]
        if which == "gate_up":  # [E, 2I(, H)]: gate rows, then up rows
            gate, up = np.split(arr, 2, axis=1)
            return [(f"{experts}.{leaf}", interleave(gate, up, name))]
        pair = self.halves.setdefault((layer, kind), {})
        pair[which] = arr
        if len(pair) < 2:
            return []
        del self.halves[(layer, kind)]
        return [(f"{experts}.{leaf}", interleave(pair["gate"], pair["up"], name))]

    def check_complete(self) -> None:
        if self.halves:
            (layer, kind), pair = next(iter(self.halves.items()))
            missing = "up" if "gate" in pair else "gate"
            raise ValueError(f"gpt-oss GGUF: no blk.{layer}.ffn_{missing}_exps.{kind} to pair")
