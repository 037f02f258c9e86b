"""Which prefill worker probably holds a prompt's prefix in its prefix cache, from what this router
sent where (an approximate view in the spirit of SGLang's cache-aware router: the workers' own
caches evict independently, so a match is a hint, never a promise).

Prompts are cut into CHUNK-token pieces with chained hashes (a piece's hash covers everything
before it); each hash remembers the workers that were sent a prompt starting with it, in LRU
order, up to `max_entries` hashes. That bound is all the memory the view ever takes: every
request with a fresh prompt adds a hash per CHUNK tokens, so the map grows with the requests
served until it reaches the bound (about 200 bytes a hash), and stays there. The pool may lower
the bound to what its prefill workers' caches can hold (`fit_to_tokens`, from their Stats): a
hash beyond that names a prefix every worker has evicted long ago. A worker that leaves is
forgotten, and the hashes no worker holds any more are dropped with it. A prompt under a LoRA
adapter hashes from the adapter's name (`prefix_hashes(..., adapter=name)`), so its affinity is
its own.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

CHUNK = 32
# 2M prompt tokens of prefixes (about 13 MB): more than the prefix caches of the prefill pools
# this router is sized for hold; the pool may set a tighter bound from its workers' KV sizes
DEFAULT_MAX_ENTRIES = 65_536
# fit_to_tokens never bounds the view below this many hashes
MIN_ENTRIES = 256


def cache_namespace(adapter: str, cache_salt: str = "") -> str:
    """The name prefix affinity keys a request's KV by: its LoRA adapter's ("" for the base
    model), and with a cache salt that too, since the workers share KV only within both
    (engine/block_manager.py chain_root). Not empty under either: the block index, which holds
    the base model's unsalted chains, is then not read for it (router/pool.py)."""
    return f"{adapter}\x00salt\x00{cache_salt}" if cache_salt else adapter


def prefix_hashes(prompt: list[int], chunk: int = CHUNK, adapter: str = "") -> list[bytes]:
    """The chained hashes of the prompt's whole chunks; under a LoRA adapter (its name) the
    chain starts from the adapter's hash, so a prompt never matches what ran under another
    adapter or the base model (whose KV the workers never share either: engine/lora.py)."""
    hashes = []
    h = hashlib.blake2b(b"lora:" + adapter.encode(), digest_size=16).digest() if adapter else b""
    for i in range(0, len(prompt) - len(prompt) % chunk, chunk):
        piece = ",".join(map(str, prompt[i : i + chunk])).encode()
        h = hashlib.blake2b(h + piece, digest_size=16).digest()
        hashes.append(h)
    return hashes


class PrefixAffinity:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, chunk: int = CHUNK):
        self.chunk = chunk
        self.max_entries = max_entries
        # hash -> the workers sent a prompt with that prefix, as a tuple (nearly always one
        # worker: a tuple takes a quarter of a set's memory)
        self._holders: OrderedDict[bytes, tuple] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def matched_tokens(self, hashes: list[bytes]) -> dict:
        """worker key -> leading prompt tokens it was sent before (contiguous from the start)."""
        matched: dict = {}
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            alive = False
            for key in holders:
                if matched.get(key, 0) == i * self.chunk:
                    matched[key] = (i + 1) * self.chunk
                    alive = True
            if not alive:
                break
        return matched

    def record(self, hashes: list[bytes], key) -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                self._holders[h] = (key,)
            else:
                self._holders.move_to_end(h)
                if key not in holders:
                    self._holders[h] = holders + (key,)
        self._evict()

    def set_max_entries(self, max_entries: int) -> None:
        """A new bound (at least 1); the least recently sent hashes past it go at once."""
        self.max_entries = max(1, max_entries)
        self._evict()

    def fit_to_tokens(self, num_tokens: int) -> None:
        """Bounds the view by the prompt tokens the prefill workers' KV caches hold together
        (blocks times block size): a hash per `chunk` of them, at least MIN_ENTRIES. A looser
        bound keeps hashes of prefixes the workers evicted, and a stale match makes a prompt look
        cheaper on the prefill pool than it is (planner/local_prefill.py then keeps it off its
        decode worker). Nothing known (0): the bound stays."""
        if num_tokens > 0:
            self.set_max_entries(max(MIN_ENTRIES, num_tokens // self.chunk))

    def _evict(self) -> None:
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def forget(self, key) -> None:
        """A worker left the pool: its cache is gone with it, and so are the hashes that only it
        held."""
        for h, holders in list(self._holders.items()):
            if key in holders:
                rest = tuple(k for k in holders if k != key)
                if rest:
                    self._holders[h] = rest  # keeps its place in the LRU order
                else:
                    del self._holders[h]
