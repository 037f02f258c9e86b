"""Llama-family decoders: Llama 2/3, SmolLM, Mistral (with or without a sliding window), Qwen2
(q/k/v bias, sliding layers with use_sliding_window), Qwen3 (RMSNorm of each query and key head
before RoPE) and Phi-3/Phi-4 (fused qkv_proj and gate_up_proj in the checkpoint, split here into
their q/k/v and gate/up shards so tensor parallelism shards them like Llama's; partial rotary)
and SmolLM3 (Llama with no position encoding in every fourth layer).

Each layer's sliding window comes from ModelConfig.layer_windows, and whether it rotates its
queries and keys from ModelConfig.layer_ropes. LlamaAttention and LlamaMLP are
shared with other families (engine/models/gemma.py, the MoE models), which pass their own norms,
scales and soft-capping as keyword arguments.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine import multimodal
from pdserve.engine.attention import PagedAttention
from pdserve.engine.config import ModelConfig
from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.kernels import cpu_fused, cpu_paged_decode_capsule, fused_triton
from pdserve.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.engine.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.quant import (
    Bf16Weight,
    Int4Weight,
    Int8Weight,
    Q4Blocks,
    float32_block_rows,
    head_quantization,
)
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.parallel import stage_layers, tp_size


class LlamaAttention(nn.Module):
    # the per-head q/k norms come before the rotary (Qwen3's, Gemma 3's) or after it (Hunyuan's)
    norm_after_rotary = False
    # rows of q_proj per query head in head_dim units: 2 where each head's rows are followed by
    # those of its output gate (Qwen3.5's gated attention, engine/models/qwen3_5.py)
    query_parts = 1

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        *,
        qk_norm: Callable[[int, float], nn.Module] | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ):
        """qk_norm: a norm class (dim, eps) applied to each query and key head before RoPE
        (Qwen3, Gemma 3; after it where the class says norm_after_rotary: Hunyuan); scale: the
        attention scale (default head_dim ** -0.5); softcap: attention logit soft-capping
        (Gemma 2). The window is the layer's in cfg.layer_windows, the attention chunk its in
        cfg.layer_chunks (Llama 4)."""
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads * self.query_parts,
            cfg.num_kv_heads,
            bias=cfg.attention_bias,
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias
        )
        self.num_heads = self.qkv_proj.num_heads // self.query_parts
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        # a layer without position encoding (SmolLM3's every fourth) has no rotary
        ropes = cfg.layer_ropes
        self.rotary = rotary if not ropes or ropes[layer_idx] else None
        # queries scaled up with the position (Ministral 3's; query_temperature), or None
        self.temperature = _temperature(cfg) if cfg.hf_config is not None else None
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm = qk_norm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = qk_norm(cfg.head_dim, cfg.rms_norm_eps)
        windows, chunks = cfg.layer_windows, cfg.layer_chunks
        self.attn = PagedAttention(
            # its place in this stage's KV cache (a hybrid model's linear layers keep none)
            cfg.kv_layer_index(layer_idx) - stage_layers(cfg.num_layers)[0],
            self.num_heads,
            self.num_kv_heads,
            cfg.head_dim,
            scale=scale,
            window=windows[layer_idx] if windows else None,
            softcap=softcap,
            sinks=cfg.attention_sinks,
            chunk=chunks[layer_idx] if chunks else None,
        )

    def normed_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k through the per-head norms (over each head's head_dim, as rows of a 2-d
        tensor)."""
        q = self.q_norm(q.reshape(-1, self.head_dim))[0].view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(-1, self.head_dim))[0].view(-1, self.num_kv_heads, self.head_dim)
        return q, k

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projection of x split into query, key and value heads, [tokens, heads, dim]."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        return q, k, v.reshape(-1, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        if self.q_norm is not None and not self.norm_after_rotary:
            q, k = self.normed_heads(q, k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        if self.q_norm is not None and self.norm_after_rotary:
            q, k = self.normed_heads(q, k)
        if self.temperature is not None:
            q = q * query_temperature(positions, *self.temperature)[:, None, None].to(q.dtype)
        return self.o_proj(self.attn(q, k, v))


def query_temperature(positions: torch.Tensor, offset: float, every: float, beta: float):
    """Llama 4's attention temperature a token (Ministral 3's too): 1 + beta x log(1 +
    floor((position + offset) / every)), which the query is scaled by, so attention sharpens
    with the distance the context has grown to (float32, [tokens])."""
    return 1.0 + beta * torch.log1p(torch.floor((positions.float() + offset) / every))


def _temperature(cfg: ModelConfig) -> tuple[float, float, float] | None:
    """A config's query temperature as query_temperature's (offset, every, beta): Ministral
    3's rope parameters' llama_4_scaling_beta, a step every original_max_position_embeddings
    positions; None where the config has none."""
    rope = getattr(cfg.hf_config, "rope_parameters", None) or {}
    beta = rope.get("llama_4_scaling_beta") if isinstance(rope, dict) else None
    if not beta:
        return None
    return 0.0, float(rope["original_max_position_embeddings"]), float(beta)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, act: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        """act: the gate's activation (Gemma: gelu with the tanh approximation)."""
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self._bf16_fused()
        if fused is not None:
            # The bf16 mode: gate_up's product stays bf16 (its linear gives bf16 for bf16 input)
            # and silu(gate) * up is one pass to the down projection's bf16 input
            # (fused_cpu.cpp silu_mul_bf16, which the decode stack runs too). Four passes over
            # the widest activations fewer; a tensor-parallel down projection gets float32 (the
            # same values) so that its partial sums are reduced in float32.
            gu = self.gate_up_proj(x.to(torch.bfloat16))
            h = fused.silu_mul_bf16(gu.reshape(-1, gu.shape[-1]))
            return self.down_proj(h if tp_size() == 1 else h.float()).float()
        gu = self.gate_up_proj(x)
        triton_fused = fused_triton.for_tensor(gu) if self.act is F.silu else None
        if triton_fused is not None:  # CUDA: silu(gate) * up in one launch (kernels/fused_triton)
            h = triton_fused.silu_mul(gu, lambda: self._act_mul(gu))
            if h is not None:
                return self.down_proj(h)
        return self.down_proj(self._act_mul(gu))

    def _act_mul(self, gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu.chunk(2, dim=-1)
        return self.act(gate) * up

    def _bf16_fused(self):
        """The compiled kernels where this MLP runs the bf16 mode's fused path: silu, both
        linears bf16-mode weights (quant.py Bf16Weight), no bias, no LoRA; else None."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if (
            self.act is not F.silu
            or not isinstance(gate_up._quant, Bf16Weight)
            or not isinstance(down._quant, Bf16Weight)
            or gate_up.bias is not None
            or down.bias is not None
            or gate_up.has_lora
            or down.has_lora
        ):
            return None
        return cpu_fused()


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        qk_norm=None,
        mlp: nn.Module | None = None,  # None: the dense MLP (a mixture of experts passes its own)
        attn: nn.Module | None = None,  # None: Llama's attention (a family may pass its own)
    ):
        super().__init__()
        self.self_attn = (
            LlamaAttention(cfg, layer_idx, rotary, qk_norm=qk_norm) if attn is None else attn
        )
        self.mlp = LlamaMLP(cfg) if mlp is None else mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    layer_class = LlamaDecoderLayer  # (Granite's scales its residual branches)
    embedding_multiplier: float | None = None  # Granite's: the embeddings scaled by it

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, qk_norm=None):
        super().__init__()
        # a pipeline stage (engine/parallel.py) holds its layers; the first also the embedding,
        # the last the final norm; with one stage, all of them
        self.first_layer, end = stage_layers(cfg.num_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
            if self.first_layer == 0
            else None
        )
        rotaries = self.layer_rotaries(cfg, rotary)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, i, rotaries[i], qk_norm) for i in range(self.first_layer, end)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if end == cfg.num_layers else None
        self.rotary = rotary
        self.eps = cfg.rms_norm_eps
        self._stack = None  # see prepare_decode_stack

    def layer_rotaries(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> list:
        """Each layer's rotary embedding: `rotary` for every one (OLMo 3's sliding layers have
        their own)."""
        return [rotary] * cfg.num_layers

    def prepare_decode_stack(self) -> None:
        """Decode-only steps run every layer in one compiled call (fused_cpu.cpp DecodeStack: the
        same ops, without a Python call per op) where that call applies: float32 activations on
        CPU, one TP rank, the compiled kernels built, every linear prepared (oneDNN float32,
        int8 or int4), plain Llama layers (no q/k norm, sliding window, soft-capping, custom
        scale, partial rotary or query temperature). Else the layers run one by one in forward."""
        self._stack = None
        layers = list(self.layers)
        attn = getattr(layers[0], "self_attn", None)
        if not isinstance(attn, LlamaAttention):  # (a hybrid's first layer: a recurrent one)
            return
        if (
            tp_size() != 1
            or self.rotary.cos.dtype != torch.float32
            or self.rotary.cos.device.type != "cpu"
            or self.rotary.cos.shape[-1] != attn.head_dim
            or attn.head_dim % 16
            or any(
                type(layer) is not LlamaDecoderLayer
                or type(layer.mlp) is not LlamaMLP
                or layer.self_attn.q_norm is not None
                or layer.self_attn.temperature is not None
                or not layer.self_attn.attn.plain
                or layer.self_attn.rotary is not self.rotary
                for layer in layers
            )
        ):
            return
        fused, attend = cpu_fused(), cpu_paged_decode_capsule()
        if fused is None or attend is None:
            return
        stack = fused.DecodeStack(
            attn.num_heads, attn.num_kv_heads, attn.head_dim, self.eps, attn.attn.scale, attend
        )
        for layer in layers:
            if layer.input_layernorm.weight.dtype != torch.float32:
                return
            stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            linears = {
                "qkv": layer.self_attn.qkv_proj,
                "o": layer.self_attn.o_proj,
                "gate_up": layer.mlp.gate_up_proj,
                "down": layer.mlp.down_proj,
            }
            for which, linear in linears.items():
                spec = _stack_linear(linear)
                if spec is None:
                    return
                stack.set_linear(which, *spec)
                q = linear._quant
                if isinstance(q, Bf16Weight) and q.bp is not None:
                    stack.set_own(which, q.bp, q.bp_part)
                elif q is None and linear._own is not None:
                    stack.set_own(which, *linear._own)
                if isinstance(q, Bf16Weight) and q.q4 is not None:
                    stack.set_q4(which, q.q4.blocks, q.q4.part, q.q4_rows)
                elif q is None and isinstance(linear._blocks, Q4Blocks) and linear.bias is None:
                    # (oneDNN adds a layer's bias inside its product: such a layer keeps oneDNN)
                    rows = float32_block_rows()
                    stack.set_q4(which, linear._blocks.blocks, linear._blocks.part, rows)
        self._stack = stack

    def _decode_stack(self, hidden, positions, meta):
        positions, cos, sin = self.rotary.tables(positions)  # (M-RoPE: a row a token)
        out = self._stack.run(
            hidden,
            positions,
            cos,
            sin,
            meta.kv_cache,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_context_lens,
            list(meta.aux_layers),  # (an EAGLE-3 head's layers: their inputs follow)
        )
        meta.aux += out[2:]
        return out[0], out[1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, carried=None):
        """The final (normalized) hidden states; in a pipeline stage before the last, the
        (hidden states, residual) pair the next stage continues from, which it passes as
        `carried` (the first stage embeds input_ids instead)."""
        meta = get_forward_context()
        if carried is None:
            hidden, residual = self.embed_tokens(input_ids), None
            if self.embedding_multiplier is not None:
                hidden = hidden * self.embedding_multiplier
            if meta.image_rows is not None:  # a vision-language model's image tokens
                hidden = multimodal.apply(hidden, meta.image_rows, meta.image_embeds)
        else:
            hidden, residual = carried
        if (
            self._stack is not None
            and meta.on_layer_done is None  # the stack's attention calls no layer hook
            and meta.num_decode_tokens == hidden.shape[0]
            and meta.decode_mask is None
            and meta.lora is None  # the stack's linears add no LoRA deltas
            and hidden.dtype == torch.float32
        ):
            if residual is not None:  # the sum the stage's first norm forms, formed here
                hidden, residual = hidden + residual, None
            hidden, residual = self._decode_stack(hidden, positions, meta)
        else:
            hidden, residual = run_layers(self, positions, hidden, residual, meta)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


def run_layers(model: nn.Module, positions, hidden, residual, meta):
    """A stage's layers one by one (`model.layers`, the first of them the whole model's layer
    `model.first_layer`) over (hidden, residual); a vision-language model's DeepStack features
    (Qwen3-VL) added after the layers they belong to."""
    for i, layer in enumerate(model.layers, model.first_layer):
        if i in meta.aux_layers:  # (an EAGLE-3 head reads this layer's input: once per listing)
            state = hidden if residual is None else hidden + residual
            meta.aux += [state] * meta.aux_layers.count(i)
        hidden, residual = layer(positions, hidden, residual)
        if meta.image_rows is not None:
            hidden = multimodal.deepstack(hidden, i, meta.image_rows, meta.image_embeds)
    return hidden, residual


def _stack_linear(linear: LinearBase):
    """DecodeStack.set_linear's arguments after `which` for a prepared linear, or None where the
    stack cannot run it (a dense weight not packed for oneDNN)."""
    bias = None if linear.bias is None else linear.bias.detach()
    q = linear._quant
    if isinstance(q, Int4Weight):  # (rows padded to sixteens: the stack would see them)
        return None if q.padded else ("int4", q.packed, q.scales_zeros, None, bias)
    if isinstance(q, Int8Weight):
        return "int8", q.packed, q.inv_smooth, q.span_row, bias
    # (no oneDNN copy where our own packing took over: the stack gets it from set_own)
    if isinstance(q, Bf16Weight):
        return "bf16", q.packed if q.packed is not None else q.bp, None, None, bias
    if q is None and linear._own is not None:
        return "dense", linear._own[0], None, None, bias
    if q is None and linear._packed is not None and linear._packed.dtype == torch.float32:
        return "dense", linear._packed, None, None, bias
    if q is None and linear._packed is None and isinstance(linear._blocks, Q4Blocks):
        # no oneDNN copy: the blocks take every step (set_q4 with float32_block_rows())
        return "dense", torch.empty(0), None, None, bias
    return None


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.*)")


def load_tensor(params: dict, name: str, tensor: torch.Tensor, packed: dict, owner: str) -> str:
    """One checkpoint tensor into its parameter of `params` (through its weight_loader, with the
    shard id where `packed` maps a fragment of its name, as LlamaForCausalLM.packed does);
    returns the parameter's name. ValueError where `owner` (a class name) has no such one."""
    shard_id = None
    for ckpt, (ours, sid) in packed.items():
        if f".{ckpt}." in name:
            name, shard_id = name.replace(f".{ckpt}.", f".{ours}."), sid
            break
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in {owner}")
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        param.data.copy_(tensor)
    elif shard_id is None:
        loader(param, tensor)
    else:
        loader(param, tensor, shard_id)
    return name


class LlamaForCausalLM(nn.Module):
    supports_pp = True  # its layers split into pipeline stages (engine/parallel.py)
    # checkpoint name fragment -> (our parameter fragment, shard id)
    packed = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    qk_norm = None  # Qwen3's per-head RMSNorm of queries and keys (a norm class)
    model_class = LlamaModel

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg, rotary, self.qk_norm)
        # the LM head sits on the first pipeline stage, beside the embedding it may be tied to
        self.lm_head = None
        if self.model.embed_tokens is not None:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if cfg.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, carried=None):
        if carried is None:  # (one stage, or the first: every family's model takes this)
            return self.model(input_ids, positions)
        return self.model(input_ids, positions, carried)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            name = self._stage_name(name)
            if name is None:  # another pipeline stage's
                continue
            loaded.add(load_tensor(params, name, tensor, self.packed, type(self).__name__))
        missing = {n for n in params if n not in loaded}
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:5]}")

    def _stage_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this pipeline stage's modules (layers numbered from the
        stage's first), or None when another stage holds it."""
        if not self.supports_pp:  # one stage: every name as it is
            return name
        m = _LAYER_NAME.match(name)
        if m is not None:
            layer = int(m.group(1)) - self.model.first_layer
            if not 0 <= layer < len(self.model.layers):
                return None
            return f"model.layers.{layer}.{m.group(2)}"
        if name.startswith("model.embed_tokens.") and self.model.embed_tokens is None:
            return None
        if name.startswith("model.norm.") and self.model.norm is None:
            return None
        if name.startswith("lm_head.") and self.lm_head is None:
            return None
        return name

    def prepare_linears(self, quantization: str | None, release_dense: bool = True) -> None:
        """Packs (or quantizes) every linear's loaded weight for its matmul; see LinearBase."""
        for module in self.modules():
            if isinstance(module, LinearBase):  # the tied head shares the embedding's storage
                head = module is self.lm_head
                shared = head and self.config.tie_word_embeddings
                module.finalize(
                    head_quantization(quantization) if head else quantization,
                    release_dense=release_dense and not shared,
                )
        self.model.prepare_decode_stack()


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = RMSNorm


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3/Phi-4: Llama with qkv_proj and gate_up_proj fused in the checkpoint. Each fused
    tensor is split into its q/k/v (gate/up) parts here, and each part loaded as Llama's shard,
    so every rank takes its own heads of each part under tensor parallelism."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights):
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                parts = tensor.split([q, kv, kv], dim=0)
                for part, ckpt in zip(parts, ("q_proj", "k_proj", "v_proj")):
                    yield name.replace(".qkv_proj.", f".{ckpt}."), part
            elif ".gate_up_proj." in name:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor
