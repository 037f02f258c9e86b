"""MiniMax-M2 (M2, M2.1, M2.5): a mixture of experts under full attention whose query and key
norms span every head at once.

Attention is OLMo 2's (engine/models/olmo2.py Olmo2Attention) with partial rotary (`rotary_dim`
of each head, read as partial_rotary_factor): an RMSNorm of the whole query projection and one of
the whole key projection, one root mean square over all heads' values of a token, not one a head
(Qwen3's), before the rotary. Under tensor parallelism a rank holds some of the heads, so each
rank sums its heads' squares and an all_reduce of those sums gives every rank the whole
projection's mean before it scales its own heads by their slice of the norm's weight
(ShardedRMSNorm; vLLM's MiniMax-Text-01 norm does the same). OLMo 2's norm multiplies by the
weight before rounding to the activations' dtype, transformers' MiniMax-M2 after: the same in
float32, the last bit apart in bf16. Every layer is sparse: DeepSeek V3's
router (sigmoid scores, experts chosen by score plus `e_score_correction_bias`, the chosen
scores renormalized) without groups, shared experts or scaling (engine/models/deepseek.py
DeepseekGate), over Mixtral's per-expert names (`block_sparse_moe.experts.N.w1/w2/w3`, the
hub's) or transformers' fused tensors (engine/models/moe.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.deepseek import DeepseekGate, DeepseekMoeSpec
from pdserve.engine.models.llama import LlamaDecoderLayer
from pdserve.engine.models.moe import MoeForCausalLM, MoeModel, sparse_mlp
from pdserve.engine.models.olmo2 import Olmo2Attention


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
    attn = Olmo2Attention(cfg, layer_idx, rotary)  # (the same norms, then the rotary)
    return LlamaDecoderLayer(cfg, layer_idx, rotary, mlp=mlp, attn=attn)


class MiniMaxM2Model(MoeModel):
    make_layer = staticmethod(minimax_layer)


class MiniMaxM2ForCausalLM(MoeForCausalLM):
    model_class = MiniMaxM2Model
    spec = staticmethod(minimax_spec)

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
