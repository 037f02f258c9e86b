"""vLLM's request fields on the HTTP front (router/openai/protocol.py): each is accepted where it
changes nothing here, or refused with a 400 naming it where ignoring it would change the answer;
messages shaped as OpenAI's spec allows (an assistant's tool calls with no content, or content
null) are read; and a stream with vLLM's stream_options.continuous_usage_stats carries each
choice's usage on every chunk (router/openai/responses/stream.py, fed a fake gRPC call)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from pydantic import ValidationError

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.errors import validation_error
from pdserve.router.openai.protocol import (
    KNOWN_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
)
from pdserve.router.openai.responses.logprobs import TokenText
from pdserve.router.openai.responses.stream import chunks
from pdserve.router.service import PROMPT_TOKENS_KEY

MESSAGES = [{"role": "user", "content": "hi"}]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps({"messages": MESSAGES, **fields}))


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"prompt": "hi", **fields}))


ACCEPTED = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "spaces_between_special_tokens": True,
    "bad_words": [],
    "priority": 0,
    "request_id": "my-id",
    "guided_decoding_backend": "xgrammar",
    "mm_processor_kwargs": {},
    "vllm_xargs": {},
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "max_repetition_pattern_size": 0,
    "min_repetition_pattern_size": 0,
    "repetition_min_count": 0,
}


@pytest.mark.parametrize("make", [chat, completion], ids=["chat", "completions"])
def test_vllm_fields_at_values_that_change_nothing_are_accepted(make):
    make(**ACCEPTED)


def test_endpoint_specific_vllm_defaults_are_accepted():
    chat(echo=False, add_special_tokens=False, include_reasoning=False)
    completion(add_special_tokens=True)


REFUSED = [
    ("spaces_between_special_tokens", False),
    ("truncate_prompt_tokens", 0),
    ("allowed_token_ids", []),
    ("priority", 1 << 31),
    ("priority", "high"),
    ("logits_processors", ["a.b"]),
    ("cache_salt", "s" * 257),
    ("kv_transfer_params", {"do_remote_decode": True}),
    ("vllm_xargs", {"k": 1}),
    ("mm_processor_kwargs", {"max_pixels": 1 << 20}),  # (silently dropped, it would mislead)
    ("guided_whitespace_pattern", " "),
    ("structural_tag", "{}"),
    ("length_penalty", "long"),
    ("return_token_ids", "yes"),
    ("max_repetition_pattern_size", 257),  # (served: past its bound)
    ("min_repetition_pattern_size", 2),  # more than max_repetition_pattern_size (unset: 0)
    ("repetition_min_count", -1),
    ("thinking_token_budget", -1),
]


@pytest.mark.parametrize("make", [chat, completion], ids=["chat", "completions"])
@pytest.mark.parametrize("field, value", REFUSED, ids=[f for f, _ in REFUSED])
def test_vllm_fields_that_would_change_the_answer_are_a_400_naming_them(make, field, value):
    with pytest.raises(ValidationError) as e:
        make(**{field: value})
    err = validation_error(e.value, KNOWN_FIELDS)
    assert err.status == 400 and err.param == field, err.message


@pytest.mark.parametrize("make", [chat, completion], ids=["chat", "completions"])
def test_served_vllm_sampling_fields_reach_the_wire(make):
    from pdserve.router.openai.protocol import sampling_params

    body = make(
        max_repetition_pattern_size=4,
        min_repetition_pattern_size=2,
        repetition_min_count=3,
        thinking_token_budget=0,
    )
    s = sampling_params(body, None)
    assert (s.max_repetition_pattern_size, s.min_repetition_pattern_size) == (4, 2)
    assert s.repetition_min_count == 3
    assert s.HasField("thinking_token_budget") and s.thinking_token_budget == 0
    assert not sampling_params(make(), None).HasField("thinking_token_budget")


@pytest.mark.parametrize(
    "make, field, value",
    [
        (chat, "echo", True),
        (chat, "add_special_tokens", True),
        (chat, "documents", [{"title": "t", "text": "x"}]),
        (chat, "chat_template", "{{ messages }}"),
        (completion, "add_special_tokens", False),
        (completion, "prompt_embeds", "AAAA"),
    ],
)
def test_endpoint_specific_vllm_fields_are_refused_off_their_defaults(make, field, value):
    with pytest.raises(ValidationError) as e:
        make(**{field: value})
    assert validation_error(e.value, KNOWN_FIELDS).param == field


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it():
    wire = chat_messages(chat(reasoning_effort="low"))
    assert json.loads(wire.chat_template_kwargs_json) == {"reasoning_effort": "low"}
    own = chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high", "x": 1})
    assert json.loads(chat_messages(own).chat_template_kwargs_json) == {
        "reasoning_effort": "high",
        "x": 1,
    }
    assert not chat_messages(chat()).chat_template_kwargs_json
    with pytest.raises(ValidationError) as e:
        chat(reasoning_effort="extreme")
    assert validation_error(e.value, KNOWN_FIELDS).param == "reasoning_effort"


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [CALL],
            "refusal": None,
            "audio": None,
        },
    ],
    ids=["content-left-out", "content-null", "replayed-nulls"],
)
def test_an_assistant_tool_call_message_needs_no_content(message):
    body = ChatCompletionRequest.model_validate_json(
        json.dumps(
            {
                "messages": [
                    *MESSAGES,
                    message,
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                ]
            }
        )
    )
    wire = chat_messages(body).messages
    assert wire[1].role == "assistant" and wire[1].content == ""
    assert json.loads(wire[1].tool_calls_json)[0]["id"] == "c1"


@pytest.mark.parametrize(
    "message",
    [{"role": "user"}, {"role": "user", "content": None}, {"role": "assistant", "content": None}],
)
def test_content_is_required_elsewhere_and_the_400_names_it(message):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate_json(json.dumps({"messages": [message]}))
    err = validation_error(e.value, KNOWN_FIELDS)
    assert err.param == "messages[0].content" and "tool_calls" in err.message


def test_stream_options_follow_vllm():
    assert chat(stream=True, stream_options={}).stream_options.usage()  # include_usage: true
    opts = chat(stream=True, stream_options={"continuous_usage_stats": True}).stream_options
    assert opts.usage() and opts.continuous()
    opts = chat(
        stream=True, stream_options={"include_usage": False, "continuous_usage_stats": True}
    ).stream_options
    assert not opts.usage() and not opts.continuous()  # vLLM: continuous needs include_usage
    with pytest.raises(ValidationError):
        chat(stream=True, stream_options={"continuous_usage_stats": "yes"})


# ---- continuous usage on a fake call ---------------------------------------------------------
class _Words:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"w{i} " for i in ids)


class FakeCall:
    """A Generate call's initial metadata and responses, as grpc.aio gives them."""

    def __init__(self, prompt_tokens: int, responses: list):
        self.metadata = ((PROMPT_TOKENS_KEY, str(prompt_tokens)),)
        self.responses = list(responses)
        self.cancelled = False

    async def initial_metadata(self):
        return self.metadata

    async def read(self):
        return self.responses.pop(0) if self.responses else grpc.aio.EOF

    def cancel(self):
        self.cancelled = True


def _delta(index, ids):
    return pdserve_pb2.GenerateResponse(
        delta=pdserve_pb2.TokenDelta(
            index=index, token_ids=ids, text="".join(f"w{i} " for i in ids)
        )
    )


def _finish(index, prompt, done):
    usage = pdserve_pb2.Usage(prompt_tokens=prompt, completion_tokens=done)
    return pdserve_pb2.GenerateResponse(
        finish=pdserve_pb2.Finish(index=index, finish_reason="length", usage=usage)
    )


def _stream(body, responses, is_chat=True, prompt_tokens=5) -> list:
    call = FakeCall(prompt_tokens, responses[1:])

    async def run():
        args = (call, responses[0], body, is_chat, "tiny", "http-1", TokenText(_Words()))
        return [c async for c in chunks(*args)]

    out = asyncio.run(run())
    assert out[-1] == "[DONE]" and call.cancelled
    return out[:-1]


@pytest.mark.parametrize("is_chat", [True, False], ids=["chat", "completions"])
def test_continuous_usage_is_on_every_chunk_with_each_choices_count(is_chat):
    opts = {"stream": True, "stream_options": {"continuous_usage_stats": True}, "n": 2}
    body = chat(**opts) if is_chat else completion(**opts)
    responses = [
        _delta(0, [7]),
        _delta(1, [8, 9]),
        _delta(0, [10]),
        _finish(0, 5, 2),
        _finish(1, 5, 2),
    ]
    out = _stream(body, responses, is_chat)
    *with_choices, last = out
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert last["usage"]["prompt_tokens"] == 5
    seen = []
    for c in with_choices:
        usage, index = c["usage"], c["choices"][0]["index"]
        assert usage["prompt_tokens"] == 5
        assert usage["total_tokens"] == 5 + usage["completion_tokens"]
        seen.append((index, usage["completion_tokens"]))
    if is_chat:  # the role chunks first, before any token
        assert seen[:2] == [(0, 0), (1, 0)]
        seen = seen[2:]
    assert seen == [(0, 1), (1, 2), (0, 2), (0, 2), (1, 2)]


def test_without_continuous_usage_only_the_last_chunk_has_usage():
    body = chat(stream=True, stream_options={"include_usage": True})
    out = _stream(body, [_delta(0, [7]), _finish(0, 5, 1)])
    assert all(c["usage"] is None for c in out[:-1]) and out[-1]["usage"]["total_tokens"] == 6
