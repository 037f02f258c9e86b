"""Engine errors -> gRPC statuses, for both worker services: the one place that decides what a
client is told when the engine refuses its request (engine/errors.py has the kinds).

    try:
        loop.add_request(...)
    except Exception as e:
        abort_for_engine_error(context, e)   # aborts the call if `e` is the engine refusing
        raise                                # anything else is a bug: gRPC answers UNKNOWN
"""

from __future__ import annotations

import logging

import grpc

from pdserve.engine.errors import (
    BadSamplingParams,
    DuplicateRequestId,
    EngineAsleep,
    EngineBroken,
    NoFreeBlocks,
    PromptTooLong,
)
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protos.convert import sampling_kwargs

log = logging.getLogger(__name__)


def engine_error_status(err: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status and message for an error the engine raised about a request; None for anything
    else. Any other ValueError from the engine is a bad request too (INVALID_ARGUMENT)."""
    if isinstance(err, EngineBroken):
        return (
            grpc.StatusCode.UNAVAILABLE,
            f"this worker's engine is broken ({err}): send the request elsewhere",
        )
    if isinstance(err, EngineAsleep):
        return (
            grpc.StatusCode.UNAVAILABLE,
            f"the worker sleeps ({err}): send the request elsewhere, or wake it (/wake_up)",
        )
    if isinstance(err, NoFreeBlocks):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode pool full, retry later ({err})"
    if isinstance(err, PromptTooLong):
        return grpc.StatusCode.OUT_OF_RANGE, str(err)
    if isinstance(err, DuplicateRequestId):
        return grpc.StatusCode.ALREADY_EXISTS, str(err)
    if isinstance(err, BadSamplingParams):
        return grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {err}"
    if isinstance(err, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    return None


def abort_for_engine_error(context, err: BaseException) -> None:
    """Ends the call with `err`'s status if it is an engine refusal; returns otherwise."""
    status = engine_error_status(err)
    if status is not None:
        # the worker's log file (a full pool is flow control, not news: debug)
        level = logging.DEBUG if status[0] == grpc.StatusCode.RESOURCE_EXHAUSTED else logging.INFO
        log.log(level, "a request refused %s: %s", status[0].name, status[1])
        context.abort(*status)


def refuse_if_broken(loop, context) -> None:
    """A Stats call on a worker whose engine broke (a rank died: engine/engine_loop.py) fails
    UNAVAILABLE with the reason, so the router marks the worker down and sends work elsewhere.
    (context None: the worker's own heartbeat, which reports nothing then.)"""
    if loop.broken and context is not None:
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"this worker's engine is broken ({loop.broken}): it must be restarted",
        )


def build_params(sampling, context, grammars=None) -> SamplingParams:
    """The engine's SamplingParams from a pdserve.v1.SamplingParams, or the call aborted with
    INVALID_ARGUMENT saying which field is wrong. With `grammars` (the engine's GrammarCache) a
    structured-output grammar is compiled here, on the handler's thread, so the engine's step
    thread finds it cached at admission."""
    try:
        params = SamplingParams(**sampling_kwargs(sampling))
        if grammars is not None and params.structured is not None:
            grammars.compile(params.structured)
        return params
    except BadSamplingParams as e:
        abort_for_engine_error(context, e)
        raise
    except (ValueError, TypeError) as e:  # a field the engine does not know, say
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}")


def grammar_stats(engine) -> dict[str, int]:
    """The engine's structured-output counters for WorkerStats (none for an engine without)."""
    grammars = getattr(engine, "grammars", None)
    return grammars.stats() if grammars is not None else {}


# LLMEngine.spec_stats()'s keys, each a WorkerStats field of the same name
SPEC_STATS_FIELDS = (
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_accepted_per_pos",
    "spec_draft_prefill_tokens",
)


def spec_stats(engine) -> dict:
    """The engine's speculative-decoding counters for WorkerStats (none for an engine without
    them): only the fields WorkerStats has, so a counter the engine adds later cannot break a
    Stats call."""
    read = getattr(engine, "spec_stats", None)
    stats = read() if callable(read) else {}
    return {k: stats[k] for k in SPEC_STATS_FIELDS if k in stats}
