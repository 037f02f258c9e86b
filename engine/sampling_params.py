"""Per-request sampling configuration.

Everything is validated at construction so a bad request is rejected at the
API boundary with a message the client can act on, instead of failing (or
silently misbehaving) inside a batched decode step shared with other requests.

SamplingParams takes vLLM's names and values as well as pdserve's own: `logprobs` as vLLM's int
(None, 0, k or -1) or as pdserve's bool with `top_logprobs` (the form the workers' wire gives),
`max_tokens=None` (the rest of the context), `seed=-1` (no seed), and vLLM's structured-output
objects (StructuredOutputsParams, and the older GuidedDecodingParams), which become pdserve's own
StructuredSpec (`structured`).
"""

from __future__ import annotations

import copy
import enum
import functools
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from pdserve.engine.errors import BadSamplingParams
from pdserve.engine.structured.spec import StructuredSpec, spec_from_wire

# Dividing float32 logits by a temperature this small overflows to inf (and
# softmax then yields NaN), so such temperatures are treated as greedy, as
# vLLM does with its _SAMPLING_EPS.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_PROMPT_LOGPROBS = 20  # alternatives per prompt position, as vLLM's default max_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_BAD_WORDS = 128  # vLLM's bounds: words a request, and their tokens all told
MAX_BAD_WORDS_TOKENS = 1024
MAX_CACHE_SALT_CHARS = 256
MAX_PREDICTION_TOKENS = 65536  # a predicted output's tokens (OpenAI's Predicted Outputs)
# repetition detection's bounds: the longest pattern, and the tokens the check may read at the
# output's end (pattern x count), so a step's check of a sequence reads a bounded tail
MAX_REPETITION_PATTERN = 256
MAX_REPETITION_SPAN = 2048


# fields pdserve.v1.SamplingParams has no twin of: how outputs reach the caller in this process
# (a worker sets them itself), and the offline API's vLLM names, which the wire has elsewhere
# (`structured`, GenerateRequest.truncate_prompt_tokens) or not at all
IN_PROCESS_FIELDS = (
    "output_kind",
    "detokenize",
    "structured_outputs",
    "guided_decoding",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "extra_args",
)


class RequestOutputKind(enum.IntEnum):
    """What each of a request's outputs carries (vLLM's names and values)."""

    CUMULATIVE = 0  # everything so far: tokens, text, logprobs (the default)
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # one output, when the request finishes, with everything


def _int(name: str, value: object) -> int:
    # bool is a subclass of int, but True as max_tokens is a client bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise BadSamplingParams(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadSamplingParams(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise BadSamplingParams(f"{name} must be finite, got {value!r}")
    return value


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise BadSamplingParams(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _in_range(
    name: str, value: float, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False
) -> None:
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi):
        lb, rb = ("(" if lo_open else "["), (")" if hi_open else "]")
        raise BadSamplingParams(f"{name} must be in {lb}{lo:g}, {hi:g}{rb}, got {value!r}")


def _str_tuple(name: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    # A bare str is one stop string, not a sequence of one-char stop strings.
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise BadSamplingParams(
            f"{name} must be a str or a list of str, got {type(value).__name__} {value!r}"
        )
    for s in items:
        if not isinstance(s, str):
            raise BadSamplingParams(f"{name} must contain only str, got {type(s).__name__} {s!r}")
        if not s:
            raise BadSamplingParams(f"{name} must not contain empty strings, got {list(items)!r}")
    return tuple(items)


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs in id order; a mapping or such pairs is taken."""
    items = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(items, (list, tuple)):
        raise BadSamplingParams(
            f"logit_bias must be a mapping of token id to bias, got {type(value).__name__}"
        )
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise BadSamplingParams(f"logit_bias entries are (token id, bias), got {item!r}")
        token, bias = _int("logit_bias token id", item[0]), _float("logit_bias", item[1])
        if token < 0:
            raise BadSamplingParams(f"logit_bias token ids must be >= 0, got {token}")
        _in_range(f"logit_bias[{token}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        pairs[token] = bias
    return tuple(sorted(pairs.items()))


def _id_tuple(name: str, value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise BadSamplingParams(
            f"{name} must be a list of int, got {type(value).__name__} {value!r}"
        )
    ids = tuple(_int(name, v) for v in value)
    for v in ids:
        if v < 0:
            raise BadSamplingParams(f"{name} must contain only ids >= 0, got {v}")
    return ids


# vLLM's structured-output kinds and the StructuredSpec field each one becomes
_VLLM_KINDS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output request (SamplingParams.structured_outputs), with its field names:
    exactly one of json (a JSON schema, as a dict or JSON text), regex, choice, grammar and
    json_object. It becomes pdserve's StructuredSpec (`to_spec`).

    Of vLLM's options: disable_any_whitespace is accepted either way, pdserve's JSON never having
    free whitespace (engine/structured/grammar.py); disable_additional_properties=True adds
    "additionalProperties": false to every object of the schema that lists properties and does
    not say, as vLLM's guidance backend does; whitespace_pattern and structural_tag have no
    pdserve equivalent and are refused when set."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        """Exactly one kind, as vLLM checks it (structural_tag counted)."""
        given = self._kinds()
        if len(given) != 1:
            raise BadSamplingParams(
                f"structured_outputs must set exactly one of "
                f"{', '.join([*_VLLM_KINDS, 'structural_tag'])}, got {', '.join(given) or 'none'}"
            )

    def _kinds(self) -> list[str]:
        return [k for k in (*_VLLM_KINDS, "structural_tag") if getattr(self, k) is not None]

    def to_spec(self) -> StructuredSpec | None:
        """The StructuredSpec this asks for (None: no kind set, which only GuidedDecodingParams
        allows), or BadSamplingParams naming what pdserve cannot honour."""
        name = type(self).__name__
        for option in ("whitespace_pattern", "structural_tag"):
            if getattr(self, option) is not None:
                raise BadSamplingParams(
                    f"{name}.{option} is not supported: pdserve's structured output has no "
                    f"such option (its JSON has no free whitespace); leave it unset"
                )
        given = self._kinds()
        if not given:
            return None
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json_object":
            if value is not True:
                raise BadSamplingParams(f"{name}.json_object must be True when set, got {value!r}")
        elif kind == "json" and self.disable_additional_properties:
            value = _closed_objects(value)
        return spec_from_wire({_VLLM_KINDS[kind]: value})

    @classmethod
    def from_value(cls, name: str, value: object) -> StructuredSpec | None:
        """The spec of `value`, an instance of this class or a dict of its fields."""
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise BadSamplingParams(
                    f"{name} has unknown fields {unknown}; known: {sorted(known)}"
                )
            value = cls(**value)
        if not isinstance(value, StructuredOutputsParams):
            raise BadSamplingParams(
                f"{name} must be a {cls.__name__} or a dict of its fields, got "
                f"{type(value).__name__}"
            )
        return value.to_spec()


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name and form (SamplingParams.guided_decoding): at most one kind (none: no
    structured output), and a backend, which may be left unset or "auto" only (pdserve has one
    grammar engine, and vLLM V1 refuses a request's backend other than its own)."""

    backend: str | None = None
    backend_was_auto: bool = False
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        given = self._kinds()
        if len(given) > 1:
            raise BadSamplingParams(
                f"guided_decoding can only use one kind, got {', '.join(given)}"
            )
        if self.backend not in (None, "", "auto"):
            raise BadSamplingParams(
                f"guided_decoding.backend={self.backend!r}: a request cannot choose the grammar "
                f"backend (pdserve has one); leave it unset"
            )


def _closed_objects(schema: object) -> object:
    """vLLM's disable_additional_properties: a copy of the JSON schema (a dict or JSON text) with
    "additionalProperties": false in every object that lists properties and does not set it."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise BadSamplingParams(f"structured_outputs.json is not valid JSON: {e}") from None
    schema = copy.deepcopy(schema)
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            todo.extend(node.values())
            if "additionalProperties" not in node and (
                "properties" in node or "patternProperties" in node
            ):
                node["additionalProperties"] = False
        elif isinstance(node, list):
            todo.extend(node)
    return schema


def _logprob_count(name: str, value: object) -> int:
    """vLLM's count of logprobs alternatives: k in [0, MAX_PROMPT_LOGPROBS], or -1 for the whole
    vocabulary."""
    k = _int(name, value)
    if not (k == -1 or 0 <= k <= MAX_PROMPT_LOGPROBS):
        raise BadSamplingParams(
            f"{name} must be in [0, {MAX_PROMPT_LOGPROBS}] (vLLM's max_logprobs), -1 for the whole "
            f"vocabulary, or None, got {k}"
        )
    return k


_CACHED = ("greedy", "shapes_logits")  # SamplingParams' cached properties


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # None (vLLM's): up to the end of the context, max_model_len less the prompt's tokens (the
    # engine sets it when the request is added: with_max_tokens)
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # the sampled tokens' logprobs, in one of two forms. vLLM's int: None none, k >= 0 the sampled
    # token's and the k most likely tokens' at each position, -1 the whole vocabulary's; LLM's
    # outputs are then vLLM's (engine/outputs.py vllm_output: a dict {token id: Logprob} per
    # position, and cumulative_logprob). pdserve's bool, as the workers' wire gives it: True the
    # sampled token's logprob and top_logprobs alternatives, each output logprob a float (a
    # TokenLogprob with .top when top_logprobs > 0); False is None.
    logprobs: int | bool | None = None
    # the most likely tokens at each sampled position besides the sampled one's logprob (OpenAI's
    # top_logprobs; 0: none); needs logprobs. With vLLM's int logprobs it is that int (-1: all).
    top_logprobs: int = 0
    # vLLM's name: for every prompt token after the first, its logprob given the tokens before it
    # and the prompt_logprobs most likely tokens there (0: the prompt token's alone; -1: the whole
    # vocabulary's; True is 1, False None). The prompt is then computed in full, never served from
    # the prefix cache.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured output (engine/structured/grammar.py): the output follows a JSON schema, is a JSON
    # object, matches a regex or is one of some strings; a dict of one of those is taken too
    structured: StructuredSpec | None = None
    # False: this request is never speculated on, whatever the engine's speculative_config
    # (engine/spec/config.py); its tokens are the same either way, only its speed differs
    speculative: bool = True
    # OpenAI's logit_bias: {token id: bias in [-100, 100]} added to those tokens' logits before
    # the penalties and sampling (vLLM's order; a structured-output mask and allowed_token_ids
    # come first). Kept as (token id, bias) pairs in id order, so the params stay hashable.
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    # vLLM's allowed_token_ids: only these tokens may be sampled (empty: any token)
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words: none of these is generated. The engine tokenizes each word as vLLM does
    # (as the text's start and after a space: with_bad_words_token_ids); a word's last token is
    # banned wherever the tokens before it are the last ones generated.
    bad_words: tuple[str, ...] = ()
    # vLLM's cache_salt: the request's prefix-cache namespace. Only requests with the same salt
    # share cached KV blocks (engine/block_manager.py chain_root); "" shares with unsalted ones.
    cache_salt: str = ""
    # OpenAI's Predicted Outputs as token ids: what the output is expected to be, mostly (a file
    # with a few lines edited). Where the engine speculates, the prediction's tokens are its
    # guesses (engine/spec/prediction.py); the output is the same with or without it.
    prediction_token_ids: tuple[int, ...] = ()
    # vLLM's thinking_token_budget: a reasoning model's reasoning ends (its next token is
    # </think>) once it holds this many tokens (engine/thinking.py); None: no budget
    thinking_token_budget: int | None = None
    # vLLM's repetition detection: the sequence ends (finish_reason "repetition") once its output
    # ends with some pattern of min..max tokens repeated repetition_min_count times in a row;
    # max_repetition_pattern_size 0 (or a count below 2): off (repetition_detected)
    max_repetition_pattern_size: int = 0
    min_repetition_pattern_size: int = 0
    repetition_min_count: int = 0
    # vLLM's output_kind: a long stream's outputs cost what is new (DELTA) instead of everything
    # so far each step (CUMULATIVE); LLM.generate asks for FINAL_ONLY. While a request with stop
    # strings runs, its text holds back the last max(len(stop)) - 1 characters, which a stop
    # string could still take back (so no output ever shows text a later one removes).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's detokenize: False leaves every output's text empty and skips the per-token decode
    # (a decode worker's router detokenizes itself); stop strings need it
    detokenize: bool = True
    # vLLM's structured-output objects (StructuredOutputsParams, or a dict of its fields, and the
    # older GuidedDecodingParams): each becomes `structured`, which holds the spec; kept as given
    # (outside equality), so at most one of the three may ask for a different spec
    structured_outputs: StructuredOutputsParams | Mapping | None = field(
        default=None, compare=False
    )
    guided_decoding: GuidedDecodingParams | Mapping | None = field(default=None, compare=False)
    # vLLM's spaces_between_special_tokens: accepted either way. The text is the tokenizer's own
    # decode, which for a fast tokenizer (every model pdserve loads with a tokenizer.json) puts
    # between two special tokens whatever its decoder does; it matters only with
    # skip_special_tokens=False.
    spaces_between_special_tokens: bool = True
    # vLLM's truncate_prompt_tokens: the prompt keeps only its last k tokens (k >= 1), or -1 as
    # many as max_model_len holds with one left for output (the router's rule: router/text.py);
    # the engine cuts the prompt's ids when the request is added (truncated_prompt)
    truncate_prompt_tokens: int | None = None
    # vLLM's extra_args: anything, for the caller's own use; no sampling reads it (kept outside
    # equality, a dict being unhashable)
    extra_args: dict | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        """Checks every field, in declaration order, normalizing as it goes."""
        self._check_sampling()
        self._check_lengths_and_outputs()

    def _put(self, name: str, value: object) -> None:
        # Frozen: normalized values (float(0) -> 0.0, list -> tuple) must go
        # through object.__setattr__; what was cached from the old value goes.
        object.__setattr__(self, name, value)
        for cached in _CACHED:
            self.__dict__.pop(cached, None)

    def _check_sampling(self) -> None:
        """n, the distribution's shaping (temperature, top_p/top_k/min_p), seed, penalties."""
        put = self._put
        put("n", _int("n", self.n))
        if self.n < 1:
            raise BadSamplingParams(f"n must be >= 1, got {self.n}")

        put("temperature", _float("temperature", self.temperature))
        if self.temperature < 0:
            raise BadSamplingParams(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}"
            )

        put("top_p", _float("top_p", self.top_p))
        _in_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)

        put("top_k", _int("top_k", self.top_k))
        if self.top_k < -1:
            raise BadSamplingParams(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}")

        put("min_p", _float("min_p", self.min_p))
        _in_range("min_p", self.min_p, 0.0, 1.0)

        if self.seed is not None:
            put("seed", _int("seed", self.seed))
            if self.seed == -1:  # vLLM's: -1 is no seed (random), as None
                put("seed", None)

        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _float(name, getattr(self, name)))
            _in_range(name, getattr(self, name), -2.0, 2.0)

        put("repetition_penalty", _float("repetition_penalty", self.repetition_penalty))
        if self.repetition_penalty <= 0:
            raise BadSamplingParams(
                f"repetition_penalty must be > 0, got {self.repetition_penalty!r}"
            )

    def _check_lengths_and_outputs(self) -> None:
        """max/min_tokens, logprobs wanted, stops, flags and structured output."""
        put = self._put
        if self.max_tokens is not None:
            put("max_tokens", _int("max_tokens", self.max_tokens))
            if self.max_tokens < 1:
                raise BadSamplingParams(
                    f"max_tokens must be >= 1 (or None: up to the end of the context), got "
                    f"{self.max_tokens}"
                )

        put("min_tokens", _int("min_tokens", self.min_tokens))
        most = self.max_tokens
        if self.min_tokens < 0 or (most is not None and self.min_tokens > most):
            raise BadSamplingParams(
                f"min_tokens must be in [0, max_tokens={most}], got {self.min_tokens}"
            )
        self._check_logprobs()

        put("stop", _str_tuple("stop", self.stop))
        put("stop_token_ids", _id_tuple("stop_token_ids", self.stop_token_ids))

        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "speculative",
            "spaces_between_special_tokens",
        ):
            _bool(name, getattr(self, name))
        self._check_structured()
        put("logit_bias", _bias_pairs(self.logit_bias or ()))
        put("allowed_token_ids", _id_tuple("allowed_token_ids", self.allowed_token_ids))
        put("bad_words", _str_tuple("bad_words", self.bad_words))
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise BadSamplingParams(
                f"bad_words has {len(self.bad_words)} words; at most {MAX_BAD_WORDS} are allowed"
            )
        put("_bad_words_ids", ())
        put("prediction_token_ids", _id_tuple("prediction_token_ids", self.prediction_token_ids))
        if len(self.prediction_token_ids) > MAX_PREDICTION_TOKENS:
            raise BadSamplingParams(
                f"prediction_token_ids has {len(self.prediction_token_ids)} ids; at most "
                f"{MAX_PREDICTION_TOKENS} are allowed"
            )
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise BadSamplingParams(
                f"cache_salt must be a str of at most {MAX_CACHE_SALT_CHARS} characters, got "
                f"{type(self.cache_salt).__name__} of {len(str(self.cache_salt))}"
            )
        if self.thinking_token_budget is not None:
            put("thinking_token_budget", _int("thinking_token_budget", self.thinking_token_budget))
            if self.thinking_token_budget < 0:
                raise BadSamplingParams(
                    f"thinking_token_budget must be >= 0, got {self.thinking_token_budget}"
                )
        self._check_repetition()
        self._check_output_form()
        self._check_vllm_extras()

    def _check_logprobs(self) -> None:
        """logprobs in vLLM's int form or pdserve's bool form (with top_logprobs), and
        prompt_logprobs: each a count of alternatives, at most MAX_PROMPT_LOGPROBS (vLLM's default
        max_logprobs), or -1 for the whole vocabulary (vLLM's int forms only)."""
        put = self._put
        put("top_logprobs", _int("top_logprobs", self.top_logprobs))
        top, wanted = self.top_logprobs, self.logprobs
        if wanted is False:
            put("logprobs", wanted := None)
        if wanted is None or wanted is True:
            if not 0 <= top <= MAX_PROMPT_LOGPROBS:
                raise BadSamplingParams(
                    f"top_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], got {top}"
                )
            if top and wanted is None:
                raise BadSamplingParams(
                    f"top_logprobs={top} needs logprobs=True (the sampled tokens' logprobs come "
                    f"with their alternatives), or give vLLM's logprobs={top} alone"
                )
        else:
            put("logprobs", _logprob_count("logprobs", wanted))
            if top not in (0, self.logprobs):
                raise BadSamplingParams(
                    f"logprobs={self.logprobs} (vLLM's count) with top_logprobs={top}: give "
                    f"logprobs=k alone, or pdserve's logprobs=True with top_logprobs=k"
                )
            put("top_logprobs", self.logprobs)
        if self.prompt_logprobs is True:  # vLLM's: True is 1
            put("prompt_logprobs", 1)
        elif self.prompt_logprobs is False:
            put("prompt_logprobs", None)
        if self.prompt_logprobs is not None:
            put("prompt_logprobs", _logprob_count("prompt_logprobs", self.prompt_logprobs))

    def _check_structured(self) -> None:
        """`structured` (a StructuredSpec or its dict), or vLLM's structured_outputs or
        guided_decoding, which become it; where more than one is given, they must ask for the same
        output (`structured` is kept then, with its reasoning)."""
        specs = []
        if self.structured is not None:
            specs.append(("structured", spec_from_wire(self.structured)))
        for name, cls in (
            ("structured_outputs", StructuredOutputsParams),
            ("guided_decoding", GuidedDecodingParams),
        ):
            value = getattr(self, name)
            spec = None if value is None else cls.from_value(name, value)
            if spec is not None:
                specs.append((name, spec))
        for name, spec in specs[1:]:
            if spec.key != specs[0][1].key:
                raise BadSamplingParams(
                    f"{specs[0][0]} and {name} ask for different structured outputs: give one"
                )
        if specs:
            self._put("structured", specs[0][1])

    def _check_vllm_extras(self) -> None:
        """truncate_prompt_tokens (k >= 1 or -1) and extra_args (a dict, or None)."""
        k = self.truncate_prompt_tokens
        if k is not None:
            self._put("truncate_prompt_tokens", k := _int("truncate_prompt_tokens", k))
            if k == 0 or k < -1:
                raise BadSamplingParams(
                    f"truncate_prompt_tokens keeps k >= 1 of the prompt's last tokens, or -1 as "
                    f"many as max_model_len holds, got {k}"
                )
        if self.extra_args is not None and not isinstance(self.extra_args, Mapping):
            raise BadSamplingParams(
                f"extra_args must be a dict, got {type(self.extra_args).__name__}"
            )

    def _check_output_form(self) -> None:
        kind = self.output_kind
        if isinstance(kind, bool) or kind not in tuple(RequestOutputKind):
            raise BadSamplingParams(
                f"output_kind must be one of {[k.name for k in RequestOutputKind]}, got {kind!r}"
            )
        self._put("output_kind", RequestOutputKind(kind))
        _bool("detokenize", self.detokenize)
        if self.stop and not self.detokenize:
            raise BadSamplingParams(
                f"stop strings {list(self.stop)!r} are matched in the output's text: they need "
                f"detokenize=True (or use stop_token_ids)"
            )

    @property
    def stop_holdback(self) -> int:
        """Characters a running request's output text holds back: a stop string could still
        end inside them, and would then take them back."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def _check_repetition(self) -> None:
        names = ("max_repetition_pattern_size", "min_repetition_pattern_size")
        for name in (*names, "repetition_min_count"):
            self._put(name, _int(name, getattr(self, name)))
            if getattr(self, name) < 0:
                raise BadSamplingParams(f"{name} must be >= 0, got {getattr(self, name)}")
        most, least = self.max_repetition_pattern_size, self.min_repetition_pattern_size
        if least > most:
            raise BadSamplingParams(
                f"min_repetition_pattern_size={least} is more than "
                f"max_repetition_pattern_size={most}"
            )
        if most > MAX_REPETITION_PATTERN:
            raise BadSamplingParams(
                f"max_repetition_pattern_size must be at most {MAX_REPETITION_PATTERN}, got {most}"
            )
        if most * self.repetition_min_count > MAX_REPETITION_SPAN:
            raise BadSamplingParams(
                f"max_repetition_pattern_size x repetition_min_count must be at most "
                f"{MAX_REPETITION_SPAN} tokens, got {most} x {self.repetition_min_count}"
            )

    @property
    def detects_repetition(self) -> bool:
        return self.max_repetition_pattern_size > 0 and self.repetition_min_count >= 2

    def repetition_detected(self, token_ids: list[int], num_output: int) -> bool:
        """Whether the output (the last `num_output` of `token_ids`) ends with a pattern of
        min..max_repetition_pattern_size tokens repeated repetition_min_count times in a row
        (vLLM's check, with a cheap first test per length: the last token recurs one pattern
        back). Reads at most MAX_REPETITION_SPAN tokens."""
        if not self.detects_repetition:
            return False
        count, last = self.repetition_min_count, token_ids[-1]
        for size in range(
            max(self.min_repetition_pattern_size, 1), self.max_repetition_pattern_size + 1
        ):
            span = size * count
            if span > num_output:
                return False
            if token_ids[-1 - size] != last:
                continue
            tail = token_ids[-span:]
            if tail[size:] == tail[:-size]:  # the tail has period `size`
                return True
        return False

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...]:
        """The bad words as token ids, once the engine has tokenized them (else empty)."""
        return self._bad_words_ids

    def with_bad_words_token_ids(self, words) -> SamplingParams:
        """These params with `words` (id lists, at most MAX_BAD_WORDS_TOKENS ids in all) as the
        tokens of their bad words; not a field, so the params' equality and the wire ignore it."""
        ids = tuple(_id_tuple("bad_words token ids", w) for w in words)
        if any(not w for w in ids) or sum(map(len, ids)) > MAX_BAD_WORDS_TOKENS:
            raise BadSamplingParams(
                f"bad_words come to {sum(map(len, ids))} token ids or hold an empty word; "
                f"at most {MAX_BAD_WORDS_TOKENS} ids in all"
            )
        out = replace(self)
        out._put("_bad_words_ids", ids)
        return out

    def with_output(
        self, kind: RequestOutputKind, detokenize: bool | None = None
    ) -> SamplingParams:
        """These params with another output_kind (and detokenize, where given); the bad words'
        ids, if set, are kept."""
        if detokenize is None:
            detokenize = self.detokenize
        out = replace(self, output_kind=kind, detokenize=detokenize)
        out._put("_bad_words_ids", self._bad_words_ids)
        return out

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """These params with max_tokens set (the engine's for max_tokens=None: the rest of the
        context); the bad words' ids, if set, are kept."""
        out = replace(self, max_tokens=max_tokens)
        out._put("_bad_words_ids", self._bad_words_ids)
        return out

    def truncated_prompt(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's token ids as truncate_prompt_tokens keeps them: the last k, or with -1
        the last max_model_len - 1 (one position left for output); all of them when unset."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        keep = max_model_len - 1 if k == -1 else k
        return ids[-keep:] if len(ids) > keep else ids

    @property
    def wants_logprobs(self) -> bool:
        """Whether the sampled tokens' logprobs are wanted (in either form)."""
        return self.logprobs is not None

    @property
    def vllm_logprobs(self) -> bool:
        """Whether they were asked for as vLLM's count, so the offline outputs take vLLM's shape
        (engine/outputs.py vllm_output), rather than as pdserve's logprobs=True."""
        return self.logprobs is not None and self.logprobs is not True

    # (greedy and shapes_logits are read for every row every step: cached, the params being
    # frozen; functools.cached_property keeps them in the instance's __dict__, and _put drops
    # them: _CACHED)
    @functools.cached_property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @functools.cached_property
    def shapes_logits(self) -> bool:
        """Whether the logits are changed before sampling by anything but a grammar: logit_bias,
        allowed_token_ids, bad words or a penalty (min_tokens is the sampler's own check: it
        depends on how many tokens are out)."""
        shaped = self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids
        return bool(shaped) or self.has_penalties

    @property
    def reads_history(self) -> bool:
        """Whether sampling a token depends on the tokens generated before it (penalties,
        min_tokens, bad words, a thinking budget): a speculated position then sees the guesses
        before it."""
        return (
            self.has_penalties
            or self.min_tokens > 0
            or bool(self.bad_words_token_ids)
            or self.thinking_token_budget is not None
        )

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
