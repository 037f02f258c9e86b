"""Peer fetch: the bytes of cached KV blocks read from one worker's pools and written into
another's, and the checks in between (docs/architecture.md section 11).

A decode worker that holds a conversation's earlier turns in its prefix cache serves them to the
prefill worker that fills its reservation for the next turn (DecodeWorker.FetchKV,
decode_worker/service.py), so the prefill worker computes only the new tokens; the prefill side
(prefill_worker/peer_fetch.py) checks each block here and installs the good ones into its own
cache (engine/block_manager.py `install_fetched`). This module owns the block's wire form and
every check a fetched block passes before it is used:

- the layout: the sender's KV layout fingerprint (model, cache dtype, layers, kv heads, head dim,
  block size, tensor-parallel size: engine/kv_host_tier.py `fingerprint`) equals the receiver's;
- the chain: the block's hash equals the one the receiver computes itself from the prompt's tokens
  (and the adapter's chain root), so a block lands only under exactly the tokens it was computed
  for, after exactly the same prefix;
- the bytes: a blake2b-128 digest of the hash and the bytes, computed by the sender, matches, and
  the size is exactly one block of the receiver's pools;
- a hybrid model's state after the last block (FetchKVBlock.state): its own digest, and exactly
  one whole-model state's size (`check_state`).

A block failing any check is refused; the fetch stops there (the chain must be contiguous) and the
prefill computes everything from that block on. Nothing in this module talks to the network.
"""

from __future__ import annotations

import hashlib

import torch

HASH_BYTES = 16  # engine/block_manager.py block_hash


def digest(block_hash: bytes, data: bytes) -> bytes:
    """What FetchKVBlock.digest holds: blake2b-128 of the block hash, then its bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(block_hash)
    h.update(data)
    return h.digest()


def hash_bytes(h: int) -> bytes:
    return h.to_bytes(HASH_BYTES, "little")


def shard_shapes(caches: list[torch.Tensor]) -> list[tuple[tuple, torch.dtype]]:
    """Each rank pool's one-block slice: its shape and dtype."""
    return [(tuple(c[:, :, 0].shape), c.dtype) for c in caches]


def block_nbytes(caches: list[torch.Tensor]) -> int:
    """One block's bytes over every rank's pool: a fetched block's exact size."""
    return sum(c[:, :, 0].numel() * c.element_size() for c in caches)


def read_block(caches: list[torch.Tensor], block_id: int) -> bytes:
    """Block `block_id` of every rank's pool, rank order, as bytes (a copy: the caller may let the
    block go once this returns)."""
    parts = []
    for cache in caches:
        shard = cache[:, :, block_id].contiguous()
        if shard.device.type != "cpu":
            shard = shard.cpu()
        parts.append(shard.view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


def write_block(caches: list[torch.Tensor], block_id: int, data: bytes) -> None:
    """Writes `data` (read_block's form, size already checked) into block `block_id` of every
    rank's pool."""
    if not data:  # (a model with no KV layer, Mamba's: its blocks have no bytes)
        return
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    offset = 0
    for cache in caches:
        dst = cache[:, :, block_id]
        n = dst.numel() * dst.element_size()
        src = flat[offset : offset + n].view(cache.dtype).view(dst.shape)
        dst.copy_(src)
        offset += n


def check_block(
    block,
    want_hash: int,
    fingerprint_hex: str,
    nbytes: int,
) -> str:
    """Why fetched `block` (a FetchKVBlock) must not be used in place of the block whose hash the
    receiver computed as `want_hash`, in pools of `fingerprint_hex` and `nbytes` bytes a block;
    "" when it passes every check (the module docstring)."""
    if block.layout_fingerprint != fingerprint_hex:
        return "its KV layout fingerprint differs (another model, dtype or TP layout)"
    if block.block_hash != hash_bytes(want_hash):
        return "its hash is not the prompt's chain hash at that block"
    if len(block.data) != nbytes:
        return f"it has {len(block.data)} bytes where a block has {nbytes}"
    if block.digest != digest(block.block_hash, block.data):
        return "its bytes do not match their digest"
    return ""


def check_state(block, nbytes: int) -> str:
    """Why the recurrent state on fetched `block` (a hybrid's: FetchKVBlock.state, the state
    after it) must not be used, in an engine whose whole-model state has `nbytes` bytes; "" when
    it passes (the block itself passed check_block)."""
    if len(block.state) != nbytes:
        return f"its state has {len(block.state)} bytes where one has {nbytes}"
    if block.state_digest != digest(block.block_hash, block.state):
        return "its state's bytes do not match their digest"
    return ""
