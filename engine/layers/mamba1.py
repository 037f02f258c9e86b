"""Mamba (the first): the selective state-space mixer of Mamba and Falcon Mamba, over per-sequence
state.

One projection gives a token's x and gate z over the inner width; x goes through a causal
depthwise convolution and SiLU, then x_proj reads from it a low-rank time step, B and C (Falcon
Mamba RMS-normalizes the three, without weights), and dt_proj widens the time step to one per
channel: dt = softplus(dt_proj(low) + bias). Each channel's state is a vector of state_size
values that decays by exp(dt * A[channel]) (A = -exp(A_log), a row a channel, unlike Mamba2's one
scalar a head) and takes dt * x * B; the channel's output reads state . C, plus D * x, times
SiLU(z), then the output projection.

The decay differs per (channel, state) value, so no block form turns a prompt into matmuls: every
token is one recurrent update, batched over channels. On CPU the compiled kernel runs a step's
rows in order, each against its sequence's slot (fused_cpu.cpp mamba1_scan_: a prompt chunk's
rows share a slot, a decode row has its own), its channels split across the threads; the torch
path loops over tokens. The state (the conv's last inputs and [inner, state_size]) lives in the
engine's slots (engine/recurrent_state.py). Tensor parallelism splits the inner channels: x_proj
is row-parallel (its low-rank output summed across ranks), dt_proj column-parallel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.kernels import cpu_fused
from pdserve.engine.layers.gated_delta import conv_span, conv_step
from pdserve.engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pdserve.engine.parallel import divide, tp_rank, tp_size
from pdserve.engine.recurrent_state import StateLayout


class Mamba1Mixer(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        *,
        inner: int,
        state_size: int,
        rank: int,
        kernel: int,
        state_index: int,
        conv_bias: bool = True,
        proj_bias: bool = False,
        bcdt_eps: float | None = None,
        bcdt_weights: bool = False,
    ):
        """state_index: this layer's place among the recurrent layers; bcdt_eps: the RMSNorm of
        B, C and the low-rank time step (None: none), Falcon Mamba's weightless, Jamba's with
        weights (bcdt_weights)."""
        super().__init__()
        self.state_index = state_index
        self.inner = divide(inner, tp_size(), "the Mamba inner channels")
        self.state_size, self.rank, self.kernel = state_size, rank, kernel
        self.bcdt_eps = bcdt_eps
        self.in_proj = MergedColumnParallelLinear(hidden_size, [inner, inner], bias=proj_bias)
        for p in (self.in_proj.weight, self.in_proj.bias):
            if p is not None:  # (the checkpoint's one in_proj: x's rows, then z's)
                p.weight_loader = self._load_in_proj
        self.conv_weight = nn.Parameter(torch.zeros(self.inner, kernel), requires_grad=False)
        self.conv_bias = (
            nn.Parameter(torch.zeros(self.inner), requires_grad=False) if conv_bias else None
        )
        self.x_proj = RowParallelLinear(inner, rank + 2 * state_size, bias=False)
        self.dt_proj = ColumnParallelLinear(rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.inner, state_size), requires_grad=False)
        self.D = nn.Parameter(torch.zeros(self.inner), requires_grad=False)
        for p in (self.conv_weight, self.conv_bias, self.A_log, self.D):
            if p is not None:
                p.weight_loader = _load_rank_rows
        self.out_proj = RowParallelLinear(inner, hidden_size, bias=proj_bias)
        self.dt_norm = self.b_norm = self.c_norm = None
        if bcdt_weights:  # (replicated: every rank reads the whole low-rank output)
            self.dt_norm = nn.Parameter(torch.ones(rank), requires_grad=False)
            self.b_norm = nn.Parameter(torch.ones(state_size), requires_grad=False)
            self.c_norm = nn.Parameter(torch.ones(state_size), requires_grad=False)

    def _load_in_proj(self, param, loaded, shard_id=None) -> None:
        for shard, rows in enumerate(loaded.chunk(2, dim=0)):
            MergedColumnParallelLinear.weight_loader(self.in_proj, param, rows, shard)

    @staticmethod
    def state_layout(*, inner: int, state_size: int, kernel: int) -> StateLayout:
        """One layer's state: the conv's channels and the scan's [channels, state], both split
        by channel."""
        divide(inner, tp_size(), "the Mamba inner channels")
        return StateLayout(kernel - 1, ((inner, False),), ((inner, False),), (state_size,))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        conv = meta.states.conv[self.state_index]
        ssm = meta.states.ssm[self.state_index]
        xs, z = self.in_proj(x).split([self.inner, self.inner], dim=-1)
        conved = torch.empty_like(xs)
        w, bias = self.conv_weight, self.conv_bias
        nd = 0 if meta.state_slots is None else meta.state_slots.numel()
        rows = []  # each row's slot, in row order
        if nd:
            conved[:nd] = conv_step(xs[:nd], conv, meta.state_slots, w, bias)
            rows.append(meta.state_slots)
        keeps = []  # (row after which, slot, keep): states the prefix cache keeps
        for start, length, slot, keep in meta.state_spans:
            span = slice(start, start + length)
            conved[span] = conv_span(xs[span], conv, slot, w, bias)
            rows.append(torch.full((length,), slot, dtype=torch.long))
            if keep >= 0:  # (the conv's now; the matrix's once the scan reaches that row)
                conv[keep].copy_(conv[slot])
                keeps.append((start + length, slot, keep))
        dt, b, c = self._ssm_inputs(conved)
        y = torch.empty(x.shape[0], self.inner, dtype=torch.float32, device=x.device)
        slots = torch.cat(rows).to(x.device)
        a = -self.A_log.float().exp()
        cuts = [0] + [end for end, _, _ in keeps] + [x.shape[0]]
        for i in range(len(cuts) - 1):  # (up to each kept state, then it is copied)
            part = slice(cuts[i], cuts[i + 1])
            y[part] = _scan(
                conved[part].float(), dt[part], a, b[part], c[part], self.D, ssm, slots[part]
            )
            if i < len(keeps):
                _, slot, keep = keeps[i]
                ssm[keep].copy_(ssm[slot])
        y = y * F.silu(z.float())
        return self.out_proj(y.to(x.dtype))

    def _ssm_inputs(self, conved: torch.Tensor):
        """dt [T, inner] (softplus'd), B and C [T, state_size], float32."""
        low, b, c = (
            self.x_proj(conved).float().split([self.rank, self.state_size, self.state_size], dim=-1)
        )
        if self.bcdt_eps is not None:
            low, b, c = (_weightless_rms(t, self.bcdt_eps) for t in (low, b, c))
            if self.dt_norm is not None:
                low, b, c = low * self.dt_norm, b * self.b_norm, c * self.c_norm
        dt = F.softplus(self.dt_proj(low.to(conved.dtype)).float())
        return dt, b.contiguous(), c.contiguous()


def _weightless_rms(t: torch.Tensor, eps: float) -> torch.Tensor:
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)


def _load_rank_rows(param, loaded, shard_id=None) -> None:
    """A per-channel tensor (the conv's [channels, 1, K] too): this rank's rows."""
    n = param.shape[0]
    loaded = loaded.reshape(loaded.shape[0], *param.shape[1:])
    param.data.copy_(loaded[tp_rank() * n : (tp_rank() + 1) * n])


def _scan(x, dt, a, b, c, d, ssm: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows in order (x and dt [T, inner], b and c [T, state]), each one recurrent update of its
    slot's state ssm[slots[t]] [inner, state], in place. Returns y [T, inner] (with D * x)."""
    fused = cpu_fused() if ssm.device.type == "cpu" else None
    if fused is None:
        return _scan_torch(x, dt, a, b, c, d, ssm, slots)
    y = torch.empty_like(x)
    args = (t.float().contiguous() for t in (x, dt, a, b, c, d))
    fused.mamba1_scan_(ssm, slots.contiguous(), *args, y)
    return y


def _scan_torch(x, dt, a, b, c, d, ssm, slots) -> torch.Tensor:
    y = torch.empty_like(x)
    for t in range(x.shape[0]):
        s = int(slots[t])
        h = ssm[s] * (dt[t, :, None] * a).exp() + (dt[t] * x[t])[:, None] * b[t]
        ssm[s].copy_(h)
        y[t] = h @ c[t] + d.float() * x[t]
    return y
