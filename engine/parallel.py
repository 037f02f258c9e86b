"""Tensor- and pipeline-parallel process state.

With tp=1 there is no process group and every collective is the identity, so the model code is
the same in both cases and the collective stays visible at the call site.

Pipeline parallelism (pp > 1) splits the decoder's layers into pp contiguous stages
(`stage_layers`), each run by tp ranks: global rank = stage * tp + tp rank. A rank's `group` is
its stage's TP group, so the model's collectives stay inside the stage; `world` holds every rank
of the engine, for the start-up choices every rank must agree on (`agree`) and for the
activations a stage hands to the next (`pp_send`, `pp_recv`: each TP rank to the rank of the
same TP index in the neighbouring stage). With pp = 1, world is the TP group.

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
    rank: int = 0  # within the stage's TP group
    size: int = 1  # of the stage's TP group
    group: object | None = None  # the stage's TP group (None: size 1)
    pp_rank: int = 0  # this rank's pipeline stage
    pp_size: int = 1
    # every rank of the engine, on gloo (start-up agreement; None: the TP group is all of it)
    world: object | None = None

    @property
    def world_rank(self) -> int:
        return self.pp_rank * self.size + self.rank

    @property
    def world_size(self) -> int:
        return self.pp_size * self.size


_DEFAULT = TPState()
_local = threading.local()


def current_tp_state() -> TPState:
    return getattr(_local, "state", _DEFAULT)


def set_tp_state(rank: int, size: int, group=None, pp_rank: int = 0, pp_size: int = 1, world=None):
    """For this thread (a follower's main thread, or the thread building a rank-0 engine)."""
    _local.state = TPState(rank, size, group, pp_rank, pp_size, world)


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


def pp_rank() -> int:
    return current_tp_state().pp_rank


def pp_size() -> int:
    return current_tp_state().pp_size


def is_first_rank() -> bool:
    """Global rank 0: the rank that schedules, samples and judges."""
    state = current_tp_state()
    return state.rank == 0 and state.pp_rank == 0


def stage_layers(num_layers: int, stage: int | None = None, stages: int | None = None):
    """(first, end) of the decoder layers pipeline stage `stage` of `stages` runs (this rank's by
    default): contiguous ranges as even as they go, the later stages taking one more layer each
    when pp does not divide the layers (the first stage also embeds and runs the LM head)."""
    state = current_tp_state()
    stage = state.pp_rank if stage is None else stage
    stages = state.pp_size if stages is None else stages
    if not 1 <= stages <= max(num_layers, 1):  # (one stage of no KV layer: Mamba2's cache)
        raise ValueError(
            f"pipeline_parallel_size={stages} needs 1 to {num_layers} stages: the model has "
            f"{num_layers} decoder layers and every stage runs at least one"
        )
    base, extra = divmod(num_layers, stages)
    first = stage * base + max(0, stage - (stages - extra))
    return first, first + base + (1 if stage >= stages - extra else 0)


def max_stage_layers(num_layers: int) -> int:
    """The most layers any stage holds (every rank sizes its KV blocks by it, so all ranks have
    the same number of blocks)."""
    stages = current_tp_state().pp_size
    return -(-num_layers // stages)


def _world_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """A sum over every rank of the engine (the TP group when pp = 1)."""
    state = current_tp_state()
    if state.pp_size == 1:
        return all_reduce(x)
    dist.all_reduce(x, group=state.world)
    return x


def agree(flag_on_rank0: bool) -> bool:
    """Rank 0's verdict, on every rank (a start-up choice that rank 0 judges)."""
    state = current_tp_state()
    if state.world_size == 1:
        return bool(flag_on_rank0)
    t = torch.tensor([1.0 if (flag_on_rank0 and is_first_rank()) else 0.0])
    return bool(_world_all_reduce(t).item() > 0)


def from_rank0(values: list[int]) -> list[int]:
    """Rank 0's integers on every rank (the others contribute zeros to a float32 sum: integers
    below 2**24 are exact)."""
    state = current_tp_state()
    if state.world_size == 1:
        return list(values)
    t = torch.tensor(values if is_first_rank() else [0] * len(values), dtype=torch.float32)
    return [int(v) for v in _world_all_reduce(t).tolist()]


def _peer(stage: int) -> int:
    state = current_tp_state()
    return stage * state.size + state.rank


def pp_send(tensors: list[torch.Tensor], stage: int) -> None:
    """Hands `tensors` to the rank of this TP index in pipeline stage `stage`."""
    dst, group = _peer(stage), dist.group.WORLD  # (nccl between GPUs, else gloo)
    for t in tensors:
        t = t.contiguous()
        if _through_host(t, group):
            t = t.cpu()
        dist.send(t, dst=dst, group=group)


def pp_recv(shapes: list[tuple[int, ...]], dtype, device, stage: int) -> list[torch.Tensor]:
    """What pp_send in stage `stage` handed this rank: tensors of `shapes`."""
    src, group = _peer(stage), dist.group.WORLD
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        buf = t.cpu() if _through_host(t, group) else t
        dist.recv(buf, src=src, group=group)
        out.append(buf.to(device) if buf is not t else t)
    return out


class PendingSend:
    """pp_isend's handle: `wait` returns once the tensors have gone (they stay referenced until
    then, so their memory is not reused under the transfer)."""

    def __init__(self, works: list, keep: list[torch.Tensor]):
        self._works, self._keep = works, keep

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works, self._keep = [], []


class PendingRecv:
    """pp_irecv's handle: `wait` returns the tensors, on the device asked for."""

    def __init__(self, works: list, bufs: list[torch.Tensor], device):
        self._works, self._bufs, self._device = works, bufs, device

    def wait(self) -> list[torch.Tensor]:
        for w in self._works:
            w.wait()
        return [b.to(self._device) for b in self._bufs]


def pp_isend(tensors: list[torch.Tensor], stage: int) -> PendingSend:
    """pp_send without waiting: the caller computes on while the tensors travel (micro-batches
    in a pipeline, engine/model_runner.py), and waits on the handle before it returns."""
    dst, group = _peer(stage), dist.group.WORLD
    works, keep = [], []
    for t in tensors:
        t = t.contiguous()
        if _through_host(t, group):
            t = t.cpu()
        keep.append(t)
        works.append(dist.isend(t, dst=dst, group=group))
    return PendingSend(works, keep)


def pp_irecv(shapes: list[tuple[int, ...]], dtype, device, stage: int) -> PendingRecv:
    """pp_recv posted ahead: messages from one stage arrive in the order they were sent."""
    src, group = _peer(stage), dist.group.WORLD
    works, bufs = [], []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        buf = t.cpu() if _through_host(t, group) else t
        bufs.append(buf)
        works.append(dist.irecv(buf, src=src, group=group))
    return PendingRecv(works, bufs, device)


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
