"""A worker's membership in a router's pool, kept alive from a daemon thread.

    registration = Registration(router_address, worker_pb2.RegisterRequest(
        worker_id="decode-0", role="decode", address=my_address, model=card), stats_fn).start()
    ...
    registration.stop()

The thread: Register (retried with exponential backoff while the router is unreachable or
refuses) -> every heartbeat_ms (the router's answer) Heartbeat with stats_fn() -> when the router
answers known=false (it restarted, or dropped this worker) or cannot be reached, Register again.
A router that rejects the registration (bad role, other model, another deployment, no or a wrong
cluster secret) is retried too, at the longest
backoff, with the reason logged: the deployment, not this process, has to change.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import grpc

from pdserve.protos import keepalive
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.protos.security import INSECURE, ClusterSecurity

log = logging.getLogger(__name__)
_REJECTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
}


class Registration:
    def __init__(
        self,
        registry_address: str,
        request: worker_pb2.RegisterRequest,
        stats_fn: Callable[[], worker_pb2.WorkerStats],
        *,
        rpc_timeout_s: float = 2.0,
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        security: ClusterSecurity = INSECURE,
    ):
        if not request.worker_id or not request.address:
            raise ValueError("RegisterRequest needs worker_id and address")
        self.registry_address = registry_address
        self.request = request
        self._register_lock = threading.Lock()
        self.stats_fn = stats_fn
        self.rpc_timeout_s = rpc_timeout_s
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        max_ms = int(max_backoff_s * 1000)
        # gRPC's own reconnect backoff grows to 120 s; ours must decide when to try again
        self._channel = security.channel(
            registry_address,
            [
                ("grpc.initial_reconnect_backoff_ms", int(min_backoff_s * 1000)),
                ("grpc.min_reconnect_backoff_ms", int(min_backoff_s * 1000)),
                ("grpc.max_reconnect_backoff_ms", max_ms),
                *keepalive.CLIENT_OPTIONS,  # a stopped router fails the heartbeat's call
            ],
        )
        self._stub = worker_pb2_grpc.RegistryStub(self._channel)
        self._stop = threading.Event()
        self._registered = threading.Event()
        self.num_registrations = 0
        self._unreachable = False
        self.heartbeat_s: float | None = None
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"registration-{request.worker_id}"
        )

    def start(self) -> Registration:
        self._thread.start()
        return self

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    def wait_registered(self, timeout: float) -> bool:
        return self._registered.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._channel.close()

    # ---- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = self.min_backoff_s
        while not self._stop.is_set():
            if self._registered.is_set():
                if not self._stop.wait(self.heartbeat_s):
                    self._heartbeat()
                continue
            outcome = self._register()
            if outcome == "ok":
                backoff = self.min_backoff_s
                continue
            self._stop.wait(self.max_backoff_s if outcome == "rejected" else backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    def _register(self) -> str:
        """ "ok", "retry" (the router is unreachable) or "rejected" (it refused this worker)."""
        try:
            with self._register_lock:  # never the old role after register_as
                reply = self._stub.Register(self.request, timeout=self.rpc_timeout_s)
        except grpc.RpcError as e:
            if e.code() in _REJECTED:
                log.error(
                    "router %s rejected worker %s: %s",
                    self.registry_address,
                    self.request.worker_id,
                    e.details(),
                )
                return "rejected"
            if not self._unreachable:  # once per outage, not once per retry
                log.warning(
                    "cannot register worker %s with router %s (%s); retrying",
                    self.request.worker_id,
                    self.registry_address,
                    e.code(),
                )
            self._unreachable = True
            return "retry"
        self._unreachable = False
        self.heartbeat_s = max(reply.heartbeat_ms, 1) / 1000
        self.num_registrations += 1
        self._registered.set()
        log.info(
            "worker %s registered with router %s (heartbeat every %d ms)",
            self.request.worker_id,
            self.registry_address,
            reply.heartbeat_ms,
        )
        return "ok"

    def register_as(self, role: str) -> None:
        """Registers under `role` now, from the calling thread (a role switch: the router moves
        the worker to that pool before this returns); later registrations use it too. Raises
        grpc.RpcError when the router refuses or cannot be reached (the role stays as it was)."""
        request = worker_pb2.RegisterRequest()
        request.CopyFrom(self.request)
        request.role = role
        with self._register_lock:
            self._stub.Register(request, timeout=self.rpc_timeout_s)
            self.request = request
        self.num_registrations += 1

    def _heartbeat(self) -> None:
        request = worker_pb2.HeartbeatRequest(worker_id=self.request.worker_id)
        try:
            request.stats.CopyFrom(self.stats_fn())
        except Exception:  # a heartbeat without numbers still keeps the membership
            log.exception("stats_fn of worker %s failed", self.request.worker_id)
        try:
            known = self._stub.Heartbeat(request, timeout=self.rpc_timeout_s).known
        except grpc.RpcError as e:
            log.warning(
                "heartbeat of worker %s to router %s failed (%s); registering again",
                self.request.worker_id,
                self.registry_address,
                e.code(),
            )
            self._unreachable = True
            self._registered.clear()
            return
        if not known:
            log.info(
                "router %s does not know worker %s; registering again",
                self.registry_address,
                self.request.worker_id,
            )
            self._registered.clear()


def register_worker(
    registry_address: str,
    role: str,
    worker_id: str,
    address: str,
    model: str,
    stats_fn: Callable[[], worker_pb2.WorkerStats],
    *,
    security: ClusterSecurity = INSECURE,
    deployment_id: str = "",
    model_id: str | None = None,
) -> Registration:
    """Starts the membership of a worker serving `model` (the deployment's model string) at
    `address`, for deployment `deployment_id`, under `model_id`, the router's model id (None: the
    model string's base name, the router's default)."""
    from pdserve.protos.pdserve.v1 import pdserve_pb2

    card = pdserve_pb2.ModelCard(id=model_id or os.path.basename(model.rstrip("/")))
    return Registration(
        registry_address,
        worker_pb2.RegisterRequest(
            worker_id=worker_id, role=role, address=address, model=card, deployment_id=deployment_id
        ),
        stats_fn,
        security=security,
    ).start()
