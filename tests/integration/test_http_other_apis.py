"""The other APIs the HTTP front serves as a chat: OpenAI's /v1/responses
(router/openai/responses_api.py) through the official `openai` client and Anthropic's
/v1/messages (router/openai/messages_api.py) through the official `anthropic` client, on one
router in front of a prefill and a decode worker on a tiny random model with a byte-level
tokenizer and a short chat template that takes tools (as tests/integration/
test_tool_calls_served.py's).

Each gives, plain and streamed, the text the chat completion gives for the same conversation
(greedy); a tool round trip works (a forced call whose arguments validate, then its result sent
back); a stored response is continued by previous_response_id (the same text as the chat of the
whole conversation), read back and deleted, and a background one polled to the answer a plain call
gives; a conversation (the Conversations API) carries the turns of the responses that name it;
refused fields get a 400 naming them (in Anthropic's error shape on its paths), and the router keeps
serving. /v1/messages also: a stop sequence is reported as the one that matched, prefill continues
the assistant's text, count_tokens counts what the chat would run, and the x-api-key header carries
the key."""

from __future__ import annotations

import json
import time

import pytest

from helpers.http import Workers, assert_error, openai_client as client, post, serves
from helpers.structured import TOOL_TEMPLATE as TEMPLATE, WEATHER, byte_level_model
from helpers.threads import wait_until

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
def workers_of_router(tiny_models, tmp_path_factory, one_thread):
    src, _ = tiny_models("llama-gqa")
    model_dir = byte_level_model(src, tmp_path_factory.mktemp("byte-responses"), TEMPLATE)
    w = Workers(model_dir, max_model_len=512)
    r = w.router()
    yield w, r
    r.stop()
    w.stop()


@pytest.fixture(scope="module")
def router(workers_of_router):
    return workers_of_router[1]


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
        (
            {"input": [{"type": "reasoning", "encrypted_content": "gAAA"}]},
            "input[0].encrypted_content",
        ),
        ({"background": True, "store": False}, "background"),
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
    with pytest.raises(openai.BadRequestError, match="not found") as e:
        c.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert e.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="other", input="hi")


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_continues_a_stored_conversation(router, stream):
    c = client(router)
    args = dict(model=MODEL, max_output_tokens=8, temperature=0)
    first = c.responses.create(instructions="Be brief.", input="Hello.", **args)
    assert first.store and first.output_text

    def turn(text: str, previous: str, **extra):
        if not stream:
            return c.responses.create(input=text, previous_response_id=previous, **args, **extra)
        return _streamed(c, input=text, previous_response_id=previous, **args, **extra)[2]

    second = turn("And you?", first.id, instructions="Be kind.")
    # the chat it continued: the first's items and answer (not its instructions, as OpenAI
    # does), then the new message, under the new instructions
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And you?"},
    ]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert second.output_text == whole.choices[0].message.content
    assert second.usage.input_tokens == whole.usage.prompt_tokens
    assert second.previous_response_id == first.id and second.store
    got = c.responses.retrieve(second.id)
    assert (got.id, got.output_text, got.status) == (second.id, second.output_text, second.status)
    items = c.responses.input_items.list(second.id).data
    assert [(i.role, i.content[0].text) for i in items] == [("user", "And you?")]
    third = turn("Bye.", second.id)
    whole = c.chat.completions.create(
        model=MODEL,
        messages=[
            *messages[1:],
            {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "Bye."},
        ],
        max_tokens=8,
        temperature=0,
    )
    assert third.output_text == whole.choices[0].message.content
    # deleted: gone, and no longer continued; the earlier ones stay
    assert c.responses.delete(second.id) is None
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        turn("Again?", second.id)
    assert c.responses.retrieve(third.id).output_text == third.output_text
    # store false: answered, not kept
    unstored = c.responses.create(instructions="Be brief.", input="Hello.", store=False, **args)
    assert unstored.store is False and unstored.output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    serves(router)


def test_responses_logprobs_when_included(router):
    c = client(router)
    args = dict(model=MODEL, input="Hello.", max_output_tokens=6, temperature=0)
    extra = dict(include=["message.output_text.logprobs"], top_logprobs=2)
    whole = c.responses.create(**args, **extra).output[0].content[0].logprobs
    assert whole and all(len(lp.top_logprobs) == 2 for lp in whole)
    assert all(lp.logprob >= lp.top_logprobs[-1].logprob for lp in whole)
    _, _, final = _streamed(c, **args, **extra)
    streamed = final.output[0].content[0].logprobs
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in whole]
    assert c.responses.create(**args).output[0].content[0].logprobs == []


def test_a_conversation_carries_the_turns(router):
    c = client(router)
    args = dict(model=MODEL, max_output_tokens=8, temperature=0)
    conv = c.conversations.create(items=[{"role": "user", "content": "Hello."}])
    first = c.responses.create(
        conversation=conv.id, input=[{"role": "user", "content": "Who?"}], **args
    )
    assert first.conversation.id == conv.id
    items = c.conversations.items.list(conv.id, order="asc").data
    assert [i.type for i in items] == ["message", "message", "message"]
    assert [i.role for i in items] == ["user", "user", "assistant"]
    assert items[2].content[0].text == first.output_text
    second = c.responses.create(conversation={"id": conv.id}, input="Bye.", store=False, **args)
    messages = [
        {"role": "user", "content": "Hello."},
        {"role": "user", "content": "Who?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Bye."},
    ]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert second.output_text == whole.choices[0].message.content
    assert len(c.conversations.items.list(conv.id).data) == 5
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(second.id)  # store false: the conversation has it, not the store
    c.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(conversation=conv.id, input="Again?", **args)


def test_a_background_response_is_polled_to_the_same_answer(workers_of_router):
    workers, router_ = workers_of_router
    c = client(router_)
    args = dict(model=MODEL, input="Hello.", max_output_tokens=8, temperature=0)
    want = c.responses.create(**args)
    queued = c.responses.create(background=True, **args)
    assert queued.status == "queued" and queued.background
    got = queued
    for _ in range(200):
        got = c.responses.retrieve(queued.id)
        if got.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert got.status == want.status and got.output_text == want.output_text
    assert got.usage.output_tokens == want.usage.output_tokens
    # cancelling one that ended answers it as it ended
    assert c.responses.cancel(queued.id).status == want.status
    # a background response continues as any stored one does
    nxt = c.responses.create(model=MODEL, input="More.", previous_response_id=queued.id)
    assert nxt.previous_response_id == queued.id
    wait_until(workers.idle, 10, "every KV block free")


# ---- Anthropic's Messages API ------------------------------------------------------------------
# the anthropic SDK (2.x) has no temperature argument any more; the API still takes it
GREEDY = {"temperature": 0}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather", "input_schema": WEATHER}


def anthropic_client(router_, key: str = "unused"):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(
        base_url=f"http://{router_.http_address}", api_key=key, max_retries=0, timeout=60
    )


def _chat_text(router_, messages, **fields) -> tuple[str, dict]:
    c = client(router_)
    whole = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, **fields)
    return whole.choices[0].message.content, whole


@pytest.mark.parametrize("stream", [False, True])
def test_messages_text_equals_the_chat_completion(router, stream):
    a = anthropic_client(router)
    system = "Answer briefly."
    turns = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
    ]
    chat_turns = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Weather?"},
    ]
    want, whole = _chat_text(router, chat_turns, max_tokens=12)
    assert want
    args = dict(model=MODEL, max_tokens=12, system=system, messages=turns, extra_body=GREEDY)
    if stream:
        with a.messages.stream(**args) as s:
            text = "".join(s.text_stream)
            got = s.get_final_message()
        assert text == want
    else:
        got = a.messages.create(**args)
    assert got.content[0].text == want and got.type == "message" and got.id.startswith("msg_")
    finish = whole.choices[0].finish_reason
    assert got.stop_reason == ("max_tokens" if finish == "length" else "end_turn")
    assert got.usage.output_tokens == whole.usage.completion_tokens
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == whole.usage.prompt_tokens
    # the same prompt again: its full blocks come from the prefix cache
    again = a.messages.create(**args)
    assert again.usage.cache_read_input_tokens > 0
    count = a.messages.count_tokens(model=MODEL, system=system, messages=turns)
    assert count.input_tokens == whole.usage.prompt_tokens


def test_a_stop_sequence_and_prefill(router):
    a = anthropic_client(router)
    user = {"role": "user", "content": "Say something."}
    base = a.messages.create(model=MODEL, max_tokens=24, messages=[user], extra_body=GREEDY)
    text = base.content[0].text
    assert len(text) >= 6, text
    stop = text[3:5]  # two characters in the middle of the greedy answer
    cut = a.messages.create(
        model=MODEL, max_tokens=24, messages=[user], stop_sequences=[stop], extra_body=GREEDY
    )
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[: text.index(stop)]
    # prefill: the answer continues the assistant's text, as the chat's continue_final_message
    prefix = {"role": "assistant", "content": text[:3]}
    rest = a.messages.create(model=MODEL, max_tokens=8, messages=[user, prefix], extra_body=GREEDY)
    want, _ = _chat_text(
        router,
        [user, prefix],
        max_tokens=8,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert rest.content[0].text == want


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(router, stream):
    a = anthropic_client(router)
    user = {"role": "user", "content": "What is the weather in Paris?"}
    args = dict(model=MODEL, tools=[ANTHROPIC_TOOL], max_tokens=96, extra_body={"temperature": 1.0})
    choice = {"type": "tool", "name": "get_weather"}
    if stream:
        with a.messages.stream(messages=[user], tool_choice=choice, **args) as s:
            kinds = [e.type for e in s]
            first = s.get_final_message()
        assert "input_json" in kinds and kinds[-1] == "message_stop"
    else:
        first = a.messages.create(messages=[user], tool_choice=choice, **args)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == "get_weather"
    assert use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    # the call and its result go back as blocks; the answer (shaped: a random model's words)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": '{"sky":"sun"}'}
    second = a.messages.create(
        messages=[
            user,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [result]},
        ],
        output_config={"format": {"type": "json_schema", "schema": {"enum": [ANSWER]}}},
        **args,
    )
    assert json.loads(second.content[0].text) == ANSWER and second.stop_reason == "end_turn"


@pytest.mark.parametrize(
    "extra, status, words",
    [
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "thinking"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "custom"),
        ({"container": "x"}, 400, "container"),
        ({"model": "claude-other"}, 404, "not served"),
    ],
)
def test_refused_messages_get_anthropics_error(router, extra, status, words):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    code, _, raw = post(router, "/v1/messages", {**body, **extra})
    assert code == status, raw[:300]
    doc = json.loads(raw)
    assert doc["type"] == "error" and set(doc["error"]) == {"type", "message"}
    want = "not_found_error" if status == 404 else "invalid_request_error"
    assert doc["error"]["type"] == want
    assert words is None or words in doc["error"]["message"], doc
    serves(router)


def test_the_sdks_exceptions_and_the_x_api_key_header(workers_of_router):
    anthropic = pytest.importorskip("anthropic")
    workers, _ = workers_of_router
    key = "sk-anthropic-0123456789"
    keyed = workers.router(api_keys=(key,))
    hi = dict(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    try:
        with pytest.raises(anthropic.AuthenticationError):
            anthropic_client(keyed, key="sk-wrong-0123456789").messages.create(**hi)
        with pytest.raises(anthropic.BadRequestError, match="thinking"):
            anthropic_client(keyed, key=key).messages.create(
                **hi, thinking={"type": "enabled", "budget_tokens": 1024}
            )
        # the SDK (2.x) sends its key as a bearer token; curl users and older clients send
        # Anthropic's own header
        for headers, status in (({"x-api-key": key}, 200), ({"x-api-key": "sk-no"}, 401)):
            code, _, raw = post(keyed, "/v1/messages", hi, headers=headers)
            assert code == status, raw[:300]
        assert json.loads(raw)["error"]["type"] == "authentication_error"
    finally:
        keyed.stop()


def test_max_tokens_past_the_context_ends_where_the_context_does(router):
    """Anthropic's max_tokens is a cap (clients such as Claude Code send 32,000 whatever the
    prompt): a prompt that leaves 8 tokens of the 512-token context is answered up to the
    context's end, stop_reason model_context_window_exceeded, not refused."""
    a = anthropic_client(router)
    n = a.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "x"}])
    filler = "x" * (512 - 8 - n.input_tokens + 1)  # one byte-level token per character
    m = a.messages.create(
        model=MODEL,
        max_tokens=100_000,
        messages=[{"role": "user", "content": filler}],
        extra_body=GREEDY,  # (greedy: the same tokens each run; none of them is the EOS)
    )
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == 512 - 8
    assert (m.stop_reason, m.usage.output_tokens) == ("model_context_window_exceeded", 8)
