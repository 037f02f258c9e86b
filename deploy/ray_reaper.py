"""Nothing of the local Ray that `pdserve up` starts outlives it, even after a kill -9.

ray.init() starting a local Ray makes the driver the parent of Ray's head processes (GCS, raylet,
monitor, dashboard, log monitor), and Ray has each die with its parent (a parent-death signal).
The raylet's own children are not tied to it that way: the dashboard agent and the runtime env
agent see the raylet die (their stdin pipe closes), then spend a minute or more trying to tell
the GCS, which is dead too, before they exit, holding their memory meanwhile.

`watch()` starts a watchdog: this file run by the same Python, standard library only, in a session
of its own (a terminal's signals and a kill of the driver's process group miss it). Every
POLL_S it records each process descended from Ray's head processes by pid and start time (a reused
pid is never taken for one of them). When the driver dies (its end of the watchdog's stdin closes
without a "stop" line, or its pid goes), the watchdog kills each recorded process still alive and
says so in one line on stderr. `Watchdog.stop()`, after ray.shutdown(), ends it quietly, killing
only what is left over. It ignores SIGINT and SIGTERM (a `pkill -f "pdserve up"` reaches it too).
Linux only (/proc); elsewhere `watch()` returns None.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

POLL_S = 1.0
KILL_ROUNDS = 5  # a process spawned while the others are killed is caught in a later round


# ---- the process table (/proc) ------------------------------------------------------------------
def stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks since boot, name) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    close = data.rfind(b")")  # the name may hold spaces and parentheses: the fields follow the last
    fields = data[close + 2 :].split()
    if len(fields) < 20 or fields[0] == b"Z":  # a zombie has exited: only its parent can reap it
        return None
    name = data[data.find(b"(") + 1 : close].decode(errors="replace")
    return int(fields[1]), int(fields[19]), name


def process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> stat(pid) of every live process."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = stat(int(entry))
            if info is not None:
                table[int(entry)] = info
    return table


def descendants(table: dict[int, tuple], roots) -> set[int]:
    """The pids in `table` that are `roots` or descend from them."""
    children: dict[int, list[int]] = {}
    for pid, info in table.items():
        children.setdefault(info[0], []).append(pid)
    found: set[int] = set()
    todo = [pid for pid in roots if pid in table]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def name_of(pid: int, comm: str) -> str:
    """What `ps` shows for a process: Ray's own title (ray::RuntimeEnvAgent) or its program's
    name, else `comm` (which the kernel cuts to 15 characters)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            first = f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return comm
    first = first.split()[0] if first.strip() else ""
    return first if first.startswith("ray::") else os.path.basename(first) or comm


def children_of(pid: int) -> dict[int, int]:
    """pid -> start time of the live children of `pid`."""
    return {p: info[1] for p, info in process_table().items() if info[0] == pid}


# ---- the driver's side --------------------------------------------------------------------------
class Watchdog:
    """The driver's handle on its watchdog process."""

    def __init__(self, process: subprocess.Popen):
        self.process = process

    def stop(self, timeout_s: float = 5.0) -> None:
        """The deployment stopped in order: the watchdog kills what is left of it, silently, and
        exits. Safe to call twice."""
        if self.process.poll() is None:
            try:
                self.process.stdin.write(b"stop\n")
                self.process.stdin.close()
            except OSError:  # it is gone already
                pass
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def watch(roots: dict[int, int], what: str = "pdserve up") -> Watchdog | None:
    """A watchdog for the processes `roots` (pid -> start time: Ray's head processes, children of
    this process) and every process that descends from them; None off Linux or without roots."""
    me = stat(os.getpid())
    if me is None or not roots:
        return None
    args = [f"{pid}:{start}" for pid, start in roots.items()]
    process = subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__), what, f"{os.getpid()}:{me[1]}", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    return Watchdog(process)


# ---- the watchdog process -----------------------------------------------------------------------
def _alive(pid: int, start: int, table) -> bool:
    info = table.get(pid)
    return info is not None and info[1] == start


def kill_recorded(seen: dict[int, int]) -> list[str]:
    """Kills the recorded processes still alive (and any they spawned meanwhile); their names."""
    names: dict[int, str] = {}
    for _ in range(KILL_ROUNDS):
        table = process_table()
        live = {p for p, start in seen.items() if _alive(p, start, table)}
        for pid in descendants(table, live) - {os.getpid()}:
            seen.setdefault(pid, table[pid][1])
            if pid not in names:
                names[pid] = name_of(pid, table[pid][2])
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone already
                pass
        if not live:
            break
        time.sleep(0.05)
    return sorted(names.values())


def main(argv: list[str]) -> int:
    # Signals meant for the driver are not for its watchdog: `pkill -INT -f "pdserve up"` matches
    # this process's command line too, and the watchdog must outlive the driver to do its work.
    # It ends by itself within POLL_S of the driver; SIGKILL still ends it at once.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    what, driver, *roots = argv
    driver_pid, driver_start = map(int, driver.split(":"))
    root_starts = dict(tuple(map(int, r.split(":"))) for r in roots)
    seen: dict[int, int] = {}
    orderly = False
    stdin = sys.stdin.fileno()
    while True:
        table = process_table()
        live_roots = [p for p, start in root_starts.items() if _alive(p, start, table)]
        for pid in descendants(table, live_roots):
            seen.setdefault(pid, table[pid][1])
        if not _alive(driver_pid, driver_start, table):
            break
        ready, _, _ = select.select([stdin], [], [], POLL_S)
        if ready:
            line = os.read(stdin, 64)
            orderly = line.startswith(b"stop")
            if orderly or not line:
                break
    killed = kill_recorded(seen)
    if killed and not orderly:
        counts: dict[str, int] = {}
        for name in killed:
            counts[name] = counts.get(name, 0) + 1
        listed = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in sorted(counts.items()))
        print(
            f"pdserve: `{what}` (pid {driver_pid}) died without stopping its local Ray; killed "
            f"what was left of it: {listed}",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
