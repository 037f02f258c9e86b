"""Paged KV block accounting: ref counts, a free queue, and the prefix cache. No tensors here.

A block is "free" when no sequence references it. Free blocks wait in an LRU queue; a free block
that still carries the hash of a full block of tokens can be revived by a prefix-cache hit until
the allocator hands it out again, at which point its hash is dropped. Hashes chain through the
previous block's hash (128-bit BLAKE2b: a crafted prompt must not be able to collide with another
user's prefix and read its KV), every hit is confirmed by comparing the block's tokens and parent
hash, and a chain is not extended past a block whose hash is held by other tokens.

A sequence of a sliding-window model gives back the blocks its window has left
(engine/kv_window.py) and puts `null_block` in their table entries: an index the model runner keeps
outside the pool, which `take` and `free` pass over. A chain whose early blocks were given back
and then reused no longer matches past the first missing block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq

from pdserve.engine.errors import NoFreeBlocks  # noqa: F401 - raised here; engine.block_manager.NoFreeBlocks stays importable


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Stable across processes and hosts, so routers can compute it for prefix affinity."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"" if parent_hash is None else parent_hash.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


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

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Seq[int], max_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix of full blocks within `max_tokens` tokens."""
        if not self.enable_prefix_caching:
            return []
        found, parent = [], None
        for i in range(max_tokens // self.block_size):
            chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, chunk)
            block_id = self._cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != chunk or block.parent_hash != parent:
                break
            found.append(block_id)
            parent = h
        return found

    def register_full_blocks(
        self, block_ids: Seq[int], token_ids: Seq[int], num_hashed: int, num_computed_tokens: int
    ) -> int:
        """Hash the full, computed blocks after the first `num_hashed`; returns the new count."""
        if not self.enable_prefix_caching:
            return num_hashed
        bs = self.block_size
        num_full = min(num_computed_tokens, len(token_ids)) // bs
        if num_full <= num_hashed:
            return num_hashed
        last = block_ids[num_hashed - 1] if num_hashed else None
        parent = None if last is None or last == self.null_block else self.blocks[last].hash
        if num_hashed and parent is None:
            # that block duplicated an already-cached one and was never registered itself, or
            # its window left it and it was given back: rebuild the chain from the tokens
            # instead of restarting it at the root
            for i in range(num_hashed):
                parent = block_hash(parent, tuple(token_ids[i * bs : (i + 1) * bs]))
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
            parent = h
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

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise NoFreeBlocks(f"need {num_blocks} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if (
                block.hash is not None
            ):  # evict: the block's old contents are about to be overwritten
                if self._cached.get(block.hash) == block_id:
                    del self._cached[block.hash]
                block.hash, block.parent_hash, block.token_ids = None, None, ()
            block.ref_count = 1
            out.append(block_id)
        return out

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
