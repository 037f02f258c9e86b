"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B), Qwen3-MoE
(Qwen3-VL-MoE's language model too).

Llama's attention (with Qwen3's per-head q/k RMSNorm for Qwen3-MoE), norms, embeddings, LM head
and loading (engine/models/llama.py) with a sparse MLP (engine/layers/moe.py FusedMoE) in the
layers the family's config makes sparse; the others keep Llama's dense MLP (Qwen2/3-MoE's
`mlp_only_layers`, `decoder_sparse_step`). Qwen2-MoE adds a shared expert behind a sigmoid gate.

Checkpoints come in two layouts, both loaded: per-expert tensors, as on the hub and as
transformers 5 still writes them (`block_sparse_moe.experts.N.w1/w2/w3` for Mixtral,
`mlp.experts.N.gate_proj/up_proj/down_proj` for Qwen), and transformers 5's in-memory fused
layout (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), which
`per_expert` splits into the per-expert names on the way in (Qwen3-VL-MoE's releases store
those transposed: `_as_in_memory`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pdserve.engine import multimodal
from pdserve.engine.config import ModelConfig
from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.engine.layers.moe import FusedMoE
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, run_layers
from pdserve.engine.parallel import stage_layers

# Mixtral's per-expert names -> Qwen's (which LlamaForCausalLM.packed then merges)
_MIXTRAL_NAMES = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
# families whose configs have no norm_topk_prob, each token's top-k weights always renormalized
_ALWAYS_RENORMALIZE = ("qwen3_vl_moe_text", "qwen3_5_moe_text")
_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?$")


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """The sparse MLP of one family, read from its HF config."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool
    shared_intermediate_size: int
    sparse_layers: frozenset[int]

    @classmethod
    def from_hf(cls, cfg: ModelConfig) -> MoeSpec:
        hf = cfg.hf_config
        n = cfg.num_layers
        if cfg.architecture == "MixtralForCausalLM":
            return cls(
                num_experts=hf.num_local_experts,
                top_k=hf.num_experts_per_tok,
                intermediate_size=cfg.intermediate_size,
                renormalize=True,
                shared_intermediate_size=0,
                sparse_layers=frozenset(range(n)),
            )
        # Qwen2-MoE, Qwen3-MoE
        only_dense = set(getattr(hf, "mlp_only_layers", None) or ())
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        sparse = {
            i
            for i in range(n)
            if i not in only_dense and hf.num_experts > 0 and (i + 1) % step == 0
        }
        return cls(
            num_experts=hf.num_experts,
            top_k=hf.num_experts_per_tok,
            intermediate_size=hf.moe_intermediate_size,
            # (Qwen3-VL-MoE's and Qwen3.5-MoE's configs have no norm_topk_prob: transformers
            # always renormalizes theirs)
            renormalize=bool(getattr(hf, "norm_topk_prob", hf.model_type in _ALWAYS_RENORMALIZE)),
            shared_intermediate_size=getattr(hf, "shared_expert_intermediate_size", 0) or 0,
            sparse_layers=frozenset(sparse),
        )


def sparse_mlp(cfg: ModelConfig, spec, **kwargs) -> FusedMoE:
    """The FusedMoE of a family's spec (MoeSpec, or DeepSeek's: the same fields); kwargs:
    FusedMoE's keyword options (a router of the family's, an ungated shared expert)."""
    return FusedMoE(
        cfg.hidden_size,
        spec.num_experts,
        spec.top_k,
        spec.intermediate_size,
        spec.renormalize,
        spec.shared_intermediate_size,
        **kwargs,
    )


def moe_decoder_layer(
    cfg: ModelConfig, spec: MoeSpec, layer_idx: int, rotary: RotaryEmbedding, qk_norm
) -> LlamaDecoderLayer:
    """Llama's layer, with a sparse MLP where the family's config makes this layer sparse."""
    mlp = sparse_mlp(cfg, spec) if layer_idx in spec.sparse_layers else None
    return LlamaDecoderLayer(cfg, layer_idx, rotary, qk_norm, mlp=mlp)


class MoeModel(nn.Module):
    """Llama's model over layers of a mixture of experts; a family's subclass builds its own
    layers (`make_layer`: engine/models/deepseek.py's)."""

    make_layer = staticmethod(moe_decoder_layer)  # (cfg, spec, layer index, rotary, qk_norm)

    def __init__(self, cfg: ModelConfig, spec, rotary: RotaryEmbedding, qk_norm=None):
        super().__init__()
        # a pipeline stage (engine/parallel.py) holds its layers; the first also the embedding,
        # the last the final norm (as LlamaModel)
        self.first_layer, end = stage_layers(cfg.num_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
            if self.first_layer == 0
            else None
        )
        self.layers = nn.ModuleList(
            self.make_layer(cfg, spec, i, rotary, qk_norm) for i in range(self.first_layer, end)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if end == cfg.num_layers else None

    def prepare_decode_stack(self) -> None:
        """(Llama's one-call decode stack has no sparse MLP, nor MLA: the layers run one by
        one.)"""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, carried=None):
        """As LlamaModel.forward: the final hidden states, or in a stage before the last the
        (hidden, residual) pair the next stage continues from."""
        meta = get_forward_context()
        if carried is None:
            hidden, residual = self.embed_tokens(input_ids), None
            if meta.image_rows is not None:  # a vision-language model's image tokens
                hidden = multimodal.apply(hidden, meta.image_rows, meta.image_embeds)
        else:
            hidden, residual = carried
        hidden, residual = run_layers(self, positions, hidden, residual, meta)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class MoeForCausalLM(LlamaForCausalLM):
    """Llama's forward, logits, loading and prepare_linears over MoeModel (a family's subclass
    names its own `model_class` and `spec`: engine/models/llama4.py, minimax_m2.py)."""

    model_class = MoeModel
    spec = staticmethod(MoeSpec.from_hf)  # (ModelConfig) -> the family's sparse MLP

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        nn.Module.__init__(self)
        if cfg.architecture == "Qwen2MoeForCausalLM":  # q/k/v bias (its config says qkv_bias)
            cfg = dataclasses.replace(
                cfg, attention_bias=bool(getattr(cfg.hf_config, "qkv_bias", True))
            )
        self.config = cfg
        self.moe = self.spec(cfg)
        # Qwen3-MoE: Qwen3's RMSNorm of each query and key head (LlamaAttention's qk_norm)
        qk_norm = RMSNorm if cfg.architecture == "Qwen3MoeForCausalLM" else None
        self.model = self.model_class(cfg, self.moe, rotary, qk_norm)
        self.lm_head = None  # on the first pipeline stage, beside the embedding
        if self.model.embed_tokens is not None:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if cfg.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._per_expert(weights))

    def _per_expert(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return per_expert(weights, self.moe.intermediate_size, self.config.hidden_size)


def _as_in_memory(which: str, tensor: torch.Tensor, size: int, hidden: int) -> torch.Tensor:
    """A fused expert tensor [E, out, in] as transformers holds it: Qwen3-VL-MoE's released
    checkpoints store each expert's matrix transposed ([E, H, 2I] and [E, I, H]), which
    transformers transposes unless the tensor already has the in-memory shape (a checkpoint
    transformers 5 saved); the same here. size: an expert's intermediate size; hidden: the
    model's."""
    want = (2 * size, hidden) if which == "gate_up_proj" else (hidden, size)
    if which in ("gate_up_proj", "down_proj") and tuple(tensor.shape[1:]) != want:
        return tensor.transpose(1, 2)
    return tensor


def per_expert(
    weights: Iterable[tuple[str, torch.Tensor]], size: int, hidden: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names in the per-expert Qwen layout, fused 3-D expert tensors split (size: an
    expert's intermediate size; hidden: the model's). Shared by the hybrid MoE families
    (engine/models/qwen3_5.py)."""
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".experts." in name:
            for old, new in _MIXTRAL_NAMES.items():
                name = name.replace(old, new)
        fused = _FUSED.match(name)
        if fused is None or tensor.dim() != 3:
            yield name, tensor
            continue
        prefix, which = fused.group(1), fused.group(2)
        tensor = _as_in_memory(which, tensor, size, hidden)
        for e in range(tensor.shape[0]):
            if which == "gate_up_proj":
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
            else:
                yield f"{prefix}.{e}.{which}.weight", tensor[e]
