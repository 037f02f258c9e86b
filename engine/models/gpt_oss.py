"""OpenAI's gpt-oss (gpt-oss-20b, gpt-oss-120b): Llama's layer with attention sinks and a mixture
of experts whose projections carry biases.

Attention is Llama's with q/k/v/o biases, layers alternating between a sliding window (128 tokens)
and the full context (ModelConfig.layer_windows, from the config's layer_types), YaRN's rotary,
and a learned sink logit per head (engine/attention.py PagedAttention's `sinks`). The sparse MLP
is FusedMoE with a biased router whose top-k logits are softmaxed (the same weights as a softmax
over every expert renormalized over the top k: `route`), biased experts and OpenAI's clamped
SwiGLU: gate clamped above at `swiglu_limit`, up clamped to +-limit, then
(up + 1) * gate * sigmoid(alpha * gate).

The checkpoint holds each layer's experts fused, as transformers' GptOssExperts does:
`experts.gate_up_proj` [E, H, 2I] with gate and up interleaved along the last dimension (gate at
even columns), `experts.down_proj` [E, I, H], and their biases; OpenAI's own releases store the
two projections in MXFP4, which engine/loader/prequantized.py reads into that same dense layout.
`GptOssForCausalLM._per_expert` splits them into each expert's gate, up and down linears, so
tensor parallelism shards every expert's intermediate dimension as for the other MoE families.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.embedding import ParallelLMHead
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.llama import LlamaDecoderLayer
from pdserve.engine.models.moe import MoeForCausalLM, MoeModel, MoeSpec, sparse_mlp


class ClampedSwiGLU:
    """gpt-oss's expert activation of a (gate, up) pair."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = float(alpha), float(limit)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def gpt_oss_spec(cfg: ModelConfig) -> MoeSpec:
    hf = cfg.hf_config
    return MoeSpec(
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=cfg.intermediate_size,
        renormalize=True,
        shared_intermediate_size=0,
        sparse_layers=frozenset(range(cfg.num_layers)),
    )


def gpt_oss_layer(cfg: ModelConfig, spec: MoeSpec, layer_idx: int, rotary, qk_norm):
    hf = cfg.hf_config
    act = ClampedSwiGLU(getattr(hf, "swiglu_alpha", 1.702), getattr(hf, "swiglu_limit", 7.0))
    mlp = sparse_mlp(cfg, spec, biases=True, expert_act=act)
    return LlamaDecoderLayer(cfg, layer_idx, rotary, qk_norm, mlp=mlp)


class GptOssModel(MoeModel):
    make_layer = staticmethod(gpt_oss_layer)


class GptOssForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        nn.Module.__init__(self)
        self.config = cfg
        self.moe = gpt_oss_spec(cfg)
        self.model = GptOssModel(cfg, self.moe, rotary)
        self.lm_head = None  # on the first pipeline stage, beside the embedding
        if self.model.embed_tokens is not None:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if cfg.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)

    def _per_expert(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names in the engine's modules: the router as the block's gate, the sinks
        in the layer's PagedAttention, each fused expert tensor split into its experts' linears
        (gate at the even columns of gate_up, up at the odd)."""
        for name, tensor in weights:
            name = name.replace(".mlp.router.", ".mlp.gate.")
            name = name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
            prefix, dot, which = name.rpartition(".experts.")
            if not dot or "." in which:
                yield name, tensor
                continue
            experts = f"{prefix}.experts"
            for e in range(tensor.shape[0]):
                t = tensor[e]
                if which == "gate_up_proj":  # [H, 2I] -> gate and up rows [I, H]
                    yield f"{experts}.{e}.gate_proj.weight", t[:, 0::2].t()
                    yield f"{experts}.{e}.up_proj.weight", t[:, 1::2].t()
                elif which == "gate_up_proj_bias":
                    yield f"{experts}.{e}.gate_proj.bias", t[0::2]
                    yield f"{experts}.{e}.up_proj.bias", t[1::2]
                elif which == "down_proj":  # [I, H] -> [H, I]
                    yield f"{experts}.{e}.down_proj.weight", t.t()
                elif which == "down_proj_bias":
                    yield f"{experts}.{e}.down_proj.bias", t
                else:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in gpt-oss")
