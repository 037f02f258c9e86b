"""DeepSeek V2 and V3 (and the models built on V3's architecture: DeepSeek R1, Kimi K2, GLM-4.7
Flash): multi-head latent attention (engine/layers/mla.py) and DeepSeek's mixture of experts;
and GLM-4.5/4.6 (Glm4MoeForCausalLM), V3's mixture of experts under Llama's attention (partial
rotary, q/k bias, optionally Qwen3's per-head q/k norms).

A layer is Llama's shape (pre-norms, residual stream) with an MLA attention and, from layer
`first_k_dense_replace` on (every `moe_layer_freq`-th; GLM-4.7 Flash: where `mlp_layer_types`
says "sparse"), a sparse MLP: routed experts picked by DeepSeek's gate plus shared experts always
added (FusedMoE with `router=DeepseekGate`, `shared_gated=False`); the first layers keep a dense
MLP. The gate differs by version (GLM's is V3's):
- V2: softmax over the experts, top-k ("greedy"), or top-k within the `topk_group` groups whose
  best expert scores highest ("group_limited_greedy"); renormalized where norm_topk_prob says so
  (the reference code's rule; transformers' V2 never renormalizes, and no released V2 asks to);
- V3: sigmoid scores; experts are chosen by score plus `e_score_correction_bias` (a checkpoint
  tensor) within the `topk_group` groups whose two best sum highest, weighted by their plain
  scores, renormalized;
and both scale the weights by routed_scaling_factor. Checkpoint names are the hub's
(`mlp.experts.N.*`, `mlp.shared_experts.*`, `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`); V3's multi-token-prediction layers past num_hidden_layers
are skipped, as transformers does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.embedding import ParallelLMHead
from pdserve.engine.layers.mla import MLAttention
from pdserve.engine.layers.moe import RouterLinear
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding, rope_inv_freq
from pdserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pdserve.engine.models.moe import MoeModel, sparse_mlp


@dataclasses.dataclass(frozen=True)
class DeepseekMoeSpec:
    """The sparse MLP of a DeepSeek config."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    shared_intermediate_size: int  # all shared experts together (one MLP)
    sigmoid: bool  # V3's scores (else V2's softmax)
    groups: int  # expert groups the choice is limited to (1: no limit)
    topk_group: int
    renormalize: bool
    scale: float  # routed_scaling_factor
    sparse_layers: frozenset[int]

    @classmethod
    def from_hf(cls, cfg: ModelConfig) -> DeepseekMoeSpec:
        hf = cfg.hf_config
        v3 = cfg.architecture != "DeepseekV2ForCausalLM"  # (V3's gate: GLM's too)
        experts = int(getattr(hf, "n_routed_experts", None) or 0)
        first = int(getattr(hf, "first_k_dense_replace", 0) or 0)
        freq = int(getattr(hf, "moe_layer_freq", 1) or 1)
        kinds = getattr(hf, "mlp_layer_types", None)  # GLM-4.7 Flash: "dense" or "sparse" each
        grouped = v3 or getattr(hf, "topk_method", "greedy") == "group_limited_greedy"
        groups = int(hf.n_group or 1) if grouped else 1
        if experts and experts % groups:
            raise ValueError(f"n_group={groups} must divide n_routed_experts={experts}")
        return cls(
            num_experts=experts,
            top_k=int(hf.num_experts_per_tok or 0),
            intermediate_size=int(hf.moe_intermediate_size),
            shared_intermediate_size=int(hf.moe_intermediate_size) * int(hf.n_shared_experts or 0),
            sigmoid=v3,
            groups=groups,
            topk_group=int(hf.topk_group or 1) if grouped else 1,
            renormalize=bool(hf.norm_topk_prob) and int(hf.num_experts_per_tok or 0) > 1,
            scale=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
            sparse_layers=frozenset(
                i
                for i in range(cfg.num_layers)
                if experts and (kinds[i] == "sparse" if kinds else i >= first and i % freq == 0)
            ),
        )


class DeepseekGate(RouterLinear):
    """The router of one sparse layer, with DeepSeek's choice of experts (module docstring)."""

    def __init__(self, hidden_size: int, spec: DeepseekMoeSpec):
        super().__init__(hidden_size, spec.num_experts, False)
        self.spec = spec
        if spec.sigmoid:  # V3: a per-expert bias on the choice (not on the weights)
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(spec.num_experts), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), each [tokens, top_k], in float32."""
        spec = self.spec
        logits = logits.float()
        scores = logits.sigmoid() if spec.sigmoid else torch.softmax(logits, dim=-1)
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if spec.groups > 1:
            per_group = choice.view(choice.shape[0], spec.groups, -1)
            if spec.sigmoid:  # V3: a group's two best, summed
                group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
            else:  # V2: a group's best
                group_scores = per_group.max(dim=-1).values
            keep = group_scores.topk(spec.topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            mask = mask.unsqueeze(-1).expand_as(per_group).reshape(choice.shape)
            choice = choice.masked_fill(~mask, float("-inf"))
        ids = choice.topk(spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if spec.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * spec.scale, ids


def deepseek_mlp(cfg: ModelConfig, spec: DeepseekMoeSpec, layer_idx: int) -> nn.Module:
    """A layer's MLP: DeepSeek's sparse one where the spec makes the layer sparse, else dense."""
    if layer_idx not in spec.sparse_layers:
        return LlamaMLP(cfg)
    return sparse_mlp(cfg, spec, router=DeepseekGate(cfg.hidden_size, spec), shared_gated=False)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its norms and forward) with MLA attention and DeepSeek's MLP."""

    def __init__(
        self, cfg: ModelConfig, spec: DeepseekMoeSpec, layer_idx: int, rotary: RotaryEmbedding
    ):
        nn.Module.__init__(self)
        self.self_attn = MLAttention(cfg, layer_idx, rotary)
        self.mlp = deepseek_mlp(cfg, spec, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekModel(MoeModel):
    """MoeModel (embedding, stages, final norm) over DeepSeek's layers."""

    @staticmethod
    def make_layer(cfg, spec, layer_idx, rotary, qk_norm) -> nn.Module:
        return DeepseekDecoderLayer(cfg, spec, layer_idx, rotary)


class Glm4MoeModel(MoeModel):
    """MoeModel over GLM-4.5's layers: Llama's (q/k norms per head where use_qk_norm) with
    DeepSeek's MLP."""

    @staticmethod
    def make_layer(cfg, spec, layer_idx, rotary, qk_norm) -> nn.Module:
        mlp = deepseek_mlp(cfg, spec, layer_idx)
        return LlamaDecoderLayer(cfg, layer_idx, rotary, qk_norm, mlp=mlp)


class DeepseekForCausalLM(LlamaForCausalLM):
    """Llama's forward, logits, loading and prepare_linears over DeepseekModel."""

    packed = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    model_class = DeepseekModel

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        nn.Module.__init__(self)
        hf = cfg.hf_config
        if getattr(hf, "mlp_bias", False):
            raise ValueError(f"{cfg.architecture} with mlp_bias is not supported")
        self.config = cfg
        self.moe = DeepseekMoeSpec.from_hf(cfg)
        qk_norm = RMSNorm if getattr(hf, "use_qk_norm", False) else None  # (GLM-4.5's)
        self.model = self.model_class(cfg, self.moe, self.layer_rotary(cfg, rotary), qk_norm)
        self.lm_head = None  # on the first pipeline stage, beside the embedding
        if self.model.embed_tokens is not None:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if cfg.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)

    @staticmethod
    def layer_rotary(cfg: ModelConfig, rotary: RotaryEmbedding) -> RotaryEmbedding:
        """The rotary the layers turn: MLA turns qk_rope_head_dim of each head, not head_dim."""
        hf = cfg.hf_config
        inv_freq, factor = rope_inv_freq(hf, cfg.rope_type, cfg.rope_theta, hf.qk_rope_head_dim)
        device = rotary.cos.device
        return RotaryEmbedding(inv_freq.to(device), factor, rotary.cos.shape[0]).to(device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._our_names(weights))

    def _our_names(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The hub's names in this module's: the shared experts are FusedMoE's one shared
        expert; the multi-token-prediction layers (past num_hidden_layers) are left out."""
        for name, tensor in weights:
            parts = name.split(".")
            if name.startswith("model.layers.") and int(parts[2]) >= self.config.num_layers:
                continue
            yield name.replace(".mlp.shared_experts.", ".mlp.shared_expert."), tensor


class Glm4MoeForCausalLM(DeepseekForCausalLM):
    """GLM-4.5/4.6: the q/k/v shards of Llama's fused projection, and the runner's rotary
    (head_dim, partial_rotary_factor) as it is."""

    packed = LlamaForCausalLM.packed
    model_class = Glm4MoeModel

    @staticmethod
    def layer_rotary(cfg: ModelConfig, rotary: RotaryEmbedding) -> RotaryEmbedding:
        return rotary
