"""Live traffic captured as a replayable trace: one line per finished request, in the Mooncake
format `pdserve bench --trace` and `pdserve tune --workload` read (tuning/workload.py).

    {"timestamp": 1532, "input_length": 2210, "output_length": 128, "hash_ids": [0, 1, 2, 7, 8]}

timestamp: milliseconds from the first captured request's arrival at the router; input_length
and output_length: prompt and generated tokens (all sequences of an n > 1 request); hash_ids: one
id per 512-token block of the prompt (the last, partial one included, as Mooncake's traces
have), equal ids for equal prefixes: block i's id names the chain of the prompt's first i + 1
blocks, hashed with a key drawn when the capture starts, so the file holds lengths, times and
which prompts shared which prefix, never a token. A replay builds equal token blocks for equal
ids, so shared prefixes replay as shared and hit the prefix cache as the originals did.

Lifecycle: the Router builds one when `observability.capture_trace` (`pdserve up
--capture-trace FILE`) is set and closes it when it stops. `record` (the response path of
every finished request) only puts the request on a bounded queue (a full queue drops it and
counts the drop); one writer thread hashes the prompt, appends the line, and rotates the file to
FILE.1 when it passes max_bytes (one older file is kept). The id map is bounded too: past
MAX_CHAINS distinct chains, new ones get fresh ids without being remembered (their later
repeats replay as unshared). A file that cannot be opened or written is one error line, and the
capture stops; serving never does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import secrets
import threading
import time
from array import array

log = logging.getLogger(__name__)

BLOCK_TOKENS = 512  # Mooncake's hash_ids block (tuning/workload.py MOONCAKE_BLOCK_TOKENS)
MAX_CHAINS = 1 << 20  # distinct prefix chains remembered (about 100 MB of map at most)
QUEUE_SIZE = 10_000  # finished requests waiting for the writer
DEFAULT_MAX_BYTES = 256 << 20


def _digest(tokens: list[int], parent: bytes) -> bytes:
    """The chain digest of a block of `tokens` after the chain `parent` (keyed: the first one is
    the capture's key)."""
    return hashlib.blake2b(array("I", tokens).tobytes(), key=parent[:16], digest_size=16).digest()


class TraceCapture:
    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES):
        self.path, self.max_bytes = path, max_bytes
        self._key = secrets.token_bytes(16)
        self._ids: dict[bytes, int] = {}  # chain digest -> id
        # parent chain digest -> [tokens, chain digest, id (None once claimed)] of partial blocks
        self._partials: dict[bytes, list[list]] = {}
        self._next_id = 0
        self._t0_ns: int | None = None
        self._queue: queue.Queue = queue.Queue(QUEUE_SIZE)
        self.written = self.dropped = 0
        self._file = None
        self.failed: str | None = None
        try:
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - the writer owns it
        except OSError as e:
            self._fail(f"cannot open {path!r} for appending: {e.strerror or e}")
        self._thread = threading.Thread(target=self._run, name="pdserve-capture", daemon=True)
        if self._file is not None:
            self._thread.start()

    # ---- the response path ----------------------------------------------------------------------
    def record(self, arrival_unix_ns: int, prompt: list[int], output_len: int) -> None:
        """A finished request; never blocks."""
        if self._file is None:
            return
        try:
            self._queue.put_nowait((arrival_unix_ns, prompt, output_len))
        except queue.Full:
            self.dropped += 1

    # ---- the writer -----------------------------------------------------------------------------
    def hash_ids(self, prompt: list[int]) -> list[int]:
        """One id per BLOCK_TOKENS tokens of `prompt` (the module docstring). A replay fills a
        partial last block with the first tokens of its id's block, so a full block that extends
        a partial one seen before under the same prefix takes the partial's id: the two prompts
        then share those tokens in the replay too (once per partial block; a partial block seen
        after the full one it begins gets an id of its own)."""
        out, parent = [], self._key
        for start in range(0, len(prompt), BLOCK_TOKENS):
            tokens = prompt[start : start + BLOCK_TOKENS]
            chain = _digest(tokens, parent)
            got = self._ids.get(chain)
            if got is None:
                full = len(tokens) == BLOCK_TOKENS
                got = self._claim_partial(parent, tokens) if full else None
                if got is None:
                    got = self._next_id
                    self._next_id += 1
                if len(self._ids) < MAX_CHAINS:
                    self._ids[chain] = got
                    if not full:
                        self._partials.setdefault(parent, []).append([len(tokens), chain, got])
            out.append(got)
            parent = chain
        return out

    def _claim_partial(self, parent: bytes, tokens: list[int]) -> int | None:
        """The id of an unclaimed partial block under `parent` that `tokens` begins with."""
        for entry in self._partials.get(parent, ()):
            n, chain, got = entry
            if got is not None and _digest(tokens[:n], parent) == chain:
                entry[2] = None  # claimed: one full block per partial
                return got
        return None

    def line(self, arrival_unix_ns: int, prompt: list[int], output_len: int) -> str:
        if self._t0_ns is None:
            self._t0_ns = arrival_unix_ns
        record = {
            "timestamp": max(0, (arrival_unix_ns - self._t0_ns) // 1_000_000),
            "input_length": len(prompt),
            "output_length": output_len,
            "hash_ids": self.hash_ids(prompt),
        }
        return json.dumps(record, separators=(", ", ": ")) + "\n"

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            try:
                self._file.write(self.line(*item))
                self.written += 1
                if self._queue.empty():
                    self._file.flush()
                if self._file.tell() >= self.max_bytes:
                    self._rotate()
            except (OSError, ValueError) as e:  # a full disk, a file gone, ...
                self._fail(f"writing {self.path!r} failed: {e}")
                break

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, self.path + ".1")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def _fail(self, why: str) -> None:
        self.failed = why
        log.error("trace capture stopped: %s; serving goes on", why)
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
        self._file = None

    def close(self, timeout_s: float = 10.0) -> None:
        """Writes what is queued (within timeout_s), then closes the file."""
        if self._thread.is_alive():
            deadline = time.monotonic() + timeout_s
            while not self._queue.empty() and time.monotonic() < deadline:
                time.sleep(0.01)
            try:
                self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                pass
            self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
        if self._file is not None:
            self._file.close()
            self._file = None
