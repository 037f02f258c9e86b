"""The OpenAI request bodies the HTTP front accepts (router/http_api.py), as strict pydantic models:
every field typed and bounded before any work, unknown fields refused (400 naming the field).

What is accepted beyond OpenAI's own fields: the sampling fields vLLM accepts (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens,
include_stop_str_in_output), pdserve's `speculative` (false: this request opts out of the decode
pool's speculative decoding), vLLM's prompt_logprobs (completions) and its chat template fields
(chat_template_kwargs, add_generation_prompt, continue_final_message), structured outputs
(OpenAI's response_format, vLLM's structured_outputs and guided_*: router/openai_structured.py).
`model` may be left out
(the served model). Logprobs: completions' `logprobs` N and chat's `top_logprobs` N up to
MAX_LOGPROBS most likely tokens per position; completions' `echo` (with max_tokens 0: the
prompt alone, its logprobs with `logprobs`, as vLLM; lm-evaluation-harness's log-likelihood
requests). OpenAI fields that change nothing here are accepted and ignored (`user`, `metadata`,
`store`, `service_tier`, ...); tools and tool_choice are router/openai_tools.py's; OpenAI
fields whose meaning pdserve does not serve (functions, logit_bias, suffix, ...) are accepted
only at their neutral value, and anything else is refused with a message saying so.

The numeric ranges are the engine's (engine/sampling_params.py) narrowed to OpenAI's documented
ones where OpenAI is stricter (temperature <= 2); the size bounds are the gRPC API's
(protos/limits.py, router/text.py), so a request refused by one front is refused by the other.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable
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
    MAX_ID_CHARS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from pdserve.router.openai_structured import StructuredFields
from pdserve.router.openai_tools import (
    ToolChoice,
    ToolMessageFields,
    Tools,
    check_tool_choice,
    check_tools,
    forced,
    forced_spec,
)
from pdserve.router.text import (
    MAX_CHAT_MESSAGES,
    MAX_TEMPLATE_KWARGS_BYTES,
    RESERVED_TEMPLATE_KEYS,
)

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
ShortStr = Annotated[StrictStr, Field(max_length=MAX_NAME_CHARS)]


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
    include_usage: StrictBool | None = None
    # vLLM's usage on every chunk: the prompt's token count reaches the HTTP front only with the
    # Finish, so only false is accepted (benchmark clients send it when asked to)
    continuous_usage_stats: StrictBool | None = None

    _final_usage_only = _neutral_only(
        "continuous_usage_stats",
        message="continuous_usage_stats is not supported: usage comes on the last chunk "
        "(include_usage)",
    )


class _Sampling(_Strict, StructuredFields):
    """Fields both endpoints share (the structured-output ones: router/openai_structured.py)."""

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
    logit_bias: dict[str, Any] | None = None
    # accepted and ignored: they change nothing about the result
    user: ShortStr | None = None

    _no_logit_bias = _neutral_only(
        "logit_bias", message="logit_bias is not supported; leave it unset or empty"
    )

    @model_validator(mode="after")
    def _consistent(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
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
    # OpenAI fields accepted only at their neutral value
    suffix: StrictStr | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    _no_suffix = _neutral_only("suffix", message="suffix is not supported")
    _no_best_of = _neutral_only(
        "best_of", message="best_of > 1 is not supported; use n", neutral=lambda v: v in (None, 1)
    )

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


class ChatMessage(_Strict, ToolMessageFields):
    # developer: OpenAI's newer name for system; tool: a call's result (tool_call_id)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null only in an assistant message with tool_calls
    content: StrictStr | Annotated[list[TextPart], Field(min_length=1, max_length=1024)] | None
    name: ShortStr | None = None  # accepted and ignored (most chat templates have no place for it)
    refusal: None = None  # OpenAI clients replay assistant messages with "refusal": null

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"content parts of type {str(kind)[:40]!r} are not supported: this model "
                        f"reads text only (parts of type 'text')"
                    )
        return v

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only in an assistant message with tool_calls")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only allowed in assistant messages")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id (the call it answers), and only it")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


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
    # tools (router/openai_tools.py): rendered by the chat template, calls parsed from the output
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    # OpenAI fields accepted only at their neutral value
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[Literal["text"]] | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    # accepted and ignored: they change nothing about the result
    parallel_tool_calls: StrictBool | None = None
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

    def tool_mode(self) -> str:
        """How the output is read: none (no tools, or tool_choice none), auto or forced."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        return "forced" if forced(self.tool_choice) else "auto"

    def structured_spec(self) -> tuple[dict, str] | None:
        if self.tool_mode() == "forced":
            return forced_spec(self.tools, self.tool_choice)
        return super().structured_spec()

    _unset_only = _neutral_only(
        "audio",
        "prediction",
        "reasoning_effort",
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
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered as chat completions does."""

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
    return_token_strs: StrictBool = False

    _check_kwargs = field_validator("chat_template_kwargs")(
        classmethod(lambda cls, v: ChatCompletionRequest._template_kwargs(v))
    )

    @field_validator("messages")
    @classmethod
    def _one_input(cls, v, info):
        if (v is None) == (info.data.get("prompt") is None):
            raise ValueError("send either prompt or messages (one of them)")
        return v

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
