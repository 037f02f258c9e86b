"""Tensor-parallel process state.

With tp=1 there is no process group and every collective is the identity, so the model code is
the same in both cases and the collective stays visible at the call site.

The state is per thread: an engine sets its own around construction and every step (`tp_scope`),
so two engines in one process (a tp=1 decode worker beside a tp=2 prefill worker in a test, each
stepping on its own loop thread) never run collectives on each other's group.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    size: int = 1
    group: object | None = None


_DEFAULT = TPState()
_local = threading.local()


def current_tp_state() -> TPState:
    return getattr(_local, "state", _DEFAULT)


def set_tp_state(rank: int, size: int, group=None) -> None:
    """For this thread (a TP follower's main thread, or the thread building a rank-0 engine)."""
    _local.state = TPState(rank, size, group)


@contextlib.contextmanager
def tp_scope(state: TPState):
    previous = current_tp_state()
    _local.state = state
    try:
        yield
    finally:
        _local.state = previous


def tp_rank() -> int:
    return current_tp_state().rank


def tp_size() -> int:
    return current_tp_state().size


def agree(flag_on_rank0: bool) -> bool:
    """Rank 0's verdict, on every rank (a start-up choice that rank 0 judges)."""
    if tp_size() == 1:
        return bool(flag_on_rank0)
    t = torch.tensor([1.0 if (flag_on_rank0 and tp_rank() == 0) else 0.0])
    return bool(all_reduce(t).item() > 0)


def _through_host(x: torch.Tensor, group) -> bool:
    """A CUDA tensor on a gloo group (PDSERVE_TP_BACKEND=gloo, engine/tp.py): its collective
    runs on a host copy, since gloo's CUDA support does not cover every collective."""
    return x.is_cuda and dist.get_backend(group) == "gloo"


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    state = current_tp_state()
    if state.size > 1:
        if _through_host(x, state.group):
            host = x.float().cpu()  # (summed in float32: gloo's bf16 support varies)
            dist.all_reduce(host, group=state.group)
            x.copy_(host)
        else:
            dist.all_reduce(x, group=state.group)
    return x


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate each rank's shard along `dim` on rank 0; other ranks get None."""
    state = current_tp_state()
    if state.size == 1:
        return x
    x = x.contiguous()
    device = x.device
    if _through_host(x, state.group):
        x = x.cpu()
    parts = [torch.empty_like(x) for _ in range(state.size)] if state.rank == 0 else None
    dist.gather(x, parts, dst=0, group=state.group)
    return torch.cat(parts, dim=dim).to(device) if state.rank == 0 else None


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"tensor_parallel_size={denominator} must divide {what} ({numerator}); "
            f"choose a tensor_parallel_size that divides {numerator}"
        )
    return numerator // denominator
