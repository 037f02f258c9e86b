"""pdserve engine: one model replica with paged KV, continuous batching and prefix caching.

The names below are loaded on first use (PEP 562), not when the package is imported: importing a
light submodule (the loader's cache paths, the sampling parameters) must not import torch and
transformers first, so `pdserve up --check` and the CLI's refusals answer without them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.lazy_names import lazy_getattr

_NAMES = {
    "LLM": "llm",
    "LLMEngine": "engine_core",
    "LoRARequest": "lora",
    "EngineConfig": "config",
    "ModelConfig": "config",
    "SamplingParams": "sampling_params",
    "BeamSearchParams": "beam_search",
    "BeamSearchOutput": "beam_search",
    "BeamSearchSequence": "beam_search",
    "RequestOutputKind": "sampling_params",
    "StructuredOutputsParams": "sampling_params",
    "GuidedDecodingParams": "sampling_params",
    "Logprob": "outputs",
    "PoolingParams": "request",
    "StructuredSpec": "structured.spec",
    "RequestOutput": "request",
    "CompletionOutput": "request",
    "Reservation": "request",
}

__all__ = [
    "LLM",
    "LLMEngine",
    "LoRARequest",
    "EngineConfig",
    "ModelConfig",
    "SamplingParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "RequestOutputKind",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "Logprob",
    "PoolingParams",
    "StructuredSpec",
    "RequestOutput",
    "CompletionOutput",
    "Reservation",
]

if TYPE_CHECKING:
    from pdserve.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from pdserve.engine.config import EngineConfig, ModelConfig
    from pdserve.engine.engine_core import LLMEngine
    from pdserve.engine.llm import LLM
    from pdserve.engine.lora import LoRARequest
    from pdserve.engine.outputs import Logprob
    from pdserve.engine.request import CompletionOutput, PoolingParams, RequestOutput, Reservation
    from pdserve.engine.sampling_params import (
        GuidedDecodingParams,
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )
    from pdserve.engine.structured.spec import StructuredSpec


__getattr__ = lazy_getattr(__name__, _NAMES, globals())
