"""Gated DeltaNet: the linear-attention layer of Qwen3.5 and Qwen3-Next, over per-sequence state.

A token's queries, keys and values (one projection, then a causal depthwise convolution of
kernel K and SiLU) update a matrix per value head instead of a KV cache: the state decays by
exp(g) (g = -exp(A_log) * softplus(a + dt_bias)), then the delta rule writes
beta * (v - S^T k) along k (keys and queries L2-normalized, queries scaled by key_dim ** -0.5),
and the output reads S^T q. The output goes through an RMSNorm over each value head, gated by
SiLU(z), and the output projection. Key heads may be fewer than value heads: each key head serves
value_heads / key_heads consecutive value heads.

State lives in the engine's slots (engine/recurrent_state.py), addressed through the forward
context: the step's one-token rows first (AttentionMetadata.state_slots, batched: one recurrent
update each, in place on CPU by the compiled kernel, fused_cpu.cpp gated_delta_step_), then each
prompt chunk (state_spans: (first row, tokens, slot, keep)), computed in chunks
of CHUNK tokens with the WY form of the rule (a triangular solve per chunk, then one pass over the
chunks carrying the state), from the state its previous chunk left. Tensor parallelism splits the
key and value heads across ranks (every rank holds whole groups), like attention heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.kernels import cpu_fused
from pdserve.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pdserve.engine.parallel import divide, tp_rank, tp_size
from pdserve.engine.recurrent_state import StateLayout

CHUNK = 64  # tokens per block of the chunked rule (transformers' and FLA's default)


def state_layout(hf_config) -> StateLayout:
    """One linear-attention layer's state and its parts: the conv's q, k and v channels and the
    delta rule's matrices [value heads, key dim, value dim], each split by heads."""
    n = tp_size()
    hk = divide(hf_config.linear_num_key_heads, n, "the linear-attention key heads")
    hv = divide(hf_config.linear_num_value_heads, n, "the linear-attention value heads")
    dk, dv = hf_config.linear_key_head_dim, hf_config.linear_value_head_dim
    key, value = (n * hk * dk, False), (n * hv * dv, False)
    return StateLayout(
        hf_config.linear_conv_kernel_dim - 1, (key, key, value), ((n * hv, False),), (dk, dv)
    )


class GatedDeltaNet(nn.Module):
    def __init__(self, hf_config, state_index: int, beta_scale: float = 1.0, norm_eps=None):
        """state_index: this layer's place among the model's linear-attention layers (its
        tensors in RecurrentStates); beta_scale: beta's range (OLMo Hybrid's 2: negative
        eigenvalues allowed); norm_eps: the output norm's epsilon (None: rms_norm_eps)."""
        super().__init__()
        c = hf_config
        self.state_index = state_index
        n = tp_size()
        self.hk_total, self.hv_total = c.linear_num_key_heads, c.linear_num_value_heads
        self.hk = divide(self.hk_total, n, "the linear-attention key heads")
        self.hv = divide(self.hv_total, n, "the linear-attention value heads")
        if self.hv_total % self.hk_total:
            raise ValueError(
                f"linear_num_value_heads={self.hv_total} must be a multiple of "
                f"linear_num_key_heads={self.hk_total}"
            )
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        key, value = self.hk_total * self.dk, self.hv_total * self.dv
        self.conv_sizes = [key, key, value]  # (whole model; a rank holds 1/n of each)
        # one matmul for q, k, v (convolved), z (the output gate), b (beta) and a (the decay)
        self.in_proj = MergedColumnParallelLinear(
            c.hidden_size, [key, key, value, value, self.hv_total, self.hv_total]
        )
        self.kernel = c.linear_conv_kernel_dim
        self.conv_weight = nn.Parameter(
            torch.zeros(sum(self.conv_sizes) // n, self.kernel), requires_grad=False
        )
        self.conv_weight.weight_loader = self._load_conv
        self.A_log = nn.Parameter(torch.zeros(self.hv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.hv), requires_grad=False)
        for p in (self.A_log, self.dt_bias):
            p.weight_loader = self._load_heads
        self.norm_weight = nn.Parameter(torch.ones(self.dv), requires_grad=False)
        self.eps = c.rms_norm_eps if norm_eps is None else norm_eps
        self.beta_scale = beta_scale
        self.out_proj = RowParallelLinear(value, c.hidden_size)

    def _load_conv(self, param, loaded, shard_id=None) -> None:
        """The checkpoint's conv1d.weight [channels, 1, K]: this rank's heads of q, k and v."""
        loaded = loaded.reshape(loaded.shape[0], -1)
        n, r = tp_size(), tp_rank()
        out, src = 0, 0
        for size in self.conv_sizes:
            part = size // n
            param.data[out : out + part].copy_(loaded[src + r * part : src + (r + 1) * part])
            out, src = out + part, src + size

    def _load_heads(self, param, loaded, shard_id=None) -> None:
        param.data.copy_(loaded.float().narrow(0, tp_rank() * self.hv, self.hv))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        states = meta.states
        conv, ssm = states.conv[self.state_index], states.ssm[self.state_index]
        key, value = self.hk * self.dk, self.hv * self.dv
        mixed, z, b, a = self.in_proj(x).split([2 * key + value, value, self.hv, self.hv], dim=-1)
        beta = b.float().sigmoid()
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = torch.empty(x.shape[0], self.hv, self.dv, dtype=torch.float32, device=x.device)
        nd = 0 if meta.state_slots is None else meta.state_slots.numel()
        if nd:
            slots = meta.state_slots
            mixed_d = conv_step(mixed[:nd], conv, slots, self.conv_weight)
            q, k, v = self._heads(mixed_d)
            out[:nd] = _recurrent_step(q, k, v, g[:nd], beta[:nd], ssm, slots)
        for start, length, slot, keep in meta.state_spans:
            rows = slice(start, start + length)
            mixed_s = conv_span(mixed[rows], conv, slot, self.conv_weight)
            q, k, v = self._heads(mixed_s)
            out[rows] = _chunked_rule(q, k, v, g[rows], beta[rows], ssm, slot)
            if keep >= 0:
                keep_state(conv, ssm, slot, keep)
        return self.out_proj(self._gated_norm(out, z))

    def _heads(self, mixed: torch.Tensor):
        """Convolved rows [T, channels] -> q, k [T, value heads, key dim] (L2-normalized, each
        key head repeated for its value heads; q scaled) and v [T, value heads, value dim],
        float32."""
        key = self.hk * self.dk
        q, k, v = mixed.float().split([key, key, self.hv * self.dv], dim=-1)
        group = self.hv // self.hk
        q = _l2norm(q.view(-1, self.hk, self.dk)) * self.dk**-0.5
        k = _l2norm(k.view(-1, self.hk, self.dk))
        if group > 1:
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        return q, k, v.view(-1, self.hv, self.dv)

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each value head (as transformers': the weight applied in the
        activations' dtype), times SiLU(z); [T, value heads * value dim] in z's dtype."""
        dtype = z.dtype
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.norm_weight.to(dtype) * normed.to(dtype)
        gated = normed.float() * F.silu(z.float().view(-1, self.hv, self.dv))
        return gated.to(dtype).view(out.shape[0], -1)


# a log-decay below which a term is dropped (exp(-60) ~ 1e-26 of its value): what would decay
# into float32's subnormal range is zero instead, which the matmuls take at full speed (a real
# model's decays reach exp(-3000) within a block; subnormal arithmetic halved the rule's speed)
_FAR = 60.0


def _decayed(log_decay: torch.Tensor) -> torch.Tensor:
    return log_decay.exp().masked_fill_(log_decay < -_FAR, 0.0)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def keep_state(conv: torch.Tensor, ssm: torch.Tensor, slot: int, keep: int) -> None:
    """This layer's state of `slot` copied into slot `keep`, where the prefix cache keeps it
    (AttentionMetadata.state_spans)."""
    conv[keep].copy_(conv[slot])
    ssm[keep].copy_(ssm[slot])


def conv_step(x, conv: torch.Tensor, slots: torch.Tensor, weight, bias=None, act=True):
    """One token per sequence through the causal depthwise conv: x [B, C], the last K - 1
    inputs from conv[slots] [B, K - 1, C], which then keep the newest K - 1. Plus `bias` where
    given, SiLU'd where `act`, in x's dtype (LFM2's short convolutions share it, without SiLU)."""
    window = torch.cat([conv.index_select(0, slots), x.float().unsqueeze(1)], dim=1)
    conv.index_copy_(0, slots, window[:, 1:])
    y = (window * weight.float().t().unsqueeze(0)).sum(1)
    return _conv_out(y, bias, act).to(x.dtype)


def conv_span(x, conv: torch.Tensor, slot: int, weight, bias=None, act=True):
    """A chunk of one sequence through the causal conv: x [L, C] after the K - 1 inputs held
    in conv[slot], which then holds the chunk's last K - 1 (earlier ones where L < K - 1); as
    conv_step's, the output."""
    padded = torch.cat([conv[slot], x.float()], dim=0)  # [K - 1 + L, C]
    conv[slot].copy_(padded[-conv.shape[1] :])
    w, length = weight.float(), x.shape[0]
    # K shifted products, token-major (the rule's matmuls want rows of tokens): a few passes over
    # [L, C], where a depthwise conv1d ran several times slower on its channel-major transpose
    y = padded[:length] * w[:, 0]
    for j in range(1, w.shape[1]):
        y += padded[j : j + length] * w[:, j]
    return _conv_out(y, bias, act).to(x.dtype)


def _conv_out(y: torch.Tensor, bias, act: bool) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    return F.silu(y) if act else y


def _recurrent_step(q, k, v, g, beta, ssm: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rule for one token per sequence: q, k [B, H, dk], v [B, H, dv], g and beta [B, H];
    the states ssm[slots] [B, H, dk, dv] are updated in place. Returns [B, H, dv]. On CPU the
    compiled kernel updates each state where it lies (fused_cpu.cpp gated_delta_step_); the
    torch path gathers the batch's states, updates them and scatters them back, three times
    the state's bytes moved (at 32 rows of a 16-head layer, 64 MiB a layer a step)."""
    fused = cpu_fused() if ssm.device.type == "cpu" else None
    if fused is None:
        return _recurrent_step_torch(q, k, v, g, beta, ssm, slots)
    out = torch.empty_like(v)
    args = (t.float().contiguous() for t in (q, k, v, g, beta))
    fused.gated_delta_step_(ssm, slots, *args, out)
    return out


def _recurrent_step_torch(q, k, v, g, beta, ssm, slots) -> torch.Tensor:
    s = ssm.index_select(0, slots) * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)
    s = s + k.unsqueeze(-1) * ((v - predicted) * beta.unsqueeze(-1)).unsqueeze(-2)
    ssm.index_copy_(0, slots, s)
    return torch.einsum("bhkv,bhk->bhv", s, q)


def _chunked_rule(q, k, v, g, beta, ssm: torch.Tensor, slot: int) -> torch.Tensor:
    """The rule over one sequence's L tokens (q, k [L, H, dk], v [L, H, dv], g and beta [L, H])
    from ssm[slot], which is left holding the state after the last token. Blocks of CHUNK
    tokens: within a block, the updates' combined effect is a lower-triangular system (the WY
    form: solved once for the values and the decayed keys), so each block costs a few matmuls
    and the state is carried from one block to the next. Returns [L, H, dv]."""
    length = q.shape[0]
    pad = (-length) % CHUNK
    # [H, blocks, CHUNK, ...]: heads first, the padding's g 0 (no decay) and beta 0 (no write)
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)).transpose(0, 1) for t in (g, beta))
    h = q.shape[0]
    q, k, v = (t.reshape(h, -1, CHUNK, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(h, -1, CHUNK), beta.reshape(h, -1, CHUNK)
    decay = g.cumsum(-1)  # log of the decay from the block's start through each token
    # decay between token j and token i of a block (i >= j), 0 above the diagonal
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    between = _decayed((decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, -math.inf))
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * between
    system = system.tril(-1) + torch.eye(CHUNK, device=q.device)
    values = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False)
    decayed_keys = torch.linalg.solve_triangular(
        system, k_beta * _decayed(decay).unsqueeze(-1), upper=False
    )
    inner = (q @ k.transpose(-1, -2)) * between  # a block's queries on its own keys
    q_decayed = q * _decayed(decay).unsqueeze(-1)
    k_to_end = k * _decayed(decay[..., -1:] - decay).unsqueeze(-1)
    block_decay = _decayed(decay[..., -1])[..., None, None]
    state = ssm[slot]
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        new = values[:, i] - decayed_keys[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + inner[:, i] @ new
        state = state * block_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ new
    ssm[slot].copy_(state)
    return out.reshape(h, -1, out.shape[-1])[:, :length].transpose(0, 1)
