"""LoRA adapters on a worker, for both worker services: the adapter a Reserve or Prefill call
names, and the run-time LoadLoRA and UnloadLoRA calls (the router's /v1/load_lora_adapter and
/v1/unload_lora_adapter, told to every worker).

A worker's adapters live in its engine's registry (engine/lora.py LoRARegistry): those of its
config's `lora_modules` from the start (so a worker that joins later, or flips role, has them),
plus what LoadLoRA added since. A call naming an adapter the worker does not have is refused
FAILED_PRECONDITION before any work; a prefill whose adapter's content hash differs from the
decode worker's (ReserveResponse.lora_hash) too, so KV computed under one adapter never lands in a
reservation made for another. LoadLoRA reads and checks the adapter on the handler's thread (a
few MB at most for the ranks served; never on gRPC's polling thread), bounded by
engine/lora.py's limits on names, paths and sizes; with `if_absent` (the router's catch-up of a
worker that joined after a run-time load) it changes nothing where the worker has that name from
that path already. `stats` gives both services' WorkerStats their adapter fields: the adapters
served and those resident, which the router routes by (router/pool.py).
"""

from __future__ import annotations

import grpc

from pdserve.engine.lora import LoRAError, LoRARequest, check_name, check_path
from pdserve.protos.pdserve.v1 import worker_pb2

MAX_STATS_NAMES = 256  # adapter names a WorkerStats lists at most (it says how many there are)


def adapter_of(engine, name: str, context):
    """The engine's AdapterInfo for a call's `lora_name` (None for ""), or the call aborted."""
    if not name:
        return None
    try:
        check_name(name)
    except LoRAError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lora_name: {e}")
    registry = getattr(engine, "loras", None)
    if registry is None:
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"lora_name {name!r}: this worker serves no LoRA adapters (lora.enabled is off)",
        )
    info = registry.get(name)
    if info is None:
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"lora_name {name!r}: this worker has no adapter of that name loaded",
        )
    return info


def adapters(engine, found: bool = False) -> worker_pb2.LoRAAdapters:
    return worker_pb2.LoRAAdapters(
        adapters=[
            worker_pb2.LoRAAdapter(
                name=a.name, path=a.path, rank=a.rank, content_hash=a.content_hash
            )
            for a in engine.list_loras()
        ],
        found=found,
    )


def stats(engine) -> dict:
    """The WorkerStats fields of the worker's adapters (worker.proto: lora_adapters, ...), read
    from any thread without waiting for the engine: the registry under its lock, the resident
    names and the counters as one atomic read each. Empty where LoRA is off."""
    registry = getattr(engine, "loras", None)
    if registry is None:
        return {}
    names = [a.name for a in registry.list()]
    cache = getattr(getattr(engine, "runner", None), "lora_cache", None)
    out = {
        "lora_adapters": names[:MAX_STATS_NAMES],
        "lora_adapters_count": len(names),
    }
    if cache is not None:
        out["lora_resident"] = list(cache.resident_names[-MAX_STATS_NAMES:])
        out["lora_loads"] = cache.loads
        out["lora_evictions"] = cache.evictions
    sched = getattr(engine, "scheduler", None)
    if sched is not None:  # each queue copied in one C call: the loop may change it meanwhile
        out["lora_running"] = _adapters(list(sched.running))
        out["lora_waiting"] = _adapters(list(sched.waiting))
    out["lora_max"] = engine.config.max_loras
    return out


def _adapters(seqs) -> list[str]:
    """The names of the adapters `seqs` run under, each once, in their first sequence's order."""
    names = dict.fromkeys(s.lora.name for s in seqs if s.lora is not None)
    return list(names)[:MAX_STATS_NAMES]


def load(engine, request, context) -> worker_pb2.LoRAAdapters:
    if getattr(engine, "loras", None) is None:
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "this worker serves no LoRA adapters (lora.enabled is off)",
        )
    try:
        check_name(request.lora_name)
        check_path(request.lora_path)
        held = engine.loras.get(request.lora_name)
        if not (request.if_absent and held is not None and held.path == request.lora_path):
            engine.add_lora(LoRARequest(request.lora_name, 1, request.lora_path))
    except LoRAError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    return adapters(engine)


def unload(engine, request, context) -> worker_pb2.LoRAAdapters:
    if getattr(engine, "loras", None) is None:
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "this worker serves no LoRA adapters (lora.enabled is off)",
        )
    try:
        check_name(request.lora_name)
    except LoRAError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    return adapters(engine, found=engine.remove_lora(request.lora_name))
