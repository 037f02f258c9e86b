"""Model resolution and weight/tokenizer loading for pdserve. The names are loaded on first use
(PEP 562): resolving a model's path and checking the cache directory import neither torch nor
gguf; reading weights (safetensors_io, prequantized) and converting a GGUF (gguf_convert) do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.lazy_names import lazy_getattr

_NAMES = {
    "CacheDirError": "resolve",
    "default_cache_dir": "resolve",
    "resolve_model": "resolve",
    "writable_dir": "resolve",
    "checkpoint_weights": "prequantized",
    "iter_safetensors": "safetensors_io",
    "load_hf_config": "safetensors_io",
}

__all__ = [
    "CacheDirError",
    "checkpoint_weights",
    "default_cache_dir",
    "iter_safetensors",
    "load_hf_config",
    "resolve_model",
    "writable_dir",
]

if TYPE_CHECKING:
    from .prequantized import checkpoint_weights
    from .resolve import CacheDirError, default_cache_dir, resolve_model, writable_dir
    from .safetensors_io import iter_safetensors, load_hf_config


__getattr__ = lazy_getattr(__name__, _NAMES, globals())
