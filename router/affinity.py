"""Which prefill worker probably holds a prompt's prefix in its prefix cache, from what this router
sent where (an approximate view in the spirit of SGLang's cache-aware router: the workers' own
caches evict independently, so a match is a hint, never a promise).

Prompts are cut into CHUNK-token pieces with chained hashes (a piece's hash covers everything
before it); each hash remembers the workers that were sent a prompt starting with it, in LRU
order, up to `max_entries` hashes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

CHUNK = 32


def prefix_hashes(prompt: list[int], chunk: int = CHUNK) -> list[bytes]:
    hashes, h = [], b""
    for i in range(0, len(prompt) - len(prompt) % chunk, chunk):
        piece = ",".join(map(str, prompt[i : i + chunk])).encode()
        h = hashlib.blake2b(h + piece, digest_size=16).digest()
        hashes.append(h)
    return hashes


class PrefixAffinity:
    def __init__(self, max_entries: int = 200_000, chunk: int = CHUNK):
        self.chunk = chunk
        self.max_entries = max_entries
        self._holders: OrderedDict[bytes, set] = OrderedDict()

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
                holders = self._holders[h] = set()
            else:
                self._holders.move_to_end(h)
            holders.add(key)
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def forget(self, key) -> None:
        """A worker left the pool: its cache is gone with it."""
        for holders in self._holders.values():
            holders.discard(key)
