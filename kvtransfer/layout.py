"""What both ends of a transfer must agree on, and how heads are split across TP ranks.

Every worker builds one KVLayout from its engine's kv_layout_spec when it starts, and a
reservation carries the decode side's fingerprint to the prefill side: the model, the dtype and
the head shapes hash into it, so two sides whose bytes would mean different things refuse each
other (LayoutMismatch names what differs and how to fix it) instead of reinterpreting KV. The
block size and the tensor-parallel split are not part of the fingerprint: data moves per token,
and each frame names the global heads it carries, so a sender and a receiver may block and
shard differently (`head_range`, `overlapping_ranks`; kvtransfer/reshard.py writes what
overlaps).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


class LayoutMismatch(ValueError):
    """The two sides hold KV of different models, dtypes or head shapes: refuse, never reinterpret."""


@dataclass(frozen=True)
class KVLayout:
    model: str  # a name or checkpoint digest; equal strings mean equal weights
    dtype: str  # "float32", "bfloat16", ...
    num_layers: int
    num_kv_heads: int  # over the whole model, not per rank
    head_dim: int
    block_size: int  # may differ between the two sides: data moves per token
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self):
        if self.num_kv_heads % self.tp_size:
            raise ValueError(f"tp_size={self.tp_size} must divide num_kv_heads={self.num_kv_heads}")

    @property
    def fingerprint(self) -> str:
        """Identity of the KV contents: what must match for bytes to mean the same thing."""
        key = f"{self.model}|{self.dtype}|{self.num_layers}|{self.num_kv_heads}|{self.head_dim}"
        return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()

    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads // self.tp_size

    @property
    def head_range(self) -> tuple[int, int]:
        """The global kv heads [start, end) this rank holds."""
        return self.tp_rank * self.heads_per_rank, (self.tp_rank + 1) * self.heads_per_rank

    def check_compatible(self, other_fingerprint: str, what: str = "peer") -> None:
        if other_fingerprint != self.fingerprint:
            raise LayoutMismatch(
                f"KV layout of the {what} ({other_fingerprint}) differs from this one "
                f"({self.fingerprint}: model={self.model}, dtype={self.dtype}, layers={self.num_layers}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}): both sides must serve the "
                f"same model in the same dtype (dtype='auto' chooses the KV cache's dtype on each "
                f"machine's CPU: set kv_cache_dtype explicitly, the same for both pools)"
            )


def overlapping_ranks(src: KVLayout, dst_tp_size: int) -> list[int]:
    """Receiver TP ranks whose heads intersect the sender rank's heads (re-sharding fan-out)."""
    lo, hi = src.head_range
    per = src.num_kv_heads // dst_tp_size
    return [r for r in range(dst_tp_size) if r * per < hi and (r + 1) * per > lo]
