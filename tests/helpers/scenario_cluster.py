"""The chaos scenario suite's CI-sized deployment (tests/chaos/test_scenarios.py runs
benchmarks/robustness/faults.py's scenarios on it): a secured router in the test process and
every worker in a child process of its own, so that a scenario can SIGSTOP, kill -9 or starve
one without touching the test.

Each child builds the worker the launcher builds (deploy/workers.py build_worker, both roles, so
the router can flip it), on a tiny random model, with its engine's steps slowed by `step_s` so
that streams are mid-way when a fault lands; it registers with the router under the cluster
secret (read from its stdin, never its argv or environment) and the deployment id, prints its
address, and lives until its stdin closes. Each child's environment names its own engine hang
file (PDSERVE_TEST_ENGINE_HANG_FILE, the engine's test hook): `set_hang` creates or removes it.
`killed(worker, restart=True)` plays the launcher's supervisor: it relaunches the worker under
the same name in its launch role and returns once the router holds it again.

Not a test module: imported as `from helpers.scenario_cluster import LocalTarget`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import torch

from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.protos.security import ClusterSecurity
from pdserve.router.server import Router, RouterConfig

SECRET = "scenario-test-secret-0123456789"
DEPLOYMENT_ID = "scenarios"
MAX_MODEL_LEN = 256
START_TIMEOUT_S = 120.0
CHILD = """
import sys, time
import torch
torch.set_num_threads(1)
from pdserve.decode_worker.server import DecodeWorkerConfig
from pdserve.deploy.workers import build_worker
from pdserve.protos.security import ClusterSecurity
role, model, registry, worker_id, step_s, max_model_len, deployment_id, kv = sys.argv[1:9]
secret = sys.stdin.readline().strip()
cfg = DecodeWorkerConfig(model=model, worker_id=worker_id, lease_ms=5000, stop_grace_s=0,
    engine_kwargs=dict(max_model_len=int(max_model_len), kv_cache_memory=1 << 20, block_size=16),
    registry_address=registry, security=ClusterSecurity(secret), deployment_id=deployment_id,
    kv_backend=kv)
worker = build_worker(role, cfg, flippable=True).start()
step = worker.loop.engine.step
worker.loop.engine.step = lambda: (time.sleep(float(step_s)), step())[1]
print("ADDRESS", worker.address, flush=True)
sys.stdin.read()
worker.stop()
"""


class LocalTarget:
    """A Target (benchmarks/robustness/faults.py) of `prefill` + `decode` child workers behind a
    router in this process; `stop()` ends them all. Router settings: its defaults, but for
    `router_kwargs`. `kv_backend`: every worker's (DecodeWorkerConfig.kv_backend)."""

    def __init__(
        self,
        model_dir: str,
        prefill: int,
        decode: int,
        step_s: float = 0.02,
        kv_backend: str = "grpc",
        **router_kwargs,
    ):
        self.model_dir, self.step_s, self.kv_backend = model_dir, step_s, kv_backend
        self.security = ClusterSecurity(SECRET)
        self.router = Router(
            RouterConfig(
                model=model_dir,
                max_model_len=MAX_MODEL_LEN,
                security=self.security,
                deployment_id=DEPLOYMENT_ID,
                **router_kwargs,
            )
        ).start()
        self.address = self.router.address
        self.roles = {f"prefill-{i}": "prefill" for i in range(prefill)}
        self.roles |= {f"decode-{i}": "decode" for i in range(decode)}
        self.hang_dir = tempfile.mkdtemp(prefix="pdserve-hang-")
        self.procs: dict[str, subprocess.Popen] = {}
        self.addresses: dict[str, str] = {}
        self.channel = self.security.channel(self.address)
        self._admin = worker_pb2_grpc.AdminStub(self.channel)
        try:
            for name in self.roles:  # all spawned first: they import in parallel
                self.procs[name] = self._spawn(name)
            for name in self.roles:
                self._read_address(name)
            self._wait_registered(set(self.roles))
        except BaseException:
            self.stop()
            raise

    # -- the children --
    def _spawn(self, name: str) -> subprocess.Popen:
        # NIXL logs INFO lines to stdout, where the child prints its address: WARN and up only
        env = dict(
            os.environ, PDSERVE_TEST_ENGINE_HANG_FILE=self.hang_file(name), NIXL_LOG_LEVEL="WARN"
        )
        args = [self.roles[name], self.model_dir, self.address, name, str(self.step_s)]
        args += [str(MAX_MODEL_LEN), DEPLOYMENT_ID, self.kv_backend]
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        proc.stdin.write(SECRET + "\n")
        proc.stdin.flush()
        return proc

    def _read_address(self, name: str) -> None:
        address = ""
        for line in self.procs[name].stdout:  # past anything a library printed first
            if line.startswith("ADDRESS "):
                address = line.split(None, 1)[1].strip()
                break
        if not address:
            raise RuntimeError(f"worker {name} did not start (exit {self.procs[name].poll()})")
        self.addresses[name] = address

    def _wait_registered(self, names: set[str], timeout_s: float = START_TIMEOUT_S) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            reply = self._admin.ListWorkers(worker_pb2.ListWorkersRequest(), timeout=30)
            if names <= {w.worker_id for w in reply.workers if w.state == "serving"}:
                return
            time.sleep(0.05)
        raise RuntimeError(f"workers {sorted(names)} did not all register in {timeout_s:.0f} s")

    def as_launched(self) -> bool:
        """Every worker alive and serving, in the router and by its own word, the role it was
        launched with: what a fresh deployment is."""
        if any(proc.poll() is not None for proc in self.procs.values()):
            return False
        reply = self._admin.ListWorkers(worker_pb2.ListWorkersRequest(), timeout=30)
        view = {w.worker_id: (w.role, w.state) for w in reply.workers}
        for name, role in self.roles.items():
            own = self.stats(name)
            if view.get(name) != (role, "serving") or own is None:
                return False
            if own.role and (own.role, own.role_state) != (role, "serving"):
                return False
        return True

    def hang_file(self, name: str) -> str:
        return os.path.join(self.hang_dir, f"{name}.hang")

    # -- Target --
    def prompts(self, load) -> list[list[int]]:
        """Random prompts over the tiny models' 256-token vocabulary (tests/helpers/models.py)."""
        g = torch.Generator().manual_seed(load.seed)
        return torch.randint(2, 256, (load.streams, load.prompt_len), generator=g).tolist()

    def pid(self, worker: str) -> int:
        return self.procs[worker].pid

    def stats(self, worker: str):
        """The worker's WorkerStats through either role's service, or None when it does not
        answer within 2 s."""
        if self.procs[worker].poll() is not None:
            return None
        with self.security.channel(self.addresses[worker]) as channel:
            for stub in (worker_pb2_grpc.DecodeWorkerStub, worker_pb2_grpc.PrefillWorkerStub):
                try:
                    return stub(channel).Stats(worker_pb2.StatsRequest(), timeout=2.0)
                except grpc.RpcError:
                    continue
        return None

    def admin(self):
        return self._admin

    def killed(self, worker: str, restart: bool) -> None:
        self.procs[worker].wait(30)
        if not restart:
            return
        time.sleep(0.5)  # the supervisor's backoff_s (deploy/supervisor.py RestartPolicy)
        self.procs[worker] = self._spawn(worker)
        self._read_address(worker)
        self._wait_registered({worker})

    def set_hang(self, worker: str, on: bool) -> None:
        path = self.hang_file(worker)
        if on:
            with open(path, "w"):
                pass
        elif os.path.exists(path):
            os.unlink(path)

    def stop(self) -> None:
        for name, proc in self.procs.items():
            self.set_hang(name, False)
            try:
                os.kill(proc.pid, signal.SIGCONT)  # in case a scenario left it stopped
            except ProcessLookupError:
                pass
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            proc.stdout.close()
        self.channel.close()
        self.router.stop()
