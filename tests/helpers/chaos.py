"""A secured cluster in one process (router + one prefill + one decode worker on a tiny model, the
workers joined through the Registry with the cluster secret), and the clients the chaos tests
play: a health probe, streams that cancel themselves, strangers without the secret."""

from __future__ import annotations

import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.threads import wait_until  # noqa: F401
from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
from pdserve.prefill_worker.server import PrefillWorker, PrefillWorkerConfig
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.protos.security import ClusterSecurity
from pdserve.router.server import Router, RouterConfig

SECRET = "chaos-test-secret-0123456789"
SECURITY = ClusterSecurity(SECRET)
RPC_TIMEOUT = 30.0
MAX_MODEL_LEN = 256


class SecureCluster:
    """heartbeat_ms is short, so a router that stops answering for a moment drops its workers:
    exactly what a stalled polling thread did."""

    def __init__(
        self,
        model_dir: str,
        heartbeat_ms: int = 300,
        max_lease_ms: int = 120_000,
        kv_backend: str = "grpc",
        max_inflight: int = 64,
        security: ClusterSecurity = SECURITY,
    ):
        self.security = security
        self.router = Router(
            RouterConfig(
                model=model_dir,
                max_model_len=MAX_MODEL_LEN,
                max_inflight=max_inflight,
                heartbeat_ms=heartbeat_ms,
                security=security,
                deployment_id="chaos",
            )
        ).start()
        engine = dict(max_model_len=MAX_MODEL_LEN, block_size=16)
        common = dict(
            model=model_dir,
            registry_address=self.router.address,
            security=security,
            deployment_id="chaos",
        )
        self.decode = DecodeWorker(
            DecodeWorkerConfig(
                worker_id="d0",
                lease_ms=min(5000, max_lease_ms),
                max_lease_ms=max_lease_ms,
                kv_backend=kv_backend,
                engine_kwargs=dict(kv_cache_memory=1 << 20, **engine),
                **common,
            )
        ).start()
        self.prefill = PrefillWorker(
            PrefillWorkerConfig(
                worker_id="p0", engine_kwargs=dict(kv_cache_memory=1 << 20, **engine), **common
            )
        ).start()
        pool = self.router.pool
        wait_until(
            lambda: pool.num_workers("prefill") == 1 and pool.num_workers("decode") == 1,
            30,
            "both workers registered",
        )
        # the client API needs no secret; with cluster TLS the router's port is mutual TLS too
        self.api_channel = (
            grpc.secure_channel(self.router.address, security.tls.channel_credentials())
            if security.tls
            else grpc.insecure_channel(self.router.address)
        )
        self.api = pdserve_pb2_grpc.PDServeStub(self.api_channel)
        self.decode_channel = security.channel(self.decode.address)
        self.d = worker_pb2_grpc.DecodeWorkerStub(self.decode_channel)

    def stop(self) -> None:
        for channel in (self.api_channel, self.decode_channel):
            channel.close()
        self.router.stop()
        self.prefill.stop()
        self.decode.stop()

    def decode_stats(self):
        return self.d.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)

    def kv_all_free(self) -> bool:
        stats = self.decode_stats()
        engine = self.prefill.loop.engine
        return (
            stats.num_free_blocks == stats.num_total_blocks
            and stats.num_reserved == 0
            and stats.num_running == 0
            and not engine.has_unfinished_requests()
            and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        )

    def registrations(self) -> tuple[int, int]:
        return (
            self.prefill.registration.num_registrations,
            self.decode.registration.num_registrations,
        )


def stream(
    api,
    prompt: list[int],
    sampling,
    request_id: str = "",
    cancel_after: int | None = None,
    timeout: float = RPC_TIMEOUT,
    started=None,
):
    """(token ids, the Finish or None, how it ended): "finished", "cancelled" (by this client, after
    `cancel_after` deltas) or the gRPC status code. `started` (a threading.Event) is set when the
    first tokens arrive: the request is then running on its decode worker."""
    call = api.Generate(
        pdserve_pb2.GenerateRequest(
            request_id=request_id, token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=sampling
        ),
        timeout=timeout,
    )
    ids, finish = [], None
    try:
        for response in call:
            if response.HasField("delta"):
                ids.extend(response.delta.token_ids)
                if started is not None:
                    started.set()
                if cancel_after is not None and len(ids) >= cancel_after:
                    call.cancel()
                    return ids, None, "cancelled"
            else:
                finish = response.finish
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:
            return ids, None, "cancelled"
        return ids, None, e.code()
    return ids, finish, "finished"


class HealthProbe:
    """Checks the router's health every `period_s` from its own thread; records each latency and
    any failure (a check that misses its deadline is a failure)."""

    def __init__(self, address: str, period_s: float = 0.1, deadline_s: float = 1.0):
        self.channel = grpc.insecure_channel(address)
        self.stub = health_pb2_grpc.HealthStub(self.channel)
        self.period_s, self.deadline_s = period_s, deadline_s
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.channel.close()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            t0 = time.perf_counter()
            try:
                self.stub.Check(health_pb2.HealthCheckRequest(), timeout=self.deadline_s)
                self.latencies.append(time.perf_counter() - t0)
            except grpc.RpcError as e:
                self.failures.append(f"{e.code().name} after {time.perf_counter() - t0:.2f}s")

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")
