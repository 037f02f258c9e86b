"""The router's index of which worker holds which KV block: block hash -> the workers (and the
tier: "device" for a worker's own KV cache, "host" for its host-memory tier,
engine/kv_host_tier.py) that hold it, built from the KV events the workers
report (engine/block_manager.py records them, worker_common/kv_events.py answers them in
WorkerStats.kv_events, router/pool.py asks for them with each Stats poll and applies the answer
here). The hashes are the engine's own (`chain_hashes` computes them as
engine/block_manager.py's block_hash does, as 16-byte digests), so a prompt's match is exact up
to the worker's block size.

Per worker the index keeps its place in that worker's event stream (epoch, last sequence
applied). An answer continues from that place, or says "reset" (the router fell behind the
worker's ring, or the worker restarted with a new epoch) and brings a bounded snapshot of the
hashes it caches: the worker's entries are replaced by it. An answer that does not fit the place
it was asked from (a gap in the sequence numbers, another epoch without a reset) breaks the
stream: the worker's entries are dropped and the next poll asks from nowhere (epoch 0), which
gets a reset. A worker that leaves, dies, re-registers or changes role is forgotten the same way
(`forget`). Dropping is always safe: a missing entry costs a recompute, never a wrong token.

Tiers: an entry is (worker, tier), and a worker may hold a block in both tiers at once (a block
restored from its host tier stays there too). Events name their tier: a block the cache evicts
into the host tier arrives as "removed" (device) then "stored" (host); one the tier pushes out as
"removed" (host); "cleared" drops both. A reset brings both snapshots. A match counts a block
held in either tier (the worker restores a host block before its prefill), and says how many of
the matched tokens are only in the host tier (`matched_by_tier`), which the pool prices a little
dearer than device hits (router/pool.py).

A hybrid model's worker (its answers say `states`) also reports after which blocks it holds a
recurrent state ("state" entries, beside the block's own): its engine starts a prompt's recurrent
layers from the state after the prompt's last cached block that has one, and computes the rest,
so its match ends there, however many more blocks it holds. A finished request's prompt and
answer, which the router just saw it compute, are expected with a state after their last block
(its engine keeps the state where a sequence's computed tokens last passed a block boundary),
until the next poll's answer says.

Between polls the index lags the workers by up to a poll period. What the router itself just
sent to a worker (a reservation's prompt, a finished turn's prompt and answer: router/legs.py)
is added as an expectation (`expect`), matched like an entry until the answer to a poll sent after
it is applied: by then the worker's own events say whether it stored those blocks.

Bounded: at most `max_entries` hashes (LRU by their last "stored"), which the pool sets to the
blocks its reporting workers hold together (`fit_to_blocks`): no true entry is pushed out. One
lock guards it all; the health thread applies answers, the request threads match prompts.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict

DEVICE, HOST, STATE = "device", "host", "state"
HASH_BYTES = 16
DEFAULT_MAX_ENTRIES = 1 << 18  # 16M tokens of 64-token blocks; the pool sets the real bound
MIN_ENTRIES = 1024


def chain_hashes(tokens, block_size: int) -> list[bytes]:
    """The engine's block hashes (engine/block_manager.py block_hash, as 16-byte little-endian
    digests) of the full blocks of `tokens`."""
    out, parent = [], b""
    for i in range(0, len(tokens) - len(tokens) % block_size, block_size):
        h = hashlib.blake2b(digest_size=HASH_BYTES)
        h.update(parent)
        h.update(array("q", tokens[i : i + block_size]).tobytes())
        parent = h.digest()
        out.append(parent)
    return out


def split_hashes(packed: bytes) -> list[bytes]:
    return [packed[i : i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES)]


class _Stream:
    """One worker's place in its event stream, and what the index holds of it."""

    __slots__ = ("epoch", "last_seq", "synced", "held", "expected", "states", "expected_states")

    def __init__(self):
        self.epoch = self.last_seq = 0
        self.synced = False  # an answer was applied since the worker was last forgotten
        self.held: set[tuple[bytes, str]] = set()  # (hash, tier)
        self.expected: dict[bytes, int] = {}  # hash -> the poll number it waits past: `expect`
        self.states = False  # a hybrid's worker: its matches end at a block with a state
        self.expected_states: dict[bytes, int] = {}  # as `expected`, for states


class KVIndex:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES):
        self.max_entries = max_entries
        self._lock = threading.Lock()
        # hash -> ((worker, tier), ...), least recently stored first
        self._holders: OrderedDict[bytes, tuple] = OrderedDict()
        self._streams: dict[object, _Stream] = {}
        self.resets = self.breaks = 0  # answers that reset a worker's entries, streams broken

    def __len__(self) -> int:
        return len(self._holders)

    # ---- the event streams --------------------------------------------------------------------
    def position(self, worker) -> tuple[int, int]:
        """(epoch, last sequence applied) of `worker`'s stream: what its next poll asks from."""
        with self._lock:
            stream = self._streams.get(worker)
            return (stream.epoch, stream.last_seq) if stream else (0, 0)

    def synced(self, worker) -> bool:
        """Whether the index can answer for `worker`: an answer of its was applied since it was
        last forgotten."""
        with self._lock:
            stream = self._streams.get(worker)
            return bool(stream and stream.synced)

    def apply(self, worker, asked: tuple[int, int], events, poll: int = 0) -> str:
        """Applies `events` (a KVEvents), the answer to a poll of `worker` numbered `poll` that
        asked from `asked` (epoch, after). Returns what it did: "events", "reset", "stale" (the
        worker's place moved since the poll was sent: ignored) or "broken" (dropped)."""
        with self._lock:
            stream = self._streams.get(worker)
            if stream is None and tuple(asked) == (0, 0):
                stream = self._streams[worker] = _Stream()
            if stream is None or (stream.epoch, stream.last_seq) != tuple(asked):
                return "stale"
            if stream.expected:
                stream.expected = {h: p for h, p in stream.expected.items() if p >= poll}
            if stream.expected_states:
                stream.expected_states = {
                    h: p for h, p in stream.expected_states.items() if p >= poll
                }
            stream.states = events.states
            if events.reset:
                self._drop(worker, stream)
                for h in split_hashes(events.snapshot):
                    self._add(h, worker, DEVICE, stream)
                for h in split_hashes(events.host_snapshot):
                    self._add(h, worker, HOST, stream)
                for h in split_hashes(events.state_snapshot):
                    self._add(h, worker, STATE, stream)
                stream.epoch, stream.last_seq, stream.synced = events.epoch, events.last_seq, True
                self.resets += 1
                self._evict()
                return "reset"
            count = sum(len(r.block_hashes) // HASH_BYTES or 1 for r in events.runs)
            if events.epoch != stream.epoch or events.last_seq != stream.last_seq + count:
                self._drop(worker, stream)
                stream.epoch = stream.last_seq = 0
                self.breaks += 1
                return "broken"
            for run in events.runs:
                if run.kind == "stored":
                    for h in split_hashes(run.block_hashes):
                        self._add(h, worker, run.tier or DEVICE, stream)
                elif run.kind == "removed":
                    for h in split_hashes(run.block_hashes):
                        self._remove(h, worker, run.tier or DEVICE, stream)
                elif run.kind == "cleared":
                    self._drop(worker, stream)
            stream.last_seq, stream.synced = events.last_seq, True
            self._evict()
            return "events"

    def expect(self, worker, hashes: list[bytes], poll: int, state: bool = False) -> None:
        """The router sent `worker` the blocks of `hashes` (it computes or receives their KV):
        matched as held until an answer to a poll numbered above `poll` is applied; with
        `state`, for a hybrid's worker, with a state after the last of them."""
        if not hashes:
            return
        with self._lock:
            stream = self._streams.get(worker)
            if stream is not None and stream.synced:
                stream.expected.update(dict.fromkeys(hashes, poll))
                if state and stream.states:
                    stream.expected_states[hashes[-1]] = poll

    def forget(self, worker) -> None:
        """`worker` left, died, re-registered or changed role: its entries and its place go."""
        with self._lock:
            stream = self._streams.pop(worker, None)
            if stream is not None:
                self._drop(worker, stream)

    # ---- matching -----------------------------------------------------------------------------
    def matched_tokens(self, prompt, block_sizes: dict) -> dict:
        """worker -> the leading tokens of `prompt` it holds (whole blocks, contiguous from the
        start, in either tier), for the synced workers among `block_sizes` (worker -> its block
        size)."""
        return {w: n for w, (n, _) in self.matched_by_tier(prompt, block_sizes).items()}

    def matched_by_tier(self, prompt, block_sizes: dict) -> dict:
        """worker -> (the leading tokens of `prompt` it holds, in either tier; how many of those
        are in its host tier only), as matched_tokens; a hybrid's worker's through its last such
        block with a state after it."""
        by_size: dict[int, list] = {}
        for worker, size in block_sizes.items():
            by_size.setdefault(size, []).append(worker)
        matched: dict = {}
        for size, workers in by_size.items():
            chain = chain_hashes(list(prompt), size)
            with self._lock:
                streams = {
                    w: s for w in workers if (s := self._streams.get(w)) is not None and s.synced
                }
                for worker, stream in streams.items():
                    n = host = 0
                    usable = (0, 0)  # (n, host) through the last block with a state
                    for h in chain:
                        tiers = {t for w, t in self._holders.get(h, ()) if w is worker}
                        if DEVICE not in tiers and h not in stream.expected:
                            if HOST not in tiers:
                                break
                            host += 1
                        n += 1
                        if STATE in tiers or h in stream.expected_states:
                            usable = (n, host)
                    if stream.states:
                        n, host = usable
                    matched[worker] = (n * size, host * size)
        return matched

    # ---- bounds -------------------------------------------------------------------------------
    def fit_to_blocks(self, num_blocks: int) -> None:
        """Bounds the index by the blocks the reporting workers hold together (no worker caches
        more hashes than it has blocks), at least MIN_ENTRIES; 0 (nothing known): unchanged."""
        if num_blocks > 0:
            with self._lock:
                self.max_entries = max(MIN_ENTRIES, num_blocks)
                self._evict()

    # ---- under the lock -----------------------------------------------------------------------
    def _add(self, h: bytes, worker, tier: str, stream: _Stream) -> None:
        holders = self._holders.get(h)
        if holders is None:
            self._holders[h] = ((worker, tier),)
        else:
            self._holders.move_to_end(h)
            if not any(w is worker and t == tier for w, t in holders):
                self._holders[h] = holders + ((worker, tier),)
        stream.held.add((h, tier))

    def _remove(self, h: bytes, worker, tier: str, stream: _Stream) -> None:
        stream.held.discard((h, tier))
        holders = self._holders.get(h)
        if holders is None:
            return
        rest = tuple(p for p in holders if not (p[0] is worker and p[1] == tier))
        if rest:
            self._holders[h] = rest
        else:
            del self._holders[h]

    def _drop(self, worker, stream: _Stream) -> None:
        for h, tier in list(stream.held):
            self._remove(h, worker, tier, stream)
        stream.expected = {}
        stream.expected_states = {}
        stream.synced = False

    def _evict(self) -> None:
        while len(self._holders) > self.max_entries:
            h, holders = self._holders.popitem(last=False)
            for worker, tier in holders:
                stream = self._streams.get(worker)
                if stream is not None:
                    stream.held.discard((h, tier))
