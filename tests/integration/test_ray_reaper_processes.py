"""The watchdog of a local Ray (deploy/ray_reaper.py) with real processes and no Ray: a fake
driver starts a fake head process that dies with it (as Ray's head processes do: a parent-death
signal) and that starts an "agent" that does not (as the raylet's agents do not). Killed with
SIGKILL, the driver leaves the agent behind; its watchdog kills it and says so in one line, and
leaves alone what does not descend from the head. Stopped in order, the watchdog kills leftovers
quietly and exits. With Ray, after a kill -9 of `pdserve up`: tests/e2e/test_deploy_ray_orphans.py.
A local Ray start that timed out has what it started killed before it is tried again.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest
import ray

from helpers.process import alive, start_time, still_alive_after
from pdserve.deploy import ray_connect

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the watchdog reads /proc")

ROOT = pathlib.Path(__file__).parents[2]

# the head: dies with its parent (PR_SET_PDEATHSIG, SIGKILL), starts an agent that does not
HEAD = textwrap.dedent(
    """
    import ctypes, subprocess, sys, time
    ctypes.CDLL(None).prctl(1, 9)
    agent = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    print(agent.pid, flush=True)
    time.sleep(600)
    """
)
# the driver: the head, a bystander that is none of Ray's, the watchdog; then waits for the test.
# Only the driver, the head and the watchdog hold the test's stderr: it reads it to the end
DRIVER = textwrap.dedent(
    """
    import subprocess, sys, time
    from pdserve.deploy import ray_reaper
    head = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE)
    agent = int(head.stdout.readline())
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    watchdog = ray_reaper.watch({head.pid: ray_reaper.stat(head.pid)[1]}, "fake up")
    time.sleep(3 * ray_reaper.POLL_S)  # it has recorded the agent
    print(head.pid, agent, bystander.pid, watchdog.process.pid, flush=True)
    if sys.stdin.readline().strip() == "stop":  # in order: Ray stopped, an agent left over
        head.kill()
        head.wait()
        watchdog.stop()
        print("stopped", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def driver():
    """The fake driver, its processes ({name: (pid, start time)}) once its watchdog runs."""
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, HEAD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    started = []
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        pids = dict(zip(("head", "agent", "bystander", "watchdog"), map(int, line.split())))
        procs = {name: (pid, start_time(pid)) for name, pid in pids.items()}
        started = list(procs.values())
        yield proc, procs
    finally:
        proc.kill()
        proc.wait()
        for pid, start in started:  # whatever the test left
            if alive(pid, start):
                os.kill(pid, signal.SIGKILL)


def test_a_killed_driver_leaves_nothing_of_its_ray_and_says_so(driver):
    proc, procs = driver
    os.kill(proc.pid, signal.SIGKILL)
    gone = {procs[name] for name in ("head", "agent", "watchdog")}
    assert still_alive_after(dict(gone), 10) == {}  # the agent too: it ignores its parent
    assert alive(*procs["bystander"])  # none of Ray's: not the watchdog's to kill
    err = proc.stderr.read()
    assert err.count("\n") == 1 and err.startswith("pdserve: `fake up` (pid "), err
    assert "died without stopping its local Ray; killed what was left of it: python" in err


def test_stopped_in_order_it_kills_what_is_left_quietly_and_exits(driver):
    proc, procs = driver
    # a `pkill -INT -f "pdserve up"` (or -TERM) meant for the driver matches the watchdog's
    # command line too: it stays, and says nothing
    watchdog = dict([procs["watchdog"]])
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(procs["watchdog"][0], sig)
    assert still_alive_after(watchdog, 1.5) == watchdog
    proc.stdin.write("stop\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "stopped"
    gone = {procs[name] for name in ("head", "agent", "watchdog")}
    assert still_alive_after(dict(gone), 10) == {}
    assert alive(*procs["bystander"])
    proc.kill()
    assert proc.stderr.read() == ""


def test_what_a_timed_out_try_started_is_killed(monkeypatch):
    """The processes a timed-out ray.init left behind (here a sleeping child standing for the GCS)
    are killed before the second try; a child the second try starts is returned for the
    watchdog."""
    children = []

    def fake_init(**kwargs):
        children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        if len(children) == 1:
            raise Exception("The current node timed out during startup.")
        return "context"

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    try:
        _, started = ray_connect.start_local_ray()
        assert children[0].wait(timeout=5) == -9  # SIGKILL
        assert list(started) == [children[1].pid]
        assert children[1].poll() is None
    finally:
        for child in children:
            child.kill()
            child.wait()
