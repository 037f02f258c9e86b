"""Per-sequence recurrent state of a hybrid model's recurrent layers, in numbered slots.

A hybrid model (Qwen3.5, Qwen3-Next, Granite 4.0-H, Nemotron-H, LFM2) keeps paged KV for its
attention layers only; each of its recurrent layers (Gated DeltaNet: engine/layers/gated_delta.py,
Mamba2: engine/layers/mamba2.py, LFM2's short convolutions) carries a fixed-size state per
sequence instead: the last kernel - 1 inputs of its causal convolution and a matrix per head.
That state does not grow with the context and is not cut into blocks: a sequence holds one slot
of it from admission to finish, and the prefix cache keeps whole states, after chosen blocks.

Lifecycle. The model runner builds one `RecurrentStates` beside the KV cache (its bytes come out
of kv_cache_memory first: `bytes_for`). The scheduler hands out slot numbers (`SlotPool`: a
sequence takes one when it is admitted or reserved, gives it back when it finishes or is
preempted, and a fork takes its own with a copy of its parent's); with the prefix cache on, free
slots keep the states after cached blocks until a sequence needs them (SlotPool's docstring).
Each step the runner makes the step's copies (`copy`: forks, states kept, states restored), then
zeroes the slots of sequences that start at position 0 (`reset`), and the layers read and write
their sequences' slots in place through the forward context (AttentionMetadata.states,
.state_slots, .state_spans). Under tensor parallelism each rank holds its heads' part of every
state (`StateLayout` says which), in a pool file where the engine shares its pools, and a
prompt's state crosses a P/D hand-off whole (`SlotState`): joined from the prefill ranks' parts,
cut for the decode ranks'.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from pdserve.kvpool import create_pool_file, map_pool_file

STATE_FILE_SUFFIX = "-states"  # a rank's states file: its KV pool file's name and this


class NoFreeSlots(RuntimeError):
    """Every recurrent-state slot is held: admit nothing more until one is given back."""


class SlotPool:
    """The scheduler's accounting of slot numbers (no tensors): a free list, and with the prefix
    cache on, the states it keeps in free slots.

    A kept state is the state a sequence had right after a cached block, by that block's chain
    hash (engine/block_manager.py): the scheduler copies it into a free slot when a sequence
    reaches such a block (`keep`), and out of it into a sequence admitted on that prefix
    (`kept`). As a cached KV block lies in the free queue until the allocator hands it out
    again, a kept state lies in a free slot until a sequence needs the slot: `take` hands out
    plain free slots first, then those of the least recently used kept states (so the cache
    holds what the running sequences leave idle, and never costs a sequence its slot). Tokens
    decide a state: two sequences that reach the same hash reach the same state.

    With a host tier below (engine/kv_host_tier.py), a kept state that loses its slot for want
    of room (`take`, `spare`, `claim`) or because its block leaves the KV cache (`push_out`) is
    first handed to `on_push_out(block_hash, slot)`, which copies it there; `claim` gives a
    state coming back from the tier a slot, kept again. `on_change(block_hash)` hears of every
    hash that starts or stops being kept (the block manager's KV events report where states
    are)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # (pop() hands out 0 first)
        self._kept: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, oldest first
        # free slots not to hand out now: those the next step's copies read or write (a
        # reservation's slot is written by another engine before that step runs)
        self.avoid: set[int] = set()
        self.on_push_out = None  # (block hash, slot) -> None: a host tier saves the state
        self.on_change = None  # (block hash) -> None: kept or no longer kept

    @property
    def num_free(self) -> int:
        slots = (*self._free, *self._kept.values())
        return sum(1 for s in slots if s not in self.avoid)

    @property
    def num_kept(self) -> int:
        return len(self._kept)

    def take(self) -> int:
        for i in range(len(self._free) - 1, -1, -1):
            if self._free[i] not in self.avoid:
                return self._free.pop(i)
        for block_hash, slot in self._kept.items():  # (the least recently used first)
            if slot not in self.avoid:
                del self._kept[block_hash]
                self._pushed(block_hash, slot)
                return slot
        raise NoFreeSlots(f"all {self.num_slots} recurrent-state slots are held")

    def _pushed(self, block_hash: int, slot: int) -> None:
        """A kept state left its slot: offered to the tier, then reported gone from the slots."""
        if self.on_push_out is not None:
            self.on_push_out(block_hash, slot)
        self._changed(block_hash)

    def _changed(self, block_hash: int) -> None:
        if self.on_change is not None:
            self.on_change(block_hash)

    def give_back(self, slot: int) -> None:
        if slot >= 0:
            self._free.append(slot)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._kept

    def kept(self, block_hash: int) -> int | None:
        """The slot of the state kept after `block_hash`, now the most recently used; None:
        none is kept."""
        slot = self._kept.get(block_hash)
        if slot is not None:
            self._kept.move_to_end(block_hash)
        return slot

    def keep(self, block_hash: int) -> int | None:
        """A free slot to copy the state after `block_hash` into, now kept for it (a plain free
        slot, else the least recently used kept state's); None where it is kept already, or
        every slot is held."""
        if block_hash in self._kept:
            self._kept.move_to_end(block_hash)
            return None
        slot = self.spare()
        if slot is not None:
            self._kept[block_hash] = slot
            self._changed(block_hash)
        return slot

    def spare(self) -> int | None:
        """A slot for a state the step will keep (held until `settle` or `give_back`): a
        plain free one, else the least recently used kept state's; None: every slot is held."""
        if self._free:
            return self._free.pop()
        if self._kept:
            block_hash, slot = self._kept.popitem(last=False)
            self._pushed(block_hash, slot)
            return slot
        return None

    def claim(self, block_hash: int, busy: set[int]) -> int | None:
        """A slot, now keeping the state after `block_hash`, for a state restored from a host
        tier that its caller writes at once: a plain free slot, else the least recently used
        kept state's (pushed out), never one in `busy` (those the next step's copies read or
        write: they would read or overwrite the restored bytes); None: no such slot."""
        slot = next((s for s in reversed(self._free) if s not in busy), None)
        if slot is not None:
            self._free.remove(slot)
        else:
            old = next((h for h, s in self._kept.items() if s not in busy), None)
            if old is None:
                return None
            slot = self._kept.pop(old)
            self._pushed(old, slot)
        self._kept[block_hash] = slot
        self._changed(block_hash)
        return slot

    def settle(self, block_hash: int, slot: int) -> bool:
        """`slot` (from `spare`), which the step filled, now keeps the state after
        `block_hash`; False where that state is kept already (the caller gives `slot` back)."""
        if block_hash in self._kept:
            return False
        self._kept[block_hash] = slot
        self._changed(block_hash)
        return True

    def drop(self, block_hash: int) -> None:
        """Forgets the state kept after `block_hash` (a later one of the same sequence replaces
        it, or a restore was refused); its slot is plain free again."""
        slot = self._kept.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)
            self._changed(block_hash)

    def push_out(self, block_hash: int) -> None:
        """The block `block_hash` left the KV cache: its kept state (if any) goes too, to the
        host tier where there is one (`on_push_out`); its slot is plain free again."""
        slot = self._kept.pop(block_hash, None)
        if slot is not None:
            self._pushed(block_hash, slot)
            self._free.append(slot)

    def clear(self) -> None:
        """Forgets every kept state (the prefix cache was reset)."""
        self._free += self._kept.values()
        self._kept.clear()


@dataclass(frozen=True)
class StateLayout:
    """How one recurrent layer's state is cut among tensor-parallel ranks: the conv state's
    channels (its last axis) and the ssm state's first axis (heads, or Mamba's channels) are runs
    of parts, each either split evenly, rank r holding the r-th of n equal slices, or held whole
    by every rank (`shared`: Mamba2's single group of B and C). A rank's state is its slices of
    each part, in order, as its layer computes them; the whole state (n = 1) is what a hand-off
    carries, so that a sender and a receiver of different tensor-parallel sizes agree."""

    conv_rows: int  # the convolution's window: kernel - 1 past inputs
    conv: tuple[tuple[int, bool], ...]  # (the part's whole channels, shared)
    heads: tuple[tuple[int, bool], ...]  # the ssm state's first axis, as conv's
    tail: tuple[int, ...] = ()  # the ssm state's other axes, held whole by every rank

    def shapes(self, n: int) -> tuple[tuple, tuple]:
        """(conv, ssm) of one slot on a rank of `n`."""
        return (self.conv_rows, _width(self.conv, n)), (_width(self.heads, n), *self.tail)

    def picks(self, n: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where rank r of n's conv channels and ssm rows sit in the whole state's."""
        return _picks(self.conv, n, r), _picks(self.heads, n, r)


def _width(parts: tuple[tuple[int, bool], ...], n: int) -> int:
    for size, shared in parts:
        if not shared and size % n:
            raise ValueError(f"a recurrent state's part of {size} does not split across {n} ranks")
    return sum(size if shared else size // n for size, shared in parts)


def _picks(parts: tuple[tuple[int, bool], ...], n: int, r: int) -> torch.Tensor:
    runs, offset = [], 0
    for size, shared in parts:
        part = size if shared else size // n
        first = offset if shared else offset + r * part
        runs.append(torch.arange(first, first + part))
        offset += size
    return torch.cat(runs)


class RecurrentStates:
    """The state tensors: per linear-attention layer, conv [slots, kernel - 1, channels] and
    ssm [slots, value heads, key dim, value dim], float32 whatever the activations' dtype (the
    rule's arithmetic is float32, as transformers' and the FLA kernels' is).

    path: keep them in a pool file there (kvpool.create_pool_file), as a tensor-parallel rank's
    KV pool is, so that rank 0 can read and write this rank's states (`mapped`)."""

    def __init__(
        self, shapes: list[tuple[tuple, tuple]], num_slots: int, device, path: str | None = None
    ):
        self.num_slots = num_slots
        if path is None:
            self.conv = [torch.zeros((num_slots, *c), device=device) for c, _ in shapes]
            self.ssm = [torch.zeros((num_slots, *s), device=device) for _, s in shapes]
            return
        self._carve(
            create_pool_file(path, (self._numel(shapes, num_slots),), torch.float32), shapes
        )

    @classmethod
    def mapped(cls, path: str, shapes: list[tuple[tuple, tuple]], num_slots: int):
        """Another rank's states, from the file it made."""
        self = cls.__new__(cls)
        self.num_slots = num_slots
        self._carve(map_pool_file(path, (cls._numel(shapes, num_slots),), torch.float32), shapes)
        return self

    @staticmethod
    def _numel(shapes, num_slots: int) -> int:
        return RecurrentStates.bytes_for(shapes, num_slots) // 4

    def _carve(self, flat: torch.Tensor, shapes) -> None:
        self.conv, self.ssm, offset = [], [], 0
        for c, s in shapes:
            for out, shape in ((self.conv, c), (self.ssm, s)):
                numel = self.num_slots * _numel(shape)
                out.append(flat[offset : offset + numel].view(self.num_slots, *shape))
                offset += numel

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
        """Copies slot src into slot dst for each (src, dst), in order: a forked sequence's
        start, a state the prefix cache keeps, a kept state a prompt starts from."""
        for src, dst in pairs:
            for t in (*self.conv, *self.ssm):
                t[dst].copy_(t[src])

    def views(self, slot: int) -> list[list[torch.Tensor]]:
        """`slot`'s state on this rank, per linear-attention layer [conv, ssm] (views)."""
        return [[c[slot], s[slot]] for c, s in zip(self.conv, self.ssm)]


class SlotState:
    """One slot's state in one recurrent layer as the whole model's, over every tensor-parallel
    rank's part (rank 0 holds the others' RecurrentStates mapped from their files): what a
    hand-off reads on the prefill side (`read`: the parts joined) and writes on the decode side
    (`write`: cut for each rank). With one rank, its views as they are."""

    def __init__(self, ranks: list[RecurrentStates], layouts: list[StateLayout], layer, slot):
        self.parts = [[st.conv[layer][slot], st.ssm[layer][slot]] for st in ranks]
        self.layout = layouts[layer] if len(ranks) > 1 else None
        self.shapes = (
            self.layout.shapes(1) if self.layout else tuple(t.shape for t in self.parts[0])
        )
        self.numel = sum(_numel(s) for s in self.shapes)

    def read(self) -> list[torch.Tensor]:
        """[conv, ssm] of the whole model (rank 0's views where it is the only rank)."""
        if self.layout is None:
            return self.parts[0]
        whole = [torch.empty(s, dtype=torch.float32) for s in self.shapes]
        n = len(self.parts)
        for r, (conv, ssm) in enumerate(self.parts):
            channels, heads = self.layout.picks(n, r)
            whole[0][:, channels] = conv
            whole[1][heads] = ssm
        return whole

    def write(self, flat: torch.Tensor) -> None:
        """The whole model's [conv, ssm], flattened in that order (`numel` values), into every
        rank's part."""
        conv, ssm = flat.view(-1).split([_numel(s) for s in self.shapes])
        conv, ssm = conv.view(self.shapes[0]), ssm.view(self.shapes[1])
        n = len(self.parts)
        for r, (mine_conv, mine_ssm) in enumerate(self.parts):
            if self.layout is None:
                mine_conv.copy_(conv)
                mine_ssm.copy_(ssm)
                continue
            channels, heads = self.layout.picks(n, r)
            mine_conv.copy_(conv[:, channels])
            mine_ssm.copy_(ssm[heads])


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
