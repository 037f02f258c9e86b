"""The disk level below the host KV tier: entries the host tier pushes out are written to files in
a directory of this worker's, bounded in bytes, and read back when a later prompt needs them.

Why it exists, and where it pays. Reading a block back must cost less than computing its tokens
again (issue 49 item 5). On the development machine (an AMD EPYC VM, 2 cores, ext4 on a virtio
disk) `python -m benchmarks.transfer.disk_tier` measured a 368,640-byte block (SmolLM2, bf16 KV,
16 tokens) read back in about 0.4-0.7 ms with the page cache dropped or bypassed (O_DIRECT), and
about 0.13 ms from the page cache, against 23-58 ms of prefill to recompute it (one thread, the
machine shared); served through the engine, a restore from a cold disk cost about 2 ms a block.
architecture.md section 11 has the figures. On a GPU the same read lands in host memory first (the host tier's
own GPU caveat applies: nothing here was measured on a GPU).

Who owns what when. The host tier (engine/kv_host_tier.py) hands over an entry it pushes out
(`put`: its parent hash, tokens, every rank's shard and their CRC-32); from then on this tier owns
that entry until it is pushed out here (LRU) or cleared. A put first takes its bytes against the
cap, pushing out least recently used entries (a high/low watermark, as the host tier), then queues
the entry for the writer thread; until the file is written the entry is served from memory (a
"pending" entry), after that from its file. The writer thread owns the files: it writes each
queued entry to its file and unlinks the files of entries pushed out, in the order the engine
thread asked, so the bytes on disk never exceed the cap (an unlink asked before a write runs
before it). The entries waiting for the writer are host memory beyond the host tier's cap, so
they are bounded too (`queue_bytes`, 64 MiB by default: 182 SmolLM2 bf16 blocks): a put that
would pass that bound is dropped (counted), and the block is recomputed when needed, which is
what it would cost without this tier. A burst (a long prefill evicting a hundred blocks in one
step) can fill it faster than the writer drains it on a loaded machine.

One file per block, named by the block hash: a push-out is one unlink (no log to compact), a
torn or corrupt file loses one block, and the page cache keeps whatever files it can. A file is
a magic, a header length and its CRC-32, a JSON header (the engine's KV layout fingerprint, the
block hash, its parent hash and tokens, each shard's dtype and shape, the payload's CRC-32) and
the shards' bytes in rank order. `load` reads the file on the engine thread (about 0.6 ms for a
SmolLM2 block) and checks the header's CRC, the fingerprint and hash against the key, the file's
length against the shards, and the payload against its CRC; the host tier then checks the chain
and shapes as for its own entries. A file that fails any check is refused (counted), deleted and
the block recomputed; nothing is served that was not written for this engine's layout.

Where the files live: `directory` (kv_disk_tier_dir, default the pdserve cache dir's
kv-disk-tier/), in a subdirectory of this worker's own, w<pid>-<random>, created 0700 (the parent
too when this creates it). At start the subdirectories of dead workers (their pid no longer runs)
are removed; `close` stops the writer and removes this worker's subdirectory, files and all.

Threads: the engine thread calls put, contains, touch, load, discard, clear and take_lost; the
writer thread runs `_write_loop`; the worker's Stats reads the counters and `hashes` (KV events).
One lock guards the index, the queue and the lost list; a file is read without it (only the engine
thread removes an entry whose file is written, so nothing unlinks a file while it reads it).

Entries that leave without the engine thread asking. Every removal but one happens on the engine
thread, which reports it itself: what `put` pushes out it returns, a refused `load` or a `discard`
shows in `refused`, `clear` is the prefix cache's reset. The one that does not is a write that
fails (disk full, I/O error): the writer thread drops the entry (counted in `write_errors`) and
appends its hash to a list, and the engine thread takes that list (`take_lost`, under the lock)
and reports the blocks "removed" as it reports a push-out (engine/block_manager.py `reap_tier`),
so the router's block index stops counting on them. The writer never touches the block manager.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import struct
import threading
import zlib
from collections import OrderedDict, deque

import torch

from pdserve.kvpool import pid_alive

# after a put would pass the cap, entries are pushed out until the bytes are at most this share
# of it (with the new entry)
WATERMARK = 0.9
# the bytes of the entries waiting for the writer, at most; a put beyond them is dropped (one
# entry is always let in when none waits)
QUEUE_BYTES = 64 << 20
MAGIC = b"PDKVDSK1"
_PREFIX = struct.Struct("<8sII")  # magic, header length, header CRC-32
SUBDIR = "kv-disk-tier"

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


def default_dir() -> str:
    from pdserve.engine.loader import default_cache_dir

    return str(default_cache_dir() / SUBDIR)


def remove_stale(base: str) -> list[str]:
    """Removes the subdirectories w<pid>-* of `base` whose pid no longer runs; returns them."""
    gone = []
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return gone
    for name in names:
        pid = name[1:].split("-", 1)[0]
        if not (name.startswith("w") and pid.isdigit()) or pid_alive(int(pid)):
            continue
        path = os.path.join(base, name)
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone


class Loaded:
    """An entry read back: the host tier checks it as its own (kv_host_tier._Entry's fields)."""

    __slots__ = ("parent_hash", "token_ids", "shards", "crc", "nbytes")

    def __init__(self, parent_hash, token_ids, shards, crc):
        self.parent_hash = parent_hash
        self.token_ids = tuple(token_ids)
        self.shards = shards
        self.crc = crc
        self.nbytes = sum(s.numel() * s.element_size() for s in shards)


class _Pending(Loaded):
    """An entry queued for the writer: what the host tier handed over, until written."""

    __slots__ = ("cancelled",)

    def __init__(self, parent_hash, token_ids, shards, crc):
        super().__init__(parent_hash, token_ids, shards, crc)
        self.cancelled = False


def _header(fp: bytes, h: int, entry) -> bytes:
    return json.dumps(
        dict(
            fp=fp.hex(),
            hash=f"{h:x}",
            parent=None if entry.parent_hash is None else f"{entry.parent_hash:x}",
            tokens=list(entry.token_ids),
            shards=[[str(s.dtype).removeprefix("torch."), list(s.shape)] for s in entry.shards],
            crc=entry.crc,
        ),
        separators=(",", ":"),
    ).encode()


def _file_bytes(header: bytes, entry) -> int:
    return _PREFIX.size + len(header) + entry.nbytes


class DiskTier:
    """capacity_bytes: the files' bytes at most; directory: where this worker's subdirectory is
    made (None: default_dir()); fp: the engine's layout fingerprint (kv_host_tier.fingerprint)."""

    def __init__(
        self,
        capacity_bytes: int,
        directory: str | None,
        fp: bytes,
        watermark: float = WATERMARK,
        queue_bytes: int = QUEUE_BYTES,
    ):
        if capacity_bytes <= 0:
            raise ValueError(f"a disk tier needs capacity_bytes > 0, got {capacity_bytes}")
        if not 0.0 < watermark <= 1.0:
            raise ValueError(f"watermark must be in (0, 1], got {watermark}")
        if queue_bytes < 1:
            raise ValueError(f"queue_bytes must be >= 1, got {queue_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.watermark = watermark
        self.queue_bytes = queue_bytes
        self.fingerprint = fp
        self.base = os.path.abspath(os.path.expanduser(directory or default_dir()))
        try:
            os.makedirs(self.base, mode=0o700, exist_ok=True)
            self.stale_removed = remove_stale(self.base)
            self.dir = os.path.join(self.base, f"w{os.getpid()}-{secrets.token_hex(4)}")
            os.mkdir(self.dir, 0o700)
        except OSError as e:
            raise ValueError(
                f"kv_disk_tier_dir {self.base!r} cannot be used: {e.strerror or e}; set "
                f"kv_disk_tier_dir to a directory this worker can write"
            ) from None
        # (fp, hash) -> [file bytes, _Pending or None once written]; least recently used first
        self._index: OrderedDict[tuple[bytes, int], list] = OrderedDict()
        self._ops: deque = deque()  # ("write", key, header, entry) | ("unlink", key)
        self._pending = 0  # the bytes of the writes queued or in progress
        self._cond = threading.Condition()
        self._closed = False
        self.bytes = 0  # the files' bytes, written or queued
        self.peak_bytes = 0
        self.stored = self.restored = self.evicted = self.refused = self.dropped = 0
        self.write_errors = 0
        # the hashes (this fingerprint's) whose entries the writer dropped, its write having
        # failed, not yet taken by the engine thread (`take_lost`)
        self._lost: list[int] = []
        self.write_s = 0.0  # the writer's time in writes, summed (its cost per block: / stored)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()

    # ---- the engine thread ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._index)

    def contains(self, h: int) -> bool:
        return (self.fingerprint, h) in self._index

    def touch(self, h: int) -> None:
        key = (self.fingerprint, h)
        with self._cond:
            if key in self._index:
                self._index.move_to_end(key)

    def hashes(self) -> list[int]:
        """The hashes held under this engine's fingerprint, least recently used first."""
        with self._cond:
            return [h for fp, h in self._index if fp == self.fingerprint]

    def put(self, h: int, parent_hash, token_ids: tuple, shards: list, crc: int) -> tuple:
        """Takes the host tier's entry of `h` (shards: CPU tensors this tier may keep; crc: their
        CRC-32). Returns (whether it was taken, the hashes pushed out to make room)."""
        key = (self.fingerprint, h)
        with self._cond:
            if self._closed:
                return False, []
            if key in self._index:
                self._index.move_to_end(key)
                return False, []
            entry = _Pending(parent_hash, token_ids, shards, crc)
            header = _header(self.fingerprint, h, entry)
            size = _file_bytes(header, entry)
            if size > self.capacity_bytes:
                return False, []
            if self._pending and self._pending + entry.nbytes > self.queue_bytes:
                self.dropped += 1
                return False, []
            dropped = []
            if self.bytes + size > self.capacity_bytes:
                low = max(0, int(self.capacity_bytes * self.watermark) - size)
                while self._index and self.bytes > low:
                    (fp, old), _ = next(iter(self._index.items()))
                    self._remove((fp, old))
                    self.evicted += 1
                    if fp == self.fingerprint:
                        dropped.append(old)
            self._index[key] = [size, entry]
            self.bytes += size
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            self._pending += entry.nbytes
            self._ops.append(("write", key, header, entry))
            self._cond.notify()
            self.stored += 1
            return True, dropped

    def load(self, h: int):
        """The entry of `h` (a Loaded, or the pending one) once its file passes this tier's
        checks (module docstring); None when it is not held, or refused (then deleted). The
        host tier checks the rest and counts the restore (`restored`) or calls `discard`."""
        key = (self.fingerprint, h)
        with self._cond:
            item = self._index.get(key)
            if item is None:
                return None
            size, pending = item
            if pending is not None:  # not written yet: served from memory
                self._index.move_to_end(key)
                return pending
        entry = self._read(key, size)
        with self._cond:
            if entry is None:
                if key in self._index:
                    self._remove(key)
                self.refused += 1
                return None
            if key in self._index:
                self._index.move_to_end(key)
            return entry

    def discard(self, h: int) -> None:
        """Drops the entry of `h` (the host tier refused what `load` gave: chain or shapes)."""
        key = (self.fingerprint, h)
        with self._cond:
            if key in self._index:
                self._remove(key)
                self.refused += 1

    def clear(self) -> list[int]:
        """Drops every entry (their files are unlinked by the writer); returns the hashes that
        were held under this fingerprint."""
        with self._cond:
            gone = [h for fp, h in self._index if fp == self.fingerprint]
            for key in list(self._index):
                self._remove(key)
            return gone

    def take_lost(self) -> list[int]:
        """The hashes whose entries the writer dropped since the last call (their files could not
        be written), for the engine thread to report as gone (module docstring)."""
        if not self._lost:  # (read without the lock: one appended meanwhile waits for the next)
            return []
        with self._cond:
            lost, self._lost = self._lost, []
            return lost

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued write and unlink is done; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._ops and not self._busy, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Stops the writer (after the operations queued so far) and removes this worker's
        directory and every file in it. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout)
        shutil.rmtree(self.dir, ignore_errors=True)
        with self._cond:
            self._index.clear()
            self.bytes = 0

    def files_bytes(self) -> int:
        """The bytes of the files in this worker's directory now (a test's check of the cap)."""
        total = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.dir):
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat().st_size
        return total

    def path(self, h: int) -> str:
        return os.path.join(self.dir, f"{h:032x}.kv")

    def stats(self) -> dict:
        return dict(
            kv_disk_tier_bytes=self.bytes,
            kv_disk_tier_capacity_bytes=self.capacity_bytes,
            kv_disk_tier_blocks=len(self._index),
            kv_disk_tier_stored=self.stored,
            kv_disk_tier_restored=self.restored,
            kv_disk_tier_evicted=self.evicted,
            kv_disk_tier_dropped=self.dropped,
            kv_disk_tier_refused=self.refused,
            kv_disk_tier_write_errors=self.write_errors,
        )

    # ---- internals ------------------------------------------------------------------------------
    _busy = False  # the writer is between taking an operation and finishing it

    def _remove(self, key) -> None:
        """Drops `key` from the index (under the lock); its file goes by the writer, after any
        write of it queued before."""
        size, pending = self._index.pop(key)
        self.bytes -= size
        if pending is not None:
            pending.cancelled = True
        self._ops.append(("unlink", key))
        self._cond.notify()

    def _read(self, key, size: int):
        """Reads and checks the file of `key` (engine thread, no lock held); None when refused."""
        fp, h = key
        try:
            with open(self.path(h), "rb") as f:
                data = f.read(size + 1)
        except OSError:
            return None
        if len(data) != size or len(data) < _PREFIX.size:
            return None
        magic, hlen, hcrc = _PREFIX.unpack_from(data)
        start = _PREFIX.size + hlen
        if magic != MAGIC or start > len(data):
            return None
        raw = data[_PREFIX.size : start]
        if zlib.crc32(raw) != hcrc:
            return None
        try:
            head = json.loads(raw)
            if head["fp"] != fp.hex() or int(head["hash"], 16) != h:
                return None
            parent = None if head["parent"] is None else int(head["parent"], 16)
            specs = [(_DTYPES[d], tuple(int(x) for x in shape)) for d, shape in head["shards"]]
            tokens = tuple(int(t) for t in head["tokens"])
            crc = int(head["crc"])
        except (ValueError, KeyError, TypeError):
            return None
        payload = memoryview(data)[start:]
        want = sum(torch.Size(shape).numel() * dtype.itemsize for dtype, shape in specs)
        if want != len(payload) or zlib.crc32(payload) != crc:
            return None
        shards, off = [], 0
        buf = bytearray(payload)  # writable, so the tensors need no copy of their own
        for dtype, shape in specs:
            n = torch.Size(shape).numel() * dtype.itemsize
            flat = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=off)
            shards.append(flat.view(dtype).reshape(shape))
            off += n
        return Loaded(parent, tokens, shards, crc)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()  # a flush may be waiting
                self._cond.wait_for(lambda: self._ops or self._closed)
                if not self._ops:  # closed, and nothing left
                    return
                op = self._ops.popleft()
                self._busy = True
            if op[0] == "unlink":
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(op[1][1]))
                continue
            _, key, header, entry = op
            ok = entry.cancelled or self._write(key, header, entry)
            with self._cond:
                self._pending -= entry.nbytes
                item = self._index.get(key)
                if item is not None and item[1] is entry:
                    if ok:
                        item[1] = None  # written: served from its file from now on
                    else:  # not written (disk full, I/O error): the entry goes
                        self._remove(key)
                        self.write_errors += 1
                        if key[0] == self.fingerprint:
                            self._lost.append(key[1])

    def _write(self, key, header: bytes, entry: _Pending) -> bool:
        import time

        t = time.perf_counter()
        path = self.path(key[1])
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                parts = [_PREFIX.pack(MAGIC, len(header), zlib.crc32(header)), header]
                parts += [s.reshape(-1).view(torch.uint8).numpy() for s in entry.shards]
                want = sum(len(memoryview(p).cast("B")) for p in parts)
                if os.writev(fd, parts) != want:
                    raise OSError("short write")
            finally:
                os.close(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            return False
        self.write_s += time.perf_counter() - t
        return True
