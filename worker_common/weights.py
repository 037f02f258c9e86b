"""A worker's weight update, for both worker services: UpdateWeights (the router's
/update_weights_from_disk, router/weights.py, called on every worker while the router holds
every request back) loads the base model's weights again from a checkpoint directory on this
worker's host, through the engine (LLMEngine.update_weights: in place on every rank, every
cached prefix block dropped), on the engine's loop thread between steps; the gRPC handler thread
waits for it, bounded by UPDATE_TIMEOUT_S. The fields are checked before the engine is asked;
the engine refuses a checkpoint of other shapes (INVALID_ARGUMENT) and a state that cannot take
one (FAILED_PRECONDITION: requests still run, a quantized mode, a draft model). While it loads,
the loop says so in the worker's Stats (engine_loading_weights), so the router does not take the
long turn for a hung engine. `stats` gives WorkerStats the version and path now served.

A trainer's weight group (engine/weight_sync.py; the router's /init_weights_update_group and
/update_weights_from_distributed): InitWeightsGroup has the engine's ranks start joining it (a
short call on the loop thread: the joining runs on threads of each rank's own, and the worker
serves on meanwhile); UpdateWeightsFromGroup receives and loads one update on the loop thread as
UpdateWeights loads a checkpoint, bounded by the group's timeout; DestroyWeightsGroup leaves it.
"""

from __future__ import annotations

import concurrent.futures

import grpc

from pdserve.engine.errors import WeightUpdateRefused
from pdserve.engine.weight_sync import WeightSyncError
from pdserve.protos.limits import (
    MAX_WEIGHT_GROUP_CHARS,
    WEIGHT_UPDATE_TIMEOUT_S as UPDATE_TIMEOUT_S,
    check_transfer_id,
    check_weight_tensors,
    check_weight_update,
    check_weights_group,
)
from pdserve.protos.pdserve.v1 import worker_pb2


def update(loop, request, context) -> worker_pb2.UpdateWeightsResponse:
    why = check_weight_update(request.model_path, request.weight_version)
    if why is not None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)

    def load(engine):
        engine.update_weights(request.model_path, request.weight_version)

    _load(loop, load, UPDATE_TIMEOUT_S, repr(request.model_path[:300]), context)
    return _served(loop.engine)


def _load(loop, load, timeout_s: float, what: str, context) -> None:
    """Runs `load(engine)` on the loop thread with the worker's Stats saying so, and turns its
    refusals into the gRPC status that says why."""

    def run(engine):
        loop.loading_weights = True
        try:
            load(engine)
        finally:
            loop.loading_weights = False

    try:
        loop.call(run, loop.engine, timeout=timeout_s)
    except WeightUpdateRefused as e:
        _refuse(context, e)
    except WeightSyncError as e:
        context.abort(grpc.StatusCode.ABORTED, f"the transfer failed, nothing was loaded: {e}")
    except concurrent.futures.TimeoutError:
        context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the engine did not finish loading {what} within {timeout_s:g} s",
        )


def _refuse(context, e: WeightUpdateRefused) -> None:
    """Aborts the call with the status of the engine's refusal: FAILED_PRECONDITION for a state
    that cannot take weights now, INVALID_ARGUMENT for a request that is wrong."""
    code = (
        grpc.StatusCode.FAILED_PRECONDITION if e.precondition else grpc.StatusCode.INVALID_ARGUMENT
    )
    context.abort(code, str(e))


def _served(engine) -> worker_pb2.UpdateWeightsResponse:
    return worker_pb2.UpdateWeightsResponse(
        model_path=engine.weights_dir, weight_version=engine.weight_version
    )


def init_group(loop, request, context) -> worker_pb2.InitWeightsGroupResponse:
    r = request
    why = check_weights_group(
        r.group_name, r.master_address, r.master_port, r.rank_offset, r.world_size, r.timeout_s
    )
    if why is not None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)

    def join(engine):
        return engine.join_weights_group(
            r.group_name, r.master_address, r.master_port, r.rank_offset, r.world_size, r.timeout_s
        )

    try:
        ranks = loop.call(join, loop.engine, timeout=UPDATE_TIMEOUT_S)
    except WeightUpdateRefused as e:
        _refuse(context, e)
    except concurrent.futures.TimeoutError:
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the engine did not take the group")
    return worker_pb2.InitWeightsGroupResponse(ranks=ranks)


def update_from_group(loop, request, context) -> worker_pb2.UpdateWeightsResponse:
    r = request
    if len(r.ndims) != len(r.names) or sum(r.ndims) != len(r.dims):
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, "ndims must give each tensor's count of dims"
        )
    shapes, at = [], 0
    for n in r.ndims:
        shapes.append(list(r.dims[at : at + n]))
        at += n
    names, dtypes = list(r.names), list(r.dtypes)
    why = check_transfer_id(r.transfer_id) or check_weight_tensors(names, dtypes, shapes)
    why = why or check_weight_update(r.source or "group", r.weight_version)
    if why is not None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
    group_timeout = loop.engine.weight_group_timeout(r.group_name)

    def load(engine):
        engine.receive_weights(
            r.group_name, names, dtypes, shapes, r.transfer_id, r.weight_version, r.source
        )

    finished = []

    def on_end():  # the router called it off (another worker refused): no rank waits on
        if not finished:
            loop.engine.call_off_transfer(r.group_name, r.transfer_id)

    context.add_callback(on_end)
    try:
        # the group's own timeout bounds each collective; the whole load gets that once more
        _load(loop, load, 2 * group_timeout + 60, f"group {r.group_name[:64]!r}", context)
    finally:
        finished.append(True)
    return _served(loop.engine)


def destroy_group(loop, request, context) -> worker_pb2.DestroyWeightsGroupResponse:
    if len(request.group_name) > MAX_WEIGHT_GROUP_CHARS:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"group_name is at most {MAX_WEIGHT_GROUP_CHARS} characters",
        )
    try:
        found = loop.call(
            lambda engine: engine.leave_weights_group(request.group_name),
            loop.engine,
            timeout=UPDATE_TIMEOUT_S,
        )
    except concurrent.futures.TimeoutError:
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the engine did not leave the group")
    return worker_pb2.DestroyWeightsGroupResponse(found=found)


def stats(engine) -> dict:
    """The WorkerStats fields of the weights served."""
    return {
        "weight_version": engine.weight_version,
        "weights_path": engine.weights_dir,
        "engine_ranks": engine.tp_state.world_size,
    }
