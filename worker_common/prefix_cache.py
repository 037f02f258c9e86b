"""A worker's prefix-cache reset, for both worker services: ResetPrefixCache (the router's
/reset_prefix_cache, vLLM's, and /flush_cache, SGLang's; router/cache_reset.py, called on every
worker at once) forgets every cached prefix block through the engine (LLMEngine.
reset_prefix_cache: with `external`, the host and disk tiers' entries too), on the engine's loop
thread between steps; the gRPC handler thread waits for it, bounded by RESET_TIMEOUT_S. A worker
where a request holds blocks refuses (FAILED_PRECONDITION) and keeps its cache: a benchmark resets
between runs, when nothing runs. Stateless.
"""

from __future__ import annotations

import concurrent.futures

import grpc

from pdserve.engine.errors import PrefixCacheBusy
from pdserve.protos.pdserve.v1 import worker_pb2

RESET_TIMEOUT_S = 60.0  # (it waits for the step under way, then clears a dict)


def reset(loop, request, context) -> worker_pb2.ResetPrefixCacheResponse:
    external = bool(request.external)
    try:
        blocks = loop.call(
            lambda engine: engine.reset_prefix_cache(external), loop.engine, timeout=RESET_TIMEOUT_S
        )
    except PrefixCacheBusy as e:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    except concurrent.futures.TimeoutError:
        context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the engine did not reset its prefix cache within {RESET_TIMEOUT_S:g} s",
        )
    return worker_pb2.ResetPrefixCacheResponse(blocks=blocks)
