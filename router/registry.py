"""The router's Registry service: workers join the pools at run time and stay while they
heartbeat.

  Register(worker_id, role, address, model, deployment_id) -> checked against this router (role,
      served model, its deployment; the cluster secret was checked before, by protos/security.py)
      -> added to the role's pool (or refreshed; a new address or role replaces the old entry)
      -> RegisterResponse(heartbeat_ms)
  Heartbeat(worker_id, stats) -> known=true, and the worker is not silent (router/pool.py);
      known=false for an id the pool does not hold (the router restarted, or the worker dropped
      out), which tells the worker to Register again
  silent (no Heartbeat and no Stats answer) for the pool's silence bound -> the pool's health
      thread drops the worker (router/pool.py: a late heartbeat alone does not, while its Stats
      answer)
"""

from __future__ import annotations

import grpc

from pdserve.protos.limits import MAX_ADDRESS_CHARS, check_id
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.router.pool import ROLES, WorkerPool


class RegistryServicer(worker_pb2_grpc.RegistryServicer):
    def __init__(
        self,
        pool: WorkerPool,
        model_id: str,
        *,
        heartbeat_ms: int = 1000,
        deployment_id: str = "",
    ):
        if heartbeat_ms < 1:
            raise ValueError(f"heartbeat_ms must be >= 1, got {heartbeat_ms}")
        self.pool = pool
        self.model_id = model_id
        self.heartbeat_ms = heartbeat_ms
        self.deployment_id = deployment_id

    def Register(self, request, context):
        refusal = check_id("worker_id", request.worker_id)
        if refusal:
            refusal.abort(context)
        if self.deployment_id and request.deployment_id != self.deployment_id:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {request.worker_id} belongs to deployment "
                f"{request.deployment_id[:64] or '(none)'} but this router serves deployment "
                f"{self.deployment_id}: another pdserve deployment may be using this port",
            )
        if request.role not in ROLES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"role must be one of {list(ROLES)}, got {request.role!r}",
            )
        if len(request.address) > MAX_ADDRESS_CHARS:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"address has {len(request.address)} characters; at most {MAX_ADDRESS_CHARS}",
            )
        if not request.address:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"address must be the host:port of the worker's {request.role} service",
            )
        if request.HasField("model") and request.model.id and request.model.id != self.model_id:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {request.worker_id} serves model {request.model.id[:200]!r} but this "
                f"router serves {self.model_id!r}: register it with the router of its model",
            )
        self.pool.register(request.role, request.worker_id, request.address)
        return worker_pb2.RegisterResponse(heartbeat_ms=self.heartbeat_ms)

    def Heartbeat(self, request, context):
        refusal = check_id("worker_id", request.worker_id)
        if refusal:
            refusal.abort(context)
        stats = request.stats if request.HasField("stats") else None
        return worker_pb2.HeartbeatResponse(known=self.pool.heartbeat(request.worker_id, stats))
