"""Would a disk tier below the host KV tier pay here? Reading a block back against recomputing it.

    python -m benchmarks.transfer.disk_tier                    # SmolLM2, bf16 KV, ~2-4 min
    python -m benchmarks.transfer.disk_tier --quick            # smoke run
    python -m benchmarks.transfer.disk_tier --skip-engine      # the disk side only

Issue 49 item 5 allows a disk tier below the host tier (engine/kv_host_tier.py) only if reading
a block back measures faster than recomputing its tokens. This script measures both sides on this
machine and prints one JSON object (and writes it to --out when given; no result file is kept in
the repository).

Recompute (the engine side): SmolLM2 with a bfloat16 KV cache (the --host-tier benchmark's
setting, so a block is 368,640 bytes), speculative decoding off, --threads torch threads. For each
prefix length L: the TTFT of a cold prompt of L + S tokens against the TTFT of the same L tokens,
cached, followed by S fresh tokens (S = --suffix); the difference is what a prefix hit of L tokens
saves, and divided by L / 16 it is the recompute cost per block. Medians over --repeats.

Served from disk (the same engine, with the tiers on: a KV cache of POOL_BLOCKS, a host tier of
HOST_BLOCKS and a disk tier below it, engine/kv_disk_tier.py): after the cached measurement, two
filler prompts push the prefix out of the cache and the host tier onto disk; the disk tier's
files are then dropped from the page cache (fsync, posix_fadvise DONTNEED) and the TTFT of the
prefix with S fresh tokens is timed: a cold disk's restore of L / 16 blocks plus S tokens' prefill.

Disk (the tier side): --blocks blocks of the engine's block bytes (random data, each file a
64-byte header and the payload, one file per block) under each directory of --dirs (default: the
temp dir and the pdserve cache dir). Per block, medians and means:

  write        open, write the header and payload, close (no fsync): what a save costs the
               thread that does it, with the page cache taking the bytes
  write_fsync  the same with an fsync before the close (a durable write; a cache does not need it)
  read_cached  open, read into a preallocated buffer, CRC-32, close: the page cache holds the file
  read_dropped the same after fsync and posix_fadvise(DONTNEED) of every file (the kernel drops
               their clean pages, so the reads go to the device); the page cache's drop is checked
               with the "Cached" line of /proc/meminfo before and after
  read_direct  O_DIRECT reads into a page-aligned buffer (no page cache at all; the file's size is
               rounded up to 4096 bytes)

A virtual machine's disk may itself be cached by the host, which the guest cannot drop: the
dropped and direct reads are what this guest sees, not a bare SSD's figures.
"""

from __future__ import annotations

import json
import mmap
import os
import statistics
import sys
import tempfile
import time
import zlib

from benchmarks import bench_common as bc

HEADER = 64
# the engine side's tiers: a cache that holds one 2112-token prompt, a small host tier, a roomy disk
POOL_BLOCKS, HOST_BLOCKS, DISK_BLOCKS = 160, 16, 1024
ALIGN = 4096


def meminfo_cached_kb() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Cached:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def summary(times_s: list[float], nbytes: int) -> dict:
    med = statistics.median(times_s)
    mean = statistics.fmean(times_s)
    return dict(
        ms_median=round(med * 1e3, 4),
        ms_mean=round(mean * 1e3, 4),
        ms_p90=round(sorted(times_s)[int(0.9 * (len(times_s) - 1))] * 1e3, 4),
        mb_s_mean=round(nbytes / mean / 1e6, 1),
    )


def disk_side(directory: str, blocks: int, block_bytes: int, seed: int = 0) -> dict:
    """Writes and reads back `blocks` files of `block_bytes` under a fresh directory in
    `directory` (removed afterwards); the per-block costs of each mode (module docstring)."""
    import random

    rnd = random.Random(seed)
    payloads = [rnd.randbytes(block_bytes) for _ in range(min(blocks, 16))]
    out: dict = dict(dir=directory, blocks=blocks, block_bytes=block_bytes)
    os.makedirs(directory, exist_ok=True)
    work = tempfile.mkdtemp(prefix="disk-tier-bench-", dir=directory)
    try:
        paths = [os.path.join(work, f"{i:06d}.kv") for i in range(blocks)]
        size = HEADER + block_bytes
        header = b"\0" * HEADER
        # the page cache takes every write (no fsync): the save path's cost
        times = []
        for i, p in enumerate(paths):
            data = payloads[i % len(payloads)]
            t = time.perf_counter()
            crc = zlib.crc32(data)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, header[:-4] + crc.to_bytes(4, "little"))
                os.write(fd, data)
            finally:
                os.close(fd)
            times.append(time.perf_counter() - t)
        out["write"] = summary(times, size)
        buf = bytearray(size)
        view = memoryview(buf)

        def read_all(flags: int = 0, into=view, length: int = size) -> list[float]:
            ts = []
            for p in paths:
                t = time.perf_counter()
                fd = os.open(p, os.O_RDONLY | flags)
                try:
                    n = os.preadv(fd, [into[:length]], 0)
                finally:
                    os.close(fd)
                zlib.crc32(into[HEADER : HEADER + block_bytes])
                ts.append(time.perf_counter() - t)
                if n < size:
                    raise RuntimeError(f"{p}: read {n} of {size} bytes")
            return ts

        read_all()  # the page cache holds every file now
        out["read_cached"] = summary(read_all(), size)
        # fsync each (so its pages are clean), then ask the kernel to drop them
        before = meminfo_cached_kb()
        times = []
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                t = time.perf_counter()
                os.fsync(fd)
                times.append(time.perf_counter() - t)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        after = meminfo_cached_kb()
        out["fsync_clean_ms_mean"] = round(statistics.fmean(times) * 1e3, 4)
        if before is not None and after is not None:
            out["page_cache_dropped_mib"] = round((before - after) / 1024, 1)
            out["files_mib"] = round(blocks * size / 2**20, 1)
        out["read_dropped"] = summary(read_all(), size)
        # O_DIRECT: an aligned buffer, a length rounded up to the alignment
        if hasattr(os, "O_DIRECT"):
            aligned = -(-size // ALIGN) * ALIGN
            mm = mmap.mmap(-1, aligned)
            try:
                mv = memoryview(mm)
                try:
                    out["read_direct"] = summary(
                        read_all(os.O_DIRECT, into=mv, length=aligned), size
                    )
                except OSError as e:
                    out["read_direct"] = dict(error=str(e))
                finally:
                    mv.release()
            finally:
                mm.close()
        # a durable write: fsync each file before closing it
        times = []
        for i, p in enumerate(paths):
            data = payloads[i % len(payloads)]
            t = time.perf_counter()
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, header)
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            times.append(time.perf_counter() - t)
        out["write_fsync"] = summary(times, size)
    finally:
        for name in os.listdir(work):
            os.unlink(os.path.join(work, name))
        os.rmdir(work)
    return out


def engine_side(args) -> dict:
    """The recompute cost per block of a cached prefix of each length (module docstring)."""
    import torch

    from pdserve.engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    bb = 30 * 2 * 16 * 3 * 64 * 2  # SmolLM2's bf16 block; checked against the pool below
    disk_dir = tempfile.mkdtemp(prefix="disk-tier-bench-engine-")
    llm = LLM(
        args.model,
        kv_cache_dtype="bfloat16",
        speculative_config=None,
        max_model_len=max(args.lengths) + args.suffix + 16,
        kv_cache_memory=POOL_BLOCKS * bb,
        kv_host_tier_bytes=HOST_BLOCKS * bb,
        kv_disk_tier_bytes=DISK_BLOCKS * (bb + 4096),
        kv_disk_tier_dir=disk_dir,
    )
    torch.set_num_threads(args.threads)
    eng = llm.engine
    kv = eng.kv_cache
    block_bytes = kv[:, :, 0].numel() * kv.element_size()
    assert block_bytes == bb, (block_bytes, bb)
    bm = eng.block_manager
    disk = bm.tier.disk
    res: dict = dict(
        model=args.model,
        load_s=round(time.perf_counter() - t0, 1),
        kv_dtype=str(kv.dtype),
        block_bytes=block_bytes,
        threads=args.threads,
        suffix=args.suffix,
        mode=getattr(eng, "mode_note", None),
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    counter = iter(range(10**9))

    def ttft(prompt: list[int]) -> tuple[float, int]:
        rid = f"r{next(counter)}"
        t = time.perf_counter()
        eng.add_request(rid, prompt, params)
        while True:
            for o in eng.step():
                if o.request_id == rid and o.finished:
                    return time.perf_counter() - t, o.num_cached_tokens

    ttft(bc.random_prompts(1, 1, 64)[0])  # warm-up
    rows = []

    def drop_disk_pages() -> None:
        assert disk.flush(120)
        for name in os.listdir(disk.dir):
            fd = os.open(os.path.join(disk.dir, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    for L in args.lengths:
        cold, warm, cached, from_disk, disk_cached, disk_blocks = [], [], [], [], [], []
        for r in range(args.repeats):
            prefix = bc.random_prompts(100 + 7 * L + r, 1, L)[0]
            t, _ = ttft(prefix + bc.random_prompts(200 + 7 * L + r, 1, args.suffix)[0])
            cold.append(t)
            t, c = ttft(prefix + bc.random_prompts(300 + 7 * L + r, 1, args.suffix)[0])
            warm.append(t)
            cached.append(c)
            for f in range(2):  # push the prefix out of the cache and the host tier
                ttft(bc.random_prompts(900 + 7 * L + 2 * r + f, 1, max(args.lengths))[0])
            drop_disk_pages()
            restored = disk.restored
            t, c = ttft(prefix + bc.random_prompts(400 + 7 * L + r, 1, args.suffix)[0])
            from_disk.append(t)
            disk_cached.append(c)
            disk_blocks.append(disk.restored - restored)
            bm.reset_prefix_cache()
        saved = statistics.median(cold) - statistics.median(warm)
        rows.append(
            dict(
                prefix_tokens=L,
                cold_ttft_ms=round(statistics.median(cold) * 1e3, 1),
                cached_ttft_ms=round(statistics.median(warm) * 1e3, 1),
                cached_tokens=cached,
                saved_ms=round(saved * 1e3, 1),
                recompute_ms_per_block=round(saved * 1e3 / (L / eng.config.block_size), 3),
                prefill_tokens_per_s=round((L + args.suffix) / statistics.median(cold), 1),
                disk_ttft_ms=round(statistics.median(from_disk) * 1e3, 1),
                disk_cached_tokens=disk_cached,
                disk_restored_blocks=disk_blocks,
            )
        )
        bc.log(f"L={L}: {rows[-1]}")
    res["lengths"] = rows
    res["disk_tier"] = disk.stats()
    llm.shutdown()
    os.rmdir(disk_dir)  # the worker's own directory went at shutdown
    return res


def main(argv: list[str] | None = None) -> int:
    ap = bc.script_parser(__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                    default=[512, 1024, 2048])  # fmt: skip
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-bytes", type=int, default=30 * 2 * 16 * 3 * 64 * 2)
    ap.add_argument("--dirs", default=None, help="comma-separated directories")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats, args.blocks = [256], 1, 32
    from pdserve.engine.loader import default_cache_dir

    dirs = (
        args.dirs.split(",")
        if args.dirs
        else [tempfile.gettempdir(), str(default_cache_dir() / "kv-disk-tier-bench")]
    )
    report = dict(
        header=bc.run_header("benchmarks.transfer.disk_tier", argv),
        loadavg_before=os.getloadavg(),
    )
    block_bytes = args.block_bytes
    if not args.skip_engine:
        report["recompute"] = engine_side(args)
        block_bytes = report["recompute"]["block_bytes"]
    report["disk"] = [disk_side(d, args.blocks, block_bytes) for d in dirs]
    report["loadavg_after"] = os.getloadavg()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
