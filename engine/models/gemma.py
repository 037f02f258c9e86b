"""Gemma 2 and Gemma 3 (text) decoders.

Both differ from Llama in: the embedding scaled by sqrt(hidden_size) (in the activation dtype);
RMSNorm computing x * (1 + w) (the checkpoint's w is stored as 1 + w when it loads, so the shared
RMSNorm and its fused kernel run it); a gelu (tanh approximation) MLP; four norms per layer (before
and after attention, before and after the MLP); the attention scale query_pre_attn_scalar ** -0.5;
sliding and full layers alternating per config.layer_types. Gemma 2 soft-caps the attention
logits and the final logits. Gemma 3 normalizes each query and key head (x * (1 + w)) before RoPE,
and its sliding layers rotate with their own base (rope_parameters["sliding_attention"], formerly
rope_local_base_freq). Layers run one by one (no fused decode stack).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine import multimodal
from pdserve.engine.config import ModelConfig
from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding, sliding_rotary
from pdserve.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from pdserve.engine.parallel import stage_layers


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, x * (1 + w): loads the checkpoint's w as 1 + w."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = self._load

    @staticmethod
    def _load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.float() + 1.0)


_ACTIVATIONS = {
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


def _activation(hf):
    name = getattr(hf, "hidden_activation", None) or "gelu_pytorch_tanh"
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"Gemma hidden_activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name]


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm):
        super().__init__()
        hf = cfg.hf_config
        self.self_attn = LlamaAttention(
            cfg,
            layer_idx,
            rotary,
            qk_norm=qk_norm,
            scale=float(hf.query_pre_attn_scalar) ** -0.5,
            softcap=getattr(hf, "attn_logit_softcapping", None),
        )
        self.mlp = LlamaMLP(cfg, act=_activation(hf))
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions, hidden, residual):
        """(hidden, residual) in and out: the residual stream is their sum (or hidden alone)."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))[0]
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden))[0], residual


class GemmaModel(LlamaModel):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, qk_norm=None):
        nn.Module.__init__(self)
        hf = cfg.hf_config
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention is not supported")
        types = getattr(hf, "layer_types", None) or ["full_attention"] * cfg.num_layers
        local = sliding_rotary(cfg, rotary)
        # a pipeline stage holds its layers; the first also the embedding, the last the final
        # norm (as LlamaModel)
        self.first_layer, end = stage_layers(cfg.num_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
            if self.first_layer == 0
            else None
        )
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, i, local if types[i] == "sliding_attention" else rotary, qk_norm)
            for i in range(self.first_layer, end)
        )
        self.norm = (
            GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if end == cfg.num_layers else None
        )
        self.rotary = rotary
        self.eps = cfg.rms_norm_eps
        self.normalizer = cfg.hidden_size**0.5
        self._normalizer_key, self._normalizer_t = None, None
        self._stack = None

    def prepare_decode_stack(self) -> None:
        self._stack = None  # Gemma layers are not the fused stack's

    def _normalizer_like(self, hidden: torch.Tensor) -> torch.Tensor:
        """sqrt(hidden_size) rounded to the activations' dtype, as HF multiplies by it, made once
        per dtype and device: the first forward is eager, so a decode graph's capture later
        finds it on the device (a host-to-device copy cannot be captured)."""
        key = (hidden.dtype, hidden.device)
        if self._normalizer_key != key:
            self._normalizer_t = torch.tensor(self.normalizer, dtype=key[0], device=key[1])
            self._normalizer_key = key
        return self._normalizer_t

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, carried=None):
        """As LlamaModel.forward: the final hidden states, or in a stage before the last the
        (hidden, residual) pair the next stage continues from."""
        if carried is None:
            hidden = self.embed_tokens(input_ids)
            hidden = hidden * self._normalizer_like(hidden)
            residual = None
            meta = get_forward_context()
            if meta.image_rows is not None:  # Gemma 3's image tokens: their rows, not scaled
                hidden = multimodal.apply(hidden, meta.image_rows, meta.image_embeds)
        else:
            hidden, residual = carried
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma2ForCausalLM(LlamaForCausalLM):
    qk_norm = None

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        nn.Module.__init__(self)
        self.config = cfg
        self.model = GemmaModel(cfg, rotary, self.qk_norm)
        self.lm_head = None  # on the first pipeline stage, beside the embedding
        if self.model.embed_tokens is not None:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if cfg.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)
        cap = getattr(cfg.hf_config, "final_logit_softcapping", None)
        self.final_softcap = float(cap) if cap else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        if logits is not None and self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = GemmaRMSNorm
