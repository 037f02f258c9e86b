"""Helpers shared by the two sides of bench/engine_bench.py and its orchestrating parent process:
the deterministic random-token prompts and their seeds, memory snapshots, machine info, and the CPU
contention monitor that records how much CPU other processes used while a section was measured.

No torch import at module level: the parent process, which imports this module too, must stay small.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import sys
import time
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOKEN_LO, TOKEN_HI = 100, 49000

# seeds of the prompt sets (disjoint, so no two sections share a prompt by construction)
SEED_DECODE = 1000
SEED_WARMUP = 2000
SEED_TTFT = 3000          # + repeat index
SEED_COLD = 4000          # + repeat index
SEED_PREFIX = 5000
SEED_SUFFIX = 6000        # + repeat index

CONTENTION_WARN_CORES = 0.1   # other processes' average CPU use that makes timings suspect


def log(msg: str) -> None:
    print(f"[engine_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def random_prompts(seed: int, n: int, length: int) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(TOKEN_LO, TOKEN_HI, (n, length), generator=g).tolist()


def proc_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def memory_snapshot() -> dict:
    import resource
    return {
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        "vm_hwm_bytes": (proc_status_kb("VmHWM") or 0) * 1024,
        "vm_rss_bytes": (proc_status_kb("VmRSS") or 0) * 1024,
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(threads: int) -> dict:
    import torch
    import transformers
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_num_threads": torch.get_num_threads(),
        "threads_requested": threads,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def git_head() -> str | None:
    """Best effort, read from .git without running git."""
    try:
        git = os.path.join(REPO_ROOT, ".git")
        if os.path.isfile(git):   # a worktree: "gitdir: <path>"
            with open(git) as f:
                git = f.read().split(":", 1)[1].strip()
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        for base in (git, os.path.join(git, "..", "..")):   # worktrees keep refs in the common dir
            path = os.path.join(base, ref)
            if os.path.isfile(path):
                with open(path) as f:
                    return f.read().strip()
        return ref
    except Exception:
        return None


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def machine_busy_cpu_s() -> float | None:
    """CPU seconds all cpus spent busy since boot (/proc/stat), None where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)          # idle + iowait
    busy = sum(fields[:8]) - idle                                     # guest is inside user
    return busy / os.sysconf("SC_CLK_TCK")


class CpuMonitor:
    """How much CPU *other* processes used while we measured: the benchmark shares the machine."""

    def __init__(self):
        self.t, self.busy, self.own = time.perf_counter(), machine_busy_cpu_s(), self._own()

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t
        own = self._own() - self.own
        busy = machine_busy_cpu_s()
        out = {"wall_s": wall, "own_cpu_s": own}
        if busy is not None and self.busy is not None:
            foreign = max(0.0, (busy - self.busy) - own)
            out.update(machine_busy_cpu_s=busy - self.busy, foreign_cpu_s=foreign,
                       foreign_cores_avg=foreign / wall if wall > 0 else None)
        return out


def process_tree_cpu_s(root_pid: int | None = None) -> float:
    """CPU seconds (user + system) of `root_pid` (default: this process) and every live descendant:
    a benchmark that starts Ray or worker processes counts them as its own, not as other load.
    Descendants that exited meanwhile drop out of the sum, so use it over windows in which the
    set of processes is stable."""
    root = os.getpid() if root_pid is None else root_pid
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()   # after the "(comm)", which may hold spaces
        except OSError:
            continue
        pid = int(name)
        parent[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick   # utime, stime
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


class TreeCpuMonitor:
    """Like CpuMonitor, but this process's whole tree (Ray, workers, helpers) counts as its own."""

    def __init__(self):
        self.t, self.busy, self.own = time.perf_counter(), machine_busy_cpu_s(), process_tree_cpu_s()

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t
        own = process_tree_cpu_s() - self.own
        busy = machine_busy_cpu_s()
        out = {"wall_s": wall, "own_tree_cpu_s": own}
        if busy is not None and self.busy is not None:
            foreign = max(0.0, (busy - self.busy) - own)
            out.update(machine_busy_cpu_s=busy - self.busy, foreign_cpu_s=foreign,
                       foreign_cores_avg=foreign / wall if wall > 0 else None)
        return out


def section(results: dict, name: str, fn) -> None:
    """Run one measurement; a failure is recorded, the other sections still run."""
    t0 = time.perf_counter()
    mon = CpuMonitor()
    log(f"{results['side']}: {name} ...")
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001 - the report must say what broke
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        log(f"{results['side']}: {name} FAILED: {type(e).__name__}: {e}")
    cpu = mon.stop()
    results.setdefault("cpu_contention", {})[name] = cpu
    log(f"{results['side']}: {name} done in {time.perf_counter() - t0:.1f} s; other processes used "
        f"{fmt(cpu.get('foreign_cores_avg'), '.2f')} cores on average meanwhile")


def wait_for_idle_machine(max_wait_s: float) -> dict:
    """Poll until other processes use < CONTENTION_WARN_CORES over a 3 s window (or give up)."""
    t0 = time.perf_counter()
    while True:
        mon = CpuMonitor()
        time.sleep(3)
        f = mon.stop().get("foreign_cores_avg")
        waited = time.perf_counter() - t0
        if f is None or f < CONTENTION_WARN_CORES or waited >= max_wait_s:
            if f is not None and f >= CONTENTION_WARN_CORES:
                log(f"machine still busy ({f:.2f} cores used by others) after {waited:.0f} s; going on")
            return {"waited_s": waited, "foreign_cores_avg_last_3s": f}
        log(f"waiting for an idle machine: others use {f:.2f} cores ({waited:.0f}/{max_wait_s:.0f} s)")


def fmt(x, spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"
