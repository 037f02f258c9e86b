"""A model's generation_config.json, read as vLLM's `--generation-config` reads it.

Two things come from the file (vLLM: ModelConfig.try_get_generation_config and
get_diff_sampling_param, SamplingParams.update_from_generation_config):

- its end-of-sequence ids (`eos_token_id`, an int or a list): the engine stops at them as it
  stops at config.json's (engine/config.py ModelConfig.from_hf), unless a request sets
  ignore_eos. Chat models often list their end-of-turn token only here.
- its default sampling fields (SAMPLING_FIELDS, vLLM's list; max_new_tokens becomes max_tokens):
  a request that leaves one of them unset runs with the model's value (the router:
  router/service.py; the offline API: LLM.get_default_sampling_params).

The mode (vLLM's names, GenerationConfig modes): "auto" reads the model folder's file; "vllm"
keeps vLLM's neutral sampling defaults and ignores the file's sampling fields, though its
end-of-sequence ids still count, as they do in vLLM; any other string is a folder whose
generation_config.json is read instead of the model's, for both. An override (vLLM's
--override-generation-config, a JSON object of SAMPLING_FIELDS) is laid over the file's sampling
fields, or over none under "vllm", as vLLM lays it; it is checked whole when the deployment loads
(check_override), so a bad one is refused rather than left out.

A model folder's file that is absent (a GGUF-converted folder has none), larger than
MAX_FILE_BYTES, unreadable or not a JSON object gives nothing and no error. A folder named as the
mode must hold a readable file: a ValueError says what to fix. A field whose value no request
could carry (a negative temperature, a top_p of 2) is left out with a warning, so that one bad
field does not make every request fail. Only json, logging and the standard library are
imported: the router reads the file too.
"""

from __future__ import annotations

import json
import logging
import math
import os

log = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
MAX_FILE_BYTES = 1 << 20  # a real one is a few hundred bytes; more is not a generation config
AUTO, VLLM = "auto", "vllm"
# vLLM's available_params (ModelConfig.get_diff_sampling_param), in its order
SAMPLING_FIELDS = (
    "repetition_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)
# what vLLM logs when the model's file sets any of them
OVERRIDE_NOTICE = (
    "Default sampling parameters have been overridden by the model's Hugging Face generation "
    "config recommended from the model creator. If this is not intended, set generation_config "
    "to 'vllm'."
)
_INT_LIMIT = 1 << 31  # the gRPC SamplingParams' top_k is an int32
# field: (an integer, whether a value is allowed, what the field must be)
_RULES = {
    "repetition_penalty": (False, lambda v: v > 0, "a number > 0"),
    "temperature": (False, lambda v: v >= 0, "a number >= 0"),
    "top_k": (True, lambda v: -1 <= v < _INT_LIMIT, "an integer >= -1 (0 or -1: off)"),
    "top_p": (False, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (False, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "max_new_tokens": (True, lambda v: 1 <= v < _INT_LIMIT, "an integer >= 1"),
}


def check_mode(mode, name: str = "generation_config") -> str:
    """`mode` when it is one (module docstring): "auto", "vllm" or a folder path; else a
    ValueError naming the setting `name`. The folder itself is checked when it is read."""
    if not isinstance(mode, str) or not mode.strip():
        raise ValueError(
            f"{name} must be 'auto' (the model's generation_config.json), 'vllm' (vLLM's neutral "
            f"sampling defaults) or a folder holding a {FILE_NAME}, got {mode!r}"
        )
    return mode


def check_override(override, name: str | None = None) -> dict:
    """`override` (a dict of SAMPLING_FIELDS, each a value a request could carry) as the
    SamplingParams defaults it sets, in their names and types; else a ValueError naming the
    field (after `name`, the setting, where given)."""
    at = f"{name}: " if name else ""
    if not isinstance(override, dict):
        raise ValueError(f'{at}must be a JSON object such as {{"temperature": 0.5}}')
    out = {}
    for field, value in override.items():
        if field not in _RULES:
            raise ValueError(
                f"{at}{str(field)[:100]!r} is not a sampling default a generation config sets; "
                f"the fields are {', '.join(SAMPLING_FIELDS)}"
            )
        checked = _checked(field, value, warn=False)
        if checked is None:
            raise ValueError(f"{at}{field} must be {_RULES[field][2]}, got {str(value)[:100]!r}")
        out["max_tokens" if field == "max_new_tokens" else field] = checked
    return out


def config_folder(model_dir, mode: str = AUTO) -> tuple[str | None, bool]:
    """(the folder whose file `mode` reads, whether that folder must hold one): the model's
    folder under "auto" and "vllm" (None: a model not read from a folder), else the mode's."""
    check_mode(mode)
    if mode in (AUTO, VLLM):
        return (os.fspath(model_dir) if model_dir else None), False
    return os.path.expanduser(mode), True


def read_file(folder, required: bool = False) -> dict:
    """The JSON object in `folder`'s generation_config.json; {} when there is none to read (see
    the module docstring), or a ValueError that names the file where `required`."""
    if folder is None:
        return {}
    path = os.path.join(os.fspath(folder), FILE_NAME)
    why = _unreadable(path)
    if why is None:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
            data = None if len(raw) > MAX_FILE_BYTES else json.loads(raw)
        except (OSError, ValueError) as e:  # (json's errors are ValueErrors, bad UTF-8 too)
            data, why = None, f"it cannot be read as JSON ({str(e)[:200]})"
        if data is None and why is None:
            why = f"it is larger than {MAX_FILE_BYTES} bytes"
        elif data is not None and not isinstance(data, dict):
            why = f"it holds a JSON {type(data).__name__}, not an object"
        if why is None:
            return data
    if required:
        raise ValueError(f"generation_config: {path} {why}: name a folder holding a {FILE_NAME}")
    if why != "does not exist":
        log.warning("%s ignored: %s", path, why)
    return {}


def _unreadable(path: str) -> str | None:
    if not os.path.exists(path):
        return "does not exist"
    if not os.path.isfile(path):
        return "is not a file"
    return None


def eos_token_ids(model_dir, mode: str = AUTO) -> tuple[int, ...]:
    """The end-of-sequence ids the generation config lists (its eos_token_id, an int or a list
    of them), each once, in its order; () for none. Read under every mode, as vLLM does."""
    folder, required = config_folder(model_dir, mode)
    eos = read_file(folder, required).get("eos_token_id")
    values = eos if isinstance(eos, list) else [] if eos is None else [eos]
    ids = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    if len(ids) != len(values):
        log.warning(
            "%s: eos_token_id %r ignored: token ids are integers >= 0", FILE_NAME, str(eos)[:200]
        )
        return ()
    return tuple(dict.fromkeys(ids))


def default_sampling_params(model_dir, mode: str = AUTO, override: dict | None = None) -> dict:
    """The sampling defaults the generation config sets (vLLM's get_diff_sampling_param): its
    SAMPLING_FIELDS that are set, with max_new_tokens named max_tokens, in SamplingParams'
    names and types, then `override`'s over them (check_override's); {} under "vllm" without an
    override, or for a model whose file sets none."""
    folder, required = config_folder(model_dir, mode)
    out = {}
    if mode != VLLM:
        config = read_file(folder, required)
        for name in SAMPLING_FIELDS:
            value = _checked(name, config.get(name))
            if value is not None:
                out["max_tokens" if name == "max_new_tokens" else name] = value
    out.update(check_override(override or {}))
    return out


def _checked(name: str, value, warn: bool = True):
    """`value` of field `name` as a SamplingParams value (an integral float becomes an int for
    an integer field), None when unset or when no request could carry it (with a warning unless
    `warn` is false)."""
    if value is None:
        return None
    integer, allowed, rule = _RULES[name]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and integer and isinstance(value, float) and value.is_integer():
        value = int(value)
    ok = number and math.isfinite(value) and (isinstance(value, int) or not integer)
    if ok and allowed(value):
        return value if integer else float(value)
    if warn:
        log.warning("%s: %s=%r ignored: it must be %s", FILE_NAME, name, value, rule)
    return None


def describe(defaults: dict) -> str:
    """A log line's words for `defaults` (default_sampling_params' dict)."""
    return ", ".join(f"{k}={v!r}" for k, v in defaults.items()) or "none"
