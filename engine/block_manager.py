"""Paged KV block accounting: ref counts, a free queue, and the prefix cache. No tensors here.

A block is "free" when no sequence references it. Free blocks wait in an LRU queue; a free block
that still carries the hash of a full block of tokens can be revived by a prefix-cache hit until
the allocator hands it out again, at which point its hash is dropped. Hashes chain through the
previous block's hash (128-bit BLAKE2b: a crafted prompt must not be able to collide with another
user's prefix and read its KV), every hit is confirmed by comparing the block's tokens and parent
hash, and a chain is not extended past a block whose hash is held by other tokens.
A sequence under a LoRA adapter roots its chain at the adapter's hash (engine/lora.py
`cache_root`: its name and a hash of its weights) instead of None, so no block is shared across
adapters or with the base model. A request with a cache salt (vLLM's cache_salt) roots it at
the salt's hash over that (`chain_root`), so only requests with the same salt share blocks: one
tenant's requests cannot time another's cached prefixes.

A sequence of a sliding-window model gives back the blocks its window has left
(engine/kv_window.py) and puts `null_block` in their table entries: an index the model runner keeps
outside the pool, which `take` and `free` pass over. A chain whose early blocks were given back
and then reused no longer matches past the first missing block.

KV events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared, read by pull instead of pushed):
every change of the prefix cache is recorded in a bounded ring with a sequence number, "stored"
when a full block's hash becomes cached, "removed" when a cached block is evicted (the allocator
hands it out again), "cleared" when every hash is dropped (`reset_prefix_cache`). A reader (the
worker's Stats, for the router's block index: router/kv_index.py) asks for the events after the
last sequence it applied, in this manager's epoch (random, new with each manager: a restarted
worker's numbers start over); when those fell out of the ring or the epoch differs it gets a
reset with a snapshot of the cached hashes instead (`kv_events`). The engine thread writes, any
thread reads: the ring is under its own lock, and the snapshot copies the hash map in one C call.

A host-memory tier (engine/kv_host_tier.py, `attach_tier`; none by default): a cached block the
allocator evicts is first copied into the tier under its hash (a "removed" event for the device,
then a "stored" one for the host tier; entries the tier pushes out to make room are "removed" from
the host tier), and a prefix lookup that misses the cache at a block the tier holds takes a fresh
block, copies the bytes back and registers it as cached ("stored" for the device; the tier keeps
its copy), before the prefill computes the rest. Device events are (kind, hash), host ones
(kind, hash, "host"); "cleared" covers both tiers. The prefix hits of each admission are counted
by where their blocks came from (`count_hits`: a block restored from the tier counts as a host
hit at the first admission that takes it, or a disk hit when the tier's disk level held it,
engine/kv_disk_tier.py). A block the disk level drops on its writer thread (a failed write) is
"removed" from the host tier once the engine thread drains the tier's lost list (`reap_tier`).

A hybrid model (engine/recurrent_state.py): its prefix hit ends at a block after which its
recurrent state is held, kept in a slot (`kept_states`, the scheduler's SlotPool) or saved in the
host tier (`save_state`). Whether a state is held after a block at all is reported too, as
(kind, hash, "state") events (`state_changed`, which the slots and the tier call as states come
and go; a reset's snapshot lists them in `state_snapshot`), so that the router counts a hybrid
worker's match only through its last block with a state; `held_prefix_tokens` counts the same.

Peer fetch (kvtransfer/peer.py, prefill_worker/peer_fetch.py): a prefill worker may install
blocks pulled from a decode worker that holds a conversation's earlier turns (`install_fetched`):
each goes into a fresh block, checked against the chain the manager computes itself from the
prompt, registered as cached and freed at once, like a block restored from the tier, so the
prompt's admission finds it as a prefix hit; its first admission counts it as a peer hit.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from pdserve.engine.errors import NoFreeBlocks  # noqa: F401 - raised here; engine.block_manager.NoFreeBlocks stays importable


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Stable across processes and hosts, so routers can compute it for prefix affinity."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"" if parent_hash is None else parent_hash.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_root(adapter_root: int | None, cache_salt: str = "") -> int | None:
    """The parent hash of a sequence's first block: its adapter's root (None: the base model),
    salted by the request's cache salt when it has one."""
    if not cache_salt:
        return adapter_root
    h = hashlib.blake2b(digest_size=16)
    h.update(b"pdserve-salt\x00" + cache_salt.encode("utf-8", "surrogatepass") + b"\x00")
    h.update(b"" if adapter_root is None else adapter_root.to_bytes(16, "little"))
    return int.from_bytes(h.digest(), "little")


# KV event kinds (the strings on the wire: protos/pdserve/v1/worker.proto, KVEventRun)
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
# the tiers a block can be in (KVEventRun.tier on the wire)
DEVICE, HOST = "device", "host"
# a hybrid's recurrent state is held after the block (KVEventRun.tier on the wire, not a tier a
# block is in: the block's own events say where it is)
STATE = "state"
# where a restored block came from, for the hit counters (not a tier on the wire: the host tier's
# disk level is part of "host" there, engine/kv_host_tier.py)
DISK = "disk"
# the ring holds this many events per block of the pool, within these bounds
EVENTS_PER_BLOCK, MIN_EVENTS, MAX_EVENTS = 4, 4096, 1 << 20
# How near the head of the free queue a cached block must be for `allocate` to take it out of
# turn, to continue a sequence's run of consecutive blocks (evicting it a few allocations early);
# at most a 32nd of the pool
NEAR_HEAD = 64


@dataclass
class KVEvents:
    """What a reader gets from `BlockManager.kv_events`: the events after its sequence `after` up
    to `last_seq` as (kind, hash) in order, or (reset) a snapshot of the hashes cached as of
    `last_seq`, at most the bound asked for (the most recently registered; `truncated` when some
    were left out). The reader's next ask is after `last_seq`, in `epoch`."""

    epoch: int
    last_seq: int
    reset: bool = False
    # (kind, block hash or None for "cleared") for the device tier, (kind, hash, "host") for
    # the host tier
    events: list = field(default_factory=list)
    snapshot: list = field(default_factory=list)  # block hashes
    host_snapshot: list = field(default_factory=list)  # the host tier's hashes, on a reset
    state_snapshot: list = field(default_factory=list)  # a hybrid's: hashes a state follows
    truncated: bool = False


class Block:
    __slots__ = (
        "block_id",
        "ref_count",
        "hash",
        "parent_hash",
        "token_ids",
        "restored",
        "fetched",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        # copied back from the host tier, not yet counted as a hit: False, or where from ("host",
        # or "disk": the tier's disk level)
        self.restored: bool | str = False
        self.fetched = False  # installed from a peer's fetch, not yet counted as a hit


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        null_block: int | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_blocks = num_blocks  # the pool's size, fixed at start
        self.blocks = [Block(i) for i in range(num_blocks)]
        # insertion order = eviction order; OrderedDict gives O(1) removal on a cache hit
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block_id
        # The table entry of a released block (sliding windows): a valid index outside the pool.
        if null_block is not None and 0 <= null_block < num_blocks:
            raise ValueError(f"null_block {null_block} lies inside the pool of {num_blocks}")
        self.null_block = null_block
        # KV events (module docstring): (kind, hash) of sequence numbers
        # _next_seq - len(_events) .. _next_seq - 1
        self.epoch = secrets.randbits(63) or 1  # never 0: a reader that never read asks with 0
        self._events: deque = deque(
            maxlen=min(MAX_EVENTS, max(MIN_EVENTS, EVENTS_PER_BLOCK * num_blocks))
        )
        self._next_seq = 1
        self._events_lock = threading.Lock()
        self.tier = None  # the host-memory tier (engine/kv_host_tier.py): attach_tier
        # a hybrid model's recurrent-state slots, which keep the states after cached blocks
        # (engine/recurrent_state.py SlotPool, the scheduler's): an evicted block's goes with it
        self.kept_states = None
        self._states_held: set[int] = set()  # hashes a state is held after: state_changed
        self.hit_tokens_device = self.hit_tokens_host = 0  # prefix hits by source: count_hits
        self.hit_tokens_peer = self.hit_tokens_disk = 0

    def attach_tier(self, tier) -> None:
        """Evicted cached blocks go to `tier` (a kv_host_tier.HostTier) and lookups restore from
        it (module docstring). Only with the prefix cache on."""
        if tier is not None and not self.enable_prefix_caching:
            raise ValueError("a host KV tier needs enable_prefix_caching")
        self.tier = tier
        if tier is not None:
            tier.on_state_gone = self.state_changed

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash the prefix cache holds (in use or free)."""
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------
    def find_cached_prefix(
        self,
        token_ids: Seq[int],
        max_tokens: int,
        admit_tokens: int | None = None,
        watermark: int = 0,
        *,
        root: int | None = None,
    ) -> list[int]:
        """Block ids of the longest cached prefix of full blocks within `max_tokens` tokens,
        blocks restored from the host tier included. admit_tokens: the lookup is for admitting
        that many tokens with `watermark` blocks left free; blocks are then restored only when
        that admission will fit (else the same lookup would restore them again at every step
        while the prompt waits, each time evicting blocks to make room). root: the chain's root
        (a LoRA adapter's, engine/lora.py cache_root; None: the base model's), so no block
        computed under one adapter is found under another, in the cache or the tier."""
        if not self.enable_prefix_caching:
            return []
        found, parent = [], root
        pinned: list[int] | None = None  # held while restoring, so a restore cannot evict them
        try:
            for i in range(max_tokens // self.block_size):
                chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
                h = block_hash(parent, chunk)
                block_id = self._cached.get(h)
                if block_id is None:
                    if self.tier is None or not self.tier.contains(h):
                        break
                    if pinned is None:  # the first restore: the prefix found so far is pinned
                        if admit_tokens is not None:
                            in_use = sum(1 for b in found if self.blocks[b].ref_count)
                            fits = self.blocks_needed(admit_tokens) - in_use + watermark
                            if len(self._free) < fits:
                                break
                        self.take(found)
                        pinned = list(found)
                    block_id = self._restore(h, parent, chunk, found[-1] if found else None)
                    if block_id is None:
                        break
                    self.take([block_id])
                    pinned.append(block_id)
                block = self.blocks[block_id]
                if block.token_ids != chunk or block.parent_hash != parent:
                    break
                found.append(block_id)
                parent = h
        finally:
            if pinned:
                self.free(pinned)
        return found

    def held_prefix_tokens(
        self, token_ids: Seq[int], max_tokens: int, root: int | None = None
    ) -> int:
        """The leading tokens (whole blocks, within `max_tokens`) this engine holds, in its cache
        or its host tier, without restoring anything: what an admission would find, as long as
        nothing is pushed out meanwhile (a restore needs a free block; this look does not).
        root: as find_cached_prefix takes it. A hybrid's (kept_states set): through the last of
        those blocks whose state is kept in a slot or held by the tier, as its admission's hit
        ends (engine/scheduler.py _with_state)."""
        if not self.enable_prefix_caching:
            return 0
        parent, n, usable = root, 0, 0
        states, tier = self.kept_states, self.tier
        for i in range(max_tokens // self.block_size):
            chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, chunk)
            block_id = self._cached.get(h)
            if block_id is not None:
                block = self.blocks[block_id]
                if block.token_ids != chunk or block.parent_hash != parent:
                    break
            elif tier is None or not tier.contains(h):
                break
            n += 1
            if states is None or h in states or (tier is not None and tier.has_state(h)):
                usable = n
            parent = h
        return usable * self.block_size

    def _restore(self, h: int, parent, chunk: tuple, after: int | None) -> int | None:
        """A fresh block holding the host tier's copy of block `h`, registered as cached (and
        free: the caller takes it), or None when no block is free or the tier refused it.
        `after`: the block before it in the prefix (allocate's)."""
        if not self._free:
            return None
        self.tier.touch(h)  # used last: the allocation's own eviction cannot push it out
        (block_id,) = self.allocate(1, after=after)
        refused = self.tier.refused
        source = self.tier.load(h, parent, chunk, block_id)
        if not source:
            self.free([block_id])
            if self.tier.refused > refused:  # it did not match, and the tier dropped it
                self._record(REMOVED, [h], HOST)
            return None
        block = self.blocks[block_id]
        block.hash, block.parent_hash, block.token_ids = h, parent, chunk
        block.restored = source if isinstance(source, str) else HOST
        self._cached[h] = block_id
        self._record(STORED, [h])
        self.free([block_id])
        return block_id

    def count_hits(self, block_ids: Seq[int]) -> None:
        """An admission took the prefix-cache hits `block_ids`: counts their tokens by source,
        host (or disk: the tier's disk level) for blocks restored from the tier that no admission
        took before, peer for blocks a peer's fetch installed, else device."""
        host = peer = disk = 0
        for block_id in block_ids:
            if block_id == self.null_block:
                continue
            block = self.blocks[block_id]
            if block.restored == DISK:
                block.restored = False
                disk += 1
            elif block.restored:
                block.restored = False
                host += 1
            elif block.fetched:
                block.fetched = False
                peer += 1
        self.hit_tokens_host += host * self.block_size
        self.hit_tokens_peer += peer * self.block_size
        self.hit_tokens_disk += disk * self.block_size
        self.hit_tokens_device += (len(block_ids) - host - peer - disk) * self.block_size

    def chain(self, token_ids: Seq[int], num_blocks: int, root: int | None = None) -> list[int]:
        """The hashes of the first `num_blocks` full blocks of `token_ids`, chained from `root`
        (as find_cached_prefix computes them)."""
        out, parent = [], root
        for i in range(min(num_blocks, len(token_ids) // self.block_size)):
            parent = block_hash(
                parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            )
            out.append(parent)
        return out

    def install_fetched(
        self,
        token_ids: Seq[int],
        first_block: int,
        hashes: Seq[int],
        write,
        root: int | None = None,
    ) -> int:
        """Installs blocks fetched from a peer (module docstring): block `first_block + i` of
        `token_ids` (whose chain hash the caller checked the fetched block against: `hashes[i]`)
        gets a fresh block that `write(i, block_id)` fills, registered as cached and left free
        for the admission to take. The chain before `first_block` must be cached here (it is
        pinned meanwhile, so the allocations cannot evict it); installing stops at the first
        block that no free block is left for, or whose hash is held by other tokens. Returns the
        blocks installed or found cached already. Engine thread."""
        if not self.enable_prefix_caching or not hashes:
            return 0
        bs = self.block_size
        pinned = self.find_cached_prefix(token_ids, first_block * bs, root=root)
        if len(pinned) < first_block:  # the chain before the fetched blocks is gone
            return 0
        self.take(pinned)
        done, stored = 0, []
        parent = self.blocks[pinned[-1]].hash if pinned else root
        try:
            for i, h in enumerate(hashes):
                chunk = tuple(token_ids[(first_block + i) * bs : (first_block + i + 1) * bs])
                if len(chunk) < bs or block_hash(parent, chunk) != h:
                    break
                holder = self._cached.get(h)
                if holder is not None:
                    other = self.blocks[holder]
                    if other.token_ids != chunk or other.parent_hash != parent:
                        break
                    self.take([holder])  # cached already: pinned, nothing to write
                    pinned.append(holder)
                else:
                    if not self._free:
                        break
                    (block_id,) = self.allocate(1, after=pinned[-1] if pinned else None)
                    pinned.append(block_id)
                    write(i, block_id)
                    block = self.blocks[block_id]
                    block.hash, block.parent_hash, block.token_ids = h, parent, chunk
                    block.fetched = True
                    self._cached[h] = block_id
                    stored.append(h)
                done += 1
                parent = h
        finally:
            if stored:
                self._record(STORED, stored)
            self.free(pinned)
        return done

    def register_full_blocks(
        self,
        block_ids: Seq[int],
        token_ids: Seq[int],
        num_hashed: int,
        num_computed_tokens: int,
        root: int | None = None,
    ) -> int:
        """Hash the full, computed blocks after the first `num_hashed`; returns the new count.
        root: the chain's root, as find_cached_prefix takes it."""
        if not self.enable_prefix_caching:
            return num_hashed
        bs = self.block_size
        num_full = min(num_computed_tokens, len(token_ids)) // bs
        if num_full <= num_hashed:
            return num_hashed
        last = block_ids[num_hashed - 1] if num_hashed else None
        parent = (
            root if last is None else None if last == self.null_block else self.blocks[last].hash
        )
        if num_hashed and parent is None:
            # that block duplicated an already-cached one and was never registered itself, or
            # its window left it and it was given back: rebuild the chain from the tokens
            # instead of restarting it at the root
            parent = root
            for i in range(num_hashed):
                parent = block_hash(parent, tuple(token_ids[i * bs : (i + 1) * bs]))
        stored = []
        for i in range(num_hashed, num_full):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            if block_ids[i] == self.null_block:  # no block to register: the chain goes on
                parent = h
                continue
            block = self.blocks[block_ids[i]]
            holder = self._cached.get(h)
            if holder is not None and holder != block.block_id:
                other = self.blocks[holder]
                if other.token_ids != chunk or other.parent_hash != parent:
                    break  # a true collision: what hangs below this hash would be ambiguous
            elif block.hash is None:
                block.hash, block.parent_hash, block.token_ids = h, parent, chunk
                self._cached[h] = block.block_id
                stored.append(h)
            parent = h
        if stored:
            self._record(STORED, stored)
        return max(num_hashed, num_full)

    # ---- allocation ---------------------------------------------------------------------------
    def take(self, block_ids: Seq[int]) -> None:
        """Add a reference to existing blocks (prefix-cache hits, forked sequences)."""
        for block_id in block_ids:
            if block_id == self.null_block:
                continue
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def allocate(self, num_blocks: int, after: int | None = None) -> list[int]:
        """`num_blocks` free blocks for the end of a sequence's table, evicting the cached ones
        among them. Least recently freed first, with two preferences for where they lie in
        memory (the decode attention kernel reads a sequence's blocks in table order, and
        memory serves consecutive blocks up to twice as fast as scattered ones): `after`, the
        sequence's current last block, is followed by after + 1, after + 2, ... while those are
        free and taking them evicts nothing out of turn (`_in_turn`); the rest come in ascending
        order."""
        if num_blocks > len(self._free):
            raise NoFreeBlocks(f"need {num_blocks} KV blocks, {len(self._free)} free")
        if self.tier is not None:
            self.reap_tier()
        ids = []
        if after is not None and after != self.null_block:
            head = None
            while len(ids) < num_blocks:
                nxt = after + 1 + len(ids)
                if nxt not in self._free:
                    break
                if head is None:  # (a small pool's queue is all near its head: a 32nd of it)
                    head = set(itertools.islice(self._free, min(NEAR_HEAD, self.num_blocks // 32)))
                if not self._in_turn(nxt, head):
                    break
                del self._free[nxt]
                ids.append(nxt)
        ids += _in_memory_order(
            [self._free.popitem(last=False)[0] for _ in range(len(ids), num_blocks)]
        )
        out, removed, moved = [], [], []
        for block_id in ids:
            block = self.blocks[block_id]
            if (
                block.hash is not None
            ):  # evict: the block's old contents are about to be overwritten
                if self._cached.get(block.hash) == block_id:
                    del self._cached[block.hash]
                    removed.append(block.hash)
                    if self.kept_states is not None:  # (its state to the tier too, if any)
                        self.kept_states.push_out(block.hash)
                    if self.tier is not None:  # its bytes move to the host tier first
                        stored, dropped = self.tier.save(
                            block.hash, block.parent_hash, block.token_ids, block_id
                        )
                        moved.append((block.hash, stored, dropped))
                block.hash, block.parent_hash, block.token_ids = None, None, ()
                block.restored = block.fetched = False
            block.ref_count = 1
            out.append(block_id)
        if removed:
            self._record(REMOVED, removed)
        for h, stored, dropped in moved:
            if dropped:
                self._record(REMOVED, dropped, HOST)
            if stored:
                self._record(STORED, [h], HOST)
        return out

    def _in_turn(self, block_id: int, head: set[int]) -> bool:
        """Whether a free block may be taken before its turn in the LRU queue: it holds no cached
        prefix (nothing is evicted early), or it is among the next few in line anyway (`head`)."""
        return self.blocks[block_id].hash is None or block_id in head

    def free(self, block_ids: Seq[int]) -> None:
        # reversed: a sequence's tail blocks are the least likely to be shared, so evict them first
        for block_id in reversed(block_ids):
            if block_id == self.null_block:
                continue
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def save_state(self, h: int, slot: int) -> None:
        """The recurrent state after block `h`, leaving slot `slot`, into the host tier (a
        hybrid's: engine/recurrent_state.py SlotPool.on_push_out); the blocks the tier pushes out
        to make room for it are "removed" (host). Nothing without a tier."""
        if self.tier is None:
            return
        _, dropped = self.tier.save_state(h, slot)
        if dropped:
            self._record(REMOVED, dropped, HOST)
        self.state_changed(h)

    def state_changed(self, h: int) -> None:
        """The state after block `h` was kept, saved, pushed out or refused somewhere: a "stored"
        or "removed" (state) event when whether one is held at all (in a slot or the host tier)
        changed."""
        held = (self.kept_states is not None and h in self.kept_states) or (
            self.tier is not None and self.tier.has_state(h)
        )
        if held == (h in self._states_held):
            return
        if held:
            self._states_held.add(h)
        else:
            self._states_held.discard(h)
        self._record(STORED if held else REMOVED, [h], STATE)

    def reap_tier(self) -> list[int]:
        """Records "removed" (host) for the blocks the tier lost on its own since the last call
        (its disk level's failed writes, kv_host_tier.HostTier.take_lost) and returns them. Engine
        thread: `allocate` calls it before the tier takes new blocks, and a worker's engine loop
        every few seconds (worker_common/process.py), so an idle worker reports them too."""
        lost = self.tier.take_lost() if self.tier is not None else []
        if lost:
            self._record(REMOVED, lost, HOST)
        return lost

    def reset_prefix_cache(self, tier: bool = True) -> bool:
        """Drops every cached hash (a "cleared" event) when no block is in use, and with `tier`
        the host tier's entries; False, and nothing changed, while a sequence holds blocks (as
        vLLM's reset_prefix_cache)."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.hash, block.parent_hash, block.token_ids = None, None, ()
            block.restored = block.fetched = False
        self._cached.clear()
        if self.kept_states is not None:
            self.kept_states.clear()
        if self.tier is not None and tier:
            self.tier.clear()
        self._record(CLEARED, [None])
        # (the states a kept tier still holds are reported again: "cleared" drops every entry)
        self._states_held = set(self.tier.state_hashes()) if self.tier is not None else set()
        if self._states_held:
            self._record(STORED, list(self._states_held), STATE)
        return True

    # ---- KV events ------------------------------------------------------------------------------
    def _record(self, kind: str, hashes: list, tier: str = DEVICE) -> None:
        with self._events_lock:
            if tier == DEVICE:
                self._events.extend((kind, h) for h in hashes)
            else:
                self._events.extend((kind, h, tier) for h in hashes)
            self._next_seq += len(hashes)

    def kv_events(self, after: int, epoch: int, max_events: int, max_snapshot: int) -> KVEvents:
        """The events after sequence `after` of `epoch`, at most `max_events` of them; a reset
        with a snapshot of at most `max_snapshot` cached hashes when `epoch` is not this
        manager's, or when `after` is not a sequence it can continue from (fell out of the ring,
        or ahead of it). Any thread."""
        with self._events_lock:
            last = self._next_seq - 1
            oldest = self._next_seq - len(self._events)  # the first sequence still in the ring
            if epoch == self.epoch and oldest - 1 <= after <= last:
                start = after - oldest + 1
                take = min(max_events, last - after)
                events = list(itertools.islice(self._events, start, start + take))
                return KVEvents(self.epoch, after + take, events=events)
            # a reset: the snapshot as of `last`; a hash cached before its "stored" event is
            # recorded shows twice (here and as an event after `last`), which a reader applies
            # as a set, so it is harmless
            cached = list(self._cached)  # one C call: the engine thread may add meanwhile
            host = self.tier.hashes() if self.tier is not None else []
            states = list(self._states_held)
        keep = cached[-max_snapshot:] if max_snapshot > 0 else []
        room = max(0, max_snapshot - len(keep))
        keep_host = host[-room:] if room else []
        room -= len(keep_host)
        keep_states = states[:room] if room > 0 else []
        return KVEvents(
            self.epoch,
            last,
            reset=True,
            snapshot=keep,
            host_snapshot=keep_host,
            state_snapshot=keep_states,
            truncated=len(keep) + len(keep_host) + len(keep_states)
            < len(cached) + len(host) + len(states),
        )

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def check_consistency(self) -> None:
        """Invariants a leak check relies on; raises AssertionError with the first violation."""
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert block.ref_count >= 0, f"block {block.block_id} ref_count {block.ref_count}"
            assert in_free == (block.ref_count == 0), f"block {block.block_id} free-queue mismatch"
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].hash == h, f"stale cache entry for block {block_id}"


def _in_memory_order(block_ids: list[int]) -> list[int]:
    """The order `allocate` gives blocks taken from the free queue: ascending, so that those
    that lie together in memory follow each other in the sequence's table."""
    return sorted(block_ids)
