"""The structured-output fields of the HTTP front's bodies (router/openai_schema.py's _Sampling
inherits StructuredFields), for chat and completions alike:

    response_format     OpenAI's: {"type": "text"} | {"type": "json_object"} |
                        {"type": "json_schema", "json_schema": {"name", "schema", "strict", ...}}
    structured_outputs  vLLM's: {"json": schema} | {"regex": str} | {"choice": [str]} |
                        {"json_object": true}
    guided_json, guided_regex, guided_choice   vLLM's older names for the same

At most one of them per request. Each is checked here (types, sizes: protos/limits.py's bounds)
and becomes the gRPC SamplingParams.structured (`structured_spec`); whether a schema or regex
compiles is the workers' check (engine/structured.py), whose INVALID_ARGUMENT `name_field`
rewrites to the field the client sent. Pure pydantic: the schemas are compiled by the workers
(tools' parameter schemas alone are checked in the router, router/openai_tools.py).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    field_validator,
    model_validator,
)

from pdserve.protos.limits import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_CHARS,
)

_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)
Regex = Annotated[StrictStr, Field(min_length=1, max_length=MAX_REGEX_CHARS)]
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
    grammar: StrictStr | None = None
    # vLLM's switches that change nothing here: one backend, never free whitespace
    disable_fallback: StrictBool | None = None
    disable_any_whitespace: StrictBool | None = None
    disable_additional_properties: StrictBool | None = None

    _check_json = field_validator("json_")(
        classmethod(lambda cls, v: v if v is None else _schema(v))
    )

    @field_validator("grammar")
    @classmethod
    def _no_grammar(cls, v):
        if v is not None:
            raise ValueError("grammar (EBNF/Lark) is not supported: use json, regex or choice")
        return v

    @model_validator(mode="after")
    def _one(self):
        given = [k for k in ("json_", "regex", "choice") if getattr(self, k) is not None] + (
            ["json_object"] if self.json_object else []
        )
        if len(given) != 1:
            raise ValueError(
                "set exactly one of json, regex, choice, json_object; got "
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

    _check_guided_json = field_validator("guided_json")(
        classmethod(lambda cls, v: v if v is None else _schema(v))
    )

    @model_validator(mode="after")
    def _at_most_one(self):
        given = [
            k
            for k in ("structured_outputs", "guided_json", "guided_regex", "guided_choice")
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
            if so.json_ is not None:
                return {"json_schema": _schema(so.json_)}, "structured_outputs.json"
            if so.regex is not None:
                return {"regex": so.regex}, "structured_outputs.regex"
            if so.choice is not None:
                return {"choice": list(so.choice)}, "structured_outputs.choice"
            return {"json_object": True}, "structured_outputs.json_object"
        if self.guided_json is not None:
            return {"json_schema": _schema(self.guided_json)}, "guided_json"
        if self.guided_regex is not None:
            return {"regex": self.guided_regex}, "guided_regex"
        if self.guided_choice is not None:
            return {"choice": list(self.guided_choice)}, "guided_choice"
        return None


_WORKER_FIELD = re.compile(r"^(?:sampling: )?(?:sampling\.)?structured\.\w+:?\s*")


def name_field(error, body) -> None:
    """A workers' refusal of the structured spec (an ApiError whose message starts "sampling:
    structured.<kind>") renamed in place to the field the client sent, as `param` and in the
    message; any other error is left as it is."""
    found = body.structured_spec() if hasattr(body, "structured_spec") else None
    if found is None or error.status != 400 or not _WORKER_FIELD.match(error.message):
        return
    param = found[1]
    error.message = f"{param}: {_WORKER_FIELD.sub('', error.message, count=1)}"
    error.param = param
