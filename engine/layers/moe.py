"""Mixture-of-experts feed-forward: the router, the experts, and routing tokens between them.

`FusedMoE` owns one sparse MLP block: a router (a replicated linear, never quantized), softmax,
top-k and the family's renormalization (or a family's own routing: DeepSeek's gate in
engine/models/deepseek.py, Llama 4's in engine/models/llama4.py), then every expert's
gate/up/down projections (Llama 4 weighs each token's input to an expert rather than its
output), and optionally a shared expert, behind a sigmoid gate (Qwen2-MoE) or always added
(DeepSeek, Llama 4). Each expert's projections are ordinary linears of engine/layers/linear.py (`experts.N.gate_up_proj`, `experts.N.down_proj`),
so `finalize` packs them for oneDNN or quantizes them to int8/int4, and the runner's calibration
hooks see each expert's own inputs, exactly as for a dense MLP.

Compute: the (token, expert) pairs are sorted by expert; each expert that received tokens runs
one batched matmul over its rows, scaled by their routing weights, and each token's top_k rows
are summed back (no per-token loop). While a CUDA graph is being captured, where shapes cannot
depend on the routing, every expert runs on every token, weighted by zero where not chosen.

Tensor parallelism shards each expert's intermediate dimension across ranks (gate/up
column-parallel, down row-parallel without its own reduction), and one all_reduce follows the
weighted sum of the routed experts and the shared expert. Chosen over placing whole experts on
ranks (expert parallelism) because every rank then does the same work whatever the routing
(a rank whose experts drew no tokens would idle in a step, and skewed routing makes one rank the
step's straggler), the router needs no dispatch or all-to-all exchange, any expert count works
with any TP size that divides the intermediate size, and the collective is the same single
all_reduce a dense MLP already pays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pdserve.engine.parallel import all_reduce, tp_rank, tp_size


class RouterLinear(ReplicatedLinear):
    """A small replicated linear whose outputs pick experts (the router, the shared expert's
    gate): it stays in the model's dtype under every quantization mode, since a rounding that
    flips a near-tie between two experts changes the token's whole computation."""

    def finalize(self, quantization: str | None = None, release_dense: bool = True) -> None:
        super().finalize(None, release_dense)


class ExpertDownLinear(RowParallelLinear):
    """An expert's down projection: row-parallel, but its partial sum is not reduced here (the
    block reduces once, after the weighted sum over experts), so its bias (gpt-oss's) is added
    by the first rank alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias if tp_rank() == 0 else None)


class ExpertMLP(nn.Module):
    """One expert (or a shared expert): a gated MLP, its intermediate dimension sharded; SiLU's
    gate unless the family has its own `act(gate, up)` (gpt-oss's clamped SwiGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, act=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias
        )
        self.down_proj = ExpertDownLinear(intermediate_size, hidden_size, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up if self.act is None else self.act(gate, up))


class UngatedExpertMLP(nn.Module):
    """An expert without a gate (Nemotron-H's): up, `act`, down; the intermediate dimension
    sharded as ExpertMLP's."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, act=None):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = ExpertDownLinear(intermediate_size, hidden_size, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), each [tokens, top_k]: softmax over the experts in float32, the
    top_k largest, divided by their sum where the family renormalizes (Mixtral,
    norm_topk_prob)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        shared_intermediate_size: int = 0,  # > 0: a shared expert
        *,
        router: RouterLinear | None = None,
        shared_gated: bool = True,
        biases: bool = False,
        expert_act=None,
        weigh_inputs: bool = False,
        gated: bool = True,
    ):
        """router: a gate with its own `route(logits) -> (weights, ids)` (DeepSeek's); None:
        a plain gate, softmax and top_k (`route`). shared_gated: the shared expert's output is
        scaled by a sigmoid gate of its own (Qwen2-MoE); False: added as it is (DeepSeek).
        biases: the plain gate and every expert's projections have biases (gpt-oss);
        expert_act: the experts' `act(gate, up)` (ExpertMLP); weigh_inputs: each token's routing
        weight scales its input to the expert rather than the expert's output (Llama 4);
        gated False: the experts and the shared one are UngatedExpertMLPs of expert_act(x)."""
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.weigh_inputs = weigh_inputs
        self.custom_routing = router is not None
        self.gate = router if router is not None else RouterLinear(hidden_size, num_experts, biases)
        expert = ExpertMLP if gated else UngatedExpertMLP
        self.experts = nn.ModuleList(
            expert(hidden_size, intermediate_size, biases, expert_act) for _ in range(num_experts)
        )
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size > 0:
            act = None if gated else expert_act
            self.shared_expert = expert(hidden_size, shared_intermediate_size, act=act)
            if shared_gated:
                self.shared_expert_gate = RouterLinear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        if self.custom_routing:
            weights, ids = self.gate.route(logits)
        else:
            weights, ids = route(logits, self.top_k, self.renormalize)
        weights = weights.to(x.dtype)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = self._all_experts(x, weights, ids)
        else:
            out = self._routed_experts(x, weights, ids)
        if self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        if tp_size() > 1:
            out = all_reduce(out)
        return out.view(shape)

    def _routed_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Each expert that drew tokens: one matmul over its rows, weighted; each (token, slot)
        pair's row lands in its own place of a [tokens, top_k, hidden] buffer (index_copy_: no
        two writes meet, and unlike index_add_ it stays one thread at decode sizes, where a
        second OpenMP thread on a shared core cost ~10x), then the slots are summed."""
        flat = ids.view(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs, grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        pair_weights = weights.view(-1)[order].unsqueeze(1)
        xs = x.index_select(0, tokens)  # each expert's rows, contiguous
        buf = x.new_empty(flat.shape[0], x.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            if self.weigh_inputs:
                y = self.experts[e](xs[rows] * pair_weights[rows])
            else:
                y = self.experts[e](xs[rows]).mul_(pair_weights[rows])
            buf.index_copy_(0, order[rows], y)
            start += n
        buf = buf.view(x.shape[0], self.top_k, x.shape[1])
        out = buf[:, 0].clone()
        for slot in range(1, self.top_k):
            out += buf[:, slot]
        return out

    def _all_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """Shapes independent of the routing (CUDA graph capture): every expert on every token,
        weighted by zero where it was not chosen."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            w = (weights * (ids == e)).sum(dim=-1, keepdim=True)
            out = out + (expert(x * w) if self.weigh_inputs else expert(x) * w)
        return out
