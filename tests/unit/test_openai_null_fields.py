"""An explicit JSON null on a chat or completions field that has a default means that default
(router/openai/protocol.py, _Sampling._null_means_default): OpenAI's spec makes these fields
nullable and its SDKs send null for a None argument, and vLLM reads null as the default. The
cross-field checks see the default, and a null on a required field is still a 400."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pdserve.router.openai.errors import validation_error
from pdserve.router.openai.protocol import (
    KNOWN_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    sampling_params,
)

MESSAGES = [{"role": "user", "content": "hi"}]

# OpenAI's nullable fields (openai/types/chat/completion_create_params.py and
# completion_create_params.py) and vLLM's booleans, as the SDK sends them for None
CHAT_NULLABLE = [
    "n",
    "logprobs",
    "stream",
    "top_logprobs",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "stream_options",
    "parallel_tool_calls",
    "response_format",
    "reasoning_effort",
    "add_generation_prompt",
    "continue_final_message",
    "include_reasoning",
    "add_special_tokens",
    "echo",
    "priority",
    "use_beam_search",
    "length_penalty",
    "spaces_between_special_tokens",
]
COMPLETION_NULLABLE = [
    "n",
    "logprobs",
    "stream",
    "echo",
    "best_of",
    "suffix",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "max_tokens",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "stream_options",
    "add_special_tokens",
    "priority",
]


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps({"messages": MESSAGES, **fields}))


def _completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"prompt": "hi", **fields}))


@pytest.mark.parametrize("field", CHAT_NULLABLE)
def test_a_null_chat_field_is_its_default(field):
    body, plain = _chat(**{field: None}), _chat()
    assert body == plain
    assert sampling_params(body, 5) == sampling_params(plain, 5)
    assert chat_messages(body) == chat_messages(plain)


@pytest.mark.parametrize("field", COMPLETION_NULLABLE)
def test_a_null_completion_field_is_its_default(field):
    body, plain = _completion(**{field: None}), _completion()
    assert body == plain
    assert sampling_params(body, 5) == sampling_params(plain, 5)


def test_the_cross_field_checks_read_a_null_as_the_default():
    with pytest.raises(ValidationError, match="needs logprobs=true"):
        _chat(logprobs=None, top_logprobs=2)
    with pytest.raises(ValidationError, match="only allowed with stream=true"):
        _chat(stream=None, stream_options={"include_usage": True})
    with pytest.raises(ValidationError, match="allowed only with echo=true"):
        _completion(max_tokens=0, echo=None)
    with pytest.raises(ValidationError, match="set add_generation_prompt=false"):
        _chat(
            messages=[*MESSAGES, {"role": "assistant", "content": "a"}],
            add_generation_prompt=None,
            continue_final_message=True,
        )
    assert _chat(logprobs=True, top_logprobs=None).num_top() == 0


@pytest.mark.parametrize(
    "model, body, param",
    [
        (ChatCompletionRequest, {"messages": None}, "messages"),
        (CompletionRequest, {"prompt": None}, "prompt"),
        (ChatCompletionRequest, {"messages": [{"role": None, "content": "hi"}]}, "messages"),
    ],
)
def test_a_null_required_field_is_still_a_400_naming_it(model, body, param):
    with pytest.raises(ValidationError) as e:
        model.model_validate_json(json.dumps(body))
    error = validation_error(e.value, KNOWN_FIELDS)
    assert error.status == 400
    assert error.param.startswith(param)
