"""Shared KV pools on a real tmpfs, each test in a private mount namespace (`unshare -m`) whose
/dev/shm is a small tmpfs of its own: a decode worker started on a full /dev/shm fails with one
line naming the bytes needed and free (not SIGBUS); and a receiver killed five times, each time
replaced by a new one, leaves the sender's mappings and /dev/shm's free space where they started.
Both skip where this host does not allow a mount namespace. The same without processes:
tests/unit/test_kvpool_space.py and tests/unit/test_shm_peer_pools.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

NO_MOUNT = 77  # the namespace's script could not mount its tmpfs


def in_private_shm(script: str, shm_size: str, *args, timeout: float = 300.0):
    """Runs `python -c script args` with /dev/shm a fresh tmpfs of shm_size, in a private mount
    namespace (the host's /dev/shm is untouched); skips where that is not permitted."""
    try:
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no unshare on this host")
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    shell = (
        f'mount -t tmpfs -o size={shm_size},mode=1777 tmpfs /dev/shm || exit {NO_MOUNT}; exec "$@"'
    )
    run = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", shell, "sh"]
        + [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if run.returncode == NO_MOUNT:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


START_DECODE = """
import sys
from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
engine = dict(kv_cache_memory=1 << 20, block_size=16)
try:
    DecodeWorker(DecodeWorkerConfig(model=sys.argv[1], kv_backend="shm", engine_kwargs=engine)).start()
except Exception as e:  # what the launcher reports of a failed start (ray_error_reason)
    print(f"{type(e).__name__}: {e}")
else:
    print("started")
"""


def test_a_decode_worker_on_a_full_dev_shm_fails_with_one_line(tiny_models):
    line = in_private_shm(START_DECODE, "256k", tiny_models("llama-gqa")[0])
    assert line.startswith("PoolSpaceError: the shared KV pool /dev/shm/pdserve-kv-"), line
    assert re.search(
        r" needs 1048576 bytes \(1.0 MiB\) but /dev/shm has \d+ bytes \(0.2 MiB\) free: ", line
    ), line
    assert "kv_cache_memory" in line and "--shm-size" in line


RECEIVER = """
import sys, time, torch
from pdserve.kvpool import create_pool_file, new_pool_paths
from pdserve.kvtransfer.backends.shm_backend import ShmServer
path = new_pool_paths("/dev/shm", 1)[0]  # removes the files of receivers killed before
server = ShmServer(lambda header, payload: None, create_pool_file(path, (2, 2, 64, 16, 4, 64), torch.float32), path)
print(server.address, flush=True)
time.sleep(600)
"""

SENDER = """
import json, os, subprocess, sys
from pdserve.kvtransfer.backends import connect

def free():
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize

def mapped():
    with open("/proc/self/maps") as f:
        return len({line.split(None, 5)[-1].strip() for line in f if "/dev/shm/pdserve-kv-" in line})

start, transports, seen = free(), [], []
for i in range(6):  # the first receiver, then five replacements of a receiver killed with -9
    rx = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    transports.append(connect("shm", rx.stdout.readline().strip()))  # kept, as a prefill worker does
    seen.append({"mapped": mapped(), "used": start - free()})
    if i < 5:
        rx.kill()
        rx.wait()
for t in transports:
    t.close()
rx.kill()
rx.wait()
for name in os.listdir("/dev/shm"):
    if name.startswith("pdserve-kv-"):
        os.unlink(os.path.join("/dev/shm", name))
print(json.dumps({"seen": seen, "end_mapped": mapped(), "end_used": start - free()}))
"""


def test_a_receiver_killed_five_times_leaks_no_pool():
    """Each replacement removes its killed predecessor's file, and the sender, which still holds a
    transport to every receiver it ever reached, unmaps the dead ones: one pool in use at a time."""
    result = json.loads(in_private_shm(SENDER, "64m", RECEIVER))
    pool = 2 * 2 * 64 * 16 * 4 * 64 * 4  # 4 MiB
    seen = result["seen"]
    assert [s["mapped"] for s in seen] == [1] * 6, seen
    for s in seen:
        assert pool <= s["used"] < pool + (1 << 20), seen  # the live pool, not one per restart
    assert result["end_mapped"] == 0 and result["end_used"] == 0, result
