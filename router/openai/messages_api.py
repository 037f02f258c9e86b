"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, served as a chat
completion (as /v1/responses is), so Anthropic's SDKs and the tools built on them (Claude Code
among them: ANTHROPIC_BASE_URL) run on a pdserve deployment.

A body (MessagesRequest) is read as the chat it describes (`as_chat`): `system` a system message
first; each message's text blocks its text; an assistant's tool_use blocks its tool calls (their
`input` as the call's JSON arguments); a user's tool_result blocks one tool message each (with
is_error the text says so), before its text; an assistant's thinking blocks its reasoning (the chat
template's reasoning_content); consecutive messages of one role joined, as Anthropic joins them. A
conversation that ends with the assistant's text is continued from it (Anthropic's prefill:
continue_final_message). stop_sequences, temperature, top_p, top_k, tools (custom tools: name,
description, input_schema), tool_choice (auto, any, tool, none) and output_config.format (a JSON
schema) become the chat's fields. The chat runs the chat path (chat.py, generate.py), and its answer
is rewritten (`Shape`) as a Message: a reasoning model's thinking block (with thinking.display
"omitted", its text left out), a text block, one tool_use block per call (a forced call that
max_tokens cut off too, its input {} where it does not parse), stop_reason (end_turn,
max_tokens, stop_sequence with the sequence that matched, tool_use, or
model_context_window_exceeded when the context, not max_tokens, ended it: max_tokens is
a cap, as Anthropic reads it, GenerateRequest.max_tokens_up_to_context) and Anthropic's usage
(input_tokens are the prompt's uncached tokens, cache_read_input_tokens the cached ones). A stream
sends Anthropic's events: message_start (its usage: what the first chunk knows), one ping,
content_block_start/_delta/_stop per block, message_delta, message_stop; a failure, an `error`
event. Errors are Anthropic's error object (router/openai/errors.py) with the same HTTP statuses as
the OpenAI paths; a prompt the context cannot hold is worded as Anthropic words it ("prompt is too
long: N tokens > M maximum"). A user's image blocks with a base64 source become the chat's
image_url parts (a data URL of media_type and data; a url source its link, fetched as a chat's
links are: router/openai/media.py), in their order among its text blocks, decoded
and bounded as chat's images are (protocol.py's images section); an image in a tool_result's
content, documents, server
tools, thinking enabled for a model without a thinking mode and max_tokens 0 are refused with a 400
naming the field; thinking enabled or disabled is the template's enable_thinking, an enabled
one's budget_tokens the reasoning's cap (thinking_token_budget). The routes are
declared on `router`, which build_app (router/openai/app.py) includes; they keep no state of their
own.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field, PrivateAttr, StrictBool, StrictStr, field_validator, model_validator

from pdserve.protos.limits import MAX_ID_CHARS, MAX_STOP_STRINGS
from pdserve.router.openai.chat import chat_request, validated_chat
from pdserve.router.openai.errors import ApiError, anthropic_type, status_of
from pdserve.router.openai.generate import generate, request_id_of
from pdserve.router.openai.media import fetch_images
from pdserve.router.openai.protocol import (
    _LINK,
    MAX_DESCRIPTION_CHARS,
    MAX_LINK_CHARS,
    MAX_TOOLS,
    ChatCompletionRequest,
    FunctionDef,
    ShortStr,
    StopString,
    TopP,
    _field_names,
    _image_file,
    _name,
    _Strict,
    chat_messages,
    check_images,
)
from pdserve.router.openai.responses import tool_calls
from pdserve.router.openai.responses.parts import shaped_events
from pdserve.router.openai.state import state_of
from pdserve.router.text import MAX_CHAT_MESSAGES

router = APIRouter()

MAX_BLOCKS = 1024  # content blocks in one message
_BLOCK_KINDS = {"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"}
# the blocks each role's message may hold
_ALLOWED = {
    "user": {"text", "image", "tool_result"},
    "assistant": _BLOCK_KINDS - {"image", "tool_result"},
}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


# ---- the request -----------------------------------------------------------------------------
class CacheControl(_Strict):
    """Anthropic's prompt-caching mark: accepted and not needed (every prompt's full blocks are
    cached here; `cache_read_input_tokens` says how many were read)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # a replayed answer's (always null here): ignored


CallId = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class ToolUseBlock(_Strict):
    """An assistant's tool call, replayed."""

    type: Literal["tool_use"]
    id: CallId
    name: StrictStr
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None  # who made the call, as Anthropic replays it: ignored
    # the SDK's model_dump() of a block carries it (null): accepted and ignored
    toolset_name: StrictStr | None = None

    _check_name = field_validator("name")(classmethod(lambda cls, v: _name(v)))


class ToolResultBlock(_Strict):
    """A tool's result for the call `tool_use_id`: text, or text blocks."""

    type: Literal["tool_result"]
    tool_use_id: CallId
    content: StrictStr | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None
    toolset_name: StrictStr | None = None  # as ToolUseBlock's: accepted and ignored

    def text(self) -> str:
        if self.content is None:
            body = ""
        elif isinstance(self.content, str):
            body = self.content
        else:
            body = "\n".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


class ImageSource(_Strict):
    """An image block's source: base64 (its media_type and data), or a url, an http(s) link
    that the router fetches from the hosts the deployment allows, as a chat's image links
    (router/openai/media.py)."""

    type: Literal["base64", "url"]
    media_type: Literal["image/png", "image/jpeg", "image/gif", "image/webp"] | None = None
    data: StrictStr | None = None
    url: StrictStr | None = None

    @field_validator("data")
    @classmethod
    def _decodes(cls, v):
        if v is not None:
            _image_file(f"data:;base64,{v}")  # strict base64, bounded as chat's image files
        return v

    @model_validator(mode="after")
    def _complete(self):
        if self.type == "base64" and (
            self.media_type is None or self.data is None or self.url is not None
        ):
            raise ValueError("a base64 source needs its media_type and data, and no url")
        if self.type == "url" and (self.media_type is not None or self.data is not None):
            raise ValueError("a url source holds its url alone: no media_type or data")
        if self.type == "url" and (
            self.url is None or not _LINK.match(self.url) or len(self.url) > MAX_LINK_CHARS
        ):
            raise ValueError(
                f"a url source needs its url, an http(s) link of at most {MAX_LINK_CHARS} "
                f"characters"
            )
        return self

    def chat_url(self) -> str:
        """The image as the chat's image_url takes it: a base64 data URL, or the link."""
        if self.type == "url":
            return self.url
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(_Strict):
    """A user's image: its file decoded and bounded as chat's image_url parts are (protocol.py's
    `_image_file`); it reaches the chat as an image_url part (`chat_messages_of`)."""

    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None
    _image: bytes = PrivateAttr(b"")

    @model_validator(mode="after")
    def _decoded(self):
        if self.source.type == "base64":  # (a link's file is the chat's, once fetched)
            self._image = _image_file(self.source.chat_url())
        return self


class ThinkingBlock(_Strict):
    """An earlier turn's thinking: its text reaches the chat template as the assistant turn's
    reasoning_content (a reasoning model's template decides which turns show it, as Anthropic
    keeps only the latest turn's); redacted thinking (encrypted) is dropped."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: StrictStr | None = None
    signature: StrictStr | None = None
    data: StrictStr | None = None


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: StrictStr | Annotated[list[Block], Field(max_length=MAX_BLOCKS)]

    def blocks(self) -> list:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)

    def images(self) -> list[bytes]:
        """The image files of its image blocks, in order (protocol.py's check_images)."""
        return [b._image for b in self.blocks() if isinstance(b, ImageBlock)]


def _check_blocks(v):
    """Each block's kind, before the union reads it: a clear 400 for kinds not served (in a
    tool_result's content too: a tool's result is read as text)."""
    if not isinstance(v, list):
        return v
    for i, message in enumerate(v):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        role = message.get("role")
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in _BLOCK_KINDS:
                raise ValueError(_unserved(f"messages[{i}].content[{j}]", kind))
            if kind not in _ALLOWED.get(role, _BLOCK_KINDS):
                raise ValueError(
                    f"messages[{i}].content[{j}]: a {role!s:.20} message cannot hold a {kind} block"
                )
            if kind == "image":
                _check_source(f"messages[{i}].content[{j}].source", block.get("source"))
            result = block.get("content") if kind == "tool_result" else None
            for k, part in enumerate(result if isinstance(result, list) else ()):
                part_kind = part.get("type") if isinstance(part, dict) else None
                if part_kind != "text":
                    where = f"messages[{i}].content[{j}].content[{k}]"
                    raise ValueError(_unserved(where, part_kind, in_result=True))
    return v


def _unserved(where: str, kind, in_result: bool = False) -> str:
    """The refusal of a block of a kind not served (a document, a server tool's; in a
    tool_result's content, anything but text)."""
    if in_result:
        inside = " in a tool_result's content"
        fix = "this model reads text (send the tool's result as text)"
    else:
        inside, fix = "", "this server reads text, image (base64), tool_use, tool_result blocks"
    return f"{where}: blocks of type {str(kind)[:40]!r} are not supported{inside}: {fix}"


def _check_source(where: str, source) -> None:
    """An image block's source is base64 or a url (their fields are its model's checks)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind not in ("base64", "url"):
        got = f", not of type {kind[:40]!r}" if isinstance(kind, str) else ""
        raise ValueError(
            f"{where}: blocks of type 'image' are served with a base64 source ({{'type': "
            f"'base64', 'media_type', 'data'}}) or a url source ({{'type': 'url', 'url'}}{got})"
        )


class CustomTool(_Strict):
    """A client tool: its name, description and the JSON schema of its input."""

    name: StrictStr
    input_schema: dict[str, Any]
    description: Annotated[StrictStr, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: StrictBool | None = None  # a forced call always follows the schema here

    _check_name = field_validator("name")(classmethod(lambda cls, v: _name(v)))
    _check_schema = field_validator("input_schema")(
        classmethod(lambda cls, v: FunctionDef._parameters(v))
    )

    def as_chat(self) -> dict:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


def _custom_tools_only(v):
    if isinstance(v, list):
        for i, tool in enumerate(v):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(
                    f"tools[{i}]: only custom tools (name, input_schema) are served here, not "
                    f"{str(kind)[:40]!r}"
                )
    return v


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    # at most one tool use (chat's parallel_tool_calls=false: a later call is dropped)
    disable_parallel_tool_use: StrictBool | None = None

    def as_chat(self):
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0, lt=1 << 31)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # ignored: no thinking


class Metadata(_Strict):
    user_id: ShortStr | None = None


class Conversation(_Strict):
    """What /v1/messages and /v1/messages/count_tokens share: the conversation and its tools."""

    model: Annotated[StrictStr, Field(min_length=1, max_length=MAX_ID_CHARS)]
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)]
    system: StrictStr | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    tools: Annotated[list[CustomTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # accepted and ignored: they change nothing about the answer
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None

    _blocks = field_validator("messages", mode="before")(
        classmethod(lambda cls, v: _check_blocks(v))
    )
    # a request's images (count and bytes), bounded as chat's
    _images = field_validator("messages")(classmethod(lambda cls, v: check_images(v)))
    _tool_kinds = field_validator("tools", mode="before")(
        classmethod(lambda cls, v: _custom_tools_only(v))
    )

    @field_validator("messages")
    @classmethod
    def _prefill_is_text(cls, v):
        last = v[-1]
        if last.role == "assistant" and any(isinstance(b, ToolUseBlock) for b in last.blocks()):
            raise ValueError(
                "the last message is the assistant's tool use: send the tools' results "
                "(tool_result blocks) in a user message after it"
            )
        return v

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v):
        names = [t.name for t in v or ()]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"tool names must be unique; {dup[:3]} appear more than once")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v, info):
        if v is None or v.type == "none":
            return v
        tools = info.data.get("tools")
        if not tools:
            if "tools" not in info.data:  # tools itself was refused: that is the error
                return v
            raise ValueError("tool_choice needs tools: send the tools the model may use")
        if v.type == "tool" and v.name not in [t.name for t in tools]:
            raise ValueError(f"tool {str(v.name)[:64]!r} is not one of the tools")
        if v.type != "tool" and v.name is not None:
            raise ValueError("name is set only with type 'tool'")
        return v

    @field_validator("output_config")
    @classmethod
    def _one_shape(cls, v, info):
        choice = info.data.get("tool_choice")
        if v is not None and v.format is not None and choice and choice.type in ("any", "tool"):
            raise ValueError(
                "a forced tool use (tool_choice) and output_config.format both shape the "
                "output: send one of them"
            )
        return v

    def prefill(self) -> bool:
        """Whether the answer continues the last message (the assistant's text)."""
        return self.messages[-1].role == "assistant"

    def chat_fields(self) -> dict:
        """The chat completion's fields of the conversation: messages, tools, output format."""
        body: dict[str, Any] = {"messages": chat_messages_of(self)}
        if self.prefill():
            body["add_generation_prompt"] = False
            body["continue_final_message"] = True
        if self.tools:
            body["tools"] = [t.as_chat() for t in self.tools]
            if self.tool_choice is not None:
                body["tool_choice"] = self.tool_choice.as_chat()
                if self.tool_choice.disable_parallel_tool_use:
                    body["parallel_tool_calls"] = False
        if self.thinking is not None and self.thinking.type != "adaptive":
            # the chat template's switch (Qwen3's, SmolLM3's); an enabled one's budget_tokens is
            # the reasoning's cap (engine/thinking.py)
            enabled = self.thinking.type == "enabled"
            body["chat_template_kwargs"] = {"enable_thinking": enabled}
            if enabled and self.thinking.budget_tokens is not None:
                body["thinking_token_budget"] = self.thinking.budget_tokens
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt.schema_},
            }
        return body


class MessagesRequest(Conversation):
    """POST /v1/messages."""

    max_tokens: Annotated[int, Field(ge=0, le=(1 << 31) - 1)]
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: StrictBool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=0, lt=1 << 31)] | None = None
    # accepted and ignored
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: ShortStr | None = None

    @field_validator("max_tokens")
    @classmethod
    def _some_tokens(cls, v):
        if v == 0:
            raise ValueError(
                "max_tokens=0 (warming the prompt cache without an answer) is not served: "
                "send at least 1 (every prompt's blocks are cached anyway)"
            )
        return v

    def as_chat(self, max_model_len: int | None = None) -> ChatCompletionRequest:
        """The chat completion this body asks for (raises ApiError when it is not one); its
        max_tokens at most `max_model_len` (the route sends it as a cap: `messages`)."""
        body = self.chat_fields()
        most = min(self.max_tokens, max_model_len) if max_model_len else self.max_tokens
        body.update(stream=self.stream, max_completion_tokens=most)
        if self.stream:  # the prompt's tokens on the first chunk: message_start says them
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        for key, value in (
            ("model", self.model),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("top_k", self.top_k or None),
            ("stop", self.stop_sequences),
        ):
            if value is not None:
                body[key] = value
        return validated_chat(body)


class CountTokensRequest(Conversation):
    """POST /v1/messages/count_tokens."""

    def as_chat(self) -> ChatCompletionRequest:
        return validated_chat({"model": self.model, **self.chat_fields()})


MESSAGES_FIELDS = _field_names(MessagesRequest)


def chat_messages_of(body: Conversation) -> list[dict]:
    """The chat messages of a conversation (the module's docstring says how)."""
    out: list[dict] = []
    if body.system is not None:
        system = body.system
        text = system if isinstance(system, str) else "\n".join(b.text for b in system)
        out.append({"role": "system", "content": text})
    for m in body.messages:
        texts = [b.text for b in m.blocks() if isinstance(b, TextBlock)]
        if m.role == "user":
            for b in m.blocks():
                if isinstance(b, ToolResultBlock):
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
            results = any(isinstance(b, ToolResultBlock) for b in m.blocks())
            if texts or m.images() or not results:
                _add(out, {"role": "user", "content": _user_content(m.blocks())})
            continue
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
            }
            for b in m.blocks()
            if isinstance(b, ToolUseBlock)
        ]
        text = "\n".join(texts) if texts or not calls else None
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        thought = "".join(
            b.thinking or ""
            for b in m.blocks()
            if isinstance(b, ThinkingBlock) and b.type == "thinking"
        )
        if thought:
            message["reasoning"] = thought
        _add(out, message)
    return out


def _user_content(blocks: list) -> str | list[dict]:
    """A user message's text blocks' text, one per line; with image blocks, the chat's text and
    image_url parts (each image's data URL) in the blocks' order."""
    if not any(isinstance(b, ImageBlock) for b in blocks):
        return "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
    return [
        {"type": "text", "text": b.text}
        if isinstance(b, TextBlock)
        else {"type": "image_url", "image_url": {"url": b.source.chat_url()}}
        for b in blocks
        if isinstance(b, (TextBlock, ImageBlock))
    ]


def _parts(content: str | list[dict] | None) -> list[dict]:
    """A chat message's content as its parts (text: one part, none when empty)."""
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []


def _add(out: list[dict], message: dict) -> None:
    """Appends `message`, joined to the one before when both are the same role's plain turn."""
    last = out[-1] if out else None
    if last is None or last["role"] != message["role"] or message["role"] not in _JOINED:
        out.append(message)
        return
    if last.get("tool_calls"):  # an assistant's calls end its turn's text
        out.append(message)
        return
    if isinstance(last["content"], list) or isinstance(message["content"], list):
        # a user's turn with images: the parts of both, in order (text parts read one per line)
        last["content"] = _parts(last["content"]) + _parts(message["content"])
    else:
        last["content"] = "\n".join(t for t in (last["content"], message["content"]) if t)
    if message.get("reasoning"):
        last["reasoning"] = last.get("reasoning", "") + message["reasoning"]
    if message.get("tool_calls"):
        last["tool_calls"] = message["tool_calls"]


_JOINED = ("user", "assistant")


# ---- the response ----------------------------------------------------------------------------
def _usage(chat_usage: dict | None) -> dict:
    """Anthropic's usage of a chat's: input_tokens are the prompt's tokens read uncached."""
    chat_usage = chat_usage or {}
    prompt = chat_usage.get("prompt_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": prompt - cached,
        "output_tokens": chat_usage.get("completion_tokens", 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _usage_at_start(chat_usage: dict | None) -> dict:
    """message_start's usage, from the first chunk's usage so far: as the final usage splits the
    prompt's tokens when the chunk says how many were cached (prompt_tokens_details), else the
    prompt's count as input_tokens and cache_read_input_tokens null, not known yet (the router
    tells it with the answer's end, Finish.usage): message_delta's usage is the final one."""
    usage = _usage(chat_usage)
    if "prompt_tokens_details" not in (chat_usage or {}):
        usage["cache_read_input_tokens"] = None
    return usage


def _thinking(text: str) -> dict:
    """A reasoning model's reasoning as a thinking block (no signature: nothing to verify)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use(call: dict) -> dict:
    """A chat tool call as a tool_use block: its arguments, a JSON object (tool_calls.py), are
    the input; a call cut off (max_tokens) has arguments that may not parse: input {}."""
    fn = call["function"]
    try:
        given = json.loads(fn["arguments"] or "{}")
    except ValueError:
        given = None
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": fn["name"],
        "input": given if isinstance(given, dict) else {},
    }


class Shape:
    """A chat's answer as a Message (generate.py's `shape`): `whole` for a chat completion,
    `events` for a chat's stream of chunks. Its id is `msg_<public_id>`, the request's id
    (generate.py's RequestId: the client's X-Request-Id, else a new one)."""

    def __init__(self, body: MessagesRequest, model_id: str, public_id: str | None = None):
        self.body, self.model_id = body, model_id
        self.id = f"msg_{public_id or uuid.uuid4().hex}"
        # thinking.display "omitted": thinking blocks without their text (Anthropic's)
        self.omitted = body.thinking is not None and body.thinking.display == "omitted"

    def cut_call(self, finish_reason: str | None, other_blocks: bool) -> dict | None:
        """The tool_use block of a call forced by name (tool_choice "tool") that max_tokens cut
        off before the chat could name it (its name comes after its arguments: tool_calls.py),
        input {}; None when the chat gave no such cut, or when the answer holds other blocks (a
        reasoning model's thinking: it may have been cut off there, before the call began)."""
        choice = self.body.tool_choice
        if finish_reason != "length" or other_blocks or choice is None or choice.type != "tool":
            return None
        call = {"id": tool_calls.call_id(), "function": {"name": choice.name, "arguments": ""}}
        return _tool_use(call)

    def message(self, content: list[dict], usage: dict, stop: tuple) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_id,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }

    def stop(self, finish_reason: str | None, stop_reason, output_tokens: int) -> tuple:
        """(Anthropic's stop_reason, stop_sequence) of a chat's finish."""
        if isinstance(stop_reason, str):
            return "stop_sequence", stop_reason
        reason = _STOP_REASONS.get(finish_reason or "", "end_turn")
        if reason == "max_tokens" and output_tokens < self.body.max_tokens:
            reason = "model_context_window_exceeded"  # the context ended it, not max_tokens
        return reason, None

    def whole(self, chat: dict) -> dict:
        choice = chat["choices"][0]
        message = choice["message"]
        content = []
        if message.get("reasoning"):
            content.append(_thinking("" if self.omitted else message["reasoning"]))
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        calls = message.get("tool_calls") or ()
        content += [_tool_use(call) for call in calls]
        cut = None if calls else self.cut_call(choice["finish_reason"], bool(content))
        if cut is not None:
            content.append(cut)
        usage = _usage(chat.get("usage"))
        stop = self.stop(choice["finish_reason"], choice["stop_reason"], usage["output_tokens"])
        out = self.message(content, usage, stop)
        out["pdserve"] = chat.get("pdserve")
        return out

    def events(self, chunks: AsyncIterator) -> AsyncIterator[bytes]:
        return shaped_events(_EventWriter(self), chunks)


def _event(kind: str, **fields) -> bytes:
    payload = json.dumps({"type": kind, **fields}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n".encode()


class _EventWriter:
    """A Message's stream events from a chat's chunks, one chunk at a time: each text run and
    each tool call is a content block, opened when its first piece comes and closed when the
    next block opens or the answer ends."""

    def __init__(self, shape: Shape):
        self.shape = shape
        self.started = False
        self.blocks = 0  # content blocks opened so far
        # ("text", -1), ("thinking", -1) or ("tool", chat call index)
        self.open: tuple[str, int] | None = None
        self.finish: tuple[str | None, Any] = (None, None)  # finish_reason, stop_reason
        self.usage: dict | None = None
        self.extension: dict | None = None
        self.failed = False
        self.calls = False  # whether a tool call came

    def feed(self, chunk) -> list[bytes]:
        if chunk == "[DONE]":
            return self._done()
        if "error" in chunk:
            self.failed = True
            e = chunk["error"]
            kind = anthropic_type(status_of(e))
            return [_event("error", error={"type": kind, "message": e["message"]})]
        out: list[bytes] = []
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        if not self.started:
            self.started = True
            usage = _usage_at_start(self.usage)
            out.append(_event("message_start", message=self.shape.message([], usage, (None, None))))
            out.append(_event("ping"))  # as Anthropic's streams send one
        if chunk.get("pdserve") is not None:
            self.extension = chunk["pdserve"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                out += self._block("thinking", _thinking(""), "thinking_delta", delta["reasoning"])
            if delta.get("content"):
                block = {"type": "text", "text": ""}
                out += self._block("text", block, "text_delta", delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        return out

    def _opening(self, key: tuple[str, int], block: dict) -> list[bytes]:
        out = self._close()
        self.open = key
        out.append(_event("content_block_start", index=self.blocks, content_block=block))
        self.blocks += 1
        return out

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.blocks - 1)]

    def _block(self, kind: str, block: dict, delta_kind: str, piece: str) -> list[bytes]:
        """A piece of a text or thinking block (`kind`: its key in `block` and its delta); an
        omitted thinking block (thinking.display) is opened and closed with no delta."""
        out = []
        if self.open != (kind, -1):
            out = self._opening((kind, -1), block)
        if kind == "thinking" and self.shape.omitted:
            return out
        delta = {"type": delta_kind, kind: piece}
        return out + [_event("content_block_delta", index=self.blocks - 1, delta=delta)]

    def _call(self, call: dict) -> list[bytes]:
        out = []
        key = ("tool", call["index"])
        self.calls = True
        if self.open != key:
            name = call["function"]["name"]
            block = _tool_use({"id": call["id"], "function": {"name": name, "arguments": ""}})
            out = self._opening(key, block)
        arguments = call.get("function", {}).get("arguments", "")
        if arguments:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            out.append(_event("content_block_delta", index=self.blocks - 1, delta=delta))
        return out

    def _done(self) -> list[bytes]:
        cut = None if self.calls else self.shape.cut_call(self.finish[0], self.blocks > 0)
        out = self._opening(("tool", -1), cut) if cut is not None else []
        out += self._close()
        usage = _usage(self.usage)
        reason, sequence = self.shape.stop(*self.finish, usage["output_tokens"])
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        out.append(_event("message_delta", delta=delta, usage=usage, pdserve=self.extension))
        out.append(_event("message_stop"))
        return out


# ---- the routes ------------------------------------------------------------------------------
def _check_thinking(front, body: Conversation) -> None:
    """thinking enabled needs a reasoning model (router/openai/responses/reasoning.py)."""
    if body.thinking is not None and body.thinking.type == "enabled" and not front.reasons:
        raise ApiError(
            400,
            "thinking: this model has no thinking mode: send thinking {'type': 'disabled'} (or "
            "'adaptive', which thinks only where the model can), or leave it unset",
            param="thinking",
        )


@router.post("/v1/messages")
async def messages(request: Request):
    front = state_of(request)
    body, metadata = await front.parse(request, MessagesRequest, MESSAGES_FIELDS)
    front.check_model(body.model)
    _check_thinking(front, body)
    # (off the event loop: the chat's checks decode its images and compile its tools' schemas)
    chat = await asyncio.to_thread(body.as_chat, front.settings.max_model_len)
    await fetch_images(chat.messages, front.settings.allowed_media_domains, indexed=False)
    gen = chat_request(front, chat)
    # Anthropic's max_tokens is a cap: a completion the context cannot hold all of ends where the
    # context does (stop_reason model_context_window_exceeded), as Anthropic's own API ends it
    gen.max_tokens_up_to_context = True
    shape = Shape(body, body.model, request_id_of(request).public)
    try:
        return await generate(request, [gen], metadata, chat, chat=True, shape=shape)
    except ApiError as e:
        raise _worded_as_anthropic(e) from None


# the router's refusal of a prompt the context cannot hold (router/text.py)
_TOO_LONG = re.compile(r"has (\d+) tokens but max_model_len is (\d+)")


def _worded_as_anthropic(e: ApiError) -> ApiError:
    """A prompt longer than the context, worded as Anthropic words it first ("prompt is too
    long: N tokens > M maximum": Claude Code and other agents match it to compact the
    conversation), then the router's advice; any other error as it is."""
    m = _TOO_LONG.search(e.message) if e.code == "context_length_exceeded" else None
    if m is None:
        return e
    tokens, most = int(m.group(1)), int(m.group(2)) - 1  # one position is left for the answer
    e.message = f"prompt is too long: {tokens} tokens > {most} maximum; {e.message}"
    return e


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    """The prompt's tokens, as /v1/messages would run it (the chat template, the tools, each
    image's tokens: the chat's image parts reach the encoder)."""
    front = state_of(request)
    body, _ = await front.parse(request, CountTokensRequest, MESSAGES_FIELDS)
    front.check_model(body.model)
    _check_thinking(front, body)
    chat = await asyncio.to_thread(body.as_chat)
    await fetch_images(chat.messages, front.settings.allowed_media_domains, indexed=False)
    front.check_prompt_size([t for m in chat.messages for t in (m.role, m.text())], "messages")
    ids = await front.encode("messages", front.encoder.tokenize_chat, chat_messages(chat), False)
    return {"input_tokens": len(ids)}
