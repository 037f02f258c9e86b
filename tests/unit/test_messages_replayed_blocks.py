"""/v1/messages bodies as agents send them back (router/openai/messages_api.py): content blocks
dumped with the anthropic SDK's model_dump() (toolset_name: null, caller: null) replay, and a
block the schema refuses is named down to its field, not "Input should be a valid string"
(router/openai/errors.py validation_error, which the OpenAI chat path shares); a non-text block
inside a tool_result's content gets the same clear 400 as one in the message itself."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from helpers.sdk import LazyModule
from pdserve.router.openai.errors import validation_error
from pdserve.router.openai.messages_api import MESSAGES_FIELDS, MessagesRequest
from pdserve.router.openai.protocol import KNOWN_FIELDS, ChatCompletionRequest, CompletionRequest

anthropic_types = LazyModule("anthropic.types")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"name": "get_weather", "input_schema": SCHEMA}
USER = {"role": "user", "content": "the weather?"}


def _body(messages: list) -> dict:
    return {"model": "tiny", "max_tokens": 8, "tools": [TOOL], "messages": messages}


def _refusal(body: dict, model=MessagesRequest, known=MESSAGES_FIELDS):
    with pytest.raises(ValidationError) as e:
        model.model_validate_json(json.dumps(body))
    return validation_error(e.value, known)


def _turns(use: dict, result: dict) -> list:
    return [USER, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]


def test_blocks_dumped_by_the_sdk_replay():
    use = anthropic_types.ToolUseBlock(
        type="tool_use", id="toolu_1", name="get_weather", input={"city": "Paris"}
    ).model_dump()
    assert "toolset_name" in use and "caller" in use  # what the SDK's dump carries
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    for toolset in (None, "weather_tools"):  # null or a name: no effect on the chat
        body = _body(_turns({**use, "toolset_name": toolset}, {**result, "toolset_name": toolset}))
        chat = MessagesRequest.model_validate_json(json.dumps(body)).as_chat()
        assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]
        assert json.loads(chat.messages[1].tool_calls[0].function.arguments) == {"city": "Paris"}
        assert chat.messages[2].text() == "sunny"


def test_a_bad_block_is_named_down_to_its_field():
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    err = _refusal(_body(_turns({**use, "foo": 1}, result)))
    assert err.status == 400 and err.param == "messages[1].content[0].foo", err.message
    assert err.message.startswith("messages[1].content[0].foo: unknown field"), err.message
    assert "valid string" not in err.message
    err = _refusal(_body(_turns(use, {"type": "tool_result", "content": "sunny"})))
    assert err.message == "messages[2].content[0].tool_use_id: Field required", err.message
    err = _refusal(_body(_turns({**use, "input": "Paris"}, result)))
    assert err.param == "messages[1].content[0].input", err.message
    assert "should be an object" in err.message
    # text sent where text or blocks are taken is still read as text
    err = _refusal(_body([{"role": "user", "content": 5}]))
    assert err.param == "messages[0].content" and "valid string" in err.message, err.message


def test_the_chat_path_names_a_bad_content_part_too():
    def chat(content) -> dict:
        return {"model": "tiny", "messages": [{"role": "user", "content": content}]}

    known = KNOWN_FIELDS
    err = _refusal(chat([{"type": "text", "text": "x", "foo": 1}]), ChatCompletionRequest, known)
    assert err.param == "messages[0].content[0].foo", err.message
    assert err.message.startswith("messages[0].content[0].foo: unknown field"), err.message
    err = _refusal(chat([{"type": "text"}]), ChatCompletionRequest, known)
    assert err.message == "messages[0].content[0].text: Field required", err.message
    err = _refusal(chat([]), ChatCompletionRequest, known)
    assert err.message == (
        "messages[0].content: List should have at least 1 item after validation, not 0"
    )
    err = _refusal(chat(5), ChatCompletionRequest, known)
    assert "Input should be a valid string" in err.message, err.message


def test_an_image_in_a_tool_result_gets_the_clear_400():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    text = {"type": "text", "text": "a screenshot:"}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [text, image]}
    err = _refusal(_body(_turns(use, result)))
    assert err.status == 400 and err.param == "messages", err.message
    assert err.message.startswith(
        "messages: messages[2].content[0].content[1]: blocks of type 'image' are not supported "
        "in a tool_result's content: this model reads text"
    ), err.message
    # text blocks (and a string) in a tool_result are served
    for content in ([text], "sunny"):
        body = _body(_turns(use, {**result, "content": content}))
        assert MessagesRequest.model_validate_json(json.dumps(body)).as_chat().messages[2]


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"prompt": [[5]] * 65}, "prompt", "at most 64 items"),  # list[list[int]]'s one error
        ({"prompt": [5, -1]}, "prompt[1]", "greater than or equal to 0"),
        ({"stop": [""]}, "stop[0]", "at least 1 character"),
        ({"prompt": [[]]}, "prompt[0]", "at least 1 item"),  # an empty token list
    ],
)
def test_a_list_sent_to_a_text_or_list_field_is_named_by_its_closest_member(body, param, says):
    """Of a union's several list members, the one with the fewest errors says what is wrong:
    65 prompts are too many, not 65 token ids that are not integers."""
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **body})
    error = validation_error(e.value, set(CompletionRequest.model_fields))
    assert error.param == param and says in error.message, error.message
