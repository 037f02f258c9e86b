"""How many cores a CPU engine's steps use, fitted to the cores that are free now.

torch's intra-op pool (OpenMP here) splits each operator of a step across its threads and waits
for all of them at the operator's end: a decode step of a small model is hundreds of such
barriers. On a quiet machine that is the fastest way to run a step. When other processes keep the
cores busy, the kernel's scheduler runs the pool's threads at different moments, and each barrier
waits for the thread that is not running, often a whole scheduling slice, while the thread that is
running spins: one stream beside two busy loops on two cores fell to 11-21% of its quiet speed,
where half would be its fair share. One thread has no barrier to wait at.

`ThreadFit` owns that choice for the process. The thread that runs the model calls `fit()` before
every forward pass; about twice a second it reads how busy this process's allowed cores were since
the last look (/proc/stat) and how much of them this process used itself (/proc/self/stat), and
sets torch's thread count to the cores this process could have had: its own use plus the idle,
rounded, between 1 and the count it started with. On a quiet machine that is the count it started
with; beside busy processes it falls to 1, and it comes back as they go. The numbers do not change
with the thread count (torch's CPU linears split rows and columns across threads, not sums), so
the tokens do not either. Where /proc cannot be read, nothing changes.
"""

from __future__ import annotations

import os
import time

import torch

PERIOD_S = 0.5  # how often the count is refitted: several decode steps, far less than a burst


def _allowed_cpus() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _idle_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(idle + iowait ticks, all ticks) summed over `cpus` since boot, or None."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return None
    idle = total = 0
    for line in lines[1:]:
        if not line.startswith(b"cpu"):
            break
        name, *fields = line.split()
        if int(name[3:]) in cpus:
            ticks = [int(x) for x in fields[:8]]  # user .. steal; guest is inside user
            idle += ticks[3] + ticks[4]
            total += sum(ticks)
    return (idle, total) if total else None


def _own_ticks() -> int | None:
    """This process's CPU ticks (user + system, every thread) since it began, or None."""
    try:
        with open("/proc/self/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


class ThreadFit:
    """torch's intra-op thread count for this process, refitted every PERIOD_S (module doc)."""

    def __init__(self, max_threads: int | None = None):
        self.max_threads = max_threads or torch.get_num_threads()
        self.threads = torch.get_num_threads()
        self.cpus = _allowed_cpus()
        self._last = None if self.max_threads <= 1 else self._sample()

    def _sample(self):
        idle, own = _idle_ticks(self.cpus), _own_ticks()
        if idle is None or own is None:
            return None
        return time.monotonic(), idle, own

    def fit(self) -> int:
        """The thread count from now on; refits it when PERIOD_S has passed since the last."""
        last = self._last
        if last is None or time.monotonic() - last[0] < PERIOD_S:
            return self.threads
        now = self._sample()
        if now is None:
            self._last = None
            return self.threads
        (_, idle0, own0), (_, idle1, own1) = last, now
        self._last = now
        span = idle1[1] - idle0[1]  # ticks of all the allowed cores together
        if span <= 0:
            return self.threads
        cores = len(self.cpus)
        free = cores * (idle1[0] - idle0[0]) / span
        mine = cores * (own1 - own0) / span
        want = max(1, min(self.max_threads, round(mine + free)))
        if want != self.threads:
            torch.set_num_threads(want)
            self.threads = want
        return want

    def restore(self) -> None:
        """Back to the count it started with, fitting again from now (the engine shuts down and
        the process goes on, or a benchmark compares with and without the fitting)."""
        if self.threads != self.max_threads:
            torch.set_num_threads(self.max_threads)
            self.threads = self.max_threads
        self._last = None if self.max_threads <= 1 else self._sample()
