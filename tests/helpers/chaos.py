"""A secured cluster in one process (router + one prefill + one decode worker on a tiny model, the
workers joined through the Registry with the cluster secret), and the clients the chaos tests
play: a health probe, streams that cancel themselves, strangers without the secret, and an abort
storm's streams with the check that a survivor's logprobs match its clean run."""

from __future__ import annotations

import random
import threading
import time
from concurrent import futures

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
        prefill_engine: dict | None = None,
    ):
        """prefill_engine: more engine settings for the prefill worker (its pipeline stages)."""
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
                worker_id="p0",
                engine_kwargs=dict(kv_cache_memory=1 << 20, **engine, **(prefill_engine or {})),
                **common,
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


# ---- an abort storm's streams (tests/chaos/test_nixl_chaos.py, test_pp_abort_storm.py) ----------
# logprobs: a stream's KV read wrong shows in its logprobs before (or without) a changed token
STORM_SAMPLING = pdserve_pb2.SamplingParams(
    temperature=0, max_tokens=10, ignore_eos=True, logprobs=True
)
LOGPROB_TOLERANCE = 1e-4  # the engine's float32 runs agree to ~1e-7 across batch compositions


def cancelled_at(api, prompt, delay_s: float | None):
    """((token ids, their logprobs), how it ended) of a STORM_SAMPLING stream its client cancels
    `delay_s` after sending it (None: never)."""
    call = api.Generate(
        pdserve_pb2.GenerateRequest(
            token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=STORM_SAMPLING
        ),
        timeout=60,
    )
    timer = threading.Timer(delay_s, call.cancel) if delay_s is not None else None
    if timer:
        timer.start()
    ids, logprobs = [], []
    try:
        for response in call:
            if response.HasField("delta"):
                ids.extend(response.delta.token_ids)
                logprobs.extend(response.delta.logprobs)
        return (ids, logprobs), "finished"
    except grpc.RpcError as e:
        how = "cancelled" if e.code() == grpc.StatusCode.CANCELLED else e.code()
        return (ids, logprobs), how
    finally:
        if timer:
            timer.cancel()


def diverged(got, ref) -> str:
    """How a stream (token ids, logprobs) departs from its clean run over the tokens it has ("":
    it does not). A changed token after drifting logprobs means KV read wrong; one with equal
    logprobs before it, another request's events."""
    (ids, lps), (ref_ids, ref_lps) = got, ref
    drift = [abs(a - b) for a, b in zip(lps, ref_lps)]
    first = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), None)
    if first is None and max(drift, default=0.0) <= LOGPROB_TOLERANCE:
        return ""
    return (
        f"tokens {ids} against {ref_ids} (first difference at {first}); logprobs differ by "
        f"{[f'{d:.1e}' for d in drift]}"
    )


def abort_storm(api, prompts, requests: int = 80, threads: int = 12, seed: int = 11) -> None:
    """Each prompt's clean run, then `requests` streams of them from `threads` clients, 60% of
    them cancelled 0-0.2 s after they were sent (many during their hand-offs): every stream
    ends finished or cancelled by its client, each matches its prompt's clean run as far as it
    got (logprobs included: `diverged`), and some were cancelled."""
    clean = [cancelled_at(api, p, None) for p in prompts]
    assert all(how == "finished" and len(ids) == 10 for (ids, _), how in clean)
    rng = random.Random(seed)
    plan = [
        (i % len(prompts), rng.uniform(0.0, 0.2) if rng.random() < 0.6 else None)
        for i in range(requests)
    ]
    with futures.ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(lambda item: cancelled_at(api, prompts[item[0]], item[1]), plan))
    for (idx, delay), (got, how) in zip(plan, results):
        assert how == "finished" or (delay is not None and how == "cancelled"), how
        ref = clean[idx][0]
        if how == "finished":
            assert len(got[0]) == len(ref[0]), (got, ref)
        assert not diverged(got, ref), f"prompt {idx}, {how}: {diverged(got, ref)}"
    assert any(how == "cancelled" for _, how in results)
