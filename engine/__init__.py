"""pdserve engine: one model replica with paged KV, continuous batching and prefix caching."""

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.engine_core import LLMEngine
from pdserve.engine.llm import LLM
from pdserve.engine.lora import LoRARequest
from pdserve.engine.request import CompletionOutput, RequestOutput, Reservation
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured.spec import StructuredSpec

__all__ = [
    "LLM",
    "LLMEngine",
    "LoRARequest",
    "EngineConfig",
    "ModelConfig",
    "SamplingParams",
    "StructuredSpec",
    "RequestOutput",
    "CompletionOutput",
    "Reservation",
]
