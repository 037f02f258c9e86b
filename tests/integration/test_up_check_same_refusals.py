"""`pdserve up --check` and `pdserve up` refuse the newcomer's mistakes alike (issue 28, must-show
b): for each one, both exit 2 and print the same first line (`up` in a process of its own,
`--check` in this one). The two share deploy/prechecks.preflight, so `up` refuses every one of these before Ray
starts or a weight loads, and each run takes the time of the CLI's imports. The GPU case runs
with CUDA_VISIBLE_DEVICES="" so that it holds on a machine with GPUs too (Ray counts only the
visible ones); on a Ray cluster joined by address, GPUs are checked only once `up` has joined it
(`--check` says so), the one newcomer mistake a check before the start cannot see there."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
from concurrent import futures

import pytest

from helpers.ports import free_ports
from pdserve.cli import main

ROOT = pathlib.Path(__file__).parents[2]


def _pdserve(argv: list[str], env: dict, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    # (a bound for a hung child only: it returns when the child exits. The child runs at the
    # test's own priority: at nice 19 it got almost no CPU beside two busy processes.)
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env=env,
    )


@pytest.fixture
def listener():
    """A TCP listener on 127.0.0.1 that nothing else owns: a busy port."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def test_check_and_up_stop_at_the_same_first_line(
    tmp_path, tiny_models, listener, capsys, monkeypatch
):
    model = tiny_models("llama-gqa")[0]  # 4 attention heads, 2 key/value heads
    grpc_port, http_port = free_ports(2)
    router = f"router: {{host: 127.0.0.1, port: {grpc_port}, http_port: {http_port}}}\n"
    ray = f"ray: {{num_cpus: 8, temp_dir: {tmp_path / 'ray'}}}\n"
    cases = {  # mistake -> (YAML, what its first line must say)
        "missing model path": (
            f"model: {tmp_path / 'no-such-model'}\n{router}{ray}",
            "model: got ",
        ),
        "busy gRPC port": (
            f"model: {model}\nrouter: {{host: 127.0.0.1, port: {listener}, "
            f"http_port: {http_port}}}\n{ray}",
            f"router.port: 127.0.0.1:{listener} is already in use",
        ),
        "busy HTTP port": (
            f"model: {model}\nrouter: {{host: 127.0.0.1, port: {grpc_port}, "
            f"http_port: {listener}}}\n{ray}",
            f"router.http_port: 127.0.0.1:{listener} is already in use",
        ),
        "GPUs on a machine without": (
            f"model: {model}\n{router}{ray}pools:\n  decode: {{resources: {{num_gpus: 1}}}}\n",
            "but the Ray cluster has 8 CPU, 0 GPU",
        ),
        "typo'd key": (
            f"model: {model}\n{router}{ray}pools:\n  decode: {{replica: 2}}\n",
            "pools.decode.replica: unknown key",
        ),
        "TP not dividing the heads": (
            f"model: {model}\n{router}{ray}pools:\n  decode: {{tp: 3}}\n",
            "pools.decode.tp: 3 does not divide the model's 4 attention heads",
        ),
        "KV cache too small": (
            f"model: {model}\n{router}{ray}pools:\n  decode: {{kv_cache_memory: 4096}}\n",
            "pools.decode: kv_cache_memory of 4096 bytes",
        ),
        "unknown KV backend": (
            f"model: {model}\n{router}{ray}kvtransfer: {{backend: rdma}}\n",
            "kvtransfer.backend: ",
        ),
    }
    env = {
        "CUDA_VISIBLE_DEVICES": "",
        "PDSERVE_CPU_KERNELS": "0",  # no kernel build in the cache: nothing starts that far
        "PDSERVE_CACHE_DIR": str(tmp_path / "cache"),
        "PDSERVE_NO_PROGRESS": "1",
    }
    for name in ("PDSERVE_API_KEYS", "PDSERVE_CLUSTER_SECRET"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    paths = []
    for i, (yaml, _) in enumerate(cases.values()):
        paths.append(tmp_path / f"case{i}.yaml")
        paths[-1].write_text(yaml)
    # `up` in processes of its own (it would start Ray), 3 at once: each mostly imports
    with futures.ThreadPoolExecutor(3) as pool:
        ups = list(pool.map(lambda path: _pdserve(["up", str(path)], dict(os.environ)), paths))
    for path, up, (mistake, (_, says)) in zip(paths, ups, cases.items()):
        capsys.readouterr()
        assert main(["up", str(path), "--check"]) == 2, mistake
        check = capsys.readouterr()
        assert up.returncode == 2, f"{mistake}: up exited {up.returncode}: {up.stderr}"
        assert "Traceback" not in up.stderr + check.err, f"{mistake}: {up.stderr}"
        first = check.err.strip().splitlines()[0]
        assert first.startswith("pdserve: ") and says in first, f"{mistake}: {first}"
        assert up.stderr.strip().splitlines()[0] == first, f"{mistake}: {up.stderr}"
        assert "ray ready" not in up.stderr and "nothing started" not in check.out
