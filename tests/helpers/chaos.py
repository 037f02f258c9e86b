"""A secured cluster in one process (router + one prefill + one decode worker on a tiny model, the
workers joined through the Registry with the cluster secret), and the clients the chaos tests
play: a health probe, streams that cancel themselves, strangers without the secret, and an abort
storm's streams with the check that a survivor's logprobs match its clean run."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import threading
import time
from concurrent import futures

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.models import random_prompts
from helpers.threads import wait_until
from helpers.worker import GREEDY, start_decode
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


# ---- a sender that claimed a reservation, wrote, and went silent (the claiming backends) ------


def dying_sender(backend, address, grant, block_ids, layout, ready, die, remote) -> None:
    """A prefill process that claims the reservation over `backend`, writes two layers, goes
    silent (no commit or abort: a stuck transfer, or a stopped process, as far as the decode side
    can tell) and dies when told. remote: its claim names no process (as a claim from another
    host: nothing the decode side can prove about it)."""
    from pdserve.kvtransfer.backends import claims, connect
    from pdserve.kvtransfer.transport import Destination
    from pdserve.kvtransfer.wire import ChunkHeader

    if remote:
        claims.process_identity = dict  # {}
    tx = connect(backend, address)
    dest = Destination(block_ids, layout, grant=grant)
    heads, dim = layout.num_kv_heads, layout.head_dim
    for layer in range(2):
        header = ChunkHeader("doomed", layout.fingerprint, layer, 0, 20, 0, heads, dim, "float32")
        tx.send(header, torch.randn(2, 20, heads, dim), dest)
    ready.set()
    die.wait(120)
    os._exit(3)


def silent_sender_held(tiny_models, backend: str, remote: bool) -> None:
    """A sender's reservation aborted while its claim may still write stays held (never handed
    to another request) past the claim's bound, with the worker reporting itself unhealthy
    (Stats fails UNAVAILABLE, as `unhealthy()` of the worker says); once the sender is gone (its
    process proven gone, or, remote, its control connection closed from its side) the blocks
    are freed and the worker is healthy again without a restart (a sender that never ends:
    under `pdserve up` the worker exits to be replaced, deploy/workers.py ExitWatch). A second
    abort (the router's Abort after its leg's stream went away) leaves the hold as it is."""
    model_dir, _ = tiny_models("llama-gqa")
    decode = start_decode(
        model_dir,
        engine=dict(kv_cache_memory=1 << 17, max_model_len=64),
        kv_backend=backend,
        kv_options={"grants": {"window_s": 0.5, "xfer_timeout_s": 0.5}},  # a bound of 6 s
        lease_ms=60_000,  # the sender process may take a while to start on a loaded machine
    )
    channel = grpc.insecure_channel(decode.address)
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)

    def stats():
        return stub.Stats(worker_pb2.StatsRequest(), timeout=10)

    def unhealthy() -> str:
        try:
            stats()
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            return e.details()
        return ""

    ctx = multiprocessing.get_context("spawn")
    ready, die = ctx.Event(), ctx.Event()
    try:
        total = stats().num_total_blocks
        res = stub.Reserve(
            worker_pb2.ReserveRequest(
                request_id="doomed", prompt_token_ids=random_prompts([20], seed=4)[0],
                sampling=GREEDY,
            ),
            timeout=10,
        )  # fmt: skip
        assert res.endpoint.backend == backend and res.endpoint.write_grant
        layout = dataclasses.replace(decode.layout, block_size=res.block_size)
        args = (backend, res.endpoint.address, res.endpoint.write_grant, list(res.block_ids))
        proc = ctx.Process(target=dying_sender, args=args + (layout, ready, die, remote))
        proc.start()
        assert ready.wait(60), "the sender never wrote"
        assert stub.Abort(worker_pb2.WorkerAbortRequest(request_id="doomed"), timeout=10).found
        s = stats()
        assert s.num_reserved == 1 and s.num_free_blocks < total  # held, not handed out
        assert stub.Abort(worker_pb2.WorkerAbortRequest(request_id="doomed"), timeout=10).found
        s = stats()
        assert s.num_reserved == 1 and s.num_free_blocks < total, s
        grants = decode.handoff.grants
        wait_until(unhealthy, 60, "the worker never reported the stuck hold")
        assert "held past the KV write bound" in unhealthy() and "'doomed'" in unhealthy()
        # what a worker under `pdserve up` watches to exit and be replaced past UNHEALTHY_EXIT_S
        # (deploy/workers.py ExitWatch), were the sender never to end
        assert "held past the KV write bound" in decode.unhealthy()
        assert decode.handoff.num_held == 1 and grants.num_stuck_total == 1  # still held
        assert decode.handoff.loop.load()["num_free_blocks"] < total
        die.set()  # the sender's process ends (and its kernel closes its connections)
        proc.join(30)
        assert proc.exitcode == 3
        wait_until(lambda: not unhealthy(), 60, "the worker stayed unhealthy")
        assert decode.unhealthy() == ""

        def freed():  # the engine frees the blocks on its loop thread, just after the grant ends
            s = stats()
            return s.num_reserved == 0 and s.num_free_blocks == total

        wait_until(freed, 10, f"the held reservation was not freed: {stats()}")
        if remote:  # freed by its closed connection, not by a proof about its process
            assert grants.num_released_peer_gone == 1 and grants.num_released_sender_gone == 0
        else:
            assert grants.num_released_sender_gone == 1
    finally:
        die.set()
        channel.close()
        decode.stop()
