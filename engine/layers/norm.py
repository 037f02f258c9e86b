"""RMSNorm, the normalization of every supported model family, with its residual add fused.

A Llama decoder layer holds two (a Gemma one four, as GemmaRMSNorm), the model one more. A layer
passes the residual stream alongside the hidden states: `forward(x, residual)` adds it (when
there is one), keeps the sum as the next residual and normalizes it, in one call of the compiled
CPU kernel where it applies (float32 rows), on CUDA in one Triton launch (kernels/fused_triton.py),
else in torch. The arithmetic is float32 whatever
the activations' dtype, as Hugging Face's Llama computes it, so outputs match the reference
model.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.kernels import fused_for, fused_triton


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
        triton_fused = fused_triton.for_tensor(x)  # None on CPU: CUDA only (kernels/fused_triton)
        if triton_fused is not None:
            done = triton_fused.add_rms_norm(
                x, residual, self.weight, self.eps, lambda: self._torch_forward(x, residual)
            )
            if done is not None:
                return done
        fused = fused_for(x) if x.dim() == 2 and self.weight.dtype == torch.float32 else None
        if fused is not None:  # one call; the residual sum is written in place
            out, residual = fused.add_rms_norm(x, residual, self.weight, self.eps)
            return out, residual
        return self._torch_forward(x, residual)

    def _torch_forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            return self._norm(x), x
        residual = x + residual
        return self._norm(residual), residual


class LayerNorm(nn.Module):
    """A LayerNorm (the mean taken out, in float32; a weight and, where the family has one, a
    bias: StarCoder2's, not Cohere's) with RMSNorm's interface: (x, residual) in, (the
    normalized sum, the sum) out."""

    def __init__(self, hidden_size: int, eps: float, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        f = x.float()
        centred = f - f.mean(-1, keepdim=True)
        normed = self.weight.float() * (
            centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        )
        if self.bias is not None:
            normed = normed + self.bias.float()
        return normed.to(x.dtype), x
