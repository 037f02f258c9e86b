"""/v1/responses served (router/openai/responses_api.py) through the official `openai` client: a
router in front of a prefill and a decode worker on a tiny random model with a byte-level
tokenizer and a short chat template that takes tools (as tests/integration/
test_tool_calls_served.py's). `responses.create`, plain and streamed, gives the text the chat
completion gives for the same input (greedy), with instructions and message-array input; a
function tool round trip works (a forced call whose arguments validate, then its output sent back
as a function_call_output item); previous_response_id and other refused fields get a 400 naming
them, and the router keeps serving."""

from __future__ import annotations

import json

import pytest

from helpers.http import Workers, assert_error, post, serves
from helpers.structured import TOOL_TEMPLATE as TEMPLATE, WEATHER, byte_level_model

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

MODEL = "tiny"
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather",
    "parameters": WEATHER,
}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER},
}
ANSWER = "It is sunny."


@pytest.fixture(scope="module")
def router(tiny_models, tmp_path_factory, one_thread):
    src, _ = tiny_models("llama-gqa")
    model_dir = byte_level_model(src, tmp_path_factory.mktemp("byte-responses"), TEMPLATE)
    w = Workers(model_dir, max_model_len=512)
    r = w.router()
    yield r
    r.stop()
    w.stop()


def client(router_):
    return openai.OpenAI(
        base_url=f"http://{router_.http_address}/v1", api_key="unused", max_retries=0, timeout=60
    )


def _streamed(c, **kwargs):
    """(the text of the deltas, the event types, the completed Response) of a streamed call."""
    text, kinds, final = "", [], None
    for event in c.responses.create(stream=True, **kwargs):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    return text, kinds, final


@pytest.mark.parametrize(
    "inputs",
    [
        {"input": "What is the weather in Paris?"},
        {
            "instructions": "Answer briefly.",
            "input": [
                {"role": "user", "content": "Hello."},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            ],
        },
    ],
    ids=["text", "messages"],
)
def test_responses_text_equals_the_chat_completion(router, inputs):
    c = client(router)
    messages = []
    if "instructions" in inputs:
        messages.append({"role": "system", "content": inputs["instructions"]})
    if isinstance(inputs["input"], str):
        messages.append({"role": "user", "content": inputs["input"]})
    else:
        for m in inputs["input"]:
            text = m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]
            messages.append({"role": m["role"], "content": text})
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chat = whole.choices[0]
    want = chat.message.content
    assert want
    got = c.responses.create(model=MODEL, max_output_tokens=12, temperature=0, **inputs)
    assert got.output_text == want and got.object == "response" and got.id.startswith("resp_")
    assert got.status == ("incomplete" if chat.finish_reason == "length" else "completed")
    assert (got.usage.input_tokens, got.usage.output_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )
    assert got.usage.total_tokens == got.usage.input_tokens + got.usage.output_tokens
    text, kinds, final = _streamed(c, model=MODEL, max_output_tokens=12, temperature=0, **inputs)
    assert text == want and final.output_text == want
    assert final.usage.output_tokens == got.usage.output_tokens
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if final.status == "completed" else "response.incomplete",
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_round_trip(router, stream):
    c = client(router)
    user = {"role": "user", "content": "What is the weather in Paris?"}
    args = dict(model=MODEL, tools=[TOOL], max_output_tokens=96, temperature=1.0)
    named = {"type": "function", "name": "get_weather"}
    if stream:
        _, kinds, first = _streamed(c, input=[user], tool_choice=named, **args)
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
    else:
        first = c.responses.create(input=[user], tool_choice=named, **args)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # the call and its result go back as items; the answer (guided: a random model's words)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky":"sun"}'}
    replay = {
        "type": "function_call",
        "call_id": call.call_id,
        "name": call.name,
        "arguments": call.arguments,
    }
    second = c.responses.create(
        input=[user, replay, result],
        extra_body={
            "text": {"format": {"type": "json_schema", "name": "a", "schema": {"enum": [ANSWER]}}}
        },
        **args,
    )
    assert json.loads(second.output_text) == ANSWER and second.status == "completed"
    # the same conversation as a chat completion sees the same prompt: the same answer
    chat = c.chat.completions.create(
        model=MODEL,
        messages=[
            user,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky":"sun"}'},
        ],
        tools=[CHAT_TOOL],
        max_tokens=96,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": {"enum": [ANSWER]}},
        },
    )
    assert json.loads(chat.choices[0].message.content) == ANSWER


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{**TOOL, "parameters": {"type": "strin"}}]}, "tools[0].parameters"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"background": True}, "background"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 100_000}, None),
    ],
)
def test_refused_fields_get_a_400_naming_them(router, extra, param):
    status, _, raw = post(router, "/v1/responses", {"model": MODEL, "input": "hi", **extra})
    assert_error(status, raw, 400, param)
    serves(router)


def test_a_client_error_is_the_sdks_exception(router):
    c = client(router)
    with pytest.raises(openai.BadRequestError, match="not stored"):
        c.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="other", input="hi")
