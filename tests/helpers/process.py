"""Processes by pid and start time, read from /proc, for the tests of what outlives a killed
`pdserve up` (tests/integration/test_ray_reaper_processes.py, tests/e2e/test_deploy_ray_orphans.py).
Read here independently of deploy/ray_reaper.py, which those tests check.

Not a test module: imported as `from helpers.process import ...` (tests/helpers/ is a package on pytest's sys.path).
"""

from __future__ import annotations

import os
import time


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of `pid`, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1]), int(fields[19])


def start_time(pid: int) -> int | None:
    info = _stat(pid)
    return None if info is None else info[2]


def alive(pid: int, start: int) -> bool:
    """Whether the process `pid` that started at `start` still runs (a zombie has exited)."""
    info = _stat(pid)
    return info is not None and info[0] != "Z" and info[2] == start


def tree(root: int) -> dict[int, int]:
    """pid -> start time of the live processes that descend from `root` (itself excluded)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _stat(int(entry))
            if info is not None and info[0] != "Z":
                parents[int(entry)] = (info[1], info[2])
    found, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, start) in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def still_alive_after(processes: dict[int, int], timeout_s: float) -> dict[int, int]:
    """Waits up to `timeout_s` for every process of `processes` (pid -> start time) to end;
    returns those still alive then."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {pid: s for pid, s in processes.items() if alive(pid, s)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def command_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"
