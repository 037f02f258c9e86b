"""Tensor-parallel process state.

With tp=1 there is no process group and every collective is the identity, so the model code is
the same in both cases and the collective stays visible at the call site.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    size: int = 1
    group: object | None = None


_state = TPState()


def set_tp_state(rank: int, size: int, group=None) -> None:
    global _state
    _state = TPState(rank, size, group)


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _state.size > 1:
        dist.all_reduce(x, group=_state.group)
    return x


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate each rank's shard along `dim` on rank 0; other ranks get None."""
    if _state.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_state.size)] if _state.rank == 0 else None
    dist.gather(x, parts, dst=0, group=_state.group)
    return torch.cat(parts, dim=dim) if _state.rank == 0 else None


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"tensor_parallel_size={denominator} must divide {what} ({numerator}); "
            f"choose a tensor_parallel_size that divides {numerator}")
    return numerator // denominator
