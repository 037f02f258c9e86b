"""What both ends of a transfer must agree on, and how heads are split across TP ranks.

Every worker builds one KVLayout from its engine's kv_layout_spec when it starts, and a
reservation carries the decode side's fingerprint to the prefill side: the model, the dtype and
the head shapes hash into it, so two sides whose bytes would mean different things refuse each
other (LayoutMismatch names what differs and how to fix it) instead of reinterpreting KV. The
block size and the tensor-parallel split are not part of the fingerprint: data moves per token,
and each frame names the global heads it carries, so a sender and a receiver may block and
shard differently (`head_range`, `overlapping_ranks`; kvtransfer/reshard.py writes what
overlaps). With fewer KV heads than ranks each head is held by several ranks (an MLA model's
single latent by all of them): a hand-off sends each head once (`sends`) and every rank that
holds it writes it.
"""

from __future__ import annotations

import dataclasses
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
        kv, tp = self.num_kv_heads, self.tp_size
        if kv % tp and tp % kv:
            raise ValueError(
                f"tp_size={tp} and num_kv_heads={kv}: one must divide the other (fewer heads than "
                f"ranks: each head is held by tp_size / num_kv_heads ranks)"
            )

    @property
    def fingerprint(self) -> str:
        """Identity of the KV contents: what must match for bytes to mean the same thing."""
        key = f"{self.model}|{self.dtype}|{self.num_layers}|{self.num_kv_heads}|{self.head_dim}"
        return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def replicas(self) -> int:
        """The ranks that hold each head: 1, or tp_size / num_kv_heads where there are fewer
        heads than ranks (an MLA model's one latent is on every rank)."""
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def head_range(self) -> tuple[int, int]:
        """The global kv heads [start, end) this rank holds."""
        first = self.tp_rank // self.replicas * self.heads_per_rank
        return first, first + self.heads_per_rank

    @property
    def sends(self) -> bool:
        """Whether this rank's heads leave it in a hand-off: the first of each head's replicas
        (the others hold the same values)."""
        return self.tp_rank % self.replicas == 0

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
    ranks = []
    for r in range(dst_tp_size):
        d0, d1 = dataclasses.replace(src, tp_size=dst_tp_size, tp_rank=r).head_range
        if d0 < hi and d1 > lo:
            ranks.append(r)
    return ranks
