"""The errors the engine raises about one request, by kind, so a server picks its answer by type
(worker_common/errors.py maps them to gRPC statuses) instead of by the message's wording.

    EngineError                      a request the engine will not take (never its own fault)
      InvalidRequest (ValueError)    something in the request is wrong: the client must change it
        BadSamplingParams            a SamplingParams field out of range or of the wrong type
        PromptTooLong                the prompt leaves no room for output under max_model_len
        DuplicateRequestId           request_id names a request the engine already holds
      NoFreeBlocks (RuntimeError)    not enough free KV blocks now: the same request may fit later
      EngineBroken (RuntimeError)    the engine cannot step any more (one of its ranks died): the
                                     request belongs on another worker, this one on a restart
      EngineAsleep (RuntimeError)    the engine sleeps (LLMEngine.sleep): it takes work again once
                                     woken
      PrefixCacheBusy (RuntimeError) a prefix-cache reset while requests hold blocks

Each stays a subclass of what the engine raised before (ValueError, RuntimeError), so callers
that catch those keep working.
"""

from __future__ import annotations


class EngineError(Exception):
    """A request the engine refuses."""


class InvalidRequest(EngineError, ValueError):
    """The request itself is wrong (prompt, ids, sampling); retrying it unchanged fails again."""


class BadSamplingParams(InvalidRequest):
    """A SamplingParams field is out of range or of the wrong type."""


class PromptTooLong(InvalidRequest):
    """The prompt has max_model_len tokens or more: none would be left for output."""


class DuplicateRequestId(InvalidRequest):
    """The request id is already in use on this engine."""


class WeightUpdateRefused(EngineError, ValueError):
    """LLMEngine.update_weights cannot take these weights: a checkpoint of other shapes or not
    there (`precondition` False: the request is wrong), or an engine that cannot take any now
    (`precondition` True: requests still run, a quantized mode, a draft model)."""

    def __init__(self, message: str, precondition: bool = False):
        super().__init__(message)
        self.precondition = precondition


class SleepRefused(EngineError, ValueError):
    """LLMEngine.sleep or wake_up cannot do what was asked: a level or tag that does not exist
    (`precondition` False), or an engine that cannot now (`precondition` True: requests still
    run, a CUDA engine, a quantized one at level 2, weights a level-2 sleep dropped that cannot
    be loaded again)."""

    def __init__(self, message: str, precondition: bool = False):
        super().__init__(message)
        self.precondition = precondition


class PrefixCacheBusy(EngineError, RuntimeError):
    """LLMEngine.reset_prefix_cache while requests hold KV blocks: nothing was reset."""


class EngineAsleep(EngineError, RuntimeError):
    """The engine sleeps (LLMEngine.sleep): it takes no request until it is woken."""


class NoFreeBlocks(EngineError, RuntimeError):
    """Not enough free KV blocks for the request now (reserve); it may fit once others finish."""


class EngineBroken(EngineError, RuntimeError):
    """The engine cannot step any more: a tensor-parallel or pipeline rank died, so every step
    would fail as the last one did. The worker refuses work until it is restarted."""
