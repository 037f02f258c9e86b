"""What a default `pdserve up` exposes (issue #47 item 5, must-show e): no port of any of its
processes listens beyond loopback, no process's environment holds a secret, and Ray's token file
is its owner's only.

`pdserve up` runs as a command, on a tiny random model, as the default deployment runs it: a local
Ray (ray.bind unset: loopback), the router's gRPC and HTTP fronts on router.host's default, a
prefill and a decode worker. The cluster secret and an API key are given the way a user gives them
from a shell (PDSERVE_CLUSTER_SECRET, PDSERVE_API_KEYS), HOME is a fresh folder (so the Ray token is
the one this start makes), and once it is ready the test reads, for `up` and every process under
it (Ray's GCS, raylet, agents, autoscaler, dashboard head, log monitor, and the workers), the
listening TCP sockets (/proc/net/tcp and tcp6 matched to each process's socket inodes) and
/proc/<pid>/environ. A request with the key is answered and one without it refused: the router
still has the key, and the workers got the secret (they registered) from its file.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pathlib
import signal
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import yaml

from helpers.process import alive, command_of, tree
from helpers.up import ray_temp_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="reads /proc"),
]

ROOT = pathlib.Path(__file__).parents[2]
START_TIMEOUT_S = 300.0
SECRET = "exposure-test-cluster-secret-5f1c9a"
API_KEY = "sk-exposure-test-key-77e2b0"
LISTEN = "0A"  # the TCP state in /proc/net/tcp*


def _listening_inodes() -> dict[int, str]:
    """socket inode -> "address:port" of every listening TCP socket (IPv4 and IPv6)."""
    found = {}
    for name, width in (("tcp", 4), ("tcp6", 16)):
        try:
            lines = pathlib.Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state != LISTEN:
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            # the kernel prints each 32-bit word in host order (little-endian here)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            found[inode] = f"{ipaddress.ip_address(raw)}:{int(hex_port, 16)}"
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rpartition(":")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def listening(pids: list[int]) -> dict[int, list[str]]:
    """pid -> the addresses its listening TCP sockets are bound to."""
    inodes = _listening_inodes()
    return {pid: sorted(inodes[i] for i in _socket_inodes(pid) if i in inodes) for pid in pids}


def _read_lines(proc: subprocess.Popen, lines: list[str], ready: threading.Event) -> None:
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == "ready":
            ready.set()


def _post(url: str, key: str | None) -> int:
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{url}/completions", body, headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def test_default_up_listens_on_loopback_only_and_keeps_secrets_out_of_environments(
    tiny_models, tmp_path
):
    from pdserve.engine.loader.resolve import default_cache_dir

    model_dir, _ = tiny_models("llama-gqa")
    with ray_temp_dir() as ray_tmp:  # removed after the kills below, which stop its writers
        pool = {"replicas": 1, "tp": 1, "resources": {"num_cpus": 1}, "kv_cache_memory": 4 << 20}
        config = tmp_path / "tiny.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "model": model_dir,
                    "served_model_name": "tiny",
                    "dtype": "float32",
                    "pools": {"prefill": pool, "decode": pool},
                    "router": {"port": 0},  # host: the default; http_port: a free one
                    "ray": {"num_cpus": 2, "temp_dir": ray_tmp},
                }
            )
        )
        home, run = tmp_path / "home", tmp_path / "run"
        home.mkdir()
        run.mkdir()
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("RAY_AUTH") and k != "XDG_RUNTIME_DIR"
        }
        env.update(
            HOME=str(home),
            TMPDIR=str(run),  # where the secret's folder goes, to see it made and removed
            PDSERVE_CACHE_DIR=str(default_cache_dir()),  # the kernels built before, not a rebuild
            PDSERVE_CLUSTER_SECRET=SECRET,
            PDSERVE_API_KEYS=API_KEY,
        )
        err_path = tmp_path / "up.err"
        processes: dict[int, int] = {}
        lines: list[str] = []
        ready = threading.Event()
        with open(err_path, "w") as err:
            up = subprocess.Popen(
                [sys.executable, "-m", "pdserve", "up", str(config)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=ROOT,
                env=env,
                start_new_session=True,
            )
        try:
            threading.Thread(target=_read_lines, args=(up, lines, ready), daemon=True).start()
            assert ready.wait(START_TIMEOUT_S), (
                f"`pdserve up` not ready within {START_TIMEOUT_S:.0f}s "
                f"({'exited ' + str(up.poll()) if up.poll() is not None else 'still starting'}):\n"
                + err_path.read_text()[-3000:]
            )
            processes = {up.pid: 0, **tree(up.pid)}
            pids = sorted(processes)
            commands = {pid: command_of(pid) for pid in pids}
            joined = " ".join(commands.values())
            for part in ("gcs_server", "raylet", "WorkerActor"):  # the whole deployment is here
                assert part in joined, f"no {part} among {joined}"

            # 1. every listening socket of every process is on loopback
            ports = listening(pids)
            exposed = [
                f"{pid} {commands[pid][:60]}: {a}"
                for pid, addresses in ports.items()
                for a in addresses
                if not _is_loopback(a)
            ]
            assert not exposed, "listening beyond loopback:\n" + "\n".join(exposed)
            by_name = {
                name: sum(len(a) for pid, a in ports.items() if name in commands[pid])
                for name in ("gcs_server", "raylet", "WorkerActor")
            }
            assert len(ports[up.pid]) >= 2, ports[up.pid]  # the router's gRPC and HTTP fronts
            assert all(by_name.values()), f"a process without a listening socket: {by_name}"

            # 2. no secret in any process's environment (the launcher's own wiped too)
            token = (home / ".ray" / "auth_token").read_text().strip()
            read = 0
            leaks = []
            for pid in pids:
                try:
                    environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
                except OSError:
                    continue
                read += 1
                for what, value in (
                    ("cluster secret", SECRET),
                    ("API key", API_KEY),
                    ("Ray token", token),
                ):
                    if value.encode() in environ:
                        leaks.append(f"{what} in the environment of {pid} {commands[pid][:60]}")
            assert read >= len(pids) - 1, f"read the environment of {read} of {len(pids)} processes"
            assert not leaks, "\n".join(leaks)

            # 3. the Ray token file that this start made: its owner's only
            token_file = home / ".ray" / "auth_token"
            assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
            assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700

            # 3b. the secret's folder and file: 0700 and 0600
            (folder,) = run.glob("pdserve-secrets-*")
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700
            assert [stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()] == [0o600]

            # 4. the router has the key, and the workers the secret (they registered, and serve)
            url = next(
                s.split(" on ", 1)[1] for s in lines if s.startswith("OpenAI-compatible HTTP")
            )
            assert _is_loopback(url.split("//", 1)[1].split("/", 1)[0])
            assert _post(url, None) == 401
            assert _post(url, API_KEY) == 200
        finally:
            if up.poll() is None:
                os.kill(up.pid, signal.SIGTERM)
                try:
                    up.wait(60)
                except subprocess.TimeoutExpired:
                    up.kill()
                    up.wait()
            for pid, start in processes.items():
                if start and alive(pid, start):
                    os.kill(pid, signal.SIGKILL)
    assert up.returncode == 0, err_path.read_text()[-3000:]
    assert not list(run.glob("pdserve-secrets-*")), "the secret's folder outlived the deployment"
