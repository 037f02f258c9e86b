"""Model resolution and weight/tokenizer loading for pdserve."""

from .resolve import CacheDirError, default_cache_dir, resolve_model, writable_dir
from .safetensors_io import iter_safetensors, load_hf_config

__all__ = [
    "CacheDirError",
    "default_cache_dir",
    "iter_safetensors",
    "load_hf_config",
    "resolve_model",
    "writable_dir",
]
