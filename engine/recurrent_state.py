"""Per-sequence recurrent state of a hybrid model's linear-attention layers, in numbered slots.

A hybrid model (Qwen3.5, Qwen3-Next) keeps paged KV for its full-attention layers only; each of
its linear-attention layers (engine/layers/gated_delta.py) carries a fixed-size state per
sequence instead: the last kernel - 1 inputs of its causal convolution and the gated delta rule's
matrix per value head. That state does not grow with the context, is not cut into blocks and
cannot be shared by prefix: a sequence holds one slot of it from admission to finish.

Lifecycle. The model runner builds one `RecurrentStates` beside the KV cache (its bytes come out
of kv_cache_memory first: `bytes_for`), with a slot per sequence the engine may run at once. The
scheduler hands out slot numbers (`SlotPool`: a sequence takes one when it is admitted or
reserved, gives it back when it finishes or is preempted, and a fork takes its own with a copy of
its parent's). Each step the runner zeroes the slots of sequences that start at position 0
(`reset`), makes the step's copies (`copy`), and the layers read and write their sequences' slots
in place through the forward context (AttentionMetadata.states, .state_slots, .state_spans).
"""

from __future__ import annotations

import torch


class NoFreeSlots(RuntimeError):
    """Every recurrent-state slot is held: admit nothing more until one is given back."""


class SlotPool:
    """The scheduler's accounting of slot numbers (no tensors): a free list."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # (pop() hands out 0 first)
        # free slots not to hand out now: the sources of copies the next step makes (a
        # reservation's slot is written by another engine before that step runs)
        self.avoid: set[int] = set()

    @property
    def num_free(self) -> int:
        return sum(1 for s in self._free if s not in self.avoid)

    def take(self) -> int:
        for i in range(len(self._free) - 1, -1, -1):
            if self._free[i] not in self.avoid:
                return self._free.pop(i)
        raise NoFreeSlots(f"all {self.num_slots} recurrent-state slots are held")

    def give_back(self, slot: int) -> None:
        if slot >= 0:
            self._free.append(slot)


class RecurrentStates:
    """The state tensors: per linear-attention layer, conv [slots, kernel - 1, channels] and
    ssm [slots, value heads, key dim, value dim], float32 whatever the activations' dtype (the
    rule's arithmetic is float32, as transformers' and the FLA kernels' is)."""

    def __init__(self, shapes: list[tuple[tuple, tuple]], num_slots: int, device):
        self.num_slots = num_slots
        self.conv = [torch.zeros((num_slots, *c), device=device) for c, _ in shapes]
        self.ssm = [torch.zeros((num_slots, *s), device=device) for _, s in shapes]

    @staticmethod
    def bytes_for(shapes: list[tuple[tuple, tuple]], num_slots: int) -> int:
        per_slot = sum(_numel(c) + _numel(s) for c, s in shapes)
        return per_slot * num_slots * 4

    def reset(self, slots: list[int]) -> None:
        """Zeroes `slots` (sequences whose first chunk runs this step)."""
        if not slots:
            return
        index = torch.tensor(slots, device=self.conv[0].device)
        for t in (*self.conv, *self.ssm):
            t.index_fill_(0, index, 0.0)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copies slot src into slot dst for each (src, dst): a forked sequence's start."""
        for src, dst in pairs:
            for t in (*self.conv, *self.ssm):
                t[dst].copy_(t[src])

    def views(self, slot: int) -> list[list[torch.Tensor]]:
        """`slot`'s state, per linear-attention layer [conv, ssm] (views: what a hand-off
        reads on one side and writes on the other)."""
        return [[c[slot], s[slot]] for c, s in zip(self.conv, self.ssm)]


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
