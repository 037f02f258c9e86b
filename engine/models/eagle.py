"""EAGLE draft heads: the small models of speculative_config methods "eagle" and "eagle3".

An EAGLE head is not a language model of its own: it predicts the target's next token from the
target's hidden states and the embedding of the token that followed them. Position p of the head
reads (embed(t[p+1]), h[p]), where h[p] is what the target computed at p, attends to the head's
own KV of the positions before it, and its output predicts t[p+2]; past the last position the
target has computed, the head feeds on its own output (the pre-norm hidden state) to guess
further. engine/spec/eagle.py runs it; this module holds the two checkpoint formats:

  EagleDraft (EAGLE-1, SafeAILab's EAGLE and vLLM's "eagle"): h is the target's final (normed)
      hidden state; fc maps [embed, h] (2 x hidden) to hidden; one Llama decoder layer without
      its first norm; the target's own LM head reads the output.
  Eagle3Draft (EAGLE-3, "eagle3"): h is fc of three of the target's layers' inputs side by side
      (`aux_layers`, the inputs of layers 2, L/2 and L-3 unless the config names others); the
      layer normalizes the embedding and h apart and attends over both (q/k/v read 2 x hidden);
      a final norm and the head's own LM head over a smaller draft vocabulary, whose ids `d2t`
      maps to the target's (draft id i is target id i + d2t[i]).

Both take the target's embedding where the checkpoint has none (`attach`). Built and loaded by the
model runner like any family, from a ModelConfig whose architecture is "EagleDraft" or
"Eagle3Draft" (never a checkpoint's own: `DRAFT_HEADS`); the forward pass reads the rows of h
from the forward context (`hidden_in`, already through fc for EAGLE-3: `combine`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.engine.layers.linear import LinearBase, QKVParallelLinear, ReplicatedLinear
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    load_tensor,
)

# the head config's attribute naming its linears' mode (the target's resolved quantization, set by
# engine/spec/eagle.py): the head is prepared in it without a calibration of its own, which would
# need the target's states (None: the head's dtype)
LINEARS_MODE = "pdserve_linears_mode"


def aux_layers(hf_config, target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs an EAGLE-3 head reads: the config's
    eagle_aux_hidden_state_layer_ids (at its top level or in eagle_config), else 2, L // 2 and
    L - 3, as the heads are trained by default."""
    ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
    if not ids:
        ids = (getattr(hf_config, "eagle_config", None) or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        )
    if not ids:
        ids = (2, target_layers // 2, target_layers - 3)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(0 <= i < target_layers for i in ids):
        raise ValueError(
            f"an EAGLE-3 head reads three of the target's {target_layers} layers' inputs, "
            f"each in 0..{target_layers - 1} (0: the embedding); its config names {list(ids)}"
        )
    return ids


def prepare_head_linears(head: nn.Module, quantization: str | None, release_dense: bool) -> None:
    """Packs a head's linears in the mode its config names (LINEARS_MODE), else `quantization`."""
    mode = getattr(head.config.hf_config, LINEARS_MODE, None) or quantization
    for module in head.modules():
        if isinstance(module, LinearBase):
            module.finalize(mode, release_dense=release_dense)


def vocab_embedding(target: nn.Module, vocab, like: torch.Tensor) -> nn.Parameter:
    """The embedding weight a head shares with its target: the target's own, or the whole
    `vocab[0]` (in the head's dtype, `like`'s) where the target's is sharded."""
    if vocab is None:
        return target.model.embed_tokens.weight
    return nn.Parameter(vocab[0].to(like.dtype), requires_grad=False)


def vocab_logits(target: nn.Module, vocab, dtype: torch.dtype):
    """The target's LM head as a head calls it: the target's own compute_logits (one rank), or
    a product with the whole `vocab[1]` on this rank alone (the target's gathers its TP shards,
    a collective the other ranks do not join while a head runs)."""
    if vocab is None:
        return target.compute_logits
    weight = vocab[1].to(dtype)
    return lambda hidden: torch.nn.functional.linear(hidden.to(dtype), weight)


class _EagleHead(nn.Module):
    supports_pp = False

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.config = cfg
        if cfg.num_layers != 1:
            raise ValueError(
                f"an EAGLE head of {cfg.num_layers} layers: only one-layer heads are supported"
            )
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.own_embedding = False  # the checkpoint has one (else the target's: attach)
        self.self_attn = LlamaAttention(cfg, 0, rotary)
        self.mlp = LlamaMLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attach(self, target: nn.Module, vocab=None) -> None:
        """Takes the target model's embedding where the checkpoint had none: the same tensor, or
        under tensor parallelism (where the target's is sharded) the whole one of `vocab`
        (engine/spec/eagle.py target_vocab: (embedding, LM head) weights)."""
        if not self.own_embedding:
            self.embed_tokens.weight = vocab_embedding(target, vocab, self.embed_tokens.weight)

    def combine(self, states: torch.Tensor) -> torch.Tensor:
        """The target's exposed hidden states as the head's input rows."""
        return states

    def _layer_out(self, positions, x, residual) -> torch.Tensor:
        """Attention over `x`, then the MLP; the pre-norm sum of the layer's output."""
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x), residual)
        return self.mlp(x) + residual

    def _load_name(self, name: str) -> str | None:
        """Our parameter name for a checkpoint tensor's (None: skip it)."""
        name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
        if name.startswith("layers.0."):
            name = name.removeprefix("layers.0.")
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in weights:
            name = self._load_name(name)
            if name is None or self._load_buffer(name, tensor):
                continue
            if name == "embed_tokens.weight":
                self.own_embedding = True
            loaded.add(load_tensor(params, name, tensor, LlamaForCausalLM.packed, "an EAGLE head"))
        missing = {n for n in params if n not in loaded and not n.startswith("embed_tokens.")}
        if missing:
            raise ValueError(f"EAGLE head checkpoint is missing tensors: {sorted(missing)[:5]}")

    def _load_buffer(self, name: str, tensor: torch.Tensor) -> bool:
        return False

    def prepare_linears(self, quantization: str | None, release_dense: bool = True) -> None:
        prepare_head_linears(self, quantization, release_dense)

    def prepare_decode_stack(self) -> None:
        """(One layer: nothing to stack.)"""


class EagleDraft(_EagleHead):
    """EAGLE-1: fc([embed, h]) through one Llama layer without its first norm; the target's LM
    head reads the pre-norm output."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__(cfg, rotary)
        bias = bool(getattr(cfg.hf_config, "bias", False))
        self.fc = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size, bias=bias)
        self._target_logits = None

    def attach(self, target: nn.Module, vocab=None) -> None:
        super().attach(target, vocab)
        self._target_logits = vocab_logits(target, vocab, self.fc.weight.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = get_forward_context().hidden_in
        x = self.fc(torch.cat([self.embed_tokens(input_ids), hidden.to(self.fc.weight.dtype)], -1))
        return self._layer_out(positions, x, x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self._target_logits(hidden)

    def _load_name(self, name: str) -> str | None:
        name = super()._load_name(name)
        # (EAGLE-1's first layer has no input norm; the target's LM head is the head's)
        if name.startswith(("input_layernorm.", "lm_head.", "norm.")):
            return None
        return name


class Eagle3Draft(_EagleHead):
    """EAGLE-3: fc of three target layers' inputs; one layer over [norm(embed), norm(h)]; a final
    norm and an LM head over the draft vocabulary, mapped to the target's ids."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__(cfg, rotary)
        hf, h = cfg.hf_config, cfg.hidden_size
        target_h = int(getattr(hf, "target_hidden_size", None) or h)
        self.fc = ReplicatedLinear(3 * target_h, h, bias=False)
        # the layer's q/k/v read the normed embedding and the normed h side by side
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * h, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, bias=cfg.attention_bias
        )
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm_before_residual = bool(getattr(hf, "norm_before_residual", False))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.draft_vocab = int(getattr(hf, "draft_vocab_size", None) or cfg.vocab_size)
        self.lm_head = ParallelLMHead(self.draft_vocab, h)
        # target id of each draft id (None: the draft vocabulary is the target's)
        self.register_buffer("targets", None, persistent=False)

    def combine(self, states: torch.Tensor) -> torch.Tensor:
        return self.fc(states.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = get_forward_context().hidden_in.to(self.fc.weight.dtype)
        embeds = self.input_layernorm(self.embed_tokens(input_ids))[0]
        normed = self.hidden_norm(hidden)[0]
        residual = normed if self.norm_before_residual else hidden
        return self._layer_out(positions, torch.cat([embeds, normed], -1), residual.clone())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        if self.targets is None and self.draft_vocab != self.config.vocab_size:
            raise ValueError(
                f"EAGLE-3 head's draft vocabulary ({self.draft_vocab} ids) has no d2t mapping "
                f"to the target's ({self.config.vocab_size})"
            )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(self.norm(hidden)[0])
        if self.targets is None:
            return logits
        out = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        out[:, self.targets] = logits
        return out

    def _load_name(self, name: str) -> str | None:
        return None if name == "t2d" else super()._load_name(name)

    def _load_buffer(self, name: str, tensor: torch.Tensor) -> bool:
        if name != "d2t":
            return False
        if tensor.shape != (self.draft_vocab,):
            raise ValueError(
                f"EAGLE-3 head's d2t has shape {tuple(tensor.shape)}, expected "
                f"({self.draft_vocab},): draft_vocab_size in its config"
            )
        targets = torch.arange(self.draft_vocab) + tensor.long().cpu()
        if int(targets.min()) < 0 or int(targets.max()) >= self.config.vocab_size:
            raise ValueError("EAGLE-3 head's d2t maps outside the target's vocabulary")
        self.targets = targets.to(self.lm_head.weight.device)
        return True
