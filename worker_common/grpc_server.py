"""A gRPC server the way every pdserve process runs one: its own handler pool (gRPC does not own
the executor, so its threads would outlive `stop()`), raised message limits, and the standard
health service, SERVING for "" and the given service names once started. Every service but health
needs the cluster secret (health is worker_common/health.py's, not grpcio's servicer, which can
deadlock the server), and requests protobuf cannot parse get INVALID_ARGUMENT
(protos/security.py). A caller without the secret holds no handler thread, except that health's
calls may hold up to a quarter of them (at most MAX_OPEN_WAITS) while their request has not
arrived; a health call past that ends RESOURCE_EXHAUSTED at once. It accepts HTTP/2 keepalive
pings (protos/keepalive.py), by which the router notices a worker that stopped answering while
calls are open on it.

Stats shares the handler pool with the streams, which hold a thread each for their whole life;
a pool full of them would queue a Stats call. That makes the worker late, which the router takes
as down (no new work), never as dead: its heartbeats go out from the registration thread over a
client channel (worker_common/registration.py), and both read EngineLoop.load() without waiting
on the engine thread (router/pool.py says how down and dead differ).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.protos import keepalive
from pdserve.protos.security import INSECURE, MAX_OPEN_WAITS, ClusterSecurity
from pdserve.worker_common.health import Health


class ServiceHost:
    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        max_workers: int,
        max_message_bytes: int,
        security: ClusterSecurity = INSECURE,
    ):
        self.host, self.port = host, port
        self.security = security
        self._executor = futures.ThreadPoolExecutor(max_workers, thread_name_prefix=f"{name}-grpc")
        self.server = grpc.server(
            self._executor,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
                *keepalive.SERVER_OPTIONS,  # the router's pings (protos/keepalive.py)
            ],
            # health needs no secret: a quarter of the threads at most wait for its requests
            interceptors=security.server_interceptors(
                max_open_waits=max(1, min(MAX_OPEN_WAITS, max_workers // 4))
            ),
        )
        self._health = Health()  # grpcio's can deadlock its server (worker_common/health.py)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        self.address: str | None = None

    def start(self, register: Callable[[grpc.Server], None], service_names: tuple[str, ...]) -> str:
        register(self.server)
        port = self.security.add_port(self.server, f"{self.host}:{self.port}")
        if port == 0:
            raise OSError(f"cannot listen on {self.host}:{self.port}: set port to a free one")
        self.address = f"{self.host}:{port}"
        self.server.start()
        for name in ("",) + tuple(service_names):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.address

    def stop(self, grace: float) -> None:
        self._health.enter_graceful_shutdown()
        self.server.stop(grace=grace).wait(grace + 5)
        self._executor.shutdown(wait=True)
