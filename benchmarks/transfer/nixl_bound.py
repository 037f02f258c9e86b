"""What bounds the nixl backend's bandwidth on one host: the same KV writes, four ways, in one run.

The kv transfer bench (kv_transfer.py) measured nixl below shm on one CPU host. This bench takes
the nixl path apart. A decode process holds a KV pool in a shared file (as the shm backend's
decode worker does, and NIXL registers it); the prefill process writes one request's KV, layer
by layer, into the pool's blocks three ways, interleaved round by round so that the machine's
load hits all of them alike:

  memcpy   the shm backend's path: the pool file mapped here, one torch index_copy_ per (layer,
           K or V) into the blocks
  nixl     the nixl backend's path: NIXL WRITEs (UCX, which on one host without xpmem or knem
           writes by CMA, process_vm_writev), one per layer, the backend's own descriptors
           (_descriptors: one per run of consecutive blocks), the source registered once
  cma      the kernel's CMA with no NIXL and no UCX: process_vm_writev of the same descriptors,
           up to 1024 of them a call (IOV_MAX), from numpy-built iovecs: the floor of any
           CMA-based path (UCX makes one call per descriptor)

for the reservation's blocks scattered (the kv bench's order: every other block, no two
adjacent, one descriptor per 12 KiB block) and contiguous (one descriptor per layer and K or V).

    python -m benchmarks.transfer.nixl_bound --tokens 8192 --rounds 5 --out /tmp/nixl_bound.json

Needs NIXL (pip install 'pdserve[nixl]') and Linux (process_vm_writev, /dev/shm).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime

import numpy as np

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 30, 16, 3, 64  # kv_transfer.py's shape
ITEMSIZE = 4  # float32
IOV_MAX = 1024


def _pool_shape(tokens: int) -> tuple[int, ...]:
    blocks = -(-tokens // BLOCK_SIZE)
    return (NUM_LAYERS, 2, 2 * blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)


def _decode(conn, tokens: int) -> None:
    """The receiving process: a pool in a shared file, registered with a NIXL agent."""
    import torch

    from pdserve.kvtransfer.backends import create_shared_kv_cache, remove_shared_kv_cache
    from pdserve.kvtransfer.backends.nixl_backend import _make_agent, require_nixl

    torch.set_num_threads(1)
    pool, path = create_shared_kv_cache(_pool_shape(tokens), torch.float32)
    try:
        agent = _make_agent(require_nixl(), f"nixl-bound-decode-{os.getpid()}")
        agent.register_memory([pool])
        conn.send((agent.get_agent_metadata(), pool.data_ptr(), path, os.getpid()))
        conn.recv()  # until the prefill side is done
    finally:
        remove_shared_kv_cache(path)


class _Cma:
    """process_vm_writev into the decode process."""

    def __init__(self, pid: int):
        self.pid = pid
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.process_vm_writev.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong]
        self.libc.process_vm_writev.argtypes += [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        self.libc.process_vm_writev.restype = ctypes.c_ssize_t

    def write(self, local: np.ndarray, remote: np.ndarray, per_call: int = IOV_MAX) -> None:
        loc = np.ascontiguousarray(local[:, :2], dtype=np.uint64)  # (address, length): an iovec
        rem = np.ascontiguousarray(remote[:, :2], dtype=np.uint64)
        for i in range(0, len(loc), per_call):
            n = min(per_call, len(loc) - i)
            got = self.libc.process_vm_writev(
                self.pid, loc.ctypes.data + 16 * i, n, rem.ctypes.data + 16 * i, n, 0
            )
            want = int(loc[i : i + n, 1].sum())
            if got != want:
                raise OSError(ctypes.get_errno(), f"process_vm_writev wrote {got} of {want}")


def _order(blocks: int, name: str) -> list[int]:
    """The reservation's blocks in the pool's slot 0."""
    ids = list(range(blocks))
    return ids[1::2] + ids[0::2] if name == "scattered" else ids


def run(tokens: int, rounds: int) -> dict:
    import torch

    from pdserve.kvpool import map_pool_file
    from pdserve.kvtransfer.backends.nixl_backend import _descriptors, _make_agent, require_nixl

    torch.set_num_threads(1)
    shape = _pool_shape(tokens)
    blocks = -(-tokens // BLOCK_SIZE)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_decode, args=(there, tokens), daemon=True)
    proc.start()
    try:
        meta, base, path, pid = here.recv()
        agent = _make_agent(require_nixl(), f"nixl-bound-prefill-{os.getpid()}")
        remote = agent.add_remote_agent(meta)
        mapped = map_pool_file(path, shape, torch.float32)
        cma = _Cma(pid)
        # the prefill side's chunks: per layer [2, tokens, heads, head_dim], as send() gets them
        chunks = [torch.randn(2, tokens, NUM_KV_HEADS, HEAD_DIM) for _ in range(NUM_LAYERS)]
        regs = [agent.register_memory([c]) for c in chunks]
        nbytes = sum(c.numel() * ITEMSIZE for c in chunks)
        results: dict = {}
        for order in ("scattered", "contiguous"):
            ids = _order(blocks, order)
            descs = [
                _descriptors(c.data_ptr(), base, layer, tuple(ids), 0, tokens, shape, ITEMSIZE)
                for layer, c in enumerate(chunks)
            ]
            index = torch.tensor(ids)

            def memcpy():
                for layer, c in enumerate(chunks):
                    src = c.view(2, blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
                    for kv in (0, 1):
                        mapped[layer, kv].index_copy_(0, index, src[kv])

            def nixl():
                for local, rem in descs:
                    handle = agent.initialize_xfer(
                        "WRITE",
                        agent.get_xfer_descs(local, "DRAM"),
                        agent.get_xfer_descs(rem, "DRAM"),
                        remote,
                    )
                    state = agent.transfer(handle)
                    while state == "PROC":
                        state = agent.check_xfer_state(handle)
                    handle.release()
                    if state != "DONE":
                        raise RuntimeError(f"a NIXL WRITE ended {state}")

            ways = {
                "memcpy": memcpy,
                "nixl": nixl,
                "cma": lambda: [cma.write(loc, rem, IOV_MAX) for loc, rem in descs],
            }
            times: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(rounds + 1):  # the first round warms the pages: not counted
                for name, way in ways.items():
                    mapped.zero_()
                    t0 = time.perf_counter()
                    way()
                    times[name].append(time.perf_counter() - t0)
                    sample = ids[len(ids) // 3]
                    want = chunks[7][1].view(blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
                    if not torch.equal(mapped[7, 1, sample], want[len(ids) // 3]):
                        raise AssertionError(f"{name} ({order}) did not write the KV it was given")
            results[order] = {
                "descriptors_per_request": int(sum(len(loc) for loc, _ in descs)),
                "ways": {
                    name: {
                        "best_gbps": nbytes / min(t[1:]) / 1e9,
                        "median_gbps": nbytes / statistics.median(t[1:]) / 1e9,
                        "times_ms": [round(x * 1e3, 2) for x in t[1:]],
                    }
                    for name, t in times.items()
                },
            }
        for reg in regs:
            agent.deregister_memory(reg)
        agent.remove_remote_agent(remote)
        return {"kv_bytes_per_request": nbytes, "orders": results}
    finally:
        here.send(True)
        proc.join(30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="one request's prompt (default 8192)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per way (default 5)")
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.tokens < 2 * BLOCK_SIZE or args.rounds < 1:
        ap.error("--tokens must be at least 32 and --rounds at least 1")
    result = run(args.tokens, args.rounds)
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = ""
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        ),
        "",
    )
    result.update(
        command="python -m benchmarks.transfer.nixl_bound " + " ".join(argv or sys.argv[1:]),
        date=datetime.now(UTC).isoformat(),
        commit=commit,
        cpu=cpu,
        cpus=os.cpu_count(),
        tokens=args.tokens,
        loadavg_after=os.getloadavg(),
    )
    for order, r in result["orders"].items():
        print(f"{order}: {r['descriptors_per_request']} descriptors per request")
        for name, w in r["ways"].items():
            print(f"  {name:7s} best {w['best_gbps']:6.2f} GB/s  median {w['median_gbps']:6.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
