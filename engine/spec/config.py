"""`speculative_config`: what an engine speculates with, under vLLM's names and keys.

A deployment YAML (a decode pool's `engine:`), `pdserve up --speculative-config JSON`,
`pdserve generate --local --speculative-config JSON` and `LLM(..., speculative_config={...})` all
hand the same mapping to `EngineConfig`, which turns it into a SpeculativeConfig here once, so a
wrong key or value is refused before any model loads. Five methods:

  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
      guesses by prompt lookup (engine/spec/ngram.py): the tokens that followed the latest earlier
      occurrence of the sequence's last n tokens, over the prompt and the output so far.
  {"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 4}
      guesses with a smaller model (engine/spec/draft.py); "self" is the target's own checkpoint,
      so "quantization": "int4" makes the target's int4 copy its draft. "method" may be left out
      when "model" is given, as in vLLM.
  {"method": "eagle3", "model": "path/or/hub-id", "num_speculative_tokens": 3}
      guesses with an EAGLE-3 head trained for the target ("eagle": an EAGLE-1 head), which reads
      the target's own hidden states (engine/spec/eagle.py).
  {"method": "mtp", "num_speculative_tokens": 1}
      guesses with the multi-token-prediction layer the target's own checkpoint carries
      (DeepSeek V3/R1, GLM-4.5/4.6, GLM-4.7 Flash, Qwen3-Next, Qwen3.5: engine/models/mtp.py),
      run as an EAGLE head.

`num_speculative_tokens` is the most a step guesses; engine/spec/gate.py picks how many (or none)
each step from the batch size and the acceptance measured so far. A request opts out with
SamplingParams(speculative=False). With "ngram", a request's predicted output (OpenAI's Predicted
Outputs, engine/spec/prediction.py) supplies the guesses while the output follows it, and those
runs may be longer: `num_prediction_tokens` (default the larger of 16 and num_speculative_tokens)
is the most a step takes from a prediction, since a prediction that is being followed is right
far more often than a lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# the methods whose drafter reads the target's hidden states (engine/spec/eagle.py)
HEAD_METHODS = ("eagle", "eagle3", "mtp")
MAX_SPECULATIVE_TOKENS = 16  # a verify step computes 1 + k positions per sequence
DEFAULT_PREDICTION_TOKENS = 16  # a predicted output's guesses a step may check (ngram)
_KEYS = {
    "method",
    "num_speculative_tokens",
    "num_prediction_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "dtype",
    "quantization",
    "disable_by_batch_size",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix looked up (vLLM's defaults when neither is set)
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # draft_model: a checkpoint (a path, a Hub id, "smollm2") or "self" (the target's own)
    model: str | None = None
    dtype: str = "auto"  # the draft's activations ("auto": as the target's)
    quantization: str | None = None  # the draft's linears: None (as dtype), "int8" or "int4"
    # never speculate in a step that decodes more sequences than this (None: the gate decides)
    disable_by_batch_size: int | None = None
    # ngram: the most guesses a step takes from a request's predicted output (None: the default)
    num_prediction_tokens: int | None = None

    @property
    def prediction_k(self) -> int:
        """The most guesses a step checks from a predicted output (0: predictions are not read:
        a draft model guesses)."""
        if self.method != "ngram":
            return 0
        if self.num_prediction_tokens is not None:
            return self.num_prediction_tokens
        return max(DEFAULT_PREDICTION_TOKENS, self.num_speculative_tokens)

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A mapping (or a SpeculativeConfig, or None) checked key by key; ValueError names the key
        and what it takes."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config must be a mapping such as "
                f'{{"method": "ngram", "num_speculative_tokens": 4}}, got {type(value).__name__}'
            )
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {unknown}; known: {sorted(_KEYS)}"
            )
        method = value.get("method")
        if method is None:
            method = "draft_model" if value.get("model") is not None else None
        if method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {list(METHODS)} (or leave it out and "
                f"give a draft 'model'), got {value.get('method')!r}"
            )
        k = value.get("num_speculative_tokens")
        _check_int("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS)
        out = dict(method=method, num_speculative_tokens=k)
        out.update(_lookup_keys(value) if method == "ngram" else _draft_keys(method, value))
        limit = value.get("disable_by_batch_size")
        if limit is not None:
            _check_int("disable_by_batch_size", limit, 1, 1 << 20)
        out["disable_by_batch_size"] = limit
        return cls(**out)

    def to_dict(self) -> dict:
        """The mapping `parse` takes back (for logs, the YAML echo and worker processes)."""
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            out.update(
                prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max
            )
            if self.num_prediction_tokens is not None:
                out["num_prediction_tokens"] = self.num_prediction_tokens
        else:
            out.update(model=self.model, dtype=self.dtype, quantization=self.quantization)
        if self.disable_by_batch_size is not None:
            out["disable_by_batch_size"] = self.disable_by_batch_size
        return out


def _lookup_keys(value: dict) -> dict:
    """Prompt lookup's own keys, checked (and the draft's refused)."""
    for key in ("model", "dtype", "quantization"):
        if value.get(key) is not None:
            raise ValueError(f"speculative_config.{key} is for method 'draft_model', not 'ngram'")
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo, hi = 2, 4
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    _check_int("prompt_lookup_min", lo, 1, 64)
    _check_int("prompt_lookup_max", hi, 1, 64)
    if lo > hi:
        raise ValueError(
            f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
        )
    out = dict(prompt_lookup_min=lo, prompt_lookup_max=hi)
    runs = value.get("num_prediction_tokens")
    if runs is not None:
        _check_int("num_prediction_tokens", runs, 1, MAX_SPECULATIVE_TOKENS)
        out["num_prediction_tokens"] = runs
    return out


def _draft_keys(method: str, value: dict) -> dict:
    """A draft model's or an EAGLE head's keys, checked (and prompt lookup's refused)."""
    for key in ("prompt_lookup_min", "prompt_lookup_max", "num_prediction_tokens"):
        if value.get(key) is not None:
            raise ValueError(f"speculative_config.{key} is for method 'ngram'")
    model = value.get("model")
    if method == "mtp":
        if model not in (None, "self") or value.get("quantization"):
            raise ValueError(
                "speculative_config method 'mtp' runs the MTP layer of the target's own "
                "checkpoint: give no 'model' (or 'self') and no 'quantization'"
            )
        model = "self"
    if method in ("eagle", "eagle3") and (model == "self" or value.get("quantization")):
        raise ValueError(
            f"speculative_config method {method!r} takes the head's checkpoint as 'model' (a "
            "path or a Hub id) and no 'quantization'"
        )
    if not isinstance(model, str) or not model:
        raise ValueError(
            "speculative_config.model must name the draft: a path, a Hub id, 'smollm2', "
            "or 'self' for the target's own checkpoint (with a 'quantization' of its own)"
        )
    dtype = value.get("dtype", "auto")
    if dtype not in ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"):
        raise ValueError(f"speculative_config.dtype must be 'auto' or a float dtype, got {dtype!r}")
    quant = value.get("quantization")
    if quant not in (None, "int8", "int4", "bf16"):
        raise ValueError(
            f"speculative_config.quantization must be null, 'int8', 'int4' or 'bf16', got {quant!r}"
        )
    return dict(model=model, dtype=dtype, quantization=quant)


def _check_int(key: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(
            f"speculative_config.{key} must be an integer in [{lo}, {hi}], got {value!r}"
        )
