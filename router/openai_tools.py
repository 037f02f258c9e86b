"""Tool calling in chat completions (router/openai_schema.py's ChatCompletionRequest): OpenAI's
`tools`, `tool_choice`, assistant messages' `tool_calls` and "tool" messages, checked here, and
the grammar of a forced call.

    tools        [{"type": "function", "function": {"name", "description"?, "parameters"?,
                 "strict"?}}], at most MAX_TOOLS, names unique (^[a-zA-Z0-9_-]{1,64}$),
                 parameters a JSON schema object (unset: no parameters)
    tool_choice  "none" | "auto" (the default with tools) | "required" |
                 {"type": "function", "function": {"name": one of the tools}}; needs tools

The chat template renders the tools (router/chat_tools.py). "auto" samples freely and
router/tool_parser.py parses <tool_call>{...}</tool_call> blocks out of the output; "none" parses
nothing. "required" and a named function force one call: the output is constrained (the same
grammar path as response_format: every token masked on both workers) to the JSON object
{"name": <a tool's name>, "arguments": <that tool's parameters>} (an anyOf over the tools for
"required"), so its arguments always validate against the schema. Each parameters schema is
compiled by llguidance when the request is read (the workers' library; a schema it cannot
compile is a 400 naming tools[i].function.parameters).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from pdserve.router.openai_structured import _schema

MAX_TOOLS = 128
MAX_TOOLS_CHARS = 512 * 1024  # all the tools, as compact JSON
MAX_DESCRIPTION_CHARS = 16 * 1024
MAX_ARGUMENTS_CHARS = 256 * 1024
_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _name(v: str) -> str:
    if not _NAME.match(v):
        raise ValueError("a function name is 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
    return v


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
        error = _compile_error(json.dumps(v, sort_keys=True, separators=(",", ":")))
        if error:
            raise ValueError(f"not a JSON schema the grammar library can compile: {error}")
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
    return v


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
    """What a chat message adds for tools (router/openai_schema.py's ChatMessage)."""

    model_config = _CONFIG
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
