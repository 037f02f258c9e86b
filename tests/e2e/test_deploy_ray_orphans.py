"""A kill -9 of `pdserve up` leaves no process of its local Ray behind. Ray's head processes die
with their parent by themselves, but the raylet's dashboard and runtime env agents outlived it by a
minute or more (issue #26); the watchdog of deploy/ray_reaper.py kills them, with one line on
`up`'s stderr. A SIGTERM while `up` starts undoes the start as Ctrl-C does: exit 130, one line
saying so, no process left and no stack from Ray's signal handler. `pdserve up` runs as a command,
on a tiny random model. The watchdog alone, with fake processes:
tests/integration/test_ray_reaper_processes.py."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from helpers.process import alive, command_of, still_alive_after, tree
from helpers.up import ray_temp_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="the watchdog reads /proc"),
]

ROOT = pathlib.Path(__file__).parents[2]
START_TIMEOUT_S = 300.0
GONE_WITHIN_S = 30.0  # the bound issue #26 asks for (the agents alone took over a minute)


def _wait_for_line(proc: subprocess.Popen, want: str, timeout_s: float, err_path) -> None:
    """Reads `proc`'s stdout on a thread of its own until the line `want`; fails at once, with
    the end of its stderr, when it exits first."""
    seen, ended = threading.Event(), threading.Event()

    def read():
        for line in proc.stdout:
            if line.strip() == want:
                seen.set()
                return
        ended.set()  # stdout closed: the process is gone

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not seen.wait(0.2) and not ended.is_set() and time.monotonic() < deadline:
        pass
    if not seen.is_set():
        state = f"exited {proc.wait(10)}" if ended.is_set() else "still starting"
        raise AssertionError(
            f"`pdserve up` printed no {want!r} ({state}):\n{err_path.read_text()[-3000:]}"
        )


@contextlib.contextmanager
def _up_on_a_tiny_model(tiny_models, tmp_path: pathlib.Path):
    """`pdserve up` of a float32 tiny model on a local Ray of its own, as a command in a session of
    its own; yields (the process, its stderr's path, a dict the test fills with the process tree
    it saw: pid -> start time). Whatever is left of that tree is killed afterwards."""
    model_dir, _ = tiny_models("llama-gqa")
    with ray_temp_dir() as ray_tmp:  # removed after the kills below, which stop its writers
        pool = {"replicas": 1, "tp": 1, "resources": {"num_cpus": 1}, "kv_cache_memory": 4 << 20}
        config = tmp_path / "tiny.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "model": model_dir,
                    "dtype": "float32",
                    "pools": {"prefill": pool, "decode": pool},
                    "router": {"host": "127.0.0.1", "port": 0, "http_port": None},
                    "ray": {"num_cpus": 2, "temp_dir": ray_tmp},
                }
            )
        )
        err_path = tmp_path / "up.err"
        processes: dict[int, int] = {}
        with open(err_path, "w") as err:
            up = subprocess.Popen(
                [sys.executable, "-m", "pdserve", "up", str(config)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=ROOT,
                start_new_session=True,  # nothing of it shares the test's process group
            )
        try:
            yield up, err_path, processes
        finally:
            if up.poll() is None:
                up.kill()
                up.wait()
            for pid, start in processes.items():
                if alive(pid, start):
                    os.kill(pid, signal.SIGKILL)


def _exit_code(up: subprocess.Popen, timeout_s: float, err_path) -> int:
    """`up`'s exit code once it exits; a failure with its threads' stacks (`pdserve up` dumps
    them on SIGUSR1) and its log where it is still running after timeout_s (a CI run under load
    saw one not exit in 120 s after SIGTERM, and nothing said where it was)."""
    try:
        return up.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(up.pid, signal.SIGUSR1)
        time.sleep(2)
        pytest.fail(f"`up` still runs {timeout_s:.0f} s on:\n{err_path.read_text()[-12000:]}")


def _assert_gone(processes: dict[int, int], after: str) -> None:
    left = still_alive_after(processes, GONE_WITHIN_S)
    assert not left, f"still running {GONE_WITHIN_S:.0f}s after {after}: " + ", ".join(
        f"{pid} {command_of(pid)}" for pid in left
    )


def test_kill_9_of_pdserve_up_leaves_no_ray_process(tiny_models, tmp_path):
    with _up_on_a_tiny_model(tiny_models, tmp_path) as (up, err_path, processes):
        _wait_for_line(up, "ready", START_TIMEOUT_S, err_path)
        processes.update(tree(up.pid))
        commands = " ".join(command_of(pid) for pid in processes)
        for part in ("raylet", "gcs_server", "Agent"):  # the agents: what outlived `up` before
            assert part in commands, f"no {part} among {commands}"
        os.kill(up.pid, signal.SIGKILL)
        up.wait()
        _assert_gone(processes, "the kill")
        said = err_path.read_text().splitlines()
        assert any("died without stopping its local Ray; killed what was left" in s for s in said)


def test_sigterm_while_up_starts_undoes_the_start_and_exits_130(tiny_models, tmp_path):
    """Ray's driver handler used to take it: exit 15, after its C++ handler printed a stack."""
    with _up_on_a_tiny_model(tiny_models, tmp_path) as (up, err_path, processes):
        # Ray runs, and the router and the workers start (a tiny model's take seconds)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "ray ready" not in err_path.read_text():
            assert up.poll() is None, f"exited {up.returncode}:\n{err_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.1)
        processes.update(tree(up.pid))
        assert "raylet" in " ".join(command_of(pid) for pid in processes)
        os.kill(up.pid, signal.SIGTERM)
        assert _exit_code(up, 120, err_path) == 130, err_path.read_text()[-3000:]
        said = err_path.read_text()
        assert "start interrupted (SIGTERM): stopping what started" in said
        assert "SIGTERM received" not in said, said[-3000:]
        assert "ready" not in up.stdout.read().split()
        _assert_gone(processes, "`up` exited")
