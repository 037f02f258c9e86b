"""The host-memory tier below an engine's KV cache: evicted prefix-cache blocks kept in host
memory, bounded in bytes, and copied back when a later prompt needs them.

Who owns a block when. A full, hashed block of the KV cache that no sequence references waits in
the block manager's free queue (engine/block_manager.py); when the allocator hands it out again
its contents are about to be overwritten, and, with a tier, the block manager first calls `save`:
the block's bytes (every layer, K and V, of every tensor-parallel rank's pool: each rank's shard
is kept as its own tensor) are copied into a new host entry under the block's hash, with its
parent hash and tokens. From then on the tier owns that copy, until it is pushed out (LRU) or
cleared. When a prompt's prefix lookup misses the KV cache at a block whose hash the tier holds,
the block manager takes a fresh block, calls `load` to copy the bytes back into it, and registers
it as cached again, before the prefill computes the rest; the tier keeps its copy (a block
evicted again later costs no second copy, only a touch).

Keyed by what. An entry is keyed by (the engine's KV layout fingerprint, the block hash). The
hash chains the block's tokens through its parent's hash (and whatever else the block manager
puts in the chain); the fingerprint covers the model, the cache dtype, the layout (layers, kv
heads per rank, head dim, block size) and the tensor-parallel size (`fingerprint`). A lookup
under another fingerprint misses, so a block stored for another model, dtype, TP layout or
adapter is unreachable; `load` also checks the chain (the hash of parent and tokens is the key,
and both equal the ones asked for), each shard's shape and dtype against the destination and
its bytes against the CRC-32 taken when it was saved (about 90 us for SmolLM2's 368 KiB bf16
block, 4.3 GB/s on an AMD EPYC, next to the 10-15 ms of computing its 16 tokens again), and
refuses a block that does not match (the caller then recomputes it).

Bounded: the entries' bytes never exceed `capacity_bytes`. A save that would pass the cap first
pushes out least recently used entries until the bytes are at most `watermark` x the cap less the
new entry (a high/low watermark, so a stream of evictions does not push out one entry per save);
an entry larger than the cap is not kept. `clear` drops everything (the prefix cache's reset).

Where it pays, and what it costs here. On a CPU the "device" KV cache is DRAM too: the tier is
a second, bigger, cheaper store in the same memory (plain tensors, no paging), and a save or a
load is one memcpy of the block's bytes on the engine thread, synchronous, between steps (the
block manager runs it while the scheduler plans or a reservation allocates; the pools are not
being written then). On a GPU the same code copies device -> host synchronously, which works
but puts the copy on the step's path; doing it well needs pinned host buffers
(`torch.empty(..., pin_memory=True)`), copies on a side CUDA stream with an event the next
write of the evicted block waits on, and a restore stream the prefill waits on. That is not
written: nothing here was measured on a GPU.

A disk level below (engine/kv_disk_tier.py, `disk`; none by default): an entry this tier pushes
out is handed to it (`DiskTier.put`) instead of dropped, and `contains`, `touch`, `load`,
`hashes` and `clear` cover both levels. A block restored from disk goes straight into the pool,
through the same checks as a host entry (chain, shapes, CRC), without a host copy (it gets one
when the pool evicts it again); `load` returns where the block came from ("host" or "disk"), for
the hit counters by source. For the KV events and the router's index the disk level is part of
this tier ("host": held below the device on this worker, restored before the prefill): a hash
pushed out of host memory into the disk is not "removed", one pushed out of both is, and
`capacity_blocks` counts both levels' blocks. An entry the disk level loses on its writer thread
(a failed write) comes back through `take_lost`, which the block manager drains on the engine
thread and reports "removed" unless a level holds the hash again.

A hybrid model's recurrent states (engine/recurrent_state.py). Its prefix hit ends at a block
after which a state is kept (the recurrent layers start from it), and the engine keeps those
states in free slots, few of them (engine/scheduler.py). With a tier, a kept state that loses its
slot (another sequence needs the slot, or its block leaves the KV cache) is first copied here
under its block's hash (`save_state`: every rank's part of the slot, each rank's as one tensor),
and a prefix lookup that finds a block's state here but in no slot copies it back into a slot
(`load_state`, through the same checks as a block: shapes and CRC), where it is kept again. A
state lies in the same LRU and under the same cap as the blocks; it is much larger than a block
(benchmarks/engine/hybrid.py's 1024-wide Qwen3.5: 6.7 MB, against 128 KiB for a block of 16
tokens), but one or two per conversation are kept (its prompt's last block and its latest one),
not one per block. States stay in host memory: one pushed out is dropped, not handed to the disk
level (the config refuses a disk tier for a hybrid). The block manager reports where a state is
held (engine/block_manager.py state_changed): `on_state_gone` tells it of one pushed out or
refused.

Counters (read by the worker's Stats, any thread; written on the engine thread): bytes held,
blocks stored, restored and pushed out; states stored, restored and refused.
"""

from __future__ import annotations

import hashlib
import zlib
from collections import OrderedDict
from collections.abc import Callable

import torch

# after a save would pass the cap, entries are pushed out until the bytes are at most this share
# of it (with the new entry)
WATERMARK = 0.9


def fingerprint(layout: dict, tp_size: int) -> bytes:
    """What identifies an engine's KV contents: its kv_layout_spec fields (model, cache dtype,
    layers, kv heads, head dim, block size) and the tensor-parallel size, as 16 bytes."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(layout):
        h.update(f"{key}={layout[key]!r};".encode())
    h.update(f"tp={tp_size}".encode())
    return h.digest()


def _crc(shards: list[torch.Tensor]) -> int:
    """CRC-32 of the shards' bytes, in order (each is a contiguous CPU tensor)."""
    crc = 0
    for s in shards:
        crc = zlib.crc32(s.reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


# what an entry holds: a KV block, or the recurrent state after it (a hybrid's)
KV, STATE = "kv", "state"
# an entry's bytes as the cap counts them are at least this, its Python objects' share: a model
# with no KV layer (Mamba's) has blocks of no bytes, whose entries would otherwise never be
# pushed out
MIN_ENTRY_BYTES = 256


class _Entry:
    __slots__ = ("parent_hash", "token_ids", "shards", "nbytes", "crc")

    def __init__(self, parent_hash, token_ids, shards):
        self.parent_hash = parent_hash
        self.token_ids = token_ids
        self.shards = shards
        self.nbytes = max(MIN_ENTRY_BYTES, sum(s.numel() * s.element_size() for s in shards))
        self.crc = _crc(shards)


class HostTier:
    """caches: returns every rank's KV pool ([layers, 2, blocks, block_size, heads, dim] each,
    rank order); fp: the engine's layout fingerprint (`fingerprint`); states: for a hybrid model,
    returns every rank's RecurrentStates (rank order), else None. Entries are keyed by
    (fingerprint, hash, KV or STATE)."""

    def __init__(
        self,
        capacity_bytes: int,
        caches: Callable[[], list[torch.Tensor]],
        fp: bytes,
        watermark: float = WATERMARK,
        disk=None,
        states: Callable[[], list] | None = None,
    ):
        if capacity_bytes <= 0:
            raise ValueError(f"a host tier needs capacity_bytes > 0, got {capacity_bytes}")
        if not 0.0 < watermark <= 1.0:
            raise ValueError(f"watermark must be in (0, 1], got {watermark}")
        self.capacity_bytes = int(capacity_bytes)
        self.watermark = watermark
        self.fingerprint = fp
        self._caches = caches
        self._states = states
        self._entries: OrderedDict[tuple[bytes, int, str], _Entry] = OrderedDict()
        self.bytes = 0
        self.peak_bytes = 0
        self.stored = self.restored = self.evicted = self.refused = 0
        self.states_stored = self.states_restored = self.states_refused = 0
        self.num_states = 0  # state entries held (the rest of `_entries` are blocks)
        self.on_state_gone = None  # (block hash) -> None: a state pushed out or refused
        self.disk = disk  # a kv_disk_tier.DiskTier below this one, or None
        self.last_source = None  # where the last successful load came from

    def __len__(self) -> int:
        """The blocks held in host memory."""
        return len(self._entries) - self.num_states

    def contains(self, h: int) -> bool:
        """Whether `h` is held here or on the disk level below."""
        return (self.fingerprint, h, KV) in self._entries or (
            self.disk is not None and self.disk.contains(h)
        )

    def touch(self, h: int) -> None:
        """Marks the entry of `h` (if held, here or on disk) used last."""
        key = (self.fingerprint, h, KV)
        if key in self._entries:
            self._entries.move_to_end(key)
        elif self.disk is not None:
            self.disk.touch(h)

    def hashes(self) -> list[int]:
        """The hashes held under this engine's fingerprint, least recently used first (the
        disk level's first, then host memory's)."""
        mine = [h for fp, h, kind in list(self._entries) if fp == self.fingerprint and kind == KV]
        if self.disk is None:
            return mine
        held = set(mine)
        return [h for h in self.disk.hashes() if h not in held] + mine

    def save(self, h: int, parent_hash, token_ids: tuple, block_id: int) -> tuple[bool, list]:
        """Copies block `block_id` of every rank's pool into the tier under `h`, unless it is
        held already (then it is only touched). Returns (whether a new entry was stored, the
        hashes pushed out to make room)."""

        def entry() -> _Entry:
            shards = []
            for cache in self._caches():
                src = cache[:, :, block_id]
                dst = torch.empty(src.shape, dtype=src.dtype, device="cpu")
                dst.copy_(src)
                shards.append(dst)
            return _Entry(parent_hash, tuple(token_ids), shards)

        stored, dropped = self._put((self.fingerprint, h, KV), entry)
        self.stored += stored
        return stored, dropped

    def _put(self, key: tuple, make: Callable[[], _Entry]) -> tuple[bool, list[int]]:
        """Stores the entry `make()` copies under `key`, unless one is held there (then it is
        only touched) or it is larger than the cap; returns (whether it was stored, the block
        hashes pushed out to make room)."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return False, []
        entry = make()
        if entry.nbytes > self.capacity_bytes:
            return False, []
        dropped = self._make_room(entry.nbytes)
        self._entries[key] = entry
        self.bytes += entry.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return True, dropped

    def _make_room(self, nbytes: int) -> list[int]:
        """Pushes out least recently used entries when `nbytes` more would pass the cap (down to
        the watermark); returns the block hashes gone from both levels (a state pushed out is
        dropped, and named nowhere)."""
        dropped = []
        if self.bytes + nbytes > self.capacity_bytes:
            low = max(0, int(self.capacity_bytes * self.watermark) - nbytes)
            while self._entries and self.bytes > low:
                (fp, old, kind), gone = self._entries.popitem(last=False)
                self.bytes -= gone.nbytes
                if kind == STATE:
                    self.num_states -= 1
                    if self.on_state_gone is not None and fp == self.fingerprint:
                        self.on_state_gone(old)
                    continue
                self.evicted += 1
                if self.disk is not None and fp == self.fingerprint:
                    # the disk takes it (or holds it already); what it pushes out is gone
                    # from both levels unless host memory holds it
                    _, pushed = self.disk.put(
                        old, gone.parent_hash, gone.token_ids, gone.shards, gone.crc
                    )
                    dropped += [p for p in pushed if (self.fingerprint, p, KV) not in self._entries]
                    if self.disk.contains(old):
                        continue
                if fp == self.fingerprint:
                    dropped.append(old)
        return dropped

    def load(self, h: int, parent_hash, token_ids: tuple, block_id: int) -> str | bool:
        """Copies the entry of `h` (from host memory, else from the disk level) into block
        `block_id` of every rank's pool, after checking it against the chain (`parent_hash`,
        `token_ids`), the pools' layout and its saved CRC; returns where it came from ("host" or
        "disk"), or False, and nothing written, when it is not there or does not match (a
        refused entry is dropped)."""
        key = (self.fingerprint, h, KV)
        entry = self._entries.get(key)
        source = "host"
        if entry is None:
            if self.disk is None:
                return False
            refused = self.disk.refused
            entry = self.disk.load(h)
            if entry is None:
                self.refused += self.disk.refused - refused
                return False
            source = "disk"
        caches = self._caches()
        ok = (
            entry.parent_hash == parent_hash
            and entry.token_ids == tuple(token_ids)
            and len(entry.shards) == len(caches)
            and all(
                s.shape == c[:, :, block_id].shape and s.dtype == c.dtype
                for s, c in zip(entry.shards, caches)
            )
            and _crc(entry.shards) == entry.crc
        )
        if not ok:
            if source == "disk":
                self.disk.discard(h)
            else:
                del self._entries[key]
                self.bytes -= entry.nbytes
            self.refused += 1
            return False
        for shard, cache in zip(entry.shards, caches):
            cache[:, :, block_id].copy_(shard)
        if source == "disk":
            self.disk.restored += 1
        else:
            self._entries.move_to_end(key)
            self.restored += 1
        self.last_source = source
        return source

    def has_state(self, h: int) -> bool:
        """Whether the recurrent state after block `h` is held."""
        return (self.fingerprint, h, STATE) in self._entries

    def save_state(self, h: int, slot: int) -> tuple[bool, list[int]]:
        """Copies recurrent-state slot `slot` of every rank into the tier as the state after
        block `h` (only touched where it is held already). Returns (whether a new entry was
        stored, the block hashes pushed out to make room)."""
        stored, dropped = self._put(
            (self.fingerprint, h, STATE),
            lambda: _Entry(None, (), [_state_flat(st, slot) for st in self._states()]),
        )
        self.states_stored += stored
        self.num_states += stored
        return stored, dropped

    def load_state(self, h: int, slot: int) -> bool:
        """Copies the state held after block `h` into recurrent-state slot `slot` of every rank,
        after checking its shapes against the slots' and its bytes against the saved CRC; False,
        and nothing written, when it is not held or does not match (a refused entry is
        dropped)."""
        key = (self.fingerprint, h, STATE)
        entry = self._entries.get(key)
        if entry is None:
            return False
        ranks = self._states()
        ok = (
            len(entry.shards) == len(ranks)
            and all(s.numel() == _state_numel(st) for s, st in zip(entry.shards, ranks))
            and _crc(entry.shards) == entry.crc
        )
        if not ok:
            del self._entries[key]
            self.bytes -= entry.nbytes
            self.num_states -= 1
            self.states_refused += 1
            if self.on_state_gone is not None:
                self.on_state_gone(h)
            return False
        for shard, st in zip(entry.shards, ranks):
            offset = 0
            for view in _state_views(st, slot):
                n = view.numel()
                view.copy_(shard[offset : offset + n].view(view.shape))
                offset += n
        self._entries.move_to_end(key)
        self.states_restored += 1
        return True

    def state_hashes(self) -> list[int]:
        """The block hashes a state is held after, under this engine's fingerprint."""
        return [
            h for fp, h, kind in list(self._entries) if fp == self.fingerprint and kind == STATE
        ]

    def clear(self) -> list[int]:
        """Drops every entry, on disk too; returns the (block) hashes that were held under this
        fingerprint."""
        gone = self.hashes()
        self._entries.clear()
        self.num_states = 0
        self.bytes = 0
        if self.disk is not None:
            self.disk.clear()
        return gone

    def take_lost(self) -> list[int]:
        """The hashes the disk level lost on its own since the last call (its writer could not
        write their files) that neither level holds now: gone from this tier. Engine thread."""
        if self.disk is None:
            return []
        return [h for h in dict.fromkeys(self.disk.take_lost()) if not self.contains(h)]

    def close(self) -> None:
        """Closes the disk level (its writer, its files); host memory needs nothing."""
        if self.disk is not None:
            self.disk.close()

    @property
    def block_bytes(self) -> int:
        """One block's bytes in the tier: every rank's shard of it."""
        return sum(c[:, :, 0].numel() * c.element_size() for c in self._caches())

    @property
    def capacity_blocks(self) -> int:
        """How many blocks the cap holds (the disk level's cap included)."""
        size = max(MIN_ENTRY_BYTES, self.block_bytes)
        blocks = self.capacity_bytes // size
        if self.disk is not None:
            blocks += self.disk.capacity_bytes // size
        return blocks

    def stats(self) -> dict:
        return dict(
            kv_host_tier_capacity_blocks=self.capacity_blocks,
            kv_host_tier_bytes=self.bytes,
            kv_host_tier_capacity_bytes=self.capacity_bytes,
            kv_host_tier_blocks=len(self),
            kv_host_tier_stored=self.stored,
            kv_host_tier_restored=self.restored,
            kv_host_tier_evicted=self.evicted,
            kv_host_tier_states_stored=self.states_stored,
            kv_host_tier_states_restored=self.states_restored,
            kv_host_tier_states_refused=self.states_refused,
        )


def _state_views(states, slot: int) -> list[torch.Tensor]:
    """One rank's recurrent-state slot (engine/recurrent_state.py RecurrentStates), per layer
    its conv and ssm state, in order."""
    return [t for pair in states.views(slot) for t in pair]


def _state_numel(states) -> int:
    return sum(t.numel() for t in _state_views(states, 0))


def _state_flat(states, slot: int) -> torch.Tensor:
    """A copy of one rank's slot as one float32 tensor."""
    return torch.cat([t.reshape(-1) for t in _state_views(states, slot)])
