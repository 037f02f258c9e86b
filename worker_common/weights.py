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
"""

from __future__ import annotations

import concurrent.futures

import grpc

from pdserve.engine.errors import WeightUpdateRefused
from pdserve.protos.limits import WEIGHT_UPDATE_TIMEOUT_S as UPDATE_TIMEOUT_S, check_weight_update
from pdserve.protos.pdserve.v1 import worker_pb2


def update(loop, request, context) -> worker_pb2.UpdateWeightsResponse:
    why = check_weight_update(request.model_path, request.weight_version)
    if why is not None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)

    def load(engine):
        loop.loading_weights = True
        try:
            engine.update_weights(request.model_path, request.weight_version)
        finally:
            loop.loading_weights = False

    try:
        loop.call(load, loop.engine, timeout=UPDATE_TIMEOUT_S)
    except WeightUpdateRefused as e:
        code = (
            grpc.StatusCode.FAILED_PRECONDITION
            if e.precondition
            else grpc.StatusCode.INVALID_ARGUMENT
        )
        context.abort(code, str(e))
    except concurrent.futures.TimeoutError:
        context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the engine did not finish loading {request.model_path[:300]!r} within "
            f"{UPDATE_TIMEOUT_S:g} s",
        )
    engine = loop.engine
    return worker_pb2.UpdateWeightsResponse(
        model_path=engine.weights_dir, weight_version=engine.weight_version
    )


def stats(engine) -> dict:
    """The WorkerStats fields of the weights served."""
    return {"weight_version": engine.weight_version, "weights_path": engine.weights_dir}
