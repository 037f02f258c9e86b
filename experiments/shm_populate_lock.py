"""How long a sender's background populate of a receiver's shm KV pool can hold up its other
threads, beside busy processes (docs/experiments/design-measurements.md, "The shm populate keeps
the process's priority").

A 1.4 GiB pool file is made and mapped; one thread populates it (MADV_POPULATE_WRITE) while the
main thread maps, touches and unmaps 4 MiB of anonymous memory in a loop, as torch does for a
large tensor; each map needs the process's mmap lock, which every madvise call holds. Printed per
variant: the populate's wall time and the longest map, with the CPU time the main thread used in
it (a blocked thread uses next to none). Variants: `nice19` (what shipped until 2026-12-02:
nice 19, 16 MiB a call, no rest) and `current` (populate_in_background as it is). `--busy N`
starts N busy processes (`while True: pass`) for the run.

    python -m experiments.shm_populate_lock --busy 5
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import threading
import time

import torch

from pdserve.kvtransfer.backends import shm_backend as sb

SHAPE = (30, 2, 2048, 16, 3, 64)  # float32: 1,440 MiB


def _busy() -> None:
    while True:
        pass


def _nice19(cache: torch.Tensor, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        sb.populate(cache, stop, 16 << 20)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def measure(variant: str) -> str:
    cache, path = sb.create_shared_kv_cache(SHAPE, torch.float32)
    del cache
    try:
        mapped = sb.map_shared_kv_cache(path, SHAPE, torch.float32)
        stop = threading.Event()
        t0 = time.perf_counter()
        if variant == "nice19":
            thread = _nice19(mapped, stop)
        else:
            thread = sb.populate_in_background([mapped], stop)
        worst, worst_cpu, maps = 0.0, 0.0, 0
        while thread.is_alive():
            wall, cpu = time.perf_counter(), time.thread_time()
            m = mmap.mmap(-1, 4 << 20)
            m[0:1] = b"x"
            m.close()
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            maps += 1
            if wall > worst:
                worst, worst_cpu = wall, cpu
        took = time.perf_counter() - t0
        return (
            f"{variant}: populate {took:.2f} s, {maps} maps, longest map {worst * 1e3:.0f} ms "
            f"(main thread's CPU in it {worst_cpu * 1e3:.1f} ms)"
        )
    finally:
        sb.remove_shared_kv_cache(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=0, help="busy processes beside the run")
    ap.add_argument("--variants", default="nice19,current")
    args = ap.parse_args()
    busy = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    try:
        for variant in args.variants.split(","):
            print(f"busy {args.busy}, {measure(variant)}", flush=True)
    finally:
        for p in busy:
            p.kill()


if __name__ == "__main__":
    main()
