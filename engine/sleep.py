"""Sleep mode: an idle engine gives its memory back to the machine and takes it again, as vLLM's
`LLM.sleep(level)` / `LLM.wake_up(tags)` do, for a reinforcement-learning trainer that shares the
host with the server between rollouts (the cluster's /sleep and /wake_up: router/sleep.py).

What each level frees, on a CPU engine. Level 1: the KV cache (every rank's pool: its pages are
dropped and read as zeros afterwards, the tensors and every mapping of them, the shm backend's in
other processes too, stay valid), every cached prefix block and the host and disk tiers' entries;
the weights stay where they are, since on a CPU they already live in host memory (vLLM's level 1
copies them there). Level 2: the weights too, every rank's (each parameter's storage and every
linear's packed forms), to be loaded again: by a weight update while asleep
(LLMEngine.update_weights, receive_weights), or else from the served checkpoint when the last tag
wakes. Tags wake apart, vLLM's "weights" and "kv_cache": waking "kv_cache" takes the pools' memory
back now (zeroed, as at the start), so a full /dev/shm is an error here and not a SIGBUS on a
request's first write. The engine (engine_core.py) keeps the state and the checks; this module
holds what each rank does to its own runner (ModelInput.memory_op) and the operations' names.
CUDA engines refuse levels 1-2: releasing device memory and taking it back under CUDA graphs is
not written (nothing here has run on a GPU).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from pdserve.engine.layers.linear import LinearBase
from pdserve.kvpool import refill_pool, release_pool

log = logging.getLogger(__name__)

LEVELS = (1, 2)
TAGS = ("weights", "kv_cache")
SLEEP, WAKE_KV = "sleep", "wake_kv"  # ModelInput.memory_op's kinds: [SLEEP, level], [WAKE_KV]


def apply(runner, op: list) -> None:
    """One rank's part of a sleep or a wake (ModelInput.memory_op)."""
    kind = op[0]
    if kind == SLEEP:
        release_kv(runner)
        if op[1] >= 2:
            release_weights(runner)
        trim_heap()
    elif kind == WAKE_KV:
        refill_kv(runner)
    else:
        raise ValueError(f"unknown memory_op {kind!r}")


def release_kv(runner) -> int:
    """Drops this rank's KV pool's pages (bytes dropped); a pool not allocated yet has none."""
    if runner.kv_cache is None:
        return 0
    return release_pool(runner.kv_cache, shared=runner.kv_cache_path is not None)


def refill_kv(runner) -> None:
    """Takes this rank's pool's memory again, zeroed (kvpool.refill_pool; PoolSpaceError where
    a full /dev/shm cannot give it)."""
    if runner.kv_cache is not None:
        refill_pool(runner.kv_cache, shared=runner.kv_cache_path is not None)


def release_weights(runner) -> int:
    """Drops this rank's weights: every parameter's storage (its shape kept in
    runner.released_weights for `restore_weights`) and every linear's packed or quantized forms
    (LinearBase.release), and the compiled decode stack that holds them. The model's buffers
    (rotary tables) stay. Returns the bytes of the parameters dropped."""
    if getattr(runner, "released_weights", None):
        return 0  # dropped already
    kept: list[tuple[torch.nn.Parameter, tuple[int, ...]]] = []
    for p in runner.model.parameters():  # (a tied head's weight once: it is the embedding's)
        if p.numel():
            kept.append((p, tuple(p.shape)))
    for module in runner.model.modules():
        if isinstance(module, LinearBase):
            module.release()
        if getattr(module, "_stack", None) is not None:
            module._stack = None  # (the decode stack holds the packed weights: llama.py)
    freed = 0
    for p, _ in kept:
        freed += p.numel() * p.element_size()
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    runner.released_weights = kept
    return freed


def restore_weights(runner) -> None:
    """Gives the parameters `release_weights` dropped their storage back for a load
    (ModelRunner._reload, which restores the linears' dense weights and packs them again),
    filled with NaN where the dtype has one: a tensor the load missed can never pass for a
    weight (freed memory handed back may still hold the old values)."""
    for p, shape in getattr(runner, "released_weights", None) or []:
        if p.numel() == 0:
            fill = float("nan") if p.dtype.is_floating_point else 0
            p.data = torch.full(shape, fill, dtype=p.dtype, device=p.device)
    runner.released_weights = None


def trim_heap() -> None:
    """Hands the C heap's free pages back to the system (glibc's malloc_trim): freed weights and
    tier entries live in the heap, which otherwise keeps them for the process's next malloc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        log.debug("no malloc_trim here: freed memory stays in the heap")


def check_tags(tags) -> tuple[str, ...]:
    """The tags to wake, each once, in TAGS' order: all of them for None; raises ValueError
    naming a tag that is not one."""
    if tags is None:
        return TAGS
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be a list of {', '.join(TAGS)}; got {tags!r:.80}")
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"tags must be among {', '.join(TAGS)}; got {unknown[0][:40]!r}")
    return tuple(t for t in TAGS if t in tags)
