"""What `pdserve up` shows its operator on the console (issue #51, must-show d): the router's line
per pool at the configured interval while requests run, a role flip's lines, and a worker that
dies and comes back, read from `up`'s own stderr; the start table names each worker's pid."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import yaml

from helpers.models import random_prompts
from helpers.up import ROOT, greedy_tokens, ray_temp_dir, stop_up

KV_BYTES = 1 << 22
SECRET = "console-test-secret-0123456789abcdef"


def _wait_for(path, pattern: str, timeout_s: float, after: int = 0) -> re.Match:
    """The first match of `pattern` in the file at `path` past character `after`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text()[after:], re.M)
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"no line matching {pattern!r} within {timeout_s:.0f} s:\n"
                         f"{path.read_text()[-3000:]}")  # fmt: skip


def test_console_shows_pools_flips_and_a_worker_back(tiny_models, tmp_path):
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    model_dir, _ = tiny_models("llama-gqa")
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    os.chmod(secret_file, 0o600)
    pool = {"tp": 1, "resources": {"num_cpus": 0.5}, "num_threads": 1, "kv_cache_memory": KV_BYTES}
    with ray_temp_dir() as ray_tmp:
        config = {
            "model": model_dir,
            "pools": {"prefill": {**pool, "replicas": 2}, "decode": {**pool, "replicas": 1}},
            "router": {"port": 0, "http_port": None},
            "ray": {"num_cpus": 2, "temp_dir": ray_tmp},
            "security": {"cluster_secret_file": str(secret_file)},
            "observability": {"stats_interval_s": 1},
        }
        config_path = tmp_path / "up.yaml"
        config_path.write_text(yaml.safe_dump(config))
        err_path = tmp_path / "up.err"
        with open(err_path, "w") as err:
            up = subprocess.Popen(
                [sys.executable, "-m", "pdserve", "up", str(config_path)],
                stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
            )  # fmt: skip
        out_lines: list[str] = []
        reader = threading.Thread(target=lambda: out_lines.extend(up.stdout), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 300
            while not any(line.startswith("decode-0 ") for line in out_lines):
                assert up.poll() is None, err_path.read_text()[-3000:]
                assert time.monotonic() < deadline, "no start table within 300 s"
                time.sleep(0.2)
            address = next(
                m[1] for line in out_lines if (m := re.fullmatch(r"router on (\S+)\n?", line))
            )
            header = next(line for line in out_lines if line.startswith("worker "))
            assert header.split()[:4] == ["worker", "role", "node", "pid"]
            pids = {line.split()[0]: int(line.split()[4]) for line in out_lines if "-" in line[:12]
                    and line.split()[0] in ("prefill-0", "prefill-1", "decode-0")}  # fmt: skip
            assert set(pids) == {"prefill-0", "prefill-1", "decode-0"}, out_lines
            # kvtransfer.backend auto (the default): one machine, so the prefill workers take shm
            rows = {line.split()[0]: line for line in out_lines if line.split()[:1] == ["decode-0"]
                    or line.split()[:1] in (["prefill-0"], ["prefill-1"])}  # fmt: skip
            assert "auto: shm, grpc" in rows["decode-0"], rows
            assert all("auto -> shm" in rows[p] for p in ("prefill-0", "prefill-1")), rows

            mark = len(err_path.read_text())
            with grpc.insecure_channel(address) as channel:
                stub = pdserve_pb2_grpc.PDServeStub(channel)
                for prompt in random_prompts([9, 30, 57], seed=3):
                    assert len(greedy_tokens(stub, pb, prompt, 24)) == 24
            # the router's line and one per pool, while the requests ran or just after
            _wait_for(err_path, r"router: prompt [\d,.]+ tok/s, generation [\d,.]+ tok/s", 20, mark)
            _wait_for(err_path, r"decode pool: 1 of 1 workers up; running", 20, mark)
            _wait_for(err_path, r"prefill pool: 2 of 2 workers up; running", 20, mark)
            _wait_for(err_path, r"router: idle", 20, mark)

            # a role flip through `pdserve ctl`: its lines reach the console
            flip = subprocess.run(
                [sys.executable, "-m", "pdserve", "ctl", "--router", address, "--secret-file",
                 str(secret_file), "flip", "prefill-1", "decode"],
                capture_output=True, text=True, cwd=ROOT, timeout=120,
            )  # fmt: skip
            assert flip.returncode == 0, flip.stderr
            _wait_for(err_path, r"flip prefill-1 prefill -> decode: draining", 10, mark)
            _wait_for(err_path, r"flip prefill-1 prefill -> decode: done", 10, mark)

            # a worker killed: dropped from its pool, replaced, back in the pool
            mark = len(err_path.read_text())
            os.kill(pids["decode-0"], signal.SIGKILL)
            _wait_for(err_path, r"decode worker decode-0 is (down|dead)", 60, mark)
            _wait_for(err_path, r"decode worker decode-0 registered at", 120, mark)
            with grpc.insecure_channel(address) as channel:
                stub = pdserve_pb2_grpc.PDServeStub(channel)
                assert len(greedy_tokens(stub, pb, random_prompts([12], seed=4)[0], 8)) == 8
        finally:
            stop_up(up)
    if up.returncode not in (0, None):
        pytest.fail(err_path.read_text()[-4000:])
