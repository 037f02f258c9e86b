"""The HTTP front's logprob and echo shapes (router/openai/responses/logprobs.py,
router/openai/responses/whole.py) from the router's gRPC messages, the bodies
router/openai/protocol.py refuses for the new fields (each a 400 naming the field), the
SamplingParams they become, and the chat template fields on the gRPC side (router/text.py's
template_options: INVALID_ARGUMENT naming the field). The served path is
tests/integration/test_http_logprobs_served.py's."""

from __future__ import annotations

import json

import grpc
import pytest
from pydantic import ValidationError

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.errors import ApiError, validation_error
from pdserve.router.openai.protocol import (
    KNOWN_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    sampling_params,
)
from pdserve.router.openai.responses.logprobs import TokenText
from pdserve.router.openai.responses.whole import whole_response
from pdserve.router.text import BadRequest, template_options


class _Words:
    """A tokenizer whose token i reads "w{i} "."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"w{i} " for i in ids)


TEXT = TokenText(_Words())
TOP = pdserve_pb2.TopLogprobs


def _responses(n_tokens=2, prompt=(4, 5, 6), with_prompt=True, tops=True):
    delta = pdserve_pb2.TokenDelta(
        index=0,
        token_ids=[8, 9][:n_tokens],
        text="w8 w9 "[: 3 * n_tokens],
        logprobs=[-0.5, -1.5][:n_tokens],
        top_logprobs=[
            TOP(token_ids=[8, 3], logprobs=[-0.5, -1.0]),
            TOP(token_ids=[2, 9], logprobs=[-1.0, -1.5]),
        ][:n_tokens]
        if tops
        else [],
    )
    finish = pdserve_pb2.Finish(index=0, finish_reason="length")
    finish.usage.prompt_tokens, finish.usage.completion_tokens = len(prompt), n_tokens
    if with_prompt:
        finish.prompt_token_ids.extend(prompt)
        finish.prompt_logprobs.extend([-2.0, -0.25])
        finish.prompt_top_logprobs.extend(
            [
                TOP(token_ids=[1, 2], logprobs=[-0.1, -0.2]),
                TOP(token_ids=[6, 1], logprobs=[-0.25, -3.0]),
            ]
        )
    return [pdserve_pb2.GenerateResponse(delta=delta), pdserve_pb2.GenerateResponse(finish=finish)]


def _completion(**body):
    return CompletionRequest.model_validate({"prompt": [4, 5, 6], **body})


def test_echo_with_logprobs_is_the_prompt_then_the_completion():
    body = _completion(echo=True, logprobs=1, max_tokens=2)
    out = whole_response(_responses(), body, False, "m", "http-x", TEXT)
    choice = out["choices"][0]
    assert choice["text"] == "w4 w5 w6 w8 w9 "
    lp = choice["logprobs"]
    assert lp["tokens"] == ["w4 ", "w5 ", "w6 ", "w8 ", "w9 "]
    assert lp["token_logprobs"] == [None, -2.0, -0.25, -0.5, -1.5]
    # the `logprobs` most likely tokens and the token itself (vLLM's)
    assert lp["top_logprobs"] == [
        None,
        {"w1 ": pytest.approx(-0.1), "w5 ": -2.0},
        {"w6 ": -0.25},
        {"w8 ": -0.5},
        {"w2 ": -1.0, "w9 ": -1.5},
    ]
    assert lp["text_offset"] == [0, 3, 6, 9, 12]
    assert out["usage"]["completion_tokens"] == 2


def test_max_tokens_0_with_echo_is_the_prompt_alone():
    body = _completion(echo=True, logprobs=0, max_tokens=0)
    assert body.max_new_tokens() == 1  # one token generated, then dropped (vLLM's)
    out = whole_response(_responses(n_tokens=1), body, False, "m", "http-x", TEXT)
    choice = out["choices"][0]
    assert choice["text"] == "w4 w5 w6 "
    assert choice["logprobs"]["token_logprobs"] == [None, -2.0, -0.25]
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] == 3


def test_prompt_logprobs_are_vllms_shape():
    body = _completion(prompt_logprobs=1, max_tokens=2)
    choice = whole_response(_responses(), body, False, "m", "http-x", TEXT)["choices"][0]
    assert choice["logprobs"] is None and choice["text"] == "w8 w9 "
    plp = choice["prompt_logprobs"]
    assert plp[0] is None
    assert plp[1] == {
        "1": {"logprob": pytest.approx(-0.1), "rank": 1, "decoded_token": "w1 "},
        "5": {"logprob": -2.0, "rank": None, "decoded_token": "w5 "},
    }
    assert plp[2] == {"6": {"logprob": -0.25, "rank": 1, "decoded_token": "w6 "}}


def test_missing_prompt_logprobs_or_alternatives_fail_the_request():
    body = _completion(echo=True, logprobs=1, max_tokens=2)
    with pytest.raises(ApiError) as e:
        whole_response(_responses(with_prompt=False), body, False, "m", "http-x", TEXT)
    assert e.value.status == 500 and e.value.code == "logprobs_unavailable"
    with pytest.raises(ApiError) as e:
        whole_response(_responses(tops=False), _completion(logprobs=2), False, "m", "h", TEXT)
    assert e.value.code == "logprobs_unavailable"


def test_chat_top_logprobs_are_openais_shape():
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    )
    out = whole_response(_responses(), body, True, "m", "http-x", TEXT)
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["w8 ", "w9 "]
    assert content[1]["top_logprobs"] == [
        {"token": "w2 ", "logprob": -1.0, "bytes": list(b"w2 ")},
        {"token": "w9 ", "logprob": -1.5, "bytes": list(b"w9 ")},
    ]


def test_sampling_params_carry_the_logprob_counts():
    s = sampling_params(_completion(echo=True, logprobs=3, max_tokens=0), 1)
    assert (s.logprobs, s.top_logprobs, s.prompt_logprobs, s.max_tokens) == (True, 3, 3, 1)
    s = sampling_params(_completion(prompt_logprobs=5, logprobs=0), None)
    assert (s.logprobs, s.HasField("top_logprobs"), s.prompt_logprobs) == (True, False, 5)
    s = sampling_params(_completion(), None)
    assert not s.HasField("prompt_logprobs") and not s.logprobs
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 4}
    )
    s = sampling_params(chat, 10)
    assert (s.logprobs, s.top_logprobs, s.HasField("prompt_logprobs")) == (True, 4, False)


MSG = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "model, body, param",
    [
        (CompletionRequest, {"prompt": "a", "logprobs": 21}, "logprobs"),
        (CompletionRequest, {"prompt": "a", "logprobs": -1}, "logprobs"),
        (CompletionRequest, {"prompt": "a", "logprobs": True}, "logprobs"),
        (CompletionRequest, {"prompt": "a", "echo": "yes"}, "echo"),
        (CompletionRequest, {"prompt": "a", "max_tokens": 0}, "echo"),
        (CompletionRequest, {"prompt": "a", "max_tokens": -1}, "max_tokens"),
        (CompletionRequest, {"prompt": "a", "echo": True, "logprobs": 1, "stream": True}, "echo"),
        (CompletionRequest, {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
        (
            CompletionRequest,
            {"prompt": "a", "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
        (CompletionRequest, {"prompt": "a", "model": ""}, "model"),
        (ChatCompletionRequest, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        (
            ChatCompletionRequest,
            {"messages": MSG, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            ChatCompletionRequest,
            {"messages": MSG, "add_generation_prompt": 1},
            "add_generation_prompt",
        ),
        (
            ChatCompletionRequest,
            {"messages": MSG, "continue_final_message": True},
            "continue_final_message",
        ),
        (
            ChatCompletionRequest,
            {"messages": MSG, "continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
        ),
        (
            ChatCompletionRequest,
            {"messages": MSG, "chat_template_kwargs": []},
            "chat_template_kwargs",
        ),
        (
            ChatCompletionRequest,
            {"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}},
            "chat_template_kwargs",
        ),
        (TokenizeRequest, {}, "messages"),
        (TokenizeRequest, {"prompt": "a", "messages": MSG}, "messages"),
        (TokenizeRequest, {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
        (TokenizeRequest, {"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
        (DetokenizeRequest, {"tokens": [-1]}, "tokens[0]"),
        (DetokenizeRequest, {}, "tokens"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(model, body, param):
    with pytest.raises(ValidationError) as e:
        model.model_validate_json(json.dumps(body))
    err = validation_error(e.value, KNOWN_FIELDS)
    assert err.status == 400 and err.param == param, err.body()
    assert param.split("[")[0] in err.message


def test_model_is_optional_and_the_template_fields_are_accepted():
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    assert body.model is None and body.chat_template_kwargs == {"enable_thinking": False}


def _chat(*roles, **fields) -> pdserve_pb2.ChatMessages:
    chat = pdserve_pb2.ChatMessages(**fields)
    chat.messages.extend(pdserve_pb2.ChatMessage(role=r, content="c") for r in roles)
    return chat


def test_template_options_are_vllms_semantics():
    assert template_options(_chat("user")) == dict(
        add_generation_prompt=True, continue_final_message=False
    )
    got = template_options(_chat("user", "assistant", continue_final_message=True))
    assert got == dict(add_generation_prompt=False, continue_final_message=True)
    got = template_options(
        _chat("user", add_generation_prompt=False, chat_template_kwargs_json='{"x": 1}')
    )
    assert got == dict(x=1, add_generation_prompt=False, continue_final_message=False)


@pytest.mark.parametrize(
    "chat, field",
    [
        (
            _chat("user", "assistant", continue_final_message=True, add_generation_prompt=True),
            "chat.continue_final_message",
        ),
        (_chat("user", continue_final_message=True), "chat.continue_final_message"),
        (_chat("user", chat_template_kwargs_json="[1]"), "chat.chat_template_kwargs_json"),
        (_chat("user", chat_template_kwargs_json="{"), "chat.chat_template_kwargs_json"),
        (
            _chat("user", chat_template_kwargs_json='{"messages": 1}'),
            "chat.chat_template_kwargs_json",
        ),
        (_chat("user", chat_template_kwargs_json="1" * 70000), "chat.chat_template_kwargs_json"),
    ],
)
def test_bad_template_fields_are_invalid_argument_naming_the_field(chat, field):
    with pytest.raises(BadRequest) as e:
        template_options(chat)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.message
