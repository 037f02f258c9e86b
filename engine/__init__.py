"""pdserve engine: one model replica with paged KV, continuous batching and prefix caching."""

from engine.config import EngineConfig, ModelConfig
from engine.engine_core import LLMEngine
from engine.llm import LLM
from engine.request import CompletionOutput, RequestOutput, Reservation
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "ModelConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Reservation",
]
