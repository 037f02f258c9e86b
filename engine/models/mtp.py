"""Multi-token-prediction layers (speculative_config method "mtp"): the head a model was trained
with beside its layers, shipped in its own checkpoint.

Two layouts of the same idea: position p reads (embed(t[p+1]), h[p]), h the target's final
normed hidden state there, and predicts t[p+2]:

    x = fc([norm_e(embed(t[p+1])), norm_h(h[p])]);  out = layer(x)  (pre-norm, residual in)
    logits = lm_head(norm(out))

  DeepSeek's (V3 and R1, GLM-4.5/4.6, GLM-4.7 Flash: `model.layers.{L}.*`, L =
      num_hidden_layers): enorm, hnorm, eh_proj, shared_head.norm around the target family's
      decoder layer (latent attention or GLM's, a sparse MLP); `out` is what a further guess
      reads.
  Qwen's (Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: `mtp.*`): pre_fc_norm_embedding,
      pre_fc_norm_hidden, fc, norm (Qwen's 1 + w norms) around a full-attention layer of the
      hybrid (gated attention, the family's MLP); `norm(out)` is what a further guess reads.

It is what an EAGLE-1 head is (engine/models/eagle.py), so engine/spec/eagle.py runs it the same
way: after each step over the positions the target kept, and past the last one fed its own
output (as vLLM does when it asks a layer for more guesses than the model has layers). The first
layer serves every guess. Its embedding and LM head are the target's (DeepSeek's copies in the
layer, `embed_tokens` and `shared_head.head`, are the same tensors and are not read); `wants`
names the few tensors the runner reads from the target's checkpoint.
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


@dataclasses.dataclass(frozen=True)
class MtpLayout:
    """Where a family keeps its MTP layer in the checkpoint, and how it feeds a guess on."""

    prefix: str  # every tensor of the layer's, its copies of the target's too
    own: dict[str, str]  # name past the prefix -> our parameter, beside the decoder layer's
    layer: str  # the decoder layer's names past the prefix start so
    shared: tuple[str, ...]  # names past the prefix of the target's tensors' copies (not read)
    norm_output: bool  # a further guess reads the normed output (else the pre-norm one)


def mtp_layout(arch: str, hf_config) -> MtpLayout | None:
    """The MTP layout of target architecture `arch` (None: its family has none here)."""
    from pdserve.engine.models import model_class
    from pdserve.engine.models.deepseek import DeepseekForCausalLM
    from pdserve.engine.models.qwen3_5 import Qwen3_5ForCausalLM

    family = model_class(arch)
    if issubclass(family, DeepseekForCausalLM):
        names = ("enorm", "hnorm", "eh_proj")
        return MtpLayout(
            prefix=f"model.layers.{int(hf_config.num_hidden_layers)}.",
            own={
                **{f"{n}.weight": f"{n}.weight" for n in names},
                "shared_head.norm.weight": "norm.weight",
            },
            layer="",
            shared=("embed_tokens.", "shared_head.head."),
            norm_output=False,
        )
    if issubclass(family, Qwen3_5ForCausalLM):
        return MtpLayout(
            prefix="mtp.",
            own={
                "pre_fc_norm_embedding.weight": "enorm.weight",
                "pre_fc_norm_hidden.weight": "hnorm.weight",
                "fc.weight": "eh_proj.weight",
                "norm.weight": "norm.weight",
            },
            layer="layers.0.",
            shared=(),
            norm_output=True,
        )
    return None


class MtpDraft(nn.Module):
    """The target's first MTP layer as a one-layer head (module docstring)."""

    supports_pp = False

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        from pdserve.engine.models import model_class

        self.config = cfg
        hf, h = cfg.hf_config, cfg.hidden_size
        arch = getattr(hf, TARGET_ARCHITECTURE)
        self.layout = mtp_layout(arch, hf)
        if self.layout is None:
            raise ValueError(f"MTP layers of {arch} are not supported")
        family = model_class(arch)
        # the layer is built as the target's family builds one (its config under the target's
        # name, which the family's properties read: GLM's o_proj without a bias, V3's gate)
        layer_cfg = dataclasses.replace(cfg, architecture=arch)
        if self.layout.prefix == "mtp.":
            from pdserve.engine.models.gemma import GemmaRMSNorm

            norm = GemmaRMSNorm  # (Qwen's 1 + w)
            self.layer = family.model_class.layer_class(layer_cfg, 0, rotary, None)
        else:
            norm = RMSNorm
            self.layer = _deepseek_layer(family, layer_cfg, rotary)
        self.packed = family.packed
        self.enorm = norm(h, cfg.rms_norm_eps)
        self.hnorm = norm(h, cfg.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * h, h, bias=False)
        self.norm = norm(h, cfg.rms_norm_eps)
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
        out = out + residual
        return self.norm(out)[0] if self.layout.norm_output else out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if not self.layout.norm_output:
            hidden = self.norm(hidden)[0]
        return self._target_logits(hidden)

    def wants(self, name: str) -> bool:
        """Whether the runner reads checkpoint tensor `name` for this head (its layer's own)."""
        layout = self.layout
        if not name.startswith(layout.prefix):
            return False
        rest = name[len(layout.prefix) :]
        return rest in layout.own or (
            rest.startswith(layout.layer) and not rest.startswith(layout.shared)
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in self._our_names(weights):
            loaded.add(load_tensor(params, name, tensor, self.packed, "an MTP layer"))
        missing = {n for n in params if n not in loaded and not n.startswith("embed_tokens.")}
        if missing:
            raise ValueError(
                f"the checkpoint's MTP layer ({self.layout.prefix}*) is missing tensors: "
                f"{sorted(missing)[:5]}"
            )

    def _our_names(self, weights):
        """The layer's checkpoint tensors under our names (a Qwen mixture's fused experts
        split per expert, as the family loads them)."""
        from pdserve.engine.models.moe import MoeSpec, per_expert

        layout = self.layout
        ours = []
        for name, tensor in weights:
            if not self.wants(name) or "rotary_emb.inv_freq" in name:
                continue
            rest = name[len(layout.prefix) :]
            if rest in layout.own:
                ours.append((layout.own[rest], tensor))
                continue
            rest = f"layer.{rest[len(layout.layer) :]}"
            ours.append((rest.replace(".mlp.shared_experts.", ".mlp.shared_expert."), tensor))
        hf = self.config.hf_config
        if layout.prefix == "mtp." and getattr(hf, "num_experts", 0):
            size = MoeSpec.from_hf(self.config).intermediate_size
            return per_expert(ours, size, self.config.hidden_size)
        return ours

    def prepare_linears(self, quantization: str | None, release_dense: bool = True) -> None:
        prepare_head_linears(self, quantization, release_dense)

    def prepare_decode_stack(self) -> None:
        """(One layer: nothing to stack.)"""


def _deepseek_layer(family, cfg: ModelConfig, rotary: RotaryEmbedding) -> nn.Module:
    """DeepSeek's (or GLM's) decoder layer for the MTP layer L: its MLP sparse where the
    family's rule makes layer L sparse (every released MTP layer is)."""
    from pdserve.engine.models.deepseek import DeepseekMoeSpec

    hf, index = cfg.hf_config, int(cfg.hf_config.num_hidden_layers)
    moe = DeepseekMoeSpec.from_hf(cfg)
    kinds = getattr(hf, "mlp_layer_types", None)
    first = int(getattr(hf, "first_k_dense_replace", 0) or 0)
    freq = int(getattr(hf, "moe_layer_freq", 1) or 1)
    if kinds and len(kinds) > index:
        sparse = kinds[index] == "sparse"
    else:  # (a layer past those the types list)
        sparse = index >= first and index % freq == 0
    moe = dataclasses.replace(
        moe, sparse_layers=frozenset({0} if sparse and moe.num_experts else ())
    )
    qk_norm = RMSNorm if getattr(hf, "use_qk_norm", False) else None
    return family.model_class.make_layer(cfg, moe, 0, family.layer_rotary(cfg, rotary), qk_norm)
