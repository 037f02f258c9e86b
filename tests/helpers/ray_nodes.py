"""A Ray cluster of a test's own, made as an operator makes one: `ray start --head` with token
authentication and more `ray start` nodes, all on this machine standing in for several hosts,
each with its own ports, in a temp dir of the test (RayNodes); Ray's own view of its actors and
nodes (ask_ray); `pdserve up --address` as a command and its stdout up to the start table.
Used by tests/e2e/test_ray_nodes.py.

Each `ray start` runs in a session of its own; RayNodes kills only the processes of those
sessions, never with `ray stop` (which would end every Ray on the machine).

Not a test module: imported as `from helpers.ray_nodes import ...`.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import threading
import time

from helpers.ports import free_ports

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
# How long one `ray start` may take, past Ray's own wait for its node (about 3 minutes): a head
# node overran 120 s in a full suite on the slower AVX2 EPYC VM (load average above 6), and with
# more time gave up by itself ("node timed out during startup"), which its output now shows
START_S = 300.0


def free_range(n: int) -> tuple[int, int]:
    """n consecutive ports free now, for a node's workers."""
    for _ in range(50):
        base = random.randrange(20000, 30000 - n)
        try:
            socks = []
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base, base + n - 1
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def session_and_start(pid: int) -> tuple[int, int] | None:
    """(session id, start time in clock ticks since boot) of a live process, or None."""
    try:
        data = pathlib.Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()  # state, ppid, pgrp, session, ...
    if fields[0] == b"Z":
        return None
    return int(fields[3]), int(fields[19])


class RayNodes:
    """The processes of the `ray start` commands this test ran: each ran in a session of its own,
    whose id is its pid, and every Ray process it starts stays in that session (Ray's workers
    change their process group, not their session). A process is this test's when it is in one of
    those sessions and started no earlier than the `ray start` that made the session: the kernel
    does not hand out a pid that is still some live process's session id."""

    def __init__(self, temp_dir: str, token_path: pathlib.Path):
        self.temp_dir = temp_dir
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",  # as Ray's token-auth docs set up a cluster
            "RAY_AUTH_TOKEN_PATH": str(token_path),
            "RAY_USAGE_STATS_ENABLED": "0",
            # a node's registration with the head waits 60 s by default, which a loaded machine
            # (test processes beside it) has overrun; a slow start is not what these tests test
            "RAY_raylet_start_wait_time_s": "180",
        }
        self.sessions: dict[int, int] = {}  # session id -> its `ray start`'s start time

    def start(self, *args: str) -> None:
        first, last = free_range(40)
        names = (
            "--node-manager-port",
            "--object-manager-port",
            "--dashboard-agent-grpc-port",
            "--dashboard-agent-listen-port",
            "--metrics-export-port",
            "--runtime-env-agent-port",
        )
        # the ports this call names (the head's --port, --address's) must not come back here
        named = {int(p) for a in args for p in a.rsplit(":", 1)[-1:] if p.isdigit()}
        ports = dict(zip(names, free_ports(len(names), named), strict=True))
        ports |= {"--min-worker-port": first, "--max-worker-port": last}
        command = [*RAY, "start", "--node-ip-address", "127.0.0.1", "--num-cpus", "1", *args]
        command += [x for k, v in ports.items() for x in (k, str(v))]
        proc = subprocess.Popen(
            command,
            env=self.env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        own = session_and_start(proc.pid)
        assert own is not None and own[0] == proc.pid  # start_new_session: it leads its own
        self.sessions[proc.pid] = own[1]
        try:
            out, _ = proc.communicate(timeout=START_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            raise AssertionError(
                f"`ray start` did not finish in {START_S:.0f} s; its output:\n{out[-3000:]}"
            ) from None
        assert proc.returncode == 0, out[-3000:]

    def processes(self) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                info = session_and_start(int(entry))
                if info and info[0] in self.sessions and info[1] >= self.sessions[info[0]]:
                    found.append(int(entry))
        return found

    def kill(self, timeout_s: float = 30.0) -> None:
        """SIGKILL to every process of the sessions, again each half second, until none is left
        or `timeout_s` has passed. A killed process stays listed until its exit completes, which
        takes longer on a loaded machine, and one may fork while the others are killed: five
        rounds (2.5 s) once left one behind in a full CI run."""
        assert all(s > 1 for s in self.sessions)
        deadline = time.monotonic() + timeout_s
        while (left := self.processes()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.5)


def ask_ray(cluster: RayNodes, address: str) -> dict:
    """Ray's own view, from a process of its own: the actors (GCS actor table) and the nodes."""
    script = (
        "import json, ray\n"
        "from ray._private.state import actors\n"
        f"ray.init(address={address!r}, log_to_driver=False)\n"
        "out = dict(actors=[dict(name=a.get('Name'), state=a.get('State'), "
        "node=a.get('Address', {}).get('NodeID')) for a in actors().values()], "
        "nodes=[dict(node=n['NodeID'], resources=n['Resources']) for n in ray.nodes() "
        "if n['Alive']])\n"
        "print('STATE ' + json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = [x for x in done.stdout.splitlines() if x.startswith("STATE ")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(line[0][len("STATE ") :])


# ---- `pdserve up` as a command ---------------------------------------------------------------------
def up_command(
    config: pathlib.Path, address: str, env: dict, err: pathlib.Path
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", str(config), "--address", address],
        env=env,
        stdout=subprocess.PIPE,
        stderr=err.open("w"),
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )


def read_until_table(proc: subprocess.Popen, timeout_s: float) -> list[str]:
    """`up`'s stdout up to the start table after "ready" (its header and one row per worker)."""
    lines, done = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "ready" in lines and len(lines) >= lines.index("ready") + 4:
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    done.wait(timeout_s)
    return lines
