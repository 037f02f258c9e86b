"""Multi-token-prediction layers (speculative_config method "mtp"): the head a model was trained
with beside its layers, shipped in its own checkpoint.

DeepSeek V3 and R1, GLM-4.5/4.6 and GLM-4.7 Flash carry `num_nextn_predict_layers` such layers
after their last one (`model.layers.{L}.*`, L = num_hidden_layers): the target's decoder layer
(DeepSeek's latent attention or GLM's, and a sparse MLP) behind a projection of two normed
inputs. Position p reads (embed(t[p+1]), h[p]), h the target's final normed hidden state there:

    x = eh_proj([enorm(embed(t[p+1])), hnorm(h[p])]);  out = layer(x)   (pre-norm, residual in)
    logits = lm_head(shared_head.norm(out))

It predicts t[p+2], as an EAGLE-1 head does (engine/models/eagle.py), so engine/spec/eagle.py runs
it the same way: after each step over the positions the target kept, and past the last one fed
its own output (as vLLM does when it asks a layer for more guesses than the model has layers).
The first layer serves every guess. Its embedding and LM head are the target's (the checkpoint's
copies, `embed_tokens` and `shared_head.head` in the layer, are the same tensors and are not
read); `wants` names the few tensors the runner reads from the target's checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.layers.embedding import VocabParallelEmbedding
from pdserve.engine.layers.linear import ReplicatedLinear
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.eagle import prepare_head_linears, vocab_embedding, vocab_logits
from pdserve.engine.models.llama import load_tensor

# the config attribute naming the target's architecture (the head's ModelConfig names its own)
TARGET_ARCHITECTURE = "pdserve_mtp_target"
# the layer's own tensors, beside its decoder layer's (read as they are named)
_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
# the layer's copies of the target's tensors (the target's own serve)
_SHARED = ("embed_tokens.", "shared_head.head.")


def mtp_layers(hf_config) -> int:
    """How many MTP layers the config says its checkpoint carries (0: none)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


class MtpDraft(nn.Module):
    """The target's first MTP layer as a one-layer head (module docstring)."""

    supports_pp = False

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        from pdserve.engine.models import model_class
        from pdserve.engine.models.deepseek import DeepseekForCausalLM, DeepseekMoeSpec

        self.config = cfg
        hf, h = cfg.hf_config, cfg.hidden_size
        arch = getattr(hf, TARGET_ARCHITECTURE)
        family = model_class(arch)
        if not issubclass(family, DeepseekForCausalLM):
            raise ValueError(f"MTP layers of {arch} are not supported")
        self.index = int(hf.num_hidden_layers)  # the layer's number in the checkpoint
        # the layer is built as the target's family builds one (its config under the target's
        # name, which the family's properties read: GLM's o_proj without a bias, V3's gate)
        layer_cfg = dataclasses.replace(cfg, architecture=arch)
        # the layer's MLP is sparse where the target's rule makes layer `index` sparse
        moe = DeepseekMoeSpec.from_hf(layer_cfg)
        kinds = getattr(hf, "mlp_layer_types", None)
        first = int(getattr(hf, "first_k_dense_replace", 0) or 0)
        freq = int(getattr(hf, "moe_layer_freq", 1) or 1)
        if kinds and len(kinds) > self.index:
            sparse = kinds[self.index] == "sparse"
        else:  # (a layer past those the types list: sparse, as every released MTP layer is)
            sparse = self.index >= first and self.index % freq == 0
        moe = dataclasses.replace(
            moe, sparse_layers=frozenset({0} if sparse and moe.num_experts else ())
        )
        qk_norm = RMSNorm if getattr(hf, "use_qk_norm", False) else None
        self.layer = family.model_class.make_layer(
            layer_cfg, moe, 0, family.layer_rotary(layer_cfg, rotary), qk_norm
        )
        self.packed = family.packed
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * h, h, bias=False)
        self.shared_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h)
        self._target_logits = None

    def attach(self, target: nn.Module, vocab=None) -> None:
        """Takes the target's embedding and LM head (the same tensors; under tensor parallelism
        the whole ones of `vocab`: engine/models/eagle.py vocab_embedding)."""
        self.embed_tokens.weight = vocab_embedding(target, vocab, self.embed_tokens.weight)
        self._target_logits = vocab_logits(target, vocab, self.eh_proj.weight.dtype)

    def combine(self, states: torch.Tensor) -> torch.Tensor:
        """The target's exposed hidden states as the head's input rows."""
        return states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = get_forward_context().hidden_in.to(self.eh_proj.weight.dtype)
        embeds = self.enorm(self.embed_tokens(input_ids))[0]
        x = self.eh_proj(torch.cat([embeds, self.hnorm(hidden)[0]], -1))
        out, residual = self.layer(positions, x, None)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self._target_logits(self.shared_norm(hidden)[0])

    def wants(self, name: str) -> bool:
        """Whether the runner reads checkpoint tensor `name` for this head (its layer's own)."""
        prefix = f"model.layers.{self.index}."
        return name.startswith(prefix) and not name[len(prefix) :].startswith(_SHARED)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        prefix = f"model.layers.{self.index}."
        for name, tensor in weights:
            if not self.wants(name) or "rotary_emb.inv_freq" in name:
                continue
            name = name[len(prefix) :]
            if name == "shared_head.norm.weight":
                name = "shared_norm.weight"
            elif name not in _OWN:
                name = f"layer.{name}".replace(".mlp.shared_experts.", ".mlp.shared_expert.")
            loaded.add(load_tensor(params, name, tensor, self.packed, "an MTP layer"))
        missing = {n for n in params if n not in loaded and not n.startswith("embed_tokens.")}
        if missing:
            raise ValueError(
                f"the checkpoint's MTP layer (model.layers.{self.index}.*) is missing tensors: "
                f"{sorted(missing)[:5]}"
            )

    def prepare_linears(self, quantization: str | None, release_dense: bool = True) -> None:
        prepare_head_linears(self, quantization, release_dense)

    def prepare_decode_stack(self) -> None:
        """(One layer: nothing to stack.)"""
