"""LoRA adapters in PEFT's format, applied per request on top of the base model's linears.

What this module owns, in the order a request meets it:

- `LoRARequest` (vLLM's shape: a name, an int id, a path) names the adapter a request runs under.
- `read_adapter` reads and checks one adapter directory as PEFT's `save_pretrained` writes it
  (`adapter_config.json` and `adapter_model.safetensors`, tensors named
  `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`): LoRA only (no DoRA, no
  biases, no `modules_to_save`, no per-module rank or alpha patterns), a rank within
  `max_lora_rank`, target modules among the attention projections (q, k, v, o) and the dense
  MLP's (gate, up, down) of the model's layers (on the Qwen3.5 hybrids also the Gated DeltaNet
  layers' `linear_attn` projections, on LFM2 its short convolutions' `conv` ones under LFM2's
  PEFT names, on Granite 4.0-H its Mamba2 mixers' `mamba` ones, on Nemotron-H each layer's one
  `mixer` under `backbone.`: Mamba2, attention or its ReLU-squared MLP by the layer's kind; each
  module checked against its layer's kind), every shape checked against the model's config.
  Experts of a mixture of experts, embeddings and the LM head are refused with an error naming
  the tensor. Its content hash (BLAKE2b of the config and the weights' bytes) goes into the
  prefix cache's chain root (`cache_root`), so KV computed under one adapter is never reused
  under another, under the base, or under a replaced adapter of the same name.
- `LoRARegistry` (the engine's rank 0) maps names to adapters the engine serves: registered
  from the config's modules at start, at run time by `add_lora`, or by a request's LoRARequest;
  each is read and checked once when registered, so a bad adapter is refused before any step.
- `LoRACache` (every rank's model runner) holds at most `max_loras` adapters' weights, each rank
  its shard of them, in least-recently-used order, and reads an evicted adapter from disk again
  when a step needs it. The scheduler never plans a step of more than `max_loras` adapters
  (engine/scheduler.py: a further adapter's requests wait for a later step, first come first
  served), so a step's adapters are always resident together. A step's ModelInput names the adapter (id and path) of each sequence,
  so tensor-parallel followers load what rank 0 registered without another message.
- `LoRABatch` is one step's grouping of the batch's rows by adapter, set in the forward context;
  every LinearBase with adapter weights adds, for each group of rows, x @ A^T @ B^T * scale
  (scale = lora_alpha / r, or / sqrt(r) with use_rslora) to its output (LinearBase.forward), in
  the activations' dtype, before a row-parallel layer's all-reduce.

Tensor parallelism shards A and B as the base weight is: a column-parallel layer (q, k, v, gate,
up) keeps A whole and its own rows of B (its heads, its slice of the intermediate size); a
row-parallel layer (o, down) keeps its columns of A and the whole B, and its partial delta is
summed with the base output's partial sums by the layer's all-reduce (the delta is linear in
x @ A^T, so the sum of the ranks' partial deltas is the whole delta).

On CPU the groups are a loop over the adapters present in the step, each an index_select of its
rows, two small matmuls and an index_add; the fused decode stack and CUDA graphs are skipped in a
step that runs an adapter. A GPU path that serves many adapters at once needs grouped kernels
over all rows of a step (punica's BGMV/SGMV, as vLLM's `add_lora`), with the adapters' weights
stacked in device buffers of `max_loras` slots: not built here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pdserve.engine.errors import InvalidRequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the PEFT module names (the last part of the path) an adapter may target, and where they land
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# a hybrid's Gated DeltaNet layers (Qwen3.5's names: Qwen3-Next fuses them per key head)
LINEAR_ATTN_MODULES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# LFM2's short convolutions (PEFT's conv.in_proj and conv.out_proj)
CONV_MODULES = ("conv_in_proj", "conv_out_proj")
# Granite 4.0-H's Mamba2 mixers (PEFT's mamba.in_proj and mamba.out_proj)
MAMBA_MODULES = ("mamba_in_proj", "mamba_out_proj")
BLOCK_MODULES = {
    "self_attn": ATTN_MODULES,
    "mlp": MLP_MODULES,
    "linear_attn": LINEAR_ATTN_MODULES,
    "conv": CONV_MODULES,
    "mamba": MAMBA_MODULES,
}
RECURRENT_BLOCKS = ("linear_attn", "conv", "mamba")
# another family's PEFT (block, module) -> ours (LFM2's attention output and SwiGLU names)
_ALIASES = {
    ("self_attn", "out_proj"): ("self_attn", "o_proj"),
    ("feed_forward", "w1"): ("mlp", "gate_proj"),
    ("feed_forward", "w3"): ("mlp", "up_proj"),
    ("feed_forward", "w2"): ("mlp", "down_proj"),
    ("conv", "in_proj"): ("conv", "conv_in_proj"),
    ("conv", "out_proj"): ("conv", "conv_out_proj"),
    ("mamba", "in_proj"): ("mamba", "mamba_in_proj"),
    ("mamba", "out_proj"): ("mamba", "mamba_out_proj"),
}
# the Qwen3.5 hybrids: Gated DeltaNet beside gated full attention, whose q_proj yields each
# head's query and output gate
GATED_QUERY = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
# the hybrids whose adapters are served
LORA_HYBRIDS = (
    *GATED_QUERY,
    "Lfm2ForCausalLM",
    "Lfm2MoeForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "NemotronHForCausalLM",
)
MAX_NAME_LEN = 256
MAX_PATH_LEN = 4096
MAX_ADAPTER_BYTES = 4 << 30  # an adapter's weights file larger than this is refused
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")
_KEY_RE = re.compile(
    r"^base_model\.model\.(?:model|backbone)\.layers\.(\d+)\."
    r"(self_attn|mlp|linear_attn|feed_forward|conv|mamba|mixer)"
    r"\.([a-z_0-9]+)"
    r"\.lora_([AB])\.weight$"
)
# Nemotron-H's PEFT names (backbone.layers.N.mixer.X): each layer's one mixer, whose kind (its
# layer_types entry) says what X may be; a mixture of experts' is refused
_MIXER_BLOCKS = {
    "linear_attention": ("mamba", ("in_proj", "out_proj"), "a Mamba2 layer"),
    "full_attention": ("self_attn", ATTN_MODULES, "an attention layer"),
    "mlp": ("mlp", ("up_proj", "down_proj"), "an MLP layer (up and down, no gate)"),
}


class LoRAError(InvalidRequest):
    """An adapter that cannot be served: a bad name, path, config, tensor or rank."""


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs under (vLLM's LoRARequest): its name, an id >= 1 (checked and
    kept for vLLM's shape; the engine numbers the adapters it registers itself, a new number for
    each registration, so a replaced adapter never reuses the old one's weights or KV), and
    `lora_path`, the directory PEFT saved it to. A name already registered with the same path is
    that adapter; with another path, the adapter is replaced."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        check_name(self.lora_name)
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise LoRAError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        check_path(self.lora_path)


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise LoRAError(
            f"lora_name must be a non-empty string of at most {MAX_NAME_LEN} characters, "
            f"got {name!r:.80}"
        )
    if not _NAME_RE.match(name):
        raise LoRAError(
            f"lora_name {name!r} may hold only letters, digits and . _ : / @ + - "
            f"(and not start with a punctuation mark)"
        )
    return name


def check_path(path: object) -> str:
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_LEN or "\x00" in path:
        raise LoRAError(
            f"lora_path must be a non-empty path of at most {MAX_PATH_LEN} characters, "
            f"got {path!r:.80}"
        )
    return path


@dataclass(frozen=True)
class AdapterInfo:
    """What the registry knows of a registered adapter (the weights stay on disk)."""

    name: str
    lora_id: int
    path: str
    rank: int
    alpha: float
    content_hash: bytes  # 16 bytes
    target_modules: tuple[str, ...]

    @functools.cached_property
    def cache_root(self) -> int:
        return cache_root(self.name, self.content_hash)


def cache_root(name: str, content_hash: bytes) -> int:
    """The parent hash of a sequence's first KV block under this adapter (the base model's is
    None): engine/block_manager.py chains every block hash from it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"pdserve-lora\x00" + name.encode() + b"\x00" + content_hash)
    return int.from_bytes(h.digest(), "little")


@dataclass
class AdapterWeights:
    """One adapter read from disk: (layer, PEFT module) -> (A [r, in], B [out, r]), and its scale."""

    info: AdapterInfo
    scale: float
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _expected_shapes(model_config, module: str) -> tuple[int, int]:
    """(in, out) of a PEFT target module in the full (unsharded) model."""
    mc = model_config
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    if module in CONV_MODULES:
        h = mc.hidden_size
        return (h, 3 * h) if module == "conv_in_proj" else (h, h)  # (in_proj: B, C and x)
    if module in MAMBA_MODULES:
        from pdserve.engine.models.mamba_hybrid import mamba_geometry

        keys = "nemotron" if mc.architecture == "NemotronHForCausalLM" else "granite"
        g = mamba_geometry(mc.hf_config, keys)
        inner = g["heads"] * g["head_dim"]
        if module == "mamba_out_proj":
            return (inner, mc.hidden_size)
        # (in_proj's rows: z, x, B, C, dt)
        return (mc.hidden_size, 2 * inner + 2 * g["groups"] * g["state_size"] + g["heads"])
    if module in LINEAR_ATTN_MODULES:
        hf = mc.hf_config
        key = hf.linear_num_key_heads * hf.linear_key_head_dim
        value = hf.linear_num_value_heads * hf.linear_value_head_dim
        return {
            "in_proj_qkv": (mc.hidden_size, 2 * key + value),
            "in_proj_z": (mc.hidden_size, value),
            "in_proj_b": (mc.hidden_size, hf.linear_num_value_heads),
            "in_proj_a": (mc.hidden_size, hf.linear_num_value_heads),
            "out_proj": (value, mc.hidden_size),
        }[module]
    inter = _dense_intermediate(mc)
    gated = 2 if mc.architecture in GATED_QUERY else 1  # (q_proj: each head's query and gate)
    return {
        "q_proj": (mc.hidden_size, gated * q),
        "k_proj": (mc.hidden_size, kv),
        "v_proj": (mc.hidden_size, kv),
        "o_proj": (q, mc.hidden_size),
        "gate_proj": (mc.hidden_size, inter),
        "up_proj": (mc.hidden_size, inter),
        "down_proj": (inter, mc.hidden_size),
    }[module]


def _dense_intermediate(mc) -> int:
    if mc.architecture in ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM"):
        from pdserve.engine.models.lfm2 import _ff_size

        return _ff_size(mc.hf_config)  # (its SwiGLU's width, adjusted as transformers does)
    return mc.intermediate_size


def read_adapter(
    name: str, path: str, lora_id: int, model_config, max_lora_rank: int
) -> AdapterWeights:
    """Reads and checks the adapter at `path` (module docstring); raises LoRAError naming what
    is wrong."""
    check_name(name)
    check_path(path)
    cfg_bytes, w_bytes = _read_files(name, path)
    r, alpha, scale = _read_config(name, cfg_bytes, max_lora_rank)
    tensors = _read_tensors(name, w_bytes, r, model_config)
    if model_config.architecture in (
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "Glm4MoeForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "Lfm2MoeForCausalLM",
    ):
        _check_dense_layers(name, model_config, {layer for layer, m in tensors if m in MLP_MODULES})
    digest = hashlib.blake2b(cfg_bytes + b"\x00" + w_bytes, digest_size=16).digest()
    modules = tuple(sorted({m for _, m in tensors}))
    info = AdapterInfo(name, lora_id, path, r, float(alpha), digest, modules)
    return AdapterWeights(info, scale, tensors)


def _read_files(name: str, path: str) -> tuple[bytes, bytes]:
    """The adapter's config and weights files' bytes (bounded in size)."""
    cfg_path, w_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path):
        raise LoRAError(f"adapter {name!r}: lora_path {path!r} is not a directory")
    for f in (cfg_path, w_path):
        if not os.path.isfile(f):
            raise LoRAError(
                f"adapter {name!r}: {f!r} is missing (PEFT's save_pretrained writes "
                f"{CONFIG_FILE} and {WEIGHTS_FILE})"
            )
    if os.path.getsize(w_path) > MAX_ADAPTER_BYTES:
        raise LoRAError(f"adapter {name!r}: {w_path!r} is larger than {MAX_ADAPTER_BYTES} bytes")
    with open(cfg_path, "rb") as fh:
        cfg_bytes = fh.read(1 << 20)
    with open(w_path, "rb") as fh:
        w_bytes = fh.read()
    return cfg_bytes, w_bytes


def _read_config(name: str, cfg_bytes: bytes, max_lora_rank: int) -> tuple[int, float, float]:
    """(r, lora_alpha, scale) from adapter_config.json, what is not served refused."""
    try:
        cfg = json.loads(cfg_bytes)
    except ValueError as e:
        raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} must hold an object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter {name!r}: peft_type must be LORA, got {cfg.get('peft_type')!r}")
    for key, ok in (
        ("use_dora", lambda v: not v),
        ("bias", lambda v: v in (None, "none")),
        ("modules_to_save", lambda v: not v),
        ("rank_pattern", lambda v: not v),
        ("alpha_pattern", lambda v: not v),
        ("layers_to_transform", lambda v: v is None),
        # LoRA of parameters rather than modules: PEFT's for gpt-oss's fused experts
        ("target_parameters", lambda v: not v),
    ):
        if not ok(cfg.get(key)):
            raise LoRAError(
                f"adapter {name!r}: {CONFIG_FILE} sets {key}={cfg.get(key)!r}, which this "
                f"server does not support"
            )
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRAError(f"adapter {name!r}: r must be an integer >= 1, got {r!r}")
    if r > max_lora_rank:
        raise LoRAError(
            f"adapter {name!r} has rank r={r}, above max_lora_rank={max_lora_rank}: raise "
            f"max_lora_rank (--max-lora-rank) to serve it"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoRAError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, alpha, scale


def _read_tensors(name: str, w_bytes: bytes, r: int, model_config) -> dict:
    """(layer, module) -> (A, B) in float32, every name and shape checked."""
    from safetensors.torch import load as load_safetensors

    try:
        raw = load_safetensors(w_bytes)
    except Exception as e:  # safetensors raises its own errors on a bad header
        raise LoRAError(f"adapter {name!r}: {WEIGHTS_FILE} is not safetensors: {e}") from None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = _KEY_RE.match(key)
        if m is None:
            raise LoRAError(
                f"adapter {name!r}: tensor {key!r} targets a module this server cannot adapt "
                f"(LoRA on the attention (q, k, v, o) and dense MLP (gate, up, down) projections "
                f"of the decoder layers only; not experts, embeddings or the LM head)"
            )
        layer, which = int(m[1]), m[4]
        if not 0 <= layer < model_config.num_layers:
            raise LoRAError(
                f"adapter {name!r}: tensor {key!r} names layer {layer}; the model has "
                f"{model_config.num_layers}"
            )
        block = _mixer_block(name, key, model_config, layer, m[3]) if m[2] == "mixer" else m[2]
        block, module = _ALIASES.get((block, m[3]), (block, m[3]))
        if module not in BLOCK_MODULES.get(block, ()):
            raise LoRAError(f"adapter {name!r}: tensor {key!r} targets an unknown module")
        _check_layer_kind(name, key, model_config, layer, block)
        if t.dim() != 2 or not t.is_floating_point():
            raise LoRAError(f"adapter {name!r}: tensor {key!r} must be a 2-d float tensor")
        parts.setdefault((layer, module), {})[which] = t
    if not parts:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    tensors = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(
                f"adapter {name!r}: layer {layer} {module} has lora_{next(iter(ab))} "
                f"without its pair"
            )
        a, b = ab["A"], ab["B"]
        want_in, want_out = _expected_shapes(model_config, module)
        if tuple(a.shape) != (r, want_in) or tuple(b.shape) != (want_out, r):
            raise LoRAError(
                f"adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}; this model with r={r} needs {(r, want_in)} and "
                f"{(want_out, r)} (an adapter of another base model?)"
            )
        tensors[(layer, module)] = (a.float(), b.float())
    return tensors


def _mixer_block(name: str, key: str, mc, layer: int, module: str) -> str:
    """The block a Nemotron-H `mixer` tensor adapts, by its layer's kind (_MIXER_BLOCKS)."""
    kinds = getattr(mc.hf_config, "layer_types", None) or ()
    kind = kinds[layer] if layer < len(kinds) else None
    if kind == "moe":
        raise LoRAError(
            f"adapter {name!r}: tensor {key!r} adapts layer {layer}'s mixture of experts; LoRA "
            f"on the experts is not supported (adapt the Mamba2, attention and MLP layers)"
        )
    if kind not in _MIXER_BLOCKS or mc.architecture != "NemotronHForCausalLM":
        raise LoRAError(f"adapter {name!r}: tensor {key!r} targets an unknown module")
    block, modules, what = _MIXER_BLOCKS[kind]
    if module not in modules:
        raise LoRAError(
            f"adapter {name!r}: tensor {key!r} targets {module} of layer {layer}'s mixer, which "
            f"is {what} here (an adapter of another base model?)"
        )
    return block


def _check_layer_kind(name: str, key: str, mc, layer: int, block: str) -> None:
    """A hybrid's attention modules are on its attention layers, its recurrent mixers' (Gated
    DeltaNet, short convolution, Mamba2) on its recurrent layers: an adapter naming another
    layer is of another model."""
    recurrent = layer in mc.recurrent_layers
    if (block in RECURRENT_BLOCKS) != recurrent and block != "mlp":
        kind = "a recurrent" if recurrent else "a full-attention"
        raise LoRAError(
            f"adapter {name!r}: tensor {key!r} targets {block} of layer {layer}, which is "
            f"{kind} layer here (an adapter of another base model?)"
        )


def _check_dense_layers(name: str, mc, mlp_layers: set[int]) -> None:
    """A mixture of experts' sparse layers have no dense gate/up/down: an adapter of those is an
    adapter of the experts, which is refused."""
    from pdserve.engine.models.deepseek import DeepseekMoeSpec
    from pdserve.engine.models.lfm2 import lfm2_moe_spec
    from pdserve.engine.models.moe import MoeSpec

    if mc.architecture == "Lfm2MoeForCausalLM":
        spec = lfm2_moe_spec(mc)
    else:
        spec = (DeepseekMoeSpec if mc.architecture == "Glm4MoeForCausalLM" else MoeSpec).from_hf(mc)
    for layer in sorted(mlp_layers):
        if layer in spec.sparse_layers:
            raise LoRAError(
                f"adapter {name!r}: layer {layer} is a mixture-of-experts layer; LoRA on the "
                f"experts is not supported (adapt the attention projections, or the dense layers)"
            )


class LoRARegistry:
    """Rank 0's adapters by name (module docstring). Thread-safe: a worker's gRPC threads
    register and remove while the engine thread looks up."""

    def __init__(self, model_config, max_lora_rank: int, max_loras: int):
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self._by_name: dict[str, AdapterInfo] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    def add(self, name: str, path: str, lora_id: int | None = None) -> AdapterInfo:
        """Reads and checks the adapter; replaces one of the same name (a new id: the old one's
        cached KV is never reused, its content hash differing or not)."""
        with self._lock:
            if lora_id is None:
                lora_id = self._next_id
            self._next_id = max(self._next_id, lora_id) + 1
        weights = read_adapter(name, path, lora_id, self.model_config, self.max_lora_rank)
        with self._lock:
            self._by_name[name] = weights.info
        return weights.info

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._by_name.pop(name, None) is not None

    def get(self, name: str) -> AdapterInfo | None:
        with self._lock:
            return self._by_name.get(name)

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return sorted(self._by_name.values(), key=lambda a: a.lora_id)

    def resolve(self, lora_request) -> AdapterInfo | None:
        """The adapter a request names: None (the base), a registered name, or a LoRARequest
        (registered now if its name is new or its path differs)."""
        if lora_request is None:
            return None
        if isinstance(lora_request, AdapterInfo):  # a worker's, looked up when its call came
            return lora_request
        if isinstance(lora_request, str):
            info = self.get(lora_request)
            if info is None:
                raise LoRAError(f"no LoRA adapter named {lora_request!r} is loaded")
            return info
        if not isinstance(lora_request, LoRARequest):
            raise LoRAError(
                f"lora_request must be a LoRARequest or an adapter's name, got "
                f"{type(lora_request).__name__}"
            )
        info = self.get(lora_request.lora_name)
        if info is not None and info.path == lora_request.lora_path:
            return info
        return self.add(lora_request.lora_name, lora_request.lora_path)


@dataclass
class RankAdapter:
    """One adapter's weights on one rank: linear module -> [(A, B, scale, output offset)]."""

    info: AdapterInfo
    linears: dict[int, list[tuple[torch.Tensor, torch.Tensor, float, int]]]


def _layer_targets(model) -> dict[tuple[int, str], tuple[object, object]]:
    """(global layer index, PEFT module) -> (linear module, shard) for this rank's stage."""
    inner = model.model
    first = getattr(inner, "first_layer", 0)
    out = {}
    for j, layer in enumerate(inner.layers):
        # (a Nemotron-H layer holds one mixer: Mamba2, attention or an MLP)
        mixer, mlp = (
            (layer.self_attn, layer.mlp) if hasattr(layer, "self_attn") else (layer.mixer,) * 2
        )
        for module, target in (*_mixer_targets(mixer), *_mlp_targets(mlp)):
            out[(first + j, module)] = target
    return out


def _mixer_targets(attn) -> list[tuple[str, tuple]]:
    """(PEFT module, (linear, shard)) of a layer's token mixer."""
    if hasattr(attn, "conv_sizes"):  # a Gated DeltaNet (its fused in_proj's shards)
        fused = attn.in_proj
        return [
            ("in_proj_qkv", (fused, (0, 1, 2))),
            ("in_proj_z", (fused, 3)),
            ("in_proj_b", (fused, 4)),
            ("in_proj_a", (fused, 5)),
            ("out_proj", (attn.out_proj, "row")),
        ]
    if hasattr(attn, "in_proj") and hasattr(attn, "heads_total"):  # a Mamba2 mixer
        # (its in_proj holds this rank's rows of z, x, B, C and dt, picked by the mixer)
        pick = functools.partial(_mamba_rows, attn)
        return [
            ("mamba_in_proj", (attn.in_proj, pick)),
            ("mamba_out_proj", (attn.out_proj, "row")),
        ]
    if hasattr(attn, "in_proj"):  # LFM2's short convolution (B, C and x: three shards)
        return [
            ("conv_in_proj", (attn.in_proj, (0, 1, 2))),
            ("conv_out_proj", (attn.out_proj, "row")),
        ]
    if hasattr(attn, "qkv_proj"):
        out = [(f"{m}_proj", (attn.qkv_proj, m)) for m in ("q", "k", "v")]
        return out + [("o_proj", (attn.o_proj, "row"))]
    return []


def _mlp_targets(mlp) -> list[tuple[str, tuple]]:
    """(PEFT module, (linear, shard)) of a layer's dense MLP: a gated one's gate and up halves
    of its fused projection, or Nemotron-H's ReLU-squared up (no gate); none for experts."""
    if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):
        return [
            ("gate_proj", (mlp.gate_up_proj, 0)),
            ("up_proj", (mlp.gate_up_proj, 1)),
            ("down_proj", (mlp.down_proj, "row")),
        ]
    if hasattr(mlp, "up_proj") and hasattr(mlp, "down_proj"):
        return [("up_proj", (mlp.up_proj, "column")), ("down_proj", (mlp.down_proj, "row"))]
    return []


def shard_adapter(
    weights: AdapterWeights, model, dtype: torch.dtype, device: torch.device
) -> RankAdapter:
    """This rank's shard of an adapter, placed on the model's linears (module docstring)."""
    targets = _layer_targets(model)
    linears: dict[int, list] = {}
    for (layer, module), (a, b) in weights.tensors.items():
        target = targets.get((layer, module))
        if target is None:
            if any(key[0] == layer for key in targets):
                raise LoRAError(
                    f"adapter {weights.info.name!r}: layer {layer} {module} has no dense "
                    f"linear in this model to adapt"
                )
            continue  # another pipeline stage's layer
        linear, shard = target
        for a_part, b_part, offset in _placements(linear, shard, a, b):
            entry = (
                a_part.to(device=device, dtype=dtype).contiguous(),
                b_part.to(device=device, dtype=dtype).contiguous(),
                weights.scale,
                offset,
            )
            linears.setdefault(id(linear), []).append(entry)
        linear.has_lora = True
    return RankAdapter(weights.info, linears)


def _mamba_rows(mixer, b: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a Mamba2 in_proj's LoRA B, as the mixer picks its weight's."""
    return torch.cat(mixer._parts(b, with_gate=True))


def _placements(linear, shard, a: torch.Tensor, b: torch.Tensor) -> list[tuple]:
    """(A, B, output offset) of this rank's part of a module's A and B on `linear`: a
    row-parallel layer's columns of A; a column-parallel layer's rows of B for its `shard` (a
    tuple of shards: B's rows split among them, as Qwen3.5's in_proj_qkv over the q, k and v
    shards of the fused projection; a callable: the rows it picks, as a Mamba2 mixer's;
    "column": a plain column-parallel layer's, as Nemotron-H's MLP up_proj)."""
    from pdserve.engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    from pdserve.engine.parallel import tp_rank, tp_size

    rank, n = tp_rank(), tp_size()
    if callable(shard):  # (the layer's own pick of this rank's rows of B)
        return [(a, shard(b), 0)]
    if shard == "row":
        size = a.shape[1] // n
        return [(a.narrow(1, rank * size, size), b, 0)]
    if shard == "column":  # (a plain column-parallel layer: this rank's rows of B)
        size = b.shape[0] // n
        return [(a, b.narrow(0, rank * size, size), 0)]
    if isinstance(shard, tuple):
        parts = b.split([linear.output_sizes[s] for s in shard])
        return [p for s, part in zip(shard, parts) for p in _placements(linear, s, a, part)]
    if isinstance(linear, QKVParallelLinear):
        q = linear.num_heads * linear.head_dim
        kv = linear.num_kv_heads * linear.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
        return [(a, b.narrow(0, rank * size, size), offset)]
    if isinstance(linear, MergedColumnParallelLinear):
        size = linear.output_sizes[shard] // n
        offset = sum(linear.output_sizes[:shard]) // n
        return [(a, b.narrow(0, rank * size, size), offset)]
    raise LoRAError(f"no LoRA placement for {type(linear).__name__}")  # pragma: no cover


class LoRACache:
    """Every rank's resident adapters, at most `max_loras`, least recently used evicted first;
    an evicted adapter is read from disk again when a step needs it (module docstring)."""

    def __init__(self, model, model_config, max_loras: int, max_lora_rank: int, dtype, device):
        self.model = model
        self.model_config = model_config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype, self.device = dtype, device
        self._resident: OrderedDict[int, RankAdapter] = OrderedDict()
        self.loads = 0  # adapters read from disk (a test reads the LRU's reloads from it)
        self.evictions = 0  # adapters dropped from the resident set to make room
        # the resident adapters' names, least recently used first: replaced whole after every
        # change, so another thread (a worker's Stats) reads it without a lock
        self.resident_names: tuple[str, ...] = ()

    def resident(self) -> list[int]:
        return list(self._resident)

    def _note_resident(self) -> None:
        names = tuple(a.info.name for a in self._resident.values())
        if names != self.resident_names:
            self.resident_names = names

    def get(self, lora_id: int, name: str, path: str, digest: bytes | None = None) -> RankAdapter:
        adapter = self._resident.get(lora_id)
        if adapter is not None:
            self._resident.move_to_end(lora_id)
            self._note_resident()
            return adapter
        weights = read_adapter(name, path, lora_id, self.model_config, self.max_lora_rank)
        if digest is not None and weights.info.content_hash != digest:
            raise LoRAError(
                f"adapter {name!r} at {path!r} changed on disk since it was loaded: load it "
                f"again under its name"
            )
        adapter = shard_adapter(weights, self.model, self.dtype, self.device)
        self.loads += 1
        self._resident[lora_id] = adapter
        self._note_resident()
        return adapter

    def evict_to(self, keep: set[int]) -> None:
        """Drops the least recently used adapters past max_loras, never one in `keep` (this
        step's, at most max_loras of them: engine/scheduler.py)."""
        for lora_id in list(self._resident):
            if len(self._resident) <= self.max_loras:
                break
            if lora_id not in keep:
                del self._resident[lora_id]
                self.evictions += 1
        self._note_resident()


@dataclass
class LoRABatch:
    """One step's rows grouped by adapter: (adapter, row indices or None for every row)."""

    groups: list[tuple[RankAdapter, torch.Tensor | None]] = dataclasses.field(default_factory=list)

    def apply(self, linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the linear's output for x) plus each group's delta on its rows."""
        key = id(linear)
        x2d = x.reshape(-1, x.shape[-1])
        y2d = y.view(-1, y.shape[-1])
        for adapter, rows in self.groups:
            entries = adapter.linears.get(key)
            if not entries:
                continue
            xs = x2d if rows is None else x2d.index_select(0, rows)
            for a, b, scale, offset in entries:
                d = (xs.to(a.dtype) @ a.t()) @ b.t()
                d = (d * scale).to(y.dtype)
                out = y2d[:, offset : offset + b.shape[0]]
                if rows is None:
                    out += d
                else:
                    out.index_add_(0, rows, d)
        return y


def batch_for(
    cache: LoRACache | None, seq_rows: list[tuple[int, int, int]], loras: dict, device
) -> LoRABatch | None:
    """The step's LoRABatch from (lora id, first row, rows) per sequence and the step's adapters
    {id: [name, path, digest]}; None when every row runs the base model."""
    if not any(lora_id for lora_id, _, _ in seq_rows):
        return None
    if cache is None:
        raise LoRAError("a step runs a LoRA adapter on an engine without enable_lora")
    total = sum(n for _, _, n in seq_rows)
    rows: dict[int, list[int]] = {}
    for lora_id, start, n in seq_rows:
        if lora_id:
            rows.setdefault(lora_id, []).extend(range(start, start + n))
    batch = LoRABatch()
    for lora_id, idx in rows.items():
        name, path, digest = loras[lora_id]
        adapter = cache.get(lora_id, name, path, bytes(digest) if digest else None)
        index = None if len(idx) == total else torch.tensor(idx, dtype=torch.long, device=device)
        batch.groups.append((adapter, index))
    cache.evict_to(set(rows))
    return batch
