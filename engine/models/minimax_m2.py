"""MiniMax-M2 (M2, M2.1, M2.5): a mixture of experts under full attention whose query and key
norms span every head at once.

Attention is Llama's with partial rotary (`rotary_dim` of each head, read as
partial_rotary_factor), after an RMSNorm of the whole query projection and one of the whole key
projection: one root mean square over all heads' values of a token, not one a head (Qwen3's).
Under tensor parallelism a rank holds some of the heads, so each rank sums its heads' squares
and one all_reduce of those sums (a number a token, for the queries and one for the keys) gives
every rank the whole projection's mean before it scales its own heads by their slice of the
norm's weight (vLLM's MiniMax-Text-01 norm does the same). Every layer is sparse: DeepSeek V3's
router (sigmoid scores, experts chosen by score plus `e_score_correction_bias`, the chosen
scores renormalized) without groups, shared experts or scaling (engine/models/deepseek.py
DeepseekGate), over Mixtral's per-expert names (`block_sparse_moe.experts.N.w1/w2/w3`, the
hub's) or transformers' fused tensors (engine/models/moe.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.embedding import ParallelLMHead
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.deepseek import DeepseekGate, DeepseekMoeSpec
from pdserve.engine.models.llama import LlamaAttention, LlamaDecoderLayer
from pdserve.engine.models.moe import MoeForCausalLM, MoeModel, sparse_mlp
from pdserve.engine.parallel import all_reduce, tp_rank, tp_size


class MiniMaxM2Attention(LlamaAttention):
    """Llama's attention after RMSNorms over the whole query and key projections (module
    docstring: one all_reduce of the squares' sums under TP)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(cfg, layer_idx, rotary)
        self.eps = cfg.rms_norm_eps
        self.q_width = cfg.num_heads * cfg.head_dim  # (the whole projection's, all ranks')
        self.k_width = cfg.num_kv_heads * cfg.head_dim
        self.q_norm = _SlicedWeight(self.num_heads * self.head_dim)
        self.k_norm = _SlicedWeight(self.num_kv_heads * self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = self._normed(q, k)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))

    def _normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k over the RMS of the whole projections (in float32), times the norms'
        weights, as transformers' MiniMaxM2RMSNorm."""
        qf, kf = q.float(), k.float()
        sums = torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1)])  # [2, tokens]
        if tp_size() > 1:
            sums = all_reduce(sums)
        q_scale = torch.rsqrt(sums[0] / self.q_width + self.eps).unsqueeze(-1)
        k_scale = torch.rsqrt(sums[1] / self.k_width + self.eps).unsqueeze(-1)
        q = self.q_norm.weight * (qf * q_scale).to(q.dtype)
        k = self.k_norm.weight * (kf * k_scale).to(k.dtype)
        return q, k


class _SlicedWeight(nn.Module):
    """A norm's weight over the whole projection, of which this rank keeps its heads' slice."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, tp_rank() * n, n))


def minimax_spec(cfg: ModelConfig) -> DeepseekMoeSpec:
    hf = cfg.hf_config
    return DeepseekMoeSpec(
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.intermediate_size,
        shared_intermediate_size=0,
        sigmoid=True,
        groups=1,
        topk_group=1,
        renormalize=True,
        scale=1.0,
        sparse_layers=frozenset(range(cfg.num_layers)),
    )


def minimax_layer(cfg: ModelConfig, spec, layer_idx: int, rotary, qk_norm=None):
    mlp = sparse_mlp(cfg, spec, router=DeepseekGate(cfg.hidden_size, spec))
    layer = LlamaDecoderLayer(cfg, layer_idx, rotary, mlp=mlp)
    layer.self_attn = MiniMaxM2Attention(cfg, layer_idx, rotary)
    return layer


class MiniMaxM2Model(MoeModel):
    make_layer = staticmethod(minimax_layer)


class MiniMaxM2ForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        nn.Module.__init__(self)
        self.config = cfg
        self.moe = minimax_spec(cfg)
        self.model = MiniMaxM2Model(cfg, self.moe, rotary)
        self.lm_head = None  # on the first pipeline stage, beside the embedding
        if self.model.embed_tokens is not None:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if cfg.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._renamed(weights))

    def _renamed(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The block's correction bias as the router's (a layer past num_hidden_layers, a
        multi-token-prediction one, is left out by LlamaForCausalLM's loading)."""
        for name, tensor in weights:
            for block in (".block_sparse_moe.", ".mlp."):
                name = name.replace(
                    f"{block}e_score_correction_bias", ".mlp.gate.e_score_correction_bias"
                )
            yield name, tensor
