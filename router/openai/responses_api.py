"""POST /v1/responses: OpenAI's Responses API, served as a chat completion. The body
(ResponsesRequest) is read as the chat it describes (`as_chat`: `instructions` a system message
first, `input` a text (one user message) or items: messages, `function_call` items (an
assistant's tool calls) and `function_call_output` items (tool results)), run through the chat
path (chat.py's `chat_request`, generate.py), and its answer rewritten (`Shape`) as a Response:
`output` holds a `message` item with the text (when there is any) and one `function_call` item
per tool call; a stream sends the events the openai SDK reads (response.created,
response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta, response.output_text.done, response.content_part.done,
response.function_call_arguments.delta/.done, response.output_item.done, then
response.completed, or response.incomplete when max_output_tokens cut it), each output item
finished before the next one is added (`_EventWriter`).

A Response is stored (router/openai/responses/store.py: bounded, in the router's memory) unless the
body says `store: false` or the deployment keeps none; `previous_response_id` continues a stored
one: its conversation's items come before this input (its instructions do not, as in OpenAI's API;
the input may be left out, a turn of those items alone; one still running is a 400),
and GET /v1/responses/{id}, its /input_items and DELETE read the store; `conversation` reads a
conversation of the Conversations API instead and adds this turn to it
(router/openai/conversations_api.py, `Keep`). With truncation "auto" the oldest of those items
are dropped when the prompt does not fit the context (`_fitted`). Function tools (tool_choice's
allowed_tools: only those listed) go through the chat path's tools
(protocol.py's tools section: parsed <tool_call> blocks in "auto" mode, a grammar when forced); a
reasoning model's reasoning is a `reasoning` item first in `output` (streamed as
response.reasoning_text.delta), and one sent back in `input` goes with the assistant turn after it;
`include` gives text parts' logprobs and reasoning items' encrypted_content (`seal`: the text,
opaque). A user message's input_image parts (image_url a base64 data URL or a link, as chat's
image_url parts: protocol.py's images section) become the chat's image_url parts in their order,
are stored and listed back with the input items, and count toward the store's bytes and, with the
earlier conversation's, toward a request's image bounds (`_check_images`); an image given as an
http(s) link is fetched from the hosts the deployment allows (router/openai/media.py) and kept as
the file it was (`fetched_links`); other tool types, images by file_id and files are refused with
a 400 naming the field. `background` runs a response apart from its connection (`_background`:
a task of the front's event loop, in the store's `running` until it ends; POST
/v1/responses/{id}/cancel cancels it). The routes are declared on `router`, which build_app
(router/openai/app.py) includes; the store is FrontState's (router/openai/state.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import (
    Field,
    PrivateAttr,
    StrictBool,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdserve.protos.limits import MAX_ID_CHARS, MAX_STOP_STRINGS
from pdserve.router.openai.chat import chat_request, validated_chat
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.generate import generate, generate_detached
from pdserve.router.openai.media import fetch_links
from pdserve.router.openai.protocol import (
    _LINK,
    INT64,
    MAX_ARGUMENTS_CHARS,
    MAX_DESCRIPTION_CHARS,
    MAX_LINK_CHARS,
    MAX_METADATA_ITEMS,
    MAX_TOKENS_FIELD,
    MAX_TOOLS,
    ChatCompletionRequest,
    FunctionDef,
    JsonSchemaFormat,
    Priority,
    RepetitionPenalty,
    ShortStr,
    StopString,
    Temperature,
    TokenCount,
    TopP,
    _field_names,
    _image_file,
    _name,
    _neutral_only,
    _Strict,
    check_images,
)
from pdserve.router.openai.responses.parts import shaped_events
from pdserve.router.openai.responses.store import (
    MAX_CONVERSATION_ITEMS,
    MAX_RUNNING,
    ResponseStore,
    Running,
    Stored,
)
from pdserve.router.openai.state import state_of
from pdserve.router.text import MAX_CHAT_MESSAGES

log = logging.getLogger(__name__)
router = APIRouter()

MAX_INPUT_ITEMS = MAX_CHAT_MESSAGES
_PARTS = ("input_text", "output_text", "input_image")


# ---- the request -----------------------------------------------------------------------------
class ItemTextPart(_Strict):
    """A message's text part: input_text (any role) or output_text (an assistant's, replayed)."""

    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None  # an output_text's, as the SDK replays it: ignored
    logprobs: list[Any] | None = None


class ItemImagePart(_Strict):
    """A user message's image (input_image): `image_url` a base64 data URL, decoded and bounded
    as chat's image_url parts are (protocol.py's `_image_file`), or an http(s) link, which the
    router fetches from the hosts the deployment allows before anything else reads the input
    (`fetched_links`); `detail` accepted, listed back and ignored; a `file_id` (a file uploaded
    to OpenAI) is not served."""

    type: Literal["input_image"]
    file_id: StrictStr | None = None
    image_url: StrictStr | None = Field(None, validate_default=True)
    detail: Literal["auto", "low", "high"] | None = None
    _image: bytes = PrivateAttr(b"")

    @field_validator("file_id")
    @classmethod
    def _no_files(cls, v):
        if v is not None:
            raise ValueError(
                "images by file_id are not served (this server keeps no files): send the image "
                "itself as a base64 data URL in image_url (data:image/png;base64,...)"
            )
        return v

    @field_validator("image_url")
    @classmethod
    def _data_url(cls, v, info: ValidationInfo):
        if v is None and "file_id" in info.data:  # else file_id was refused: that is the error
            raise ValueError(
                "Field required: the image as a base64 data URL (data:image/png;base64,...)"
            )
        if v is not None and not _is_link(v):
            if _LINK.match(v):
                raise ValueError(f"an image link may be at most {MAX_LINK_CHARS} characters")
            _image_file(v)  # its refusal here names the field (the part's own check cannot)
        return v

    @model_validator(mode="after")
    def _decoded(self):
        if self.image_url is not None and not _is_link(self.image_url):
            self._image = _image_file(self.image_url)
        return self

    def listed(self) -> dict:
        """The part as input_items lists it (and as it is stored)."""
        return {"type": "input_image", "image_url": self.image_url, "detail": self.detail or "auto"}


ItemPart = Annotated[ItemTextPart | ItemImagePart, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | Annotated[list[ItemPart], Field(min_length=1, max_length=1024)]
    id: ShortStr | None = None  # a replayed output item's: kept as the input item's id
    status: ShortStr | None = None

    def images(self) -> list[bytes]:
        """The image files of its input_image parts, in order (protocol.py's check_images)."""
        if isinstance(self.content, str):
            return []
        return [p._image for p in self.content if p.type == "input_image"]


CallId = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class FunctionCallItem(_Strict):
    """An assistant's call, replayed from an earlier response's output."""

    type: Literal["function_call"]
    call_id: CallId
    name: StrictStr
    arguments: Annotated[StrictStr, Field(max_length=MAX_ARGUMENTS_CHARS)]
    id: ShortStr | None = None
    status: ShortStr | None = None

    _check_name = field_validator("name")(classmethod(lambda cls, v: _name(v)))


class FunctionCallOutputItem(_Strict):
    """A tool's result for the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: CallId
    output: StrictStr
    id: ShortStr | None = None
    status: ShortStr | None = None


class ReasoningPart(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


class ReasoningItem(_Strict):
    """A reasoning model's reasoning, replayed from an earlier response's output: it reaches the
    chat template with the assistant turn that follows it (as reasoning_content)."""

    type: Literal["reasoning"]
    id: ShortStr | None = None
    summary: Annotated[list[ReasoningPart], Field(max_length=1024)] = []
    content: Annotated[list[ReasoningPart], Field(max_length=1024)] | None = None
    # include reasoning.encrypted_content's (`seal`); OpenAI's models' cannot be read here
    encrypted_content: StrictStr | None = None
    status: ShortStr | None = None

    _sealed = field_validator("encrypted_content")(
        classmethod(lambda cls, v: v if v is None else (unseal(v), v)[1])
    )

    def text(self) -> str:
        if self.encrypted_content is not None:
            return unseal(self.encrypted_content)
        return "".join(p.text for p in self.content or self.summary)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_KINDS = {"message", "function_call", "function_call_output", "reasoning"}


def _check_items(v):
    """Each item's kind, before the union reads it: a clear 400 for kinds not served."""
    if not isinstance(v, list):
        return v
    for i, item in enumerate(v):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in _ITEM_KINDS:
            raise ValueError(
                f"input[{i}]: items of type {str(kind)[:40]!r} are not supported: send messages, "
                f"function_call, function_call_output and reasoning items"
            )
        parts = item.get("content")
        if kind == "message" and isinstance(parts, list):
            _check_parts(f"input[{i}].content", parts, item.get("role"))
    return v


def _check_parts(where: str, parts: list, role) -> None:
    for part in parts:
        t = part.get("type") if isinstance(part, dict) else None
        if t not in _PARTS:
            raise ValueError(
                f"{where}: parts of type {str(t)[:40]!r} are not supported: this server reads "
                f"input_text, output_text and input_image (an image as a base64 data URL) parts"
            )
        if t == "input_image" and role != "user" and isinstance(role, str):
            raise ValueError(
                f"{where}: input_image parts are only allowed in user messages, not in "
                f"{role[:20]} messages"
            )


Includable = Literal["message.output_text.logprobs", "reasoning.encrypted_content"]
# reasoning.encrypted_content: the reasoning's text behind this prefix, base64-encoded (opaque to
# the client, as OpenAI's is, though not secret: it is the client's own model's reasoning)
SEALED = "pdserve:v1:"


def seal(text: str) -> str:
    return SEALED + base64.b64encode(text.encode()).decode()


def unseal(value: str) -> str:
    """The text of a reasoning item's encrypted_content written by `seal` (ValueError if not)."""
    if not value.startswith(SEALED):
        raise ValueError(
            "encrypted_content was not written by this server (OpenAI's models' encrypted "
            "reasoning cannot be read here): leave the reasoning item out"
        )
    try:
        return base64.b64decode(value[len(SEALED) :], validate=True).decode()
    except ValueError:
        raise ValueError("encrypted_content is not this server's: it does not decode") from None


class ConversationRef(_Strict):
    id: ShortStr


class ReasoningConfig(_Strict):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # its older name


class ResponsesTool(_Strict):
    """A function tool, in the Responses API's flat form."""

    type: Literal["function"]
    name: StrictStr
    description: Annotated[StrictStr, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    _check_name = field_validator("name")(classmethod(lambda cls, v: _name(v)))
    _check_parameters = field_validator("parameters")(
        classmethod(lambda cls, v: FunctionDef._parameters(v))
    )

    def as_chat(self) -> dict:
        function = {"name": self.name}
        for key in ("description", "parameters", "strict"):
            if getattr(self, key) is not None:
                function[key] = getattr(self, key)
        return {"type": "function", "function": function}


def _function_tools_only(v):
    if isinstance(v, list):
        for i, tool in enumerate(v):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(
                    f"tools[{i}]: only function tools are served here, not {str(kind)[:40]!r}"
                )
    return v


class NamedFunction(_Strict):
    type: Literal["function"]
    name: StrictStr


class AllowedTool(_Strict):
    """One of tool_choice's allowed_tools: a function of `tools`, by name."""

    type: Literal["function"]
    name: StrictStr


class AllowedTools(_Strict):
    """tool_choice {"type": "allowed_tools"}: the model may call only these of `tools` (the
    others are left out of its prompt), in `mode` auto (it may answer in text instead) or
    required (it calls one or more of them)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: Annotated[list[AllowedTool], Field(min_length=1, max_length=MAX_TOOLS)]

    _kinds = field_validator("tools", mode="before")(
        classmethod(lambda cls, v: _function_tools_only(v))
    )


# metadata, OpenAI's bounds: at most MAX_METADATA_ITEMS pairs, keys of at most 64 characters and
# values of at most 512 (responses' and conversations')
MetadataKey = Annotated[StrictStr, Field(max_length=64)]
MetadataValue = Annotated[StrictStr, Field(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_ITEMS)]


class TextFormat(_Strict):
    """`text.format`: text, json_object, or json_schema (flat: name, schema, description,
    strict), as chat's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _shape(self):
        if (self.type == "json_schema") != (self.name is not None and self.schema_ is not None):
            raise ValueError(
                "name and schema are required with type 'json_schema', and only with it"
            )
        return self

    def response_format(self) -> dict | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        schema = {"name": self.name, "schema": self.schema_}
        if self.description is not None:
            schema["description"] = self.description
        return {"type": "json_schema", "json_schema": schema}


class TextConfig(_Strict):
    format: TextFormat | None = None
    # accepted and echoed: no model served here has that control, so it changes nothing
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Strict):
    """POST /v1/responses."""

    model: Annotated[StrictStr, Field(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    # unset only with conversation or previous_response_id: a turn of their items so far
    # (the route's `_turn` checks it)
    input: (
        StrictStr
        | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
        | None
    ) = None
    instructions: StrictStr | None = None
    max_output_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: StrictBool = False
    # unset: stored (OpenAI's default) when the deployment keeps responses (the module's docstring)
    store: StrictBool | None = None
    previous_response_id: ShortStr | None = None
    tools: Annotated[list[ResponsesTool], Field(max_length=MAX_TOOLS)] | None = None
    # (the objects first: a 400 for a bad one names its field, tool_choice.mode say)
    tool_choice: (
        Annotated[NamedFunction | AllowedTools, Field(discriminator="type")]
        | Literal["none", "auto", "required"]
        | None
    ) = None
    text: TextConfig | None = None
    # false: at most one function call (chat's parallel_tool_calls)
    parallel_tool_calls: StrictBool | None = None
    # accepted, echoed and otherwise ignored: they change nothing about the answer (service_tier
    # is answered "default", the one tier served here, for "auto")
    metadata: Metadata | None = None
    user: ShortStr | None = None
    service_tier: ShortStr | None = None
    prompt_cache_key: ShortStr | None = None
    # the prefix cache here keeps what its own eviction keeps, however long this asks
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: ShortStr | None = None
    stream_options: dict[str, StrictBool] | None = None
    # a bound on calls to OpenAI's built-in tools (web search, ...), of which none are served:
    # echoed, and function calls are not bounded by it (as OpenAI's are not)
    max_tool_calls: Annotated[int, Field(ge=1, lt=INT64)] | None = None
    # "auto": the conversation's oldest items are dropped for the prompt to fit the context
    # (`_fitted`); "disabled" (the default): a prompt that does not fit is refused with a 400
    truncation: Literal["auto", "disabled"] | None = None
    request_id: ShortStr | None = None  # vLLM's label: the answer is unchanged
    # vLLM's sampling fields (benchmark clients send stop and ignore_eos): as in chat
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: StrictBool | None = None
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    top_k: Annotated[int, Field(ge=-1, lt=1 << 31)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_FIELD)] | None = None
    # a reasoning model's reasoning capped at this many tokens (as chat's, engine/thinking.py)
    thinking_token_budget: Annotated[int, Field(ge=0, lt=1 << 31)] | None = None
    # true: answered at once (queued), run apart from the connection, read by GET; needs store
    background: StrictBool | None = None
    # a reasoning model's: effort is the chat template's reasoning_effort (as chat's); the full
    # reasoning comes as a reasoning item's content, so there is no summary to ask for
    reasoning: ReasoningConfig | None = None
    # message.output_text.logprobs: each text part's token logprobs (with top_logprobs
    # alternatives); reasoning.encrypted_content: reasoning items carry their text as an opaque
    # string, so a client with store false (Codex's way) can send them back
    include: Annotated[list[Includable], Field(max_length=8)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # accepted only at its neutral value: prompt templates stored at OpenAI
    prompt: dict[str, Any] | None = None
    # a conversation of the Conversations API (its id, or {"id"}): its items come first, and
    # this input and the answer are added to it (router/openai/conversations_api.py)
    conversation: ShortStr | ConversationRef | None = None
    priority: Priority = 0  # as chat's (protocol.py)
    cache_salt: ShortStr | None = None  # vLLM's, as chat's: prefix-cache hits only within a salt

    _items = field_validator("input", mode="before")(classmethod(lambda cls, v: _check_items(v)))
    _tool_kinds = field_validator("tools", mode="before")(
        classmethod(lambda cls, v: _function_tools_only(v))
    )

    @field_validator("input")
    @classmethod
    def _bounded_images(cls, v):
        # a request's images (count and bytes) as chat's: those of earlier items count too (the
        # route's `_check_images`)
        if isinstance(v, list):
            check_images([item for item in v if isinstance(item, MessageItem)])
        return v

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v):
        names = [t.name for t in v or ()]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"function names must be unique; {dup[:3]} appear more than once")
        return v

    _unset = _neutral_only("prompt", message="{field} is not supported; leave it unset")

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v, info):
        tools = info.data.get("tools")
        if v is None or v == "none":
            return v
        if not tools:
            if "tools" not in info.data:  # tools itself was refused: that is the error
                return v
            raise ValueError("tool_choice needs tools: send the functions the model may call")
        names = [t.name for t in tools]
        if isinstance(v, NamedFunction) and v.name not in names:
            raise ValueError(f"function {v.name[:64]!r} is not one of the tools")
        for i, allowed in enumerate(v.tools if isinstance(v, AllowedTools) else ()):
            if allowed.name not in names:
                raise ValueError(
                    f"tools[{i}]: function {allowed.name[:64]!r} is not one of the tools: an "
                    "allowed tool must be one of those sent in tools"
                )
        return v

    @field_validator("text")
    @classmethod
    def _one_shape(cls, v, info):
        choice = info.data.get("tool_choice")
        forced = (
            choice == "required"
            or isinstance(choice, NamedFunction)
            or isinstance(choice, AllowedTools)
            and choice.mode == "required"
        )
        if forced and v is not None and v.format is not None and v.format.type != "text":
            raise ValueError(
                "a forced tool call (tool_choice) and text.format both shape the output: send "
                "one of them"
            )
        return v

    def includes(self, what: str) -> bool:
        return what in (self.include or ())

    def wants_logprobs(self) -> bool:
        """The text parts' logprobs: include's message.output_text.logprobs, or top_logprobs."""
        return self.includes("message.output_text.logprobs") or bool(self.top_logprobs)

    def as_chat(self, items: list[dict] | None = None) -> ChatCompletionRequest:
        """The chat completion this body asks for, on the conversation's `items` (None: the
        body's input alone); raises ApiError when it is not one."""
        body: dict[str, Any] = {"messages": chat_messages(self, items), "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for key, value in (
            ("model", self.model),
            ("max_completion_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("stop", self.stop),
            ("ignore_eos", self.ignore_eos),
            ("seed", self.seed),
            ("top_k", self.top_k),
            ("min_p", self.min_p),
            ("repetition_penalty", self.repetition_penalty),
            ("min_tokens", self.min_tokens),
            ("thinking_token_budget", self.thinking_token_budget),
            ("priority", self.priority or None),
            ("parallel_tool_calls", self.parallel_tool_calls),
            ("reasoning_effort", _effort(self.reasoning)),
            ("cache_salt", self.cache_salt),
            ("logprobs", self.wants_logprobs() or None),
            ("top_logprobs", self.top_logprobs if self.wants_logprobs() else None),
        ):
            if value is not None:
                body[key] = value
        if self.tools:
            choice, tools = self.tool_choice, self.tools
            if isinstance(choice, AllowedTools):  # only those the model may call
                allowed = {t.name for t in choice.tools}
                choice, tools = choice.mode, [t for t in tools if t.name in allowed]
            body["tools"] = [t.as_chat() for t in tools]
            if isinstance(choice, NamedFunction):
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            elif choice is not None:
                body["tool_choice"] = choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.response_format() is not None:
            body["response_format"] = fmt.response_format()
        return validated_chat(body)


RESPONSES_FIELDS = _field_names(ResponsesRequest, JsonSchemaFormat)


def _effort(config: ReasoningConfig | None) -> str | None:
    """Chat's reasoning_effort (low, medium, high) of the Responses API's reasoning.effort."""
    effort = config.effort if config is not None else None
    return "low" if effort == "minimal" else effort


def chat_messages(body: ResponsesRequest, items: list[dict] | None = None) -> list[dict]:
    """The chat messages of a Responses body: instructions first (as a system message), then
    the conversation's `items` (None: the body's own input_items)."""
    out: list[dict] = []
    if body.instructions is not None:
        out.append({"role": "system", "content": body.instructions})
    return out + messages_of(input_items(body) if items is None else items)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(body: ResponsesRequest) -> list[dict]:
    """The body's input as the API's items, as GET /v1/responses/{id}/input_items lists them:
    each with an id (its own when it sent one), a message's text as parts."""
    return [] if body.input is None else items_of(body.input)


def items_of(value: str | list) -> list[dict]:
    """Input (a text, or validated items) as the API's items (`input_items`)."""
    if isinstance(value, str):
        return [_item_message("user", [{"type": "input_text", "text": value}], None)]
    out = []
    for item in value:
        if isinstance(item, MessageItem):
            if isinstance(item.content, str):
                kind = "output_text" if item.role == "assistant" else "input_text"
                parts = [{"type": kind, "text": item.content}]
            else:
                parts = [
                    p.listed() if p.type == "input_image" else {"type": p.type, "text": p.text}
                    for p in item.content
                ]
            out.append(_item_message(item.role, parts, item.id))
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "function": {"name": item.name, "arguments": item.arguments},
            }
            out.append({**_function_call(call, "completed"), "id": item.id or _new_id("fc")})
        elif isinstance(item, ReasoningItem):
            out.append(_reasoning_item(item.text(), item.id))
        else:
            out.append(
                {
                    "type": "function_call_output",
                    "id": item.id or _new_id("fco"),
                    "call_id": item.call_id,
                    "output": item.output,
                    "status": "completed",
                }
            )
    return out


def _reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {
        "type": "reasoning",
        "id": item_id or _new_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _item_message(role: str, parts: list[dict], item_id: str | None) -> dict:
    for part in parts:
        if part["type"] == "output_text":
            part["annotations"] = []
    return {
        "type": "message",
        "id": item_id or _new_id("msg"),
        "role": role,
        "content": parts,
        "status": "completed",
    }


def messages_of(items: list[dict]) -> list[dict]:
    """The chat messages of a conversation's items (input items, or an answer's output items):
    an assistant's text and the function calls right after it are one assistant message, as
    chat completions write them."""
    out: list[dict] = []
    thought = ""  # a reasoning item's text, for the assistant turn that follows it
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            thought += "".join(p["text"] for p in item.get("content") or item.get("summary") or ())
            continue
        if kind == "message":
            out.append({"role": item["role"], "content": _chat_content(item["content"])})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        if thought and out[-1]["role"] == "assistant" and "reasoning" not in out[-1]:
            out[-1]["reasoning"], thought = thought, ""
    return out


def _chat_content(parts: list[dict]) -> str | list[dict]:
    """A message item's content in the chat: its text parts' text joined; with input_image parts,
    the chat's text and image_url parts in their order (adjacent text parts joined)."""
    if not any(p["type"] == "input_image" for p in parts):
        return "".join(p["text"] for p in parts)
    out: list[dict] = []
    for p in parts:
        if p["type"] == "input_image":
            url = {"url": p["image_url"], "detail": p.get("detail")}
            out.append({"type": "image_url", "image_url": url})
        elif out and out[-1]["type"] == "text":
            out[-1]["text"] += p["text"]
        else:
            out.append({"type": "text", "text": p["text"]})
    return out


def _is_link(url: str) -> bool:
    return bool(_LINK.match(url)) and len(url) <= MAX_LINK_CHARS


async def fetched_links(front, items: list[dict], param: str = "input") -> None:
    """Replaces each input_image of `items` (the request's `param`) given as a link by the file
    fetched from it (router/openai/media.py: only from the hosts the deployment allows), as a
    base64 data URL, so that a stored response, a conversation and every later turn hold the
    image itself, not a link that may change or vanish; then checks the images of `items`
    against a request's bounds (a 400 on `param`, as the body's own check would have)."""
    links = [
        (f"{param}[{i}].content[{j}]", part)
        for i, item in enumerate(items)
        if _has_image(item)
        for j, part in enumerate(item["content"])
        if part["type"] == "input_image" and _is_link(part.get("image_url") or "")
    ]
    if not links:
        return
    already = sum(  # (the data URLs' files, about)
        len(p.get("image_url") or "") * 3 // 4
        for item in items
        if _has_image(item)
        for p in item["content"]
        if p["type"] == "input_image" and not _is_link(p.get("image_url") or "")
    )
    domains = front.settings.allowed_media_domains
    files = await fetch_links([(w, p["image_url"]) for w, p in links], domains, already, param)
    await asyncio.to_thread(_as_data_urls, [part for _, part in links], files, items, param)


def _as_data_urls(parts: list[dict], files: list[bytes], items: list[dict], param: str) -> None:
    """fetched_links' part off the event loop: each of `parts` its file as a base64 data URL,
    then `items`' images checked against a request's bounds."""
    for part, data in zip(parts, files):
        encoded = base64.b64encode(data).decode("ascii")
        part["image_url"] = f"data:application/octet-stream;base64,{encoded}"
    try:
        check_images([MessageItem.model_validate(item) for item in items if _has_image(item)])
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param, code="invalid_value") from None


def _has_image(item: dict) -> bool:
    parts = item.get("content") if item["type"] == "message" else None
    return isinstance(parts, list) and any(p["type"] == "input_image" for p in parts)


def _check_images(body: ResponsesRequest, history: list[dict], new: list[dict]) -> None:
    """The images of the conversation a response runs on, the earlier items' (`history`: a
    previous response's or a conversation's) with the input's, within a request's bounds
    (protocol.py's check_images; the input's own were checked with the body, or once fetched
    from their links): a 400 naming where the earlier ones came from. Their data URLs are
    decoded again: run off the event loop."""
    if not any(_has_image(item) for item in history):
        return
    messages = [MessageItem.model_validate(item) for item in history + new if _has_image(item)]
    try:
        check_images(messages)
    except ValueError as e:
        param = "previous_response_id" if body.conversation is None else "conversation"
        raise ApiError(
            400,
            f"{param}: {e} (the earlier conversation's images and the input's together): "
            "start a new conversation, or send the images it needs as input",
            param=param,
            code="invalid_value",
        ) from None


# ---- the response ----------------------------------------------------------------------------
def _usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": details.get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": (chat_usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens", 0
            )
        },
        "total_tokens": chat_usage["total_tokens"],
    }


def _message(item_id: str, text: str, status: str, logprobs: list | None = None) -> dict:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text, logprobs)],
    }


def _text_part(text: str, logprobs: list | None = None) -> dict:
    """An output_text part; `logprobs` the chat's logprobs entries of its tokens ({"token",
    "logprob", "bytes", "top_logprobs"}: the Responses API's shape too)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _function_call(call: dict, status: str) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{call['id']}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


class Shape:
    """A chat's answer as a Response (generate.py's `shape`): `whole` for a chat completion,
    `events` for a chat's stream of chunks. With `keep`, the finished Response is stored."""

    def __init__(self, body: ResponsesRequest, model_id: str, keep: Keep | None = None):
        self.body, self.model_id, self.keep = body, model_id, keep
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def thought(self, item: dict) -> dict:
        """A reasoning item, with its text sealed in encrypted_content when the body asks."""
        if self.body.includes("reasoning.encrypted_content"):
            item["encrypted_content"] = seal(item["content"][0]["text"])
        return item

    def finished(self, response: dict) -> dict:
        """`response`, the final Response, after storing it when the body asked for that."""
        if self.keep is not None:
            self.keep.put(response)
        return response

    def response(
        self, status: str, output: list[dict], usage=None, reason: str | None = None
    ) -> dict:
        b = self.body
        choice = b.tool_choice if b.tool_choice is not None else "auto"
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        tier = b.service_tier
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": bool(b.background),
            "error": None,
            "incomplete_details": {"reason": reason} if reason else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model_id,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": b.reasoning.model_dump(exclude_none=True) if b.reasoning else None,
            "store": self.keep is not None and self.keep.response,
            "conversation": {"id": self.keep.conversation}
            if self.keep is not None and self.keep.conversation
            else None,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt
                else {"type": "text"},
                "verbosity": (b.text.verbosity if b.text is not None else None) or "medium",
            },
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "truncation": b.truncation or "disabled",
            "usage": usage,
            "user": b.user,
            "metadata": dict(b.metadata or {}),
            "max_tool_calls": b.max_tool_calls,
            "top_logprobs": b.top_logprobs or 0,
            "prompt_cache_key": b.prompt_cache_key,
            "prompt_cache_retention": b.prompt_cache_retention,
            "safety_identifier": b.safety_identifier,
            # the tier it ran on: the one served here, for "auto" (or unset)
            "service_tier": "default" if tier in (None, "auto") else tier,
        }

    def _ending(self, finish_reason: str | None) -> tuple[str, str | None]:
        if finish_reason == "length":
            return "incomplete", "max_output_tokens"
        return "completed", None

    def whole(self, chat: dict) -> dict:
        choice = chat["choices"][0]
        message = choice["message"]
        output = []
        if message.get("reasoning"):
            output.append(self.thought(_reasoning_item(message["reasoning"])))
        if message.get("content"):
            lp = (choice.get("logprobs") or {}).get("content")
            output.append(_message(f"msg_{uuid.uuid4().hex}", message["content"], "completed", lp))
        for call in message.get("tool_calls") or []:
            output.append(_function_call(call, "completed"))
        status, reason = self._ending(choice["finish_reason"])
        out = self.response(status, output, _usage(chat.get("usage")), reason)
        out["pdserve"] = chat.get("pdserve")
        return self.finished(out)

    def events(self, chunks: AsyncIterator) -> AsyncIterator[bytes]:
        return shaped_events(_EventWriter(self), chunks)


class _EventWriter:
    """The Response events of a chat's chunks, one chunk at a time. One output item is open at a
    time, as OpenAI's and vLLM's streams go: each is finished (its *.done events, then
    response.output_item.done) before the next one's response.output_item.added, so a reasoning
    item ends when the answer's text starts, and a message before the function calls after it.
    Text of a kind already finished (text after a call, say) opens an item of its own."""

    def __init__(self, shape: Shape):
        self.shape = shape
        self.seq = 0
        self.output: list[dict] = []  # the items opened so far, in their output order
        self.open: dict | None = None  # the item being written (the one not yet finished)
        self.text: list[str] = []  # the open message's or reasoning item's text so far
        self.logprobs: list[dict] = []  # the open message's logprobs entries so far
        self.pending: list[dict] = []  # those not yet on a text delta event
        self.calls: dict[int, dict] = {}  # chat tool call index -> its function_call item
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.extension: dict | None = None
        self.failed = False

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        payload = json.dumps(data, separators=(",", ":"))
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    def feed(self, chunk) -> list[bytes]:
        if chunk == "[DONE]":
            return self._done()
        if "error" in chunk:
            self.failed = True
            e = chunk["error"]
            return [self._event("error", code=e.get("code"), message=e["message"], param=None)]
        out: list[bytes] = []
        if self.seq == 0:
            start = self.shape.response("in_progress", [])
            out += [
                self._event("response.created", response=start),
                self._event("response.in_progress", response=start),
            ]
        if chunk.get("usage") is not None and not chunk.get("choices"):
            self.usage = chunk["usage"]
        if chunk.get("pdserve") is not None:
            self.extension = chunk["pdserve"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            self.pending += (choice.get("logprobs") or {}).get("content") or ()
            if delta.get("reasoning"):
                out += self._reasoning(delta["reasoning"])
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _start(self, item: dict, part: dict | None = None) -> list[bytes]:
        """Finishes the open item, then opens `item` (with its first content `part`)."""
        out = self._finish()
        self.output.append(item)
        self.open, self.text, self.logprobs = item, [], []
        index = len(self.output) - 1
        out.append(self._event("response.output_item.added", output_index=index, item=item))
        if part is not None:
            ids = dict(item_id=item["id"], output_index=index, content_index=0)
            out.append(self._event("response.content_part.added", **ids, part=part))
        return out

    def _ids(self) -> dict:
        """The open item's fields on its content's events."""
        return dict(item_id=self.open["id"], output_index=len(self.output) - 1, content_index=0)

    def _reasoning(self, piece: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "reasoning":
            item = _reasoning_item("")
            item.update(content=[], status="in_progress")
            out += self._start(item, {"type": "reasoning_text", "text": ""})
        self.text.append(piece)
        out.append(self._event("response.reasoning_text.delta", **self._ids(), delta=piece))
        return out

    def _text(self, piece: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "message":
            item = _message(f"msg_{uuid.uuid4().hex}", "", "in_progress")
            item["content"] = []
            out += self._start(item, _text_part(""))
        self.text.append(piece)
        logprobs, self.pending = self.pending, []
        self.logprobs += logprobs
        ids = self._ids()
        out.append(self._event("response.output_text.delta", **ids, delta=piece, logprobs=logprobs))
        return out

    def _call(self, call: dict) -> list[bytes]:
        """A chat tool call's delta (its first with its id and name): its function_call item
        opened then, its arguments' deltas on it."""
        out = []
        item = self.calls.get(call["index"])
        arguments = call.get("function", {}).get("arguments", "")
        if item is None:
            fn = call["function"]
            chat_call = {"id": call["id"], "function": {"name": fn["name"], "arguments": ""}}
            item = _function_call(chat_call, "in_progress")
            self.calls[call["index"]] = item
            out += self._start(item)
        if arguments:
            item["arguments"] += arguments
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.output.index(item),
                    delta=arguments,
                )
            )
        return out

    def _finish(self) -> list[bytes]:
        """The open item's done events and response.output_item.done (none when none is open)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, out = len(self.output) - 1, []
        ids = dict(item_id=item["id"], output_index=index, content_index=0)
        text = "".join(self.text)
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out.append(self._event("response.reasoning_text.done", **ids, text=text))
            out.append(self._event("response.content_part.done", **ids, part=part))
            item["content"] = [part]
            self.shape.thought(item)
        elif item["type"] == "message":
            lp, self.pending = self.logprobs + self.pending, []
            out.append(self._event("response.output_text.done", **ids, text=text, logprobs=lp))
            part = _text_part(text, lp)
            out.append(self._event("response.content_part.done", **ids, part=part))
            item["content"] = [part]
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        item["status"] = "completed"
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _done(self) -> list[bytes]:
        out = self._finish()
        status, reason = self.shape._ending(self.finish_reason)
        final = self.shape.response(status, self.output, _usage(self.usage), reason)
        final["pdserve"] = self.extension
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._event(kind, response=self.shape.finished(final)))
        return out


# ---- the routes ------------------------------------------------------------------------------
@dataclass
class Keep:
    """What a finished Response leaves in the store: itself (`response`: store not false), and
    its input and output added to a conversation (`conversation`'s id); `items` the items before
    the answer (an earlier response's or the conversation's, then the input from `first_input`)."""

    store: ResponseStore
    owner: str | None
    items: list[dict]
    first_input: int
    response: bool = True
    conversation: str | None = None

    def put(self, response: dict) -> None:
        inputs = (self.first_input, len(self.items))
        if self.response and not self.store.put(
            response, self.items + response["output"], inputs, self.owner
        ):
            # (its client has it already; a later GET or previous_response_id finds none)
            log.warning(
                "response %s is larger than the whole response store (%d bytes, "
                "router.responses_store_mb): it was not stored",
                response["id"],
                self.store.max_bytes,
            )
        if self.conversation is None or response["status"] not in ("completed", "incomplete"):
            return
        conversation = self.store.conversation(self.conversation, self.owner)
        if conversation is None:  # (deleted or evicted meanwhile: nothing to add to)
            return
        turn = self.items[self.first_input :] + response["output"]
        if not self.store.extend(self.conversation, conversation, turn):
            # past the conversation's bounds: the turn is not added, and a later response
            # that continues it is refused (conversation_items), not run without this turn
            conversation.full = True
            log.warning(
                "conversation %s is full: a response's turn was not added", self.conversation
            )


@router.post("/v1/responses")
async def responses(request: Request):
    front = state_of(request)
    body, metadata = await front.parse(request, ResponsesRequest, RESPONSES_FIELDS)
    front.check_model(body.model)
    owner = front.owner(request)
    conversation = _conversation_id(body.conversation)
    if conversation is not None:
        history = conversation_items(front.responses, conversation, owner, body)
    else:
        history = _history(front.responses, body.previous_response_id, owner)
    new = _turn(body, history)
    await fetched_links(front, new)
    items = history + new
    await asyncio.to_thread(_check_images, body, history, new)
    # (off the event loop: the chat's checks decode its images and compile its tools' schemas)
    chat = await asyncio.to_thread(body.as_chat, await _fitted(front, body, history, new))
    gen = chat_request(front, chat, param="input")
    keep = None
    stored = front.responses.enabled and body.store is not False
    if stored or conversation is not None:
        keep = Keep(front.responses, owner, items, len(history), stored, conversation)
    shape = Shape(body, body.model or front.settings.model_id, keep)  # (an adapter's name)
    if body.background:
        return _background(front, shape, gen, metadata, chat)
    return await generate(request, [gen], metadata, chat, chat=True, shape=shape)


def _turn(body: ResponsesRequest, history: list[dict]) -> list[dict]:
    """The request's own input items: none (a turn of only what came before) when it continues
    a conversation or a previous response and sends no input."""
    if body.input is None and body.conversation is None and body.previous_response_id is None:
        raise ApiError(
            400,
            "input: Field required: send the input (it may be left out only to continue a "
            "conversation or a previous_response_id with what they hold so far)",
            param="input",
            code="invalid_value",
        )
    if body.input is None and not history:
        raise ApiError(
            400,
            "input: the conversation has no items yet, so a turn without input has nothing to "
            "answer: send the input",
            param="input",
            code="invalid_value",
        )
    return input_items(body)


async def _fitted(front, body: ResponsesRequest, history: list[dict], new: list[dict]):
    """The items a response runs on: the earlier conversation's `history`, then the new input
    `new`. With truncation "auto", as OpenAI's: when that prompt does not fit the context with
    max_output_tokens, the fewest of the oldest `history` items (at `_cuts`) are dropped for it
    to fit; never the instructions nor the new input. Each try renders and counts the prompt as
    Generate does (the router's PromptEncoder, FrontState.encode), at most 2 + log2 of the cuts:
    the whole one, the new input alone, then a binary search between them. When even the new
    input alone does not fit, the whole conversation goes on to be refused as it is without
    "auto". The response's stored items stay the whole conversation's (`Keep`)."""
    limit = front.settings.max_model_len or getattr(front.encoder, "max_model_len", 0)
    if body.truncation != "auto" or not history or not limit:
        return history + new
    cuts = _cuts(history, new)
    if len(cuts) == 1 or await _fits(front, body, history + new, limit):
        return history + new
    if not await _fits(front, body, history[cuts[-1] :] + new, limit):
        return history + new
    lo, hi = 0, len(cuts) - 1  # cuts[lo] does not fit, cuts[hi] does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if await _fits(front, body, history[cuts[mid] :] + new, limit):
            hi = mid
        else:
            lo = mid
    return history[cuts[hi] :] + new


def _cuts(history: list[dict], new: list[dict]) -> list[int]:
    """How many of the oldest `history` items truncation may drop, ascending from 0: the kept
    items start with no tool output whose call was dropped, and not within a turn's parallel
    calls; the last drops the whole history (the new input alone; when there is no new input,
    all but the last item)."""
    items = history + new
    out = [0]
    for k in range(1, len(history)):
        kind, before = items[k]["type"], items[k - 1]["type"]
        if kind != "function_call_output" and (kind, before) != ("function_call",) * 2:
            out.append(k)
    last = len(history) if new else len(history) - 1
    if last > out[-1]:
        out.append(last)
    return out


async def _fits(front, body: ResponsesRequest, items: list[dict], limit: int) -> bool:
    """Whether the prompt of `items` leaves room in the context (`limit` tokens) for the answer:
    max_output_tokens (min_tokens) beside it, at least one token."""
    if len(chat_messages(body, items)) > MAX_CHAT_MESSAGES:
        return False
    chat = await asyncio.to_thread(body.as_chat, items)
    try:
        gen = chat_request(front, chat, param="input")
    except ApiError as e:  # its bytes are more than the context can hold
        if e.code == "context_length_exceeded":
            return False
        raise
    ids = await front.encode("input", front.encoder.tokenize_chat, gen.chat)
    return len(ids) + max(1, body.max_output_tokens or 0, body.min_tokens or 0) <= limit


def _background(front, shape: Shape, gen, metadata, chat: ChatCompletionRequest) -> dict:
    """Starts a background response: stored as queued now, run by a task of the front's event
    loop apart from the client's connection, stored again as it ends (completed, incomplete,
    failed or cancelled)."""
    store, keep = front.responses, shape.keep
    if keep is None or not keep.response:
        raise ApiError(
            400,
            "background needs the response stored, to be read back by GET /v1/responses/{id}: "
            "leave store unset"
            + ("" if store.enabled else " (this deployment stores none: responses_store_mb 0)"),
            param="background",
        )
    if shape.body.stream:
        raise ApiError(
            400,
            "a background response is not streamed here: send stream false and poll GET "
            "/v1/responses/{id}",
            param="stream",
        )
    if len(store.running) >= MAX_RUNNING:
        raise ApiError(
            429,
            f"{MAX_RUNNING} background responses are in progress, the most at once: retry later",
            "rate_limit_error",
            code="rate_limit_exceeded",
        )
    queued = shape.response("queued", [])
    running = Running(keep.owner, queued, keep.items, keep.first_input)
    store.running[shape.id] = running
    running.task = asyncio.create_task(_run_background(front, shape, running, gen, metadata, chat))
    return queued


async def _run_background(front, shape: Shape, running: Running, gen, metadata, chat) -> None:
    running.response = shape.response("in_progress", [])
    try:
        shape.whole(await generate_detached(front, [gen], metadata, chat, chat=True))
    except asyncio.CancelledError:
        shape.finished(shape.response("cancelled", []))
        raise
    except Exception as e:
        if not isinstance(e, ApiError):
            log.exception("background response %s failed", shape.id)
            e = ApiError(500, f"the response failed: {type(e).__name__}", "server_error")
        failed = shape.response("failed", [])
        failed["error"] = {"code": e.code or e.type, "message": e.message}
        shape.finished(failed)
    finally:
        front.responses.running.pop(shape.id, None)


def _conversation_id(ref) -> str | None:
    return ref.id if isinstance(ref, ConversationRef) else ref


def conversation_items(store: ResponseStore, key: str, owner: str | None, body) -> list[dict]:
    """The items of the conversation `key` that a response continues (its `conversation`)."""
    if body.previous_response_id is not None:
        raise ApiError(
            400,
            "conversation and previous_response_id both name what came before: send one of them",
            param="conversation",
        )
    found = store.conversation(key, owner)
    if found is None:
        raise conversation_not_found(key, param="conversation")
    if found.full:
        raise ApiError(
            400,
            f"conversation {key[:200]!r} is full: an earlier response's turn did not fit its "
            f"bounds ({MAX_CONVERSATION_ITEMS} items, {store.max_conversation_bytes} bytes) and "
            "was not added to it; start a new conversation",
            param="conversation",
            code="conversation_too_large",
        )
    return found.dicts()


def conversation_not_found(key: str, param: str | None = None) -> ApiError:
    return ApiError(
        404,
        f"Conversation with id {key[:200]!r} not found (never created, deleted, or evicted from "
        "the router's store)",
        param=param,
        code="not_found",
    )


def _history(store: ResponseStore, response_id: str | None, owner: str | None) -> list[dict]:
    """The items of the conversation that `response_id` (previous_response_id) ended."""
    if response_id is None:
        return []
    if not store.enabled:
        raise ApiError(
            400,
            "responses are not stored on this deployment (router.responses_store_mb is 0), so "
            "there is no earlier response to continue: send the whole conversation as input "
            "items (messages, function_call and function_call_output)",
            param="previous_response_id",
        )
    stored = store.get(response_id, owner)
    if stored is None:
        raise ApiError(
            400,
            f"Previous response with id {response_id[:200]!r} not found: it was never stored, "
            "was deleted, or was evicted from the router's store (router.responses_store_mb)",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if isinstance(stored, Running):  # a background one: its output is not known yet
        raise ApiError(
            400,
            f"Previous response with id {response_id[:200]!r} is still in progress: wait for it "
            "to end (GET /v1/responses/{id} until its status is no longer queued or "
            "in_progress) or cancel it (POST /v1/responses/{id}/cancel), then continue it",
            param="previous_response_id",
            code="response_in_progress",
        )
    return stored.items()


def _stored(request: Request, response_id: str) -> Stored | Running:
    front = state_of(request)
    front.authorize(request)
    stored = front.responses.get(response_id, front.owner(request))
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"Response with id {response_id[:200]!r} not found (never stored, deleted, or evicted "
        "from the router's store)",
        code="not_found",
    )


@router.get("/v1/responses/{response_id}")
async def retrieve(request: Request, response_id: str):
    stored = _stored(request, response_id)
    if request.query_params.get("stream", "false") != "false":
        raise ApiError(
            400, "a stored response is answered whole here: leave stream unset", param="stream"
        )
    return Response(stored.response_json, media_type="application/json")


@router.delete("/v1/responses/{response_id}")
async def delete(request: Request, response_id: str):
    if isinstance(_stored(request, response_id), Running):
        raise ApiError(
            400,
            "the response is in progress: cancel it first (POST /v1/responses/{id}/cancel)",
            code="response_in_progress",
        )
    front = state_of(request)
    front.responses.delete(response_id, front.owner(request))
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(request: Request, response_id: str):
    """Cancels a background response in progress (its call aborted on both pools) and answers
    it as it is then; one that already ended is answered as it ended."""
    found = _stored(request, response_id)
    if isinstance(found, Running):
        found.task.cancel()
        await asyncio.wait([found.task])
        found = _stored(request, response_id)
    if not json.loads(found.response_json).get("background"):
        raise ApiError(400, "only a background response can be cancelled", code="not_background")
    return Response(found.response_json, media_type="application/json")


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str):
    """The request's own input items, a page at a time (OpenAI's list: limit 1-100, order,
    after an item's id)."""
    return page(_stored(request, response_id).input_items(), request.query_params)


def page(items: list[dict], query) -> dict:
    """A page of `items` as OpenAI's lists give them: `limit` (1-100, default 20), `order`
    (asc, or desc: the default, newest first), `after` an item's id."""
    return page_of([item["id"] for item in items], items.__getitem__, query)


def page_of(ids: list, item, query, most: int = 100, default: int = 20) -> dict:
    """page() of the items whose ids are `ids` (oldest first), `item(i)` giving the i-th: only
    the page's items are read (a conversation's are decoded one at a time: router/openai/
    responses/store.py). `limit` is 1 to `most`, `default` unset (the Files API's list: 10,000
    both)."""
    limit = query.get("limit", str(default))
    # (isascii: str.isdigit is also true of digits int() refuses, such as "²")
    if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= most):
        raise ApiError(400, f"limit must be a whole number from 1 to {most}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be 'asc' or 'desc'", param="order")
    at = list(range(len(ids)))
    at = at[::-1] if order == "desc" else at
    after = query.get("after")
    if after is not None:
        listed = [ids[i] for i in at]
        if after not in listed:
            raise ApiError(
                400, "after must be the id of one of the items listed here", param="after"
            )
        at = at[listed.index(after) + 1 :]
    chosen = at[: int(limit)]
    return {
        "object": "list",
        "data": [item(i) for i in chosen],
        "first_id": ids[chosen[0]] if chosen else None,
        "last_id": ids[chosen[-1]] if chosen else None,
        "has_more": len(at) > len(chosen),
    }
