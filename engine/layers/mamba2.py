"""Mamba2: the state-space mixer of Granite 4.0-H, Bamba and Nemotron-H, over per-sequence state.

One projection gives a token's gate z, its x, B and C (convolved together by a causal depthwise
convolution and SiLU) and a time step dt per head. Each head's state is a [head_dim, state_size]
matrix: it decays by exp(dt * A) (A = -exp(A_log), dt = softplus(dt + dt_bias)), then adds
dt * x outer B; the head's output reads state @ C, plus D * x. B and C belong to groups of heads
(n_groups of them, each shared by heads / n_groups consecutive heads). The output goes through
an RMSNorm over each group's channels after the gate (x * SiLU(z), then the norm: transformers'
and the reference kernels' order), then the output projection.

State lives in the engine's slots (engine/recurrent_state.py), addressed through the forward
context as Gated DeltaNet's is (engine/layers/gated_delta.py, whose convolution helpers this
shares): the step's one-token rows first, batched through one recurrent update each
(AttentionMetadata.state_slots), then each prompt chunk (state_spans), computed in blocks of
CHUNK tokens with the state-space dual form (within a block a masked matmul, between blocks the
state carried), from the state its previous chunk left. Tensor parallelism splits the heads
across ranks; a rank holds the B and C groups its heads read (a group shared by several ranks is
held by each), and where one norm group spans ranks its sum of squares is all-reduced.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.kernels import cpu_fused
from pdserve.engine.layers.gated_delta import conv_span, conv_step, keep_state
from pdserve.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from pdserve.engine.parallel import all_reduce, divide, tp_rank, tp_size
from pdserve.engine.recurrent_state import StateLayout

CHUNK = 64  # tokens per block of the dual form (the result does not depend on it)
# a log-decay below which a term is dropped: as gated_delta's _FAR (exp(-60) ~ 1e-26)
_FAR = 60.0


def rank_groups(groups: int, heads: int) -> tuple[int, int]:
    """(first group, groups held) of this rank's heads: its share where the groups split evenly
    across ranks, or the single group every rank reads."""
    n, r = tp_size(), tp_rank()
    if heads % groups:
        raise ValueError(f"the {heads} Mamba heads do not split into {groups} groups")
    if groups % n == 0:
        return r * (groups // n), groups // n
    if groups == 1:  # (Granite 4.0-H's, Bamba's: every rank holds it)
        return 0, 1
    raise ValueError(
        f"{groups} Mamba groups cannot be split across {n} tensor-parallel ranks: use a "
        f"tensor-parallel size that divides {groups}, or 1"
    )


class Mamba2Mixer(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        *,
        heads: int,
        head_dim: int,
        state_size: int,
        groups: int,
        kernel: int,
        state_index: int,
        eps: float,
        conv_bias: bool = True,
        proj_bias: bool = False,
        out_bias: bool | None = None,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        norm: str = "after_gate",
    ):
        """state_index: this layer's place among the model's recurrent layers (its tensors in
        RecurrentStates); out_bias: the output projection's bias (None: proj_bias); dt_limit:
        the time step's clamp on prompt chunks (transformers and the reference kernels apply it
        there only, not on one-token steps); norm: the group norm after the gate ("after_gate":
        Granite's, Nemotron-H's), before it ("before_gate") or none, the gate alone ("none":
        Falcon-H1's choices)."""
        super().__init__()
        n = tp_size()
        self.state_index = state_index
        self.heads = divide(heads, n, "the Mamba heads")
        self.head_dim, self.state_size, self.kernel = head_dim, state_size, kernel
        self.group0, self.groups = rank_groups(groups, heads)
        self.groups_total, self.heads_total = groups, heads
        self.inner_total = heads * head_dim
        inner, bc = self.heads * head_dim, self.groups * state_size
        # [z, x, B, C, dt] of this rank (the checkpoint's in_proj rows picked by _load_in_proj)
        self.sizes = [inner, inner, bc, bc, self.heads]
        self.in_proj = ColumnParallelLinear(hidden_size, sum(self.sizes) * n, bias=proj_bias)
        for p in (self.in_proj.weight, self.in_proj.bias):
            if p is not None:
                p.weight_loader = self._load_in_proj
        channels = inner + 2 * bc
        self.conv_weight = nn.Parameter(torch.zeros(channels, kernel), requires_grad=False)
        self.conv_bias = (
            nn.Parameter(torch.zeros(channels), requires_grad=False) if conv_bias else None
        )
        for p in (self.conv_weight, self.conv_bias):
            if p is not None:
                p.weight_loader = self._load_conv
        self.A_log = nn.Parameter(torch.zeros(self.heads), requires_grad=False)
        self.D = nn.Parameter(torch.zeros(self.heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.heads), requires_grad=False)
        if norm not in ("after_gate", "before_gate", "none"):
            raise ValueError(f"norm must be after_gate, before_gate or none, got {norm!r}")
        self.norm = norm
        self.norm_weight = None
        if norm != "none":
            self.norm_weight = nn.Parameter(torch.ones(inner), requires_grad=False)
        for p in (self.A_log, self.D, self.dt_bias, self.norm_weight):
            if p is not None:
                p.weight_loader = _load_rank_rows
        self.eps = eps
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        out_bias = proj_bias if out_bias is None else out_bias
        self.out_proj = RowParallelLinear(self.inner_total, hidden_size, bias=out_bias)

    @staticmethod
    def state_layout(*, heads, head_dim, state_size, groups, kernel) -> StateLayout:
        """One Mamba2 layer's state and its parts: the conv's x channels (split by heads) and
        its B and C groups (split by group, or one group every rank holds), the scan's
        [heads, head dim, state] split by heads."""
        divide(heads, tp_size(), "the Mamba heads")
        rank_groups(groups, heads)  # (raises where the groups cannot be split)
        bc = (groups * state_size, groups == 1)
        return StateLayout(
            kernel - 1,
            ((heads * head_dim, False), bc, bc),
            ((heads, False),),
            (head_dim, state_size),
        )

    # -- loading: the checkpoint's whole-model tensors, this rank's rows of each part

    def _parts(self, loaded: torch.Tensor, with_gate: bool) -> list[torch.Tensor]:
        """This rank's rows of [z,] x, B, C[, dt] from the whole model's (in_proj's rows or the
        conv's channels, which lack z and dt)."""
        n, r = tp_size(), tp_rank()
        inner, bc_total = self.inner_total, self.groups_total * self.state_size
        sizes = [inner, inner, bc_total, bc_total, self.heads_total]
        if not with_gate:
            sizes = sizes[1:4]
        whole = loaded.split(sizes, dim=0)
        if with_gate:
            z, x, b, c, dt = whole
        else:
            x, b, c = whole
        local = inner // n
        first, held = self.group0 * self.state_size, self.groups * self.state_size
        x = x.narrow(0, r * local, local)
        b, c = b.narrow(0, first, held), c.narrow(0, first, held)
        if not with_gate:
            return [x, b, c]
        heads = self.heads
        return [z.narrow(0, r * local, local), x, b, c, dt.narrow(0, r * heads, heads)]

    def _load_in_proj(self, param, loaded, shard_id=None) -> None:
        param.data.copy_(torch.cat(self._parts(loaded, with_gate=True)))

    def _load_conv(self, param, loaded, shard_id=None) -> None:
        """conv1d.weight [channels, 1, K] (or its bias [channels]): this rank's x, B and C."""
        parts = self._parts(loaded.reshape(loaded.shape[0], -1), with_gate=False)
        param.data.copy_(torch.cat(parts).reshape(param.shape))

    # -- the forward pass

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        conv = meta.states.conv[self.state_index]
        ssm = meta.states.ssm[self.state_index]
        inner, bc = self.sizes[0], self.sizes[2]
        z, xbc, dt = self.in_proj(x).split([inner, inner + 2 * bc, self.heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        a = -self.A_log.float().exp()
        y = torch.empty(x.shape[0], self.heads, self.head_dim, device=x.device)
        w, bias = self.conv_weight, self.conv_bias
        nd = 0 if meta.state_slots is None else meta.state_slots.numel()
        if nd:
            slots = meta.state_slots
            xs, b, c = self._split(conv_step(xbc[:nd], conv, slots, w, bias))
            y[:nd] = _ssm_step(xs, dt[:nd], a, b, c, self.D, ssm, slots)
        low, high = self.dt_limit
        for start, length, slot, keep in meta.state_spans:
            rows = slice(start, start + length)
            xs, b, c = self._split(conv_span(xbc[rows], conv, slot, w, bias))
            dts = dt[rows].clamp(low, high)
            y[rows] = _ssm_chunked(xs, dts, a, b, c, self.D, ssm, slot)
            if keep >= 0:
                keep_state(conv, ssm, slot, keep)
        return self.out_proj(self._gated_norm(y.view(x.shape[0], -1), z))

    def _split(self, xbc: torch.Tensor):
        """Convolved rows [T, channels] -> x [T, heads, head_dim], B and C [T, groups, state],
        float32."""
        inner, bc = self.sizes[0], self.sizes[2]
        xs, b, c = xbc.float().split([inner, bc, bc], dim=-1)
        shape = (-1, self.groups, self.state_size)
        return xs.view(-1, self.heads, self.head_dim), b.view(shape), c.view(shape)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y * SiLU(z), then RMSNorm over each group's channels (a group spread over ranks: its
        sum of squares all-reduced), times the weight; in z's dtype. (The norm before the gate,
        or none, where the layer says so.)"""
        dtype = z.dtype
        if self.norm == "none":
            return (y * F.silu(z.float())).to(dtype)
        if self.norm == "before_gate":
            return (self._grouped_norm(y, torch.float32) * F.silu(z.float())).to(dtype)
        return self._grouped_norm(y * F.silu(z.float()), dtype)

    def _grouped_norm(self, x: torch.Tensor, dtype) -> torch.Tensor:
        """RMSNorm of x over each group's channels, times the weight, in `dtype`."""
        group = self.inner_total // self.groups_total  # a norm group's channels, whole model
        local = x.shape[-1]
        if group <= local:
            rows = x.view(x.shape[0], -1, group)
            normed = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + self.eps)
        else:  # (the single group, spread over every rank)
            squares = all_reduce(x.pow(2).sum(-1, keepdim=True))
            normed = x * torch.rsqrt(squares / group + self.eps)
        normed = normed.reshape(x.shape).to(dtype)
        return self.norm_weight.to(dtype) * normed


def _load_rank_rows(param, loaded, shard_id=None) -> None:
    """A per-head (or per-channel) vector: this rank's rows."""
    n = param.shape[0]
    param.data.copy_(loaded.float().narrow(0, tp_rank() * n, n))


def _heads_of(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., groups, state] -> [..., heads, state]: each group's row for each of its heads."""
    per = heads // t.shape[-2]
    return t if per == 1 else t.repeat_interleave(per, dim=-2)


def _ssm_step(x, dt, a, b, c, d, ssm: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token per sequence: x [B, H, P], dt [B, H], b and c [B, G, N]; the states
    ssm[slots] [B, H, P, N] are updated in place. Returns y [B, H, P] (with D * x). On CPU the
    compiled kernel updates each state where it lies, in one pass (fused_cpu.cpp mamba2_step_);
    the torch path gathers, updates and scatters them."""
    fused = cpu_fused() if ssm.device.type == "cpu" else None
    if fused is None:
        return _ssm_step_torch(x, dt, a, b, c, d, ssm, slots)
    y = torch.empty_like(x)
    args = (t.float().contiguous() for t in (x, dt, a, b, c, d))
    fused.mamba2_step_(ssm, slots, *args, y)
    return y


def _ssm_step_torch(x, dt, a, b, c, d, ssm, slots) -> torch.Tensor:
    heads = x.shape[1]
    b, c = _heads_of(b, heads), _heads_of(c, heads)
    s = ssm.index_select(0, slots) * (dt * a).exp()[..., None, None]
    s += (x * dt[..., None]).unsqueeze(-1) * b.unsqueeze(-2)
    ssm.index_copy_(0, slots, s)
    return (s @ c.unsqueeze(-1)).squeeze(-1) + x * d.float()[:, None]


def _decayed(log_decay: torch.Tensor) -> torch.Tensor:
    return log_decay.exp().masked_fill_(log_decay < -_FAR, 0.0)


def _ssm_chunked(x, dt, a, b, c, d, ssm: torch.Tensor, slot: int) -> torch.Tensor:
    """One sequence's L tokens (x [L, H, P], dt [L, H], b and c [L, G, N]) from ssm[slot],
    which is left holding the state after the last token. Blocks of CHUNK tokens: within a
    block, each output is the block's earlier inputs weighted by C.B and the decay between them
    (a masked matmul), plus the state the block started from read through C and decayed; the
    state is carried from one block to the next. Returns [L, H, P] (with D * x)."""
    length, heads = x.shape[0], x.shape[1]
    pad = (-length) % CHUNK
    xdt = x * dt.unsqueeze(-1)
    log = dt * a  # [L, H]: each token's log-decay
    # [H, blocks, CHUNK, ...], heads first; the padding's decay 0 and input 0
    xdt = F.pad(xdt, (0, 0, 0, 0, 0, pad)).transpose(0, 1)
    b = F.pad(_heads_of(b, heads), (0, 0, 0, 0, 0, pad)).transpose(0, 1)
    c = F.pad(_heads_of(c, heads), (0, 0, 0, 0, 0, pad)).transpose(0, 1)
    log = F.pad(log, (0, 0, 0, pad)).transpose(0, 1)
    xdt, b, c = (t.reshape(heads, -1, CHUNK, t.shape[-1]) for t in (xdt, b, c))
    decay = log.reshape(heads, -1, CHUNK).cumsum(-1)  # from the block's start through each token
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=x.device).tril()
    between = _decayed((decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, -math.inf))
    inner = (c @ b.transpose(-1, -2)) * between  # [H, blocks, CHUNK, CHUNK]
    c_decayed = c * _decayed(decay).unsqueeze(-1)
    x_to_end = xdt * _decayed(decay[..., -1:] - decay).unsqueeze(-1)
    block_decay = _decayed(decay[..., -1])[..., None, None]
    state = ssm[slot]  # [H, P, N]
    out = torch.empty_like(xdt)
    for i in range(xdt.shape[1]):
        out[:, i] = inner[:, i] @ xdt[:, i] + c_decayed[:, i] @ state.transpose(-1, -2)
        state = state * block_decay[:, i] + x_to_end[:, i].transpose(-1, -2) @ b[:, i]
    ssm[slot].copy_(state)
    y = out.reshape(heads, -1, out.shape[-1])[:, :length].transpose(0, 1)
    return y + x * d.float()[:, None]
