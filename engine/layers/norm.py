from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.kernels import fused_for


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as HF Llama does), with an optional fused residual add."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        fused = fused_for(x) if x.dim() == 2 and self.weight.dtype == torch.float32 else None
        if fused is not None:  # one call; the residual sum is written in place
            out, residual = fused.add_rms_norm(x, residual, self.weight, self.eps)
            return out, residual
        if residual is None:
            return self._norm(x), x
        residual = x + residual
        return self._norm(residual), residual
