"""The OpenAI request bodies the HTTP front accepts, as strict pydantic models, and what each
becomes on the gRPC wire (`sampling_params`, `chat_messages`). Every field is typed and bounded
before any work; an unknown field is refused with a 400 naming it (KNOWN_FIELDS).

Beyond OpenAI's own fields it accepts vLLM's sampling fields (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, allowed_token_ids, bad_words, skip_special_tokens,
include_stop_str_in_output, truncate_prompt_tokens, cache_salt, return_tokens_as_token_ids),
OpenAI's logit_bias, pdserve's `speculative` (false: this request opts out of the decode pool's
speculative decoding), vLLM's prompt_logprobs and chat template fields, structured outputs and
tools (their sections below say more), and a user message's images (OpenAI's image_url parts,
base64 data URLs only: the images section). `model` may be left out (the served model). OpenAI
fields that change nothing here are accepted and ignored (`user`, `metadata`, ...); those whose
meaning pdserve does not serve (functions, best_of, ...) are accepted only at their neutral
value. vLLM's other request fields (VllmFields, and each endpoint's own) follow the same rule, so a client
written for vLLM runs unchanged or gets a 400 naming the field it would have to drop; vLLM's
stream_options (StreamOptions: include_usage true once stream_options is sent, and
continuous_usage_stats) are served, and so is use_beam_search (router/openai/beam.py; n the beam
width, at most MAX_BEAM_WIDTH), with which every field a beam search cannot apply is refused
(BEAM_NEUTRAL).

The numeric ranges are the engine's (engine/sampling_params.py) narrowed to OpenAI's documented
ones where OpenAI is stricter (temperature <= 2); the size bounds are the gRPC API's
(protos/limits.py, router/text.py), so a request refused by one front is refused by the other.
The models hold no state: the handlers (router/openai/) validate a body once, off the event loop.
"""

from __future__ import annotations

import base64
import binascii
import json
import operator
import re
import types
import typing
from collections.abc import Callable
from functools import cache, lru_cache
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictStr,
    field_validator,
    model_validator,
)

from pdserve.protos.convert import OPTIONAL_FIELDS, structured_message
from pdserve.protos.limits import (
    LOGIT_BIAS_RANGE,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_CHARS,
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_ID_CHARS,
    MAX_IMAGE_FILE_BYTES,
    MAX_IMAGES,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REGEX_CHARS,
    MAX_REPETITION_PATTERN,
    MAX_REPETITION_SPAN,
    MAX_REQUEST_IMAGE_BYTES,
    MAX_SCHEMA_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.errors import ApiError
from pdserve.router.text import (
    MAX_CHAT_MESSAGES,
    MAX_TEMPLATE_KWARGS_BYTES,
    RESERVED_TEMPLATE_KEYS,
)

# ---- structured output -------------------------------------------------------------------
# _Sampling inherits StructuredFields, for chat and completions alike:
#
#     response_format     OpenAI's: {"type": "text"} | {"type": "json_object"} |
#                         {"type": "json_schema", "json_schema": {"name", "schema", "strict", ...}}
#     structured_outputs  vLLM's: {"json": schema} | {"regex": str} | {"choice": [str]} |
#                         {"grammar": GBNF or Lark} | {"json_object": true}
#     guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older names for the same
#
# At most one of them per request. Each is checked here (types, sizes: protos/limits.py's bounds)
# and becomes the gRPC SamplingParams.structured (`structured_spec`); whether a schema, regex or
# grammar compiles is the workers' check (engine/structured/grammar.py), whose INVALID_ARGUMENT
# `name_field` rewrites to the field the client sent. Only the tools' parameter schemas are
# compiled here.
_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)
Regex = Annotated[StrictStr, Field(min_length=1, max_length=MAX_REGEX_CHARS)]
Grammar = Annotated[StrictStr, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
Choices = Annotated[
    list[Annotated[StrictStr, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]],
    Field(min_length=1, max_length=MAX_CHOICES),
]
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _schema(v: Any) -> dict:
    """A JSON schema given as an object or as its JSON text: an object, at most MAX_SCHEMA_CHARS
    as compact JSON."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(v, dict):
        raise ValueError(f"a JSON schema must be a JSON object, got {type(v).__name__}")
    size = len(json.dumps(v, separators=(",", ":"), ensure_ascii=False))
    if size > MAX_SCHEMA_CHARS:
        raise ValueError(
            f"the schema has {size} characters as compact JSON; at most {MAX_SCHEMA_CHARS}"
        )
    return v


class JsonSchemaFormat(BaseModel):
    model_config = _CONFIG
    name: StrictStr
    description: StrictStr | None = None
    # OpenAI's field is `schema`; pydantic reserves that name on models
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None  # the output always follows the schema here

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not _NAME.match(v):
            raise ValueError("1 to 64 characters of a-z, A-Z, 0-9, _ and -")
        return v

    _check_schema = field_validator("schema_")(classmethod(lambda cls, v: _schema(v)))


class ResponseFormat(BaseModel):
    model_config = _CONFIG
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                "json_schema is required with type 'json_schema', and only allowed with it"
            )
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs (one of json, regex, choice, json_object)."""

    model_config = _CONFIG
    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: Regex | None = None
    choice: Choices | None = None
    json_object: StrictBool | None = None
    grammar: Grammar | None = None
    # vLLM's switches that change nothing here: one backend, never free whitespace
    disable_fallback: StrictBool | None = None
    disable_any_whitespace: StrictBool | None = None
    disable_additional_properties: StrictBool | None = None
    # a reasoning model's: true holds the grammar from the first token, reasoning included (vLLM's
    # server option enable_in_reasoning, here per request); unset or false: after the reasoning
    enable_in_reasoning: StrictBool | None = None

    _check_json = field_validator("json_")(
        classmethod(lambda cls, v: v if v is None else _schema(v))
    )

    @model_validator(mode="after")
    def _one(self):
        kinds = ("json_", "regex", "choice", "grammar")
        given = [k for k in kinds if getattr(self, k) is not None] + (
            ["json_object"] if self.json_object else []
        )
        if len(given) != 1:
            raise ValueError(
                "set exactly one of json, regex, choice, grammar, json_object; got "
                + (", ".join(g.rstrip("_") for g in given) or "none")
            )
        return self


class StructuredFields(BaseModel):
    """The structured-output fields both endpoints take."""

    model_config = _CONFIG
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: Regex | None = None
    guided_choice: Choices | None = None
    guided_grammar: Grammar | None = None

    _check_guided_json = field_validator("guided_json")(
        classmethod(lambda cls, v: v if v is None else _schema(v))
    )

    @model_validator(mode="after")
    def _at_most_one(self):
        given = [
            k
            for k in (
                "structured_outputs",
                "guided_json",
                "guided_regex",
                "guided_choice",
                "guided_grammar",
            )
            if getattr(self, k) is not None
        ]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} both shape the output: send one of them")
        return self

    def structured_spec(self) -> tuple[dict, str] | None:
        """(the engine's StructuredSpec keywords, the field the client set), None for free text."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return {"json_object": True}, "response_format"
        if rf is not None and rf.type == "json_schema":
            return {"json_schema": rf.json_schema.schema_}, "response_format.json_schema.schema"
        so = self.structured_outputs
        if so is not None:
            found = _structured_outputs_spec(so)
            if so.enable_in_reasoning:
                found[0]["reasoning"] = "none"
            return found
        if self.guided_json is not None:
            return {"json_schema": _schema(self.guided_json)}, "guided_json"
        if self.guided_regex is not None:
            return {"regex": self.guided_regex}, "guided_regex"
        if self.guided_choice is not None:
            return {"choice": list(self.guided_choice)}, "guided_choice"
        if self.guided_grammar is not None:
            return {"grammar": self.guided_grammar}, "guided_grammar"
        return None


def _structured_outputs_spec(so: StructuredOutputs) -> tuple[dict, str]:
    if so.json_ is not None:
        return {"json_schema": _schema(so.json_)}, "structured_outputs.json"
    if so.regex is not None:
        return {"regex": so.regex}, "structured_outputs.regex"
    if so.choice is not None:
        return {"choice": list(so.choice)}, "structured_outputs.choice"
    if so.grammar is not None:
        return {"grammar": so.grammar}, "structured_outputs.grammar"
    return {"json_object": True}, "structured_outputs.json_object"


_WORKER_FIELD = re.compile(r"^(?:sampling: )?(?:sampling\.)?structured\.\w+:?\s*")


def name_field(error, body) -> None:
    """A workers' refusal of the structured spec (an ApiError whose message starts "sampling:
    structured.<kind>") renamed in place to the field the client sent, as `param` and in the
    message; the router's refusal of a priority names `priority`; any other error is left as
    it is."""
    if error.status == 400 and error.message.startswith("priority="):
        error.param = "priority"  # the router's scheduling policy refused it (router/service.py)
        return
    found = body.structured_spec() if hasattr(body, "structured_spec") else None
    if found is None or error.status != 400 or not _WORKER_FIELD.match(error.message):
        return
    param = found[1]
    error.message = f"{param}: {_WORKER_FIELD.sub('', error.message, count=1)}"
    error.param = param


# ---- tools -----------------------------------------------------------------------------------
# Tool calling in chat completions: OpenAI's `tools`, `tool_choice`, assistant messages'
# `tool_calls` and "tool" messages, and the grammar of a forced call.
#
#     tools        [{"type": "function", "function": {"name", "description"?, "parameters"?,
#                  "strict"?}}], at most MAX_TOOLS, names unique (^[a-zA-Z0-9_-]{1,64}$),
#                  parameters a JSON schema object (unset: no parameters)
#     tool_choice  "none" | "auto" (the default with tools) | "required" |
#                  {"type": "function", "function": {"name": one of the tools}}; needs tools
#
# The chat template renders the tools (router/chat_tools.py). "auto" samples freely and
# router/openai/responses/tool_calls.py parses <tool_call>{...}</tool_call> blocks out of the
# output; "none" parses nothing. "required" and a named function force one call: the output is
# constrained (the same grammar path as response_format) to the JSON object {"name": <a tool's
# name>, "arguments": <that tool's parameters>} (an anyOf over the tools for "required"), so its
# arguments always validate against the schema. Each parameters schema is checked against the
# JSON Schema meta-schema when the request is read (a 400 naming tools[i].function.parameters);
# the schemas of a forced call are also compiled by llguidance then (a 400 naming tool_choice and
# the tool). "auto" builds no grammar, so a valid schema the grammar library does not implement
# ("not", "propertyNames", as agents' tools use) is served there, as vLLM serves it.
MAX_TOOLS = 128
MAX_TOOLS_CHARS = 512 * 1024  # all the tools, as compact JSON
MAX_DESCRIPTION_CHARS = 16 * 1024
MAX_ARGUMENTS_CHARS = 256 * 1024
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _name(v: str) -> str:
    if not _NAME.match(v):
        raise ValueError("a function name is 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
    return v


@lru_cache(maxsize=256)
def _schema_error(text: str) -> str:
    """What the JSON Schema meta-schema says is wrong with a schema given as compact JSON ("" when
    nothing): the schema's own "$schema" draft, else the latest."""
    from jsonschema import validators
    from jsonschema.exceptions import SchemaError

    schema = json.loads(text)
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return (f"at {where}: " if where else "") + e.message[:300]
    except RecursionError:  # the meta-schema's checks recurse a few frames per level
        return "it is nested too deeply to be checked: flatten it (fewer levels of subschemas)"
    return ""


@lru_cache(maxsize=256)
def _compile_error(text: str) -> str:
    """llguidance's complaint about a JSON schema ("" when it compiles; "" without llguidance,
    and the workers then say it)."""
    try:
        from llguidance import LLMatcher
    except ImportError:  # pragma: no cover - a router without the workers' library
        return ""
    try:
        grammar = LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        error = LLMatcher.validate_grammar(grammar, None)
    except Exception as e:  # the library's own error types
        error = str(e) or type(e).__name__
    lines = [x.strip() for x in str(error or "").splitlines() if x.strip()]
    return " ".join(lines[:3])[:300]


class FunctionDef(BaseModel):
    model_config = _CONFIG
    name: StrictStr
    description: Annotated[StrictStr, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # a forced call always follows the schema here

    _check_name = field_validator("name")(classmethod(lambda cls, v: _name(v)))

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v):
        if v is None:
            return v
        v = _schema(v)
        error = _schema_error(json.dumps(v, sort_keys=True, separators=(",", ":")))
        if error:
            raise ValueError(f"not a valid JSON schema: {error}")
        return v

    def schema(self) -> dict:
        return self.parameters if self.parameters is not None else NO_PARAMETERS


class Tool(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(BaseModel):
    model_config = _CONFIG
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: ChosenFunction


class CalledFunction(BaseModel):
    model_config = _CONFIG
    name: StrictStr
    arguments: Annotated[StrictStr, Field(max_length=MAX_ARGUMENTS_CHARS)]

    _check_name = field_validator("name")(classmethod(lambda cls, v: _name(v)))


class ToolCall(BaseModel):
    """An assistant message's call, as a client replays it."""

    model_config = _CONFIG
    id: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: CalledFunction


Tools = Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)]
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tools(tools: list[Tool] | None) -> list[Tool] | None:
    if tools is None:
        return tools
    names = [t.function.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"function names must be unique; {dup[:3]} appear more than once")
    size = len(json.dumps([t.model_dump(exclude_none=True) for t in tools], separators=(",", ":")))
    if size > MAX_TOOLS_CHARS:
        raise ValueError(
            f"the tools have {size} characters as compact JSON; at most {MAX_TOOLS_CHARS}"
        )
    return tools


def check_tool_choice(v, data: dict):
    """tool_choice against the fields before it (tools, the structured-output ones)."""
    if v is None:
        return v
    tools = data.get("tools")
    if not tools:
        if "tools" not in data:  # tools itself was refused: that is the error to report
            return v
        raise ValueError("tool_choice needs tools: send the functions the model may call")
    if isinstance(v, NamedToolChoice):
        names = [t.function.name for t in tools]
        if v.function.name not in names:
            raise ValueError(
                f"function {v.function.name[:64]!r} is not one of the tools: {names[:8]}"
            )
    if forced(v):
        shaped = [
            k
            for k in ("structured_outputs", "guided_json", "guided_regex", "guided_choice")
            if data.get(k) is not None
        ]
        rf = data.get("response_format")
        if rf is not None and rf.type != "text":
            shaped.insert(0, "response_format")
        if shaped:
            raise ValueError(
                f"a forced tool call and {shaped[0]} both shape the output: send one of them"
            )
        _check_forced_grammar(tools, v)
    return v


def _check_forced_grammar(tools: list[Tool], tool_choice) -> None:
    """A forced call's grammar is built from its tools' schemas: each must compile."""
    for i, tool in enumerate(tools):
        if isinstance(tool_choice, NamedToolChoice) and tool.function.name != (
            tool_choice.function.name
        ):
            continue
        text = json.dumps(tool.function.schema(), sort_keys=True, separators=(",", ":"))
        error = _compile_error(text)
        if error:
            raise ValueError(
                f"a forced call is constrained by its tool's schema, and the grammar library "
                f"cannot compile tools[{i}]'s: {error} (tool_choice 'auto' takes it)"
            )


def forced(tool_choice) -> bool:
    return tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)


def _rebase(schema, pointer: str):
    """`schema` with its local $refs ("#/$defs/x", "#") moved under `pointer`."""
    if isinstance(schema, dict):
        return {
            k: (
                pointer + v[1:]
                if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else _rebase(v, pointer)
            )
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_rebase(v, pointer) for v in schema]
    return schema


def _call_schema(tool: Tool, pointer: str) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "arguments": _rebase(tool.function.schema(), pointer + "/properties/arguments"),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_spec(tools: list[Tool], tool_choice) -> tuple[dict, str] | None:
    """(the StructuredSpec keywords, the field a compile error names) of a forced call, None
    when the call is not forced."""
    if not forced(tool_choice):
        return None
    if isinstance(tool_choice, NamedToolChoice):
        i = next(i for i, t in enumerate(tools) if t.function.name == tool_choice.function.name)
        return {"json_schema": _call_schema(tools[i], "#")}, f"tools[{i}].function.parameters"
    if len(tools) == 1:
        return {"json_schema": _call_schema(tools[0], "#")}, "tools[0].function.parameters"
    alternatives = [_call_schema(t, f"#/anyOf/{i}") for i, t in enumerate(tools)]
    return {"json_schema": {"anyOf": alternatives}}, "tools"


def tools_json(tools: list[Tool]) -> str:
    return json.dumps([t.model_dump(exclude_none=True) for t in tools], ensure_ascii=False)


def tool_calls_json(calls: list[ToolCall]) -> str:
    return json.dumps([c.model_dump() for c in calls], ensure_ascii=False)


class ToolMessageFields(BaseModel):
    """What a chat message adds for tools (ChatMessage below)."""

    model_config = _CONFIG
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None


# ---- the request bodies ------------------------------------------------------------------
INT64 = 1 << 63
UINT32 = 1 << 32
MAX_TOKENS_FIELD = (1 << 31) - 1  # beyond any max_model_len; the router says which is the limit
MAX_PROMPT_IDS = 1 << 20  # more than any max_model_len; the router refuses past max_model_len
MAX_NAME_CHARS = 256
MAX_METADATA_ITEMS = 16


class _Strict(BaseModel):
    # strict: "2" for an integer or 1 for a bool is a mistake worth a 400; NaN and infinities are
    # refused for every float; unknown fields are refused (OpenAI's harmless ones are declared)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=2.0)]
TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKENS_FIELD)]
StopString = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, lt=UINT32)]
LogitBias = Annotated[float, Field(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE)]
ShortStr = Annotated[StrictStr, Field(max_length=MAX_NAME_CHARS)]


def _keeps_some(k: int) -> int:
    if k == 0:
        raise ValueError(
            "truncate_prompt_tokens keeps k >= 1 of the prompt's last tokens, or -1 for as many "
            "as max_model_len holds; 0 would keep none"
        )
    return k


# vLLM's truncate_prompt_tokens (chat, completions and embeddings alike): the router keeps the
# prompt's last k tokens (router/text.py)
TruncatePromptTokens = Annotated[int, Field(ge=-1, lt=1 << 31), AfterValidator(_keeps_some)]


# GenerateRequest.priority is an int32 (vLLM takes any int; past these bounds: 400 naming it)
Priority = Annotated[int, Field(strict=True, ge=-(1 << 31), lt=1 << 31)]


def _neutral_only(*fields: str, message: str, neutral: Callable[[Any], bool] = operator.not_):
    """A validator for OpenAI fields pdserve accepts only at their neutral value: any value of
    `fields` that neutral(value) (default: falsy) does not accept is refused with `message`, where
    {field} names the field."""

    def check(cls, v, info):
        if not neutral(v):
            raise ValueError(message.replace("{field}", info.field_name))
        return v

    return field_validator(*fields)(classmethod(check))


class StreamOptions(_Strict):
    # unset: true, as vLLM (a stream_options object asks for usage unless it says otherwise)
    include_usage: StrictBool | None = None
    # vLLM's: usage (the prompt's tokens and the choice's completion tokens so far) on every
    # chunk too; needs include_usage (vLLM's rule)
    continuous_usage_stats: StrictBool | None = None

    def usage(self) -> bool:
        return self.include_usage is not False

    def continuous(self) -> bool:
        return self.usage() and bool(self.continuous_usage_stats)


class VllmFields(BaseModel):
    """vLLM's request fields that both endpoints take and pdserve serves at their neutral value
    only (a value that would change the answer is refused with a 400 naming the field, never
    ignored), or accepts and ignores where they change nothing about the answer here."""

    model_config = _CONFIG
    # vLLM's beam search (router/openai/beam.py): n beams, answered as n choices best first
    use_beam_search: StrictBool = False
    # beam search's alone: a sequence's score is its cumulative logprob / length ** this (vLLM's);
    # no effect without use_beam_search, as in vLLM
    length_penalty: float = 1.0
    spaces_between_special_tokens: StrictBool = True
    # keep only the prompt's last k tokens (-1: as many as max_model_len holds; 0 is refused)
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    # only these tokens may be sampled (vLLM's; an empty list is refused, as vLLM does)
    allowed_token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None
    ) = None
    # none of these words is generated (vLLM's; the worker tokenizes them as vLLM does)
    bad_words: Annotated[list[StopString], Field(max_length=MAX_BAD_WORDS)] | None = None
    # vLLM's priority scheduling: lower first; not 0 needs the router's scheduling_policy
    # "priority" (the router refuses it otherwise, 400 naming the field)
    priority: Priority = 0
    logits_processors: list[Any] | None = None
    # each logprob's token as "token_id:<id>" (vLLM's; its text otherwise)
    return_tokens_as_token_ids: StrictBool | None = None
    # the request's prefix-cache namespace: only requests with the same salt share cached KV
    cache_salt: Annotated[StrictStr, Field(max_length=MAX_CACHE_SALT_CHARS)] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    guided_whitespace_pattern: StrictStr | None = None
    structural_tag: StrictStr | None = None
    # accepted and ignored: one structured-output backend
    guided_decoding_backend: ShortStr | None = None
    # vLLM's per-request processor arguments (Qwen2-VL's max_pixels): refused but for {}, since
    # the router's processor runs as the deployment configures it (ignoring one would let a
    # client believe its images were bounded)
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's: the response's id (chatcmpl-<id>) where no X-Request-Id header names one, and part
    # of the router's id (router/openai/generate.py request_id_of checks it)
    request_id: ShortStr | None = None
    # vLLM's: the prompt's and each choice's token ids in the response (RL frameworks read them)
    return_token_ids: StrictBool | None = None
    # a reasoning model's reasoning ends (</think>) once it holds this many tokens (vLLM's; the
    # engine refuses it for a model without <think> and </think>: engine/thinking.py)
    thinking_token_budget: Annotated[int, Field(ge=0, lt=1 << 31)] | None = None
    # newer vLLM's repetition detection (0: off): the output ends, finish_reason "repetition",
    # once it ends with a pattern of min..max tokens repeated repetition_min_count times
    max_repetition_pattern_size: Annotated[int, Field(ge=0, le=MAX_REPETITION_PATTERN)] | None = (
        None
    )
    min_repetition_pattern_size: Annotated[int, Field(ge=0, le=MAX_REPETITION_PATTERN)] | None = (
        None
    )
    repetition_min_count: Annotated[int, Field(ge=0, le=MAX_REPETITION_SPAN)] | None = None

    _spaces = _neutral_only(
        "spaces_between_special_tokens",
        message="spaces_between_special_tokens=false is not supported",
        neutral=lambda v: v is True,
    )

    @field_validator("min_repetition_pattern_size")
    @classmethod
    def _repetition_sizes(cls, v, info):
        most = info.data.get("max_repetition_pattern_size") or 0
        if v is not None and v > most:
            raise ValueError(
                f"min_repetition_pattern_size={v} is more than max_repetition_pattern_size={most}"
            )
        return v

    @field_validator("repetition_min_count")
    @classmethod
    def _repetition_span(cls, v, info):
        most = info.data.get("max_repetition_pattern_size") or 0
        if v is not None and most * v > MAX_REPETITION_SPAN:
            raise ValueError(
                f"max_repetition_pattern_size x repetition_min_count must be at most "
                f"{MAX_REPETITION_SPAN} tokens (the output's end each step reads), got "
                f"{most} x {v}"
            )
        return v

    _unset = _neutral_only(
        "logits_processors",
        "kv_transfer_params",
        "vllm_xargs",
        "guided_whitespace_pattern",
        "structural_tag",
        message="{field} is not supported; leave it unset",
    )
    _processor_kwargs = _neutral_only(
        "mm_processor_kwargs",
        message="{field} is not taken per request: images go through the model's processor as "
        "the deployment configures it; leave it unset",
    )


def _admits_none(annotation) -> bool:
    """Whether a field's type takes null: None itself, Any, or a union (through Annotated) with
    one of them in it."""
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _admits_none(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return any(_admits_none(a) for a in typing.get_args(annotation))
    return False


@cache
def _defaulted_non_nullable(model: type[BaseModel]) -> frozenset[str]:
    """The body keys (aliases where a field has one) of `model`'s fields that have a default and
    whose type does not take null."""
    return frozenset(
        f.alias or name
        for name, f in model.model_fields.items()
        if not f.is_required() and not _admits_none(f.annotation)
    )


# ---- beam search ----------------------------------------------------------------------------
# use_beam_search (router/openai/beam.py) asks each step for the 2 x n most likely tokens, at most
# MAX_LOGPROBS: n, the beam width, is at most half that (vLLM's max_logprobs bounds it the same)
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
# the fields beam search cannot apply, and the value of each that changes nothing: vLLM's beam
# search ranks sequences by the model's own logprobs and ignores them, which would change the
# answer silently; here any other value with use_beam_search is a 400 naming the field
BEAM_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "top_p": lambda v: v is None or v == 1.0,
    "top_k": lambda v: v in (None, 0, -1),
    "min_p": lambda v: not v,
    "presence_penalty": lambda v: not v,
    "frequency_penalty": lambda v: not v,
    "repetition_penalty": lambda v: v is None or v == 1.0,
    "min_tokens": lambda v: not v,
    "stop": lambda v: not v,
    "stop_token_ids": lambda v: not v,
    "logit_bias": lambda v: not v,
    "allowed_token_ids": lambda v: v is None,
    "bad_words": lambda v: not v,
    "thinking_token_budget": lambda v: v is None,
    "max_repetition_pattern_size": lambda v: not v,
    "min_repetition_pattern_size": lambda v: not v,
    "repetition_min_count": lambda v: not v,
    "response_format": lambda v: v is None or v.type == "text",
    "structured_outputs": lambda v: v is None,
    "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "guided_grammar": lambda v: v is None,
    # completions'
    "prompt_logprobs": lambda v: v is None,
    "suffix": lambda v: v is None,
    # chat's: a forced tool call is a grammar on the output
    "tool_choice": lambda v: v is None or not forced(v),
}
_BEAM_WHY = {
    "prompt_logprobs": "a beam search answers no prompt logprobs",
    "suffix": "a fill-in-the-middle prompt stops at tokens a beam search does not stop at",
    "tool_choice": "a forced tool call shapes the output with a grammar",
}


def _beam_check(fields: list[str]):
    """A field validator refusing, with use_beam_search, a value of `fields` that BEAM_NEUTRAL
    does not accept (use_beam_search is declared before every such field: info.data has it)."""

    def check(cls, v, info):
        if info.data.get("use_beam_search") and not BEAM_NEUTRAL[info.field_name](v):
            why = _BEAM_WHY.get(
                info.field_name,
                "vLLM's beam search ranks the beams by the model's own logprobs and ignores "
                "it without a word, which changes the answer",
            )
            raise ValueError(f"not applied with use_beam_search ({why}): leave it unset")
        return v

    return field_validator(*fields)(classmethod(check))


class _Sampling(_Strict, StructuredFields, VllmFields):
    """Fields both endpoints share (the structured-output ones: StructuredFields).

    An explicit null on a field that has a default means that default, for every field of the
    chat and completions bodies (n, stream, logprobs, echo, add_generation_prompt, ...): OpenAI's
    spec makes them nullable, its SDKs send null for a None argument, and vLLM reads null as the
    default. A null on a required field (messages, prompt) is still refused."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # before the fields are read, so the field checks see the default as if the key were
        # left out (the cross-field checks included)
        if not isinstance(data, dict):
            return data
        defaulted = _defaulted_non_nullable(cls)
        if not any(v is None and k in defaulted for k, v in data.items()):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}

    # unset: the served model (vLLM's default)
    model: Annotated[StrictStr, Field(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=-1, lt=1 << 31)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    max_tokens: TokenCount | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_FIELD)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    # pdserve's: false opts this request out of speculative decoding (same tokens, its own pace)
    speculative: StrictBool | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # OpenAI's: {token id, as a decimal string: bias in [-100, 100]} added to those tokens' logits
    logit_bias: (
        Annotated[dict[StrictStr, LogitBias], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None
    ) = None
    # accepted and ignored: they change nothing about the result
    user: ShortStr | None = None

    _beam_unapplied = _beam_check(
        [f for f in BEAM_NEUTRAL if f not in ("prompt_logprobs", "suffix", "tool_choice")]
    )

    @field_validator("n")
    @classmethod
    def _beam_width(cls, v, info):
        if info.data.get("use_beam_search") and v > MAX_BEAM_WIDTH:
            raise ValueError(
                f"with use_beam_search n is the beam width, at most {MAX_BEAM_WIDTH} (each step "
                f"asks for the 2 x n most likely tokens, at most {MAX_LOGPROBS}), got {v}"
            )
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, v):
        for key in v or ():
            if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < UINT32):
                raise ValueError(f"keys are token ids (decimal strings), got {key[:40]!r}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, v, info):
        # stream is declared before stream_options: info.data has it unless it was refused
        if v is not None and "stream" in info.data and not info.data["stream"]:
            raise ValueError("only allowed with stream=true: send stream=true, or leave it out")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        most = self.max_new_tokens()
        if self.min_tokens is not None and most is not None and self.min_tokens > most:
            raise ValueError(f"min_tokens={self.min_tokens} is more than max_tokens={most}")
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    # one prompt (text, or token ids) or a batch of them (a list of texts or of token id lists):
    # choice i * n + j is prompt i's sequence j, as OpenAI's and vLLM's
    prompt: (
        StrictStr
        | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_IDS)]
        | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_N)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_IDS)]],
            Field(min_length=1, max_length=MAX_N),
        ]
    )
    # 0 to 2**31 - 1: 0 only with echo (the prompt alone, nothing generated: vLLM's)
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_FIELD)] | None = None
    # each token's logprob and the `logprobs` most likely tokens at its position
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # the prompt before the completion (with logprobs: the prompt's logprobs too)
    echo: StrictBool = Field(False, validate_default=True)  # checked with max_tokens=0 too
    # vLLM's: the prompt's logprobs and the k most likely tokens at each position, in each choice
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # the text after the completion: a code model's fill-in-the-middle (router/openai/fim.py)
    suffix: StrictStr | None = None
    # OpenAI fields accepted only at their neutral value
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    # vLLM's completion fields accepted only at their neutral value
    add_special_tokens: StrictBool = True
    prompt_embeds: Any = None

    _completion_vllm = _neutral_only(
        "prompt_embeds", message="prompt_embeds is not supported; send prompt"
    )
    _special = _neutral_only(
        "add_special_tokens",
        message="add_special_tokens=false is not supported for completions",
        neutral=lambda v: v is True,
    )

    _no_best_of = _neutral_only(
        "best_of", message="best_of > 1 is not supported; use n", neutral=lambda v: v in (None, 1)
    )
    _beam_completion = _beam_check(["prompt_logprobs", "suffix"])

    @field_validator("max_tokens")
    @classmethod
    def _beam_generates(cls, v, info):
        if v == 0 and info.data.get("use_beam_search"):
            raise ValueError("use_beam_search generates: max_tokens must be at least 1")
        return v

    @field_validator("echo")
    @classmethod
    def _beam_echo(cls, v, info):
        if v and info.data.get("use_beam_search") and info.data.get("logprobs") is not None:
            raise ValueError(
                "echo with logprobs needs the prompt's logprobs, which a beam search does not "
                "compute: send echo or logprobs, not both, with use_beam_search"
            )
        return v

    # cross-field checks on the later field, so that the error names a field (info.data holds
    # the fields declared before it that validated)
    @field_validator("echo")
    @classmethod
    def _echo_consistent(cls, v, info):
        if info.data.get("max_tokens") == 0 and not v:
            raise ValueError(
                "max_tokens=0 generates nothing: it is allowed only with echo=true (the prompt "
                "alone, with its logprobs when logprobs is set)"
            )
        if v and info.data.get("stream") and info.data.get("logprobs") is not None:
            raise ValueError(
                "echo with logprobs is not streamed (the prompt's logprobs come with the "
                "response's end): send stream=false, or leave logprobs unset"
            )
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_whole(cls, v, info):
        if v is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs is not streamed: send stream=false")
        return v

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def num_top(self) -> int:
        return self.logprobs or 0

    def prompt_logprobs_k(self) -> int | None:
        """The prompt logprobs the workers compute: echo with logprobs needs the prompt's (vLLM's
        echo), prompt_logprobs asks for them; None: neither."""
        ks = [
            k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None
        ]
        return max(ks) if ks else None

    def max_new_tokens(self) -> int | None:
        # echo with max_tokens=0: one token is generated and dropped (vLLM does the same)
        return 1 if self.max_tokens == 0 else self.max_tokens

    @model_validator(mode="after")
    def _sequences_bounded(self):
        num_prompts = len(self.prompts())
        if num_prompts * self.n > MAX_N:
            raise ValueError(
                f"{num_prompts} prompts x n={self.n} asks for {num_prompts * self.n} sequences, "
                f"at most {MAX_N} per request: send fewer prompts or a lower n"
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: each prompt as text or token ids."""
        p = self.prompt
        if isinstance(p, list) and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Prediction(_Strict):
    """OpenAI's Predicted Outputs: the output expected, mostly (a file with a few lines changed),
    whose tokens the decode pool checks as its speculative guesses."""

    type: Literal["content"]
    content: StrictStr | Annotated[list[TextPart], Field(min_length=1, max_length=1024)]

    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(part.text for part in c)


# ---- images ------------------------------------------------------------------------------
# A vision-language model's (LLaVA's) images come in a user message's content, as OpenAI's
# image_url parts: {"type": "image_url", "image_url": {"url": "data:image/png;base64,...",
# "detail": ...}} or, as vLLM also reads it, {"type": "image_url", "image_url": "data:..."}. A
# base64 data URL is decoded here (strict base64) and bounded as the gRPC API bounds it
# (protos/limits.py: each file, and a request's count and bytes: check_images); an http(s) link
# is kept as such, and fetched by the chat route where the deployment allows its host
# (router/openai/media.py; elsewhere, or with no host allowed, it is refused). Whether the bytes
# are an image is the router's encoder's check (it opens them with Pillow, off the event loop),
# as is whether the served model takes images.
_DATA_URL = re.compile(r"data:([^,]*);base64,", re.IGNORECASE)
_LINK = re.compile(r"https?://", re.IGNORECASE)
MAX_LINK_CHARS = 2048
_URL_REFUSED = (
    f"an image_url must be a base64 data URL (data:image/png;base64,...) or an http(s) link of "
    f"at most {MAX_LINK_CHARS} characters (fetched only from the hosts the deployment allows: "
    f"router.allowed_media_domains)"
)
# the most base64 characters an image file of MAX_IMAGE_FILE_BYTES encodes into
_MAX_IMAGE_BASE64_CHARS = 4 * -(-MAX_IMAGE_FILE_BYTES // 3)


def _image_file(url: str) -> bytes:
    """The image file a base64 data URL holds; a ValueError that says what to change when
    `url` is another URL, its data is not strict base64, or the file is empty or too large."""
    found = _DATA_URL.match(url)
    if found is None:
        raise ValueError(_URL_REFUSED)
    data = url[found.end() :]
    too_large = f"more than the {MAX_IMAGE_FILE_BYTES >> 20} MiB an image file may hold"
    if len(data) > _MAX_IMAGE_BASE64_CHARS:  # refused before it is decoded
        raise ValueError(f"the image file is about {len(data) * 3 // 4} bytes, {too_large}")
    try:
        image = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"the data URL's data is not valid base64 ({e})") from None
    if not image:
        raise ValueError("the data URL holds no image: its data is empty")
    if len(image) > MAX_IMAGE_FILE_BYTES:
        raise ValueError(f"the image file is {len(image)} bytes, {too_large}")
    return image


class ImageUrl(_Strict):
    url: StrictStr
    # OpenAI's resolution hint: accepted and ignored (the model's processor sizes the image)
    detail: Literal["auto", "low", "high"] | None = None
    _image: bytes = PrivateAttr(b"")
    _link: str = PrivateAttr("")

    @model_validator(mode="after")
    def _decoded(self):
        if _LINK.match(self.url) and len(self.url) <= MAX_LINK_CHARS:
            self._link = self.url  # (fetched by the chat route, where its host is allowed)
        elif _DATA_URL.match(self.url):
            self._image = _image_file(self.url)
        else:
            raise ValueError(
                f"an image_url must be a base64 data URL (data:image/png;base64,...) or an "
                f"http(s) link of at most {MAX_LINK_CHARS} characters (fetched only from the "
                f"hosts the deployment allows: router.allowed_media_domains)"
            )
        return self

    @property
    def link(self) -> str:
        """The http(s) link the image is at; "" for a data URL's."""
        return self._link


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl

    @field_validator("image_url", mode="before")
    @classmethod
    def _bare_url(cls, v):
        # vLLM's form: the URL itself, without the object around it
        return {"url": v} if isinstance(v, str) else v

    def image(self) -> bytes:
        """The image file's bytes (the data URL's data, decoded, or the link's, once fetched:
        b"" until then)."""
        return self.image_url._image


ContentPart = TextPart | ImagePart
_PART_KINDS = ("text", "image_url")


class ChatMessage(_Strict, ToolMessageFields):
    # developer: OpenAI's newer name for system; tool: a call's result (tool_call_id)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null or left out only in an assistant message with tool_calls (OpenAI's spec and vLLM);
    # image parts only in a user message (OpenAI's rule)
    content: (
        StrictStr | Annotated[list[ContentPart], Field(min_length=1, max_length=1024)] | None
    ) = Field(None, validate_default=True)
    name: ShortStr | None = None  # accepted and ignored (most chat templates have no place for it)
    refusal: None = None  # OpenAI clients replay assistant messages with "refusal": null
    audio: None = None  # and "audio": null
    # an assistant's reasoning, replayed (interleaved thinking): vLLM's name and DeepSeek's; the
    # chat template reads it as reasoning_content (Qwen3's, GLM's and Kimi's templates do)
    reasoning: StrictStr | None = None
    reasoning_content: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_and_image_parts(cls, v):
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in _PART_KINDS:
                    raise ValueError(
                        f"content parts of type {str(kind)[:40]!r} are not supported: this "
                        f"server reads parts of type 'text' and 'image_url' (an image as a "
                        f"base64 data URL, or a link to a host the deployment allows)"
                    )
        return v

    @field_validator("content")
    @classmethod
    def _content_needed(cls, v, info):
        # tool_calls (ToolMessageFields) and role are declared before content: info.data has them
        role = info.data.get("role")
        if v is None and not (role == "assistant" and info.data.get("tool_calls")):
            if "role" in info.data:  # else the role itself was refused: that is the error
                raise ValueError(
                    "Field required (it may be null or left out only in an assistant message "
                    "with tool_calls)"
                )
        images = isinstance(v, list) and any(p.type == "image_url" for p in v)
        if images and role is not None and role != "user":
            raise ValueError(
                f"image_url parts are only allowed in user messages, not in {role} messages"
            )
        return v

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only allowed in assistant messages")
        both = self.reasoning is not None and self.reasoning_content is not None
        if both and self.reasoning != self.reasoning_content:
            raise ValueError("reasoning and reasoning_content differ: send one of them")
        if self.thought() is not None and self.role != "assistant":
            raise ValueError("reasoning is only allowed in assistant messages")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id (the call it answers), and only it")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # text parts one per line, as vLLM's chat parsing (and the offline LLM.chat) joins them;
        # image parts have no text
        return "\n".join(p.text for p in self.content if p.type == "text")

    def images(self) -> list[bytes]:
        """The image files of the message's image parts, in order (none: a text message)."""
        if not isinstance(self.content, list):
            return []
        return [p.image() for p in self.content if p.type == "image_url"]

    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role

    def thought(self) -> str | None:
        """An assistant's replayed reasoning (either name)."""
        return self.reasoning if self.reasoning is not None else self.reasoning_content


def check_images(messages: list[ChatMessage] | None) -> list[ChatMessage] | None:
    """A chat's images, bounded as a request's (at most MAX_IMAGES, MAX_REQUEST_IMAGE_BYTES of
    files in all messages together); the messages as they are."""
    sizes = [len(image) for m in messages or () for image in m.images()]
    if len(sizes) > MAX_IMAGES:
        raise ValueError(f"at most {MAX_IMAGES} images in a request, got {len(sizes)}")
    if sum(sizes) > MAX_REQUEST_IMAGE_BYTES:
        raise ValueError(
            f"at most {MAX_REQUEST_IMAGE_BYTES >> 20} MiB of image files in a request, got "
            f"{sum(sizes)} bytes"
        )
    return messages


# vLLM's `chat_template` (a Jinja template sent with the request) on chat completions and
# /tokenize: a chat is rendered with the served model's template only (router/text.py)
CHAT_TEMPLATE_REFUSED = (
    "chat_template is not supported per request: chats are rendered with the served model's "
    "chat template (its tokenizer's, or the deployment's `chat_template`); leave it unset"
)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)]
    max_completion_tokens: TokenCount | None = None
    logprobs: StrictBool = False
    # the most likely tokens at each position, besides each token's logprob: needs logprobs=true
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's chat template fields: rendered with the model's template (router/text.py)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # tools (the tools section above): rendered by the chat template, calls parsed from the output
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    # vLLM's chat fields accepted only at their neutral value
    echo: StrictBool = False
    add_special_tokens: StrictBool = False
    documents: list[Any] | None = None
    chat_template: StrictStr | None = None
    # vLLM's: false drops a reasoning model's reasoning from the answer
    # (router/openai/responses/reasoning.py)
    include_reasoning: StrictBool = True
    # vLLM's: a chat template variable (templates of reasoning models read it), as vLLM passes it
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # OpenAI fields accepted only at their neutral value
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[Literal["text"]] | None = None
    web_search_options: Any = None
    # OpenAI's Predicted Outputs (the router tokenizes the text: GenerateRequest.prediction)
    prediction: Prediction | None = None
    # false: at most one tool call, the first (a later one is dropped, as vLLM does)
    parallel_tool_calls: StrictBool | None = None
    # accepted and ignored: they change nothing about the result
    metadata: Annotated[dict[str, ShortStr], Field(max_length=MAX_METADATA_ITEMS)] | None = None
    store: StrictBool | None = None
    service_tier: ShortStr | None = None
    prompt_cache_key: ShortStr | None = None
    safety_identifier: ShortStr | None = None

    _no_functions = _neutral_only(
        "functions", message="functions is OpenAI's older form: send tools instead"
    )
    _no_function_call = _neutral_only(
        "function_call",
        message="function_call is OpenAI's older form: send tool_choice instead",
        neutral=lambda v: v in (None, "none"),
    )
    _check_tools = field_validator("tools")(classmethod(lambda cls, v: check_tools(v)))
    _check_tool_choice = field_validator("tool_choice")(
        classmethod(lambda cls, v, info: check_tool_choice(v, info.data))
    )
    _check_images = field_validator("messages")(classmethod(lambda cls, v: check_images(v)))
    _beam_chat = _beam_check(["tool_choice"])

    def tool_mode(self) -> str:
        """How the output is read: none (no tools, or tool_choice none), auto or forced."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        return "forced" if forced(self.tool_choice) else "auto"

    def structured_spec(self) -> tuple[dict, str] | None:
        if self.tool_mode() == "forced":
            return forced_spec(self.tools, self.tool_choice)
        return super().structured_spec()

    _chat_vllm = _neutral_only(
        "echo",
        "add_special_tokens",
        "documents",
        message="{field} is not supported; leave it unset",
    )
    _no_chat_template = _neutral_only("chat_template", message=CHAT_TEMPLATE_REFUSED)
    _unset_only = _neutral_only(
        "audio",
        "web_search_options",
        message="{field} is not supported; leave it unset",
        neutral=lambda v: v is None,
    )

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info):
        if v and not info.data.get("logprobs"):
            raise ValueError(f"top_logprobs={v} needs logprobs=true")
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _continue_consistent(cls, v, info):
        if v and info.data.get("add_generation_prompt", True):
            raise ValueError(
                "continue_final_message=true continues the last message: set "
                "add_generation_prompt=false with it"
            )
        messages = info.data.get("messages")
        if v and messages and messages[-1].role != "assistant":
            raise ValueError(
                "continue_final_message=true continues the last message, which must be the "
                "assistant's"
            )
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        if v is None:
            return v
        reserved = sorted(k for k in v if k in RESERVED_TEMPLATE_KEYS or not k.isidentifier())
        if reserved:
            raise ValueError(
                f"keys {[k[:40] for k in reserved[:3]]} are not template variables a request may set "
                f"(apply_chat_template's own parameters; add_generation_prompt and "
                f"continue_final_message are fields of their own)"
            )
        if len(json.dumps(v)) > MAX_TEMPLATE_KWARGS_BYTES:
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON")
        return v

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    def num_top(self) -> int:
        return self.top_logprobs or 0

    def prompt_logprobs_k(self) -> int | None:
        return None

    @model_validator(mode="after")
    def _one_max_tokens(self):
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"max_tokens={a} and max_completion_tokens={b} disagree: send one of them"
            )
        return self

    def max_new_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's): a prompt, or chat messages (with their template fields and
    tools) rendered as chat completions renders them."""

    model: Annotated[StrictStr, Field(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    prompt: StrictStr | None = None
    messages: (
        Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)] | None
    ) = Field(None, validate_default=True)
    # unset: true for a prompt, false for messages (the template writes them), as vLLM
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # as chat completions takes them (the tools section above): the template renders them, so
    # the count is that of the chat request with the same messages and tools
    tools: Tools | None = None
    chat_template: StrictStr | None = None  # vLLM's: refused, as chat completions refuses it
    return_token_strs: StrictBool = False

    _check_kwargs = field_validator("chat_template_kwargs")(
        classmethod(lambda cls, v: ChatCompletionRequest._template_kwargs(v))
    )
    _no_chat_template = _neutral_only("chat_template", message=CHAT_TEMPLATE_REFUSED)

    @field_validator("tools")
    @classmethod
    def _tools(cls, v, info):
        if v is not None and info.data.get("prompt") is not None:
            raise ValueError("tools applies to messages only: the chat template renders them")
        return check_tools(v)

    @field_validator("messages")
    @classmethod
    def _one_input(cls, v, info):
        if (v is None) == (info.data.get("prompt") is None):
            raise ValueError("send either prompt or messages (one of them)")
        return check_images(v)

    @field_validator("continue_final_message")
    @classmethod
    def _continue(cls, v, info):
        if v and info.data.get("messages") is None:
            raise ValueError("continue_final_message applies to messages only")
        return ChatCompletionRequest._continue_consistent(v, info)


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: Annotated[StrictStr, Field(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_IDS)]


# ---- the field names, for naming the one at fault --------------------------------------------
def _field_names(*annotations) -> set[str]:
    """Every field name of the models in `annotations`, nested ones included (through lists,
    unions and Annotated)."""
    names: set[str] = set()
    for a in annotations:
        fields = getattr(a, "model_fields", None)
        if isinstance(a, type) and fields:
            names |= {f.alias or name for name, f in fields.items()}
            names |= _field_names(*(f.annotation for f in fields.values()))
        else:
            names |= _field_names(*typing.get_args(a))
    return names


KNOWN_FIELDS = _field_names(
    CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest
)


# ---- what a body becomes on the gRPC wire ----------------------------------------------------
# SamplingParams' optional scalars an OpenAI body carries as they are (the others are translated
# in sampling_params)
_TRANSLATED = ("n", "max_tokens", "logprobs", "prompt_logprobs", "top_logprobs")
_PASSED_THROUGH = tuple(f for f in OPTIONAL_FIELDS if f not in _TRANSLATED)


def sampling_params(body, max_tokens: int | None) -> pdserve_pb2.SamplingParams:
    """The gRPC SamplingParams of an OpenAI body: only what the client set (the engine's defaults
    are OpenAI's: temperature 1, top_p 1, max_tokens 16 for completions). Logprobs: the sampled
    tokens' when the body wants them, with its number of alternatives (top_logprobs); the
    prompt's when echo or prompt_logprobs needs them."""
    s = pdserve_pb2.SamplingParams()
    if body.n != 1:
        s.n = body.n
    for name in _PASSED_THROUGH:
        value = getattr(body, name)
        if value is not None:
            setattr(s, name, value)
    if max_tokens is not None:
        s.max_tokens = max_tokens
    s.stop.extend(body.stops())
    if body.stop_token_ids:
        s.stop_token_ids.extend(body.stop_token_ids)
    for key, bias in (body.logit_bias or {}).items():
        s.logit_bias[int(key)] = bias
    if body.allowed_token_ids:
        s.allowed_token_ids.extend(body.allowed_token_ids)
    if body.bad_words:
        s.bad_words.extend(body.bad_words)
    if body.wants_logprobs:
        s.logprobs = True
        if body.num_top():
            s.top_logprobs = body.num_top()
    k = body.prompt_logprobs_k()
    if k is not None:
        s.prompt_logprobs = k
    found = body.structured_spec()
    if found is not None:
        structured_message(s.structured, found[0])
    return s


def chat_messages(body) -> pdserve_pb2.ChatMessages:
    """The gRPC chat of an OpenAI chat body (or a /tokenize one): messages and template fields.
    A message with images becomes its parts (ContentPart: text and image files, in order)."""
    chat = pdserve_pb2.ChatMessages(
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )
    for m in body.messages:
        msg = chat.messages.add(role=m.template_role())
        if m.images():  # text and images in their order; content is left empty
            for p in m.content:
                if p.type == "text":
                    msg.parts.add(text=p.text)
                elif p.image_url.link and not p.image():
                    raise ApiError(
                        400,
                        "an image link is fetched for /v1/chat/completions only: send the image "
                        "here as a base64 data URL (data:image/png;base64,...)",
                        param="messages",
                        code="invalid_value",
                    )
                else:
                    msg.parts.add(image=p.image())
        else:
            msg.content = m.text()
        if m.tool_calls:
            msg.tool_calls_json = tool_calls_json(m.tool_calls)
        if m.tool_call_id is not None:
            msg.tool_call_id = m.tool_call_id
        if m.thought() is not None:
            msg.reasoning = m.thought()
    if getattr(body, "tools", None):
        chat.tools_json = tools_json(body.tools)
    kwargs = dict(body.chat_template_kwargs or {})
    effort = getattr(body, "reasoning_effort", None)
    if effort is not None:  # vLLM passes it to the template beside the request's own kwargs
        kwargs.setdefault("reasoning_effort", effort)
    if kwargs:
        chat.chat_template_kwargs_json = json.dumps(kwargs)
    return chat
