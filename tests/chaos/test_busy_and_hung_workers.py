"""Slow is not dead, and hung is caught: the CI-sized twins of benchmarks/robustness/busy_hogs.py.

- Two busy processes hog both cores while streams run on 1 prefill + 1 decode worker: no worker
  is ever marked down or dead (router/pool.py), no stream fails, every stream is token-identical
  to the engine's own greedy output.
- A decode worker's engine thread hangs (the PDSERVE_TEST_ENGINE_HANG_FILE hook,
  engine/engine_loop.py) while its gRPC server still answers: its streams resume on the other
  decode worker within 10 s of the hang, token-identical, and it is counted dead as `stalled`.

The router and the workers run in this process and join through the Registry, as a deployment's
workers do; the default health bounds (worker_down_s, worker_silence_s, worker_stall_s) apply.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from helpers.hang import Streams, blocks_free, greedy, start_decode, start_prefill, stop_workers
from helpers.models import random_prompts
from helpers.router import start_router, stop_router
from helpers.threads import wait_until

HOG_S = 15.0
HOG = "import time\nend = time.monotonic() + float(__import__('sys').argv[1])\n"
HOG += "while time.monotonic() < end:\n    pass\n"
BOUND_S = 10.0  # a hung engine's streams go on elsewhere within this of the hang


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([20, 24, 28, 32], seed=47)


@pytest.fixture(scope="module")
def want(model_dir, prompts):
    return greedy(model_dir, prompts)


class HealthWatch:
    """Samples the pool every 20 ms: every (worker, down, dead) seen that was not healthy."""

    def __init__(self, pool):
        self.pool, self.bad = pool, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.02):
            for w in self.pool.members():
                if w.down or w.dead:
                    self.bad.append((self.pool.name(w), w.down, w.dead, time.monotonic()))

    def stop(self):
        self._stop.set()
        self._thread.join(5)


# It loads the machine itself: another test beside it (pytest-xdist) would double that load.
@pytest.mark.serial
def test_busy_machine_marks_no_worker_down_and_every_stream_completes(model_dir, prompts, want):
    router = start_router(model_dir)  # the default health bounds and heartbeat
    workers = [
        start_prefill(model_dir, "p0", router.address),
        start_decode(model_dir, "d0", router.address),
    ]
    hogs = []
    try:
        wait_until(
            lambda: router.pool.num_workers("prefill") == router.pool.num_workers("decode") == 1,
            30,
            "both workers joined",
        )
        watch = HealthWatch(router.pool)
        hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(HOG_S)]) for _ in range(2)]
        start, rounds = time.monotonic(), 0
        while time.monotonic() - start < HOG_S:  # streams all through the hogs
            streams = Streams(router, prompts)
            assert streams.join(120), "streams did not finish beside the busy processes"
            assert streams.errors == [None] * len(prompts)
            assert streams.ids == want
            rounds += 1
        watch.stop()
        assert all(h.poll() is None or h.returncode == 0 for h in hogs)
        assert watch.bad == [], watch.bad[:5]
        assert router.pool.deaths == {"silent": 0, "stalled": 0}
        assert rounds >= 1
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(10)
        stop_router(router)
        stop_workers(*workers)


def test_a_hung_engine_s_streams_resume_on_the_other_decode_worker(
    model_dir, prompts, want, tmp_path, monkeypatch
):
    hang = tmp_path / "hang"
    monkeypatch.setenv("PDSERVE_TEST_ENGINE_HANG_FILE", str(hang))  # read as each loop is made
    router = start_router(model_dir)
    decodes = [start_decode(model_dir, f"d{i}", router.address) for i in range(2)]
    prefill = start_prefill(model_dir, "p0", router.address)
    try:
        wait_until(lambda: router.pool.num_workers("decode") == 2, 30, "both decode workers")
        wait_until(lambda: router.pool.num_workers("prefill") == 1, 30, "the prefill worker")
        streams = Streams(router, prompts)
        wait_until(lambda: all(len(ids) >= 2 for ids in streams.ids), 30, "every stream started")
        running = [len(d.loop.engine.scheduler.running) for d in decodes]
        victim = running.index(max(running))
        assert running[victim] >= 1
        name = decodes[victim].config.worker_id
        (tmp_path / f"hang.{name}-engine").touch()  # its server still answers
        hung_at = time.monotonic()
        assert streams.join(BOUND_S + 60), "streams on the hung engine never finished"
        assert streams.errors == [None] * len(prompts)
        assert streams.ids == want
        waits = [next((t - hung_at for t in ts if t > hung_at), None) for ts in streams.times]
        late = [w for w in waits if w is not None and w >= BOUND_S]
        assert not late, waits
        assert router.pool.deaths["stalled"] >= 1 and router.pool.deaths["silent"] == 0
        survivor = decodes[1 - victim].config.worker_id
        assert {last.finish.timings.decode_worker for last in streams.last} == {survivor}
        (tmp_path / f"hang.{name}-engine").unlink()  # back: it frees what the moved streams held
        wait_until(lambda: all(blocks_free(d) for d in decodes), 30, "every block freed")
        wait_until(lambda: not router.pool.decode[victim].dead, 10, "alive again")
    finally:
        (tmp_path / "hang.d0-engine").unlink(missing_ok=True)
        (tmp_path / "hang.d1-engine").unlink(missing_ok=True)
        stop_router(router)
        stop_workers(prefill, *decodes)
