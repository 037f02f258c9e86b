"""Images on /v1/responses (router/openai/responses_api.py): a user message's input_image parts
(image_url a base64 data URL) reach the router's gRPC chat as image parts, in their order among
the text parts; they are stored and listed back as the API lists them, replayed by
previous_response_id and by a conversation, and counted in the store's bytes; every image the
front cannot take is a 400 in OpenAI's error shape naming the field. On the front's ASGI app with
a fake router (no socket), and on the request model directly."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from pydantic import ValidationError

from helpers.http_front import FakeRouter, asgi_call, front_app, one_token
from pdserve.protos.limits import MAX_IMAGE_FILE_BYTES, MAX_IMAGES
from pdserve.router.openai.errors import validation_error
from pdserve.router.openai.responses_api import RESPONSES_FIELDS, ResponsesRequest

PNG = b"\x89PNG\r\n\x1a\n not really a png"  # the front does not open it: the encoder does
JPEG = b"\xff\xd8\xff\xe0 nor a jpeg"


def url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image(data: bytes = PNG, **fields) -> dict:
    return {"type": "input_image", "image_url": url(data), **fields}


def text(t: str) -> dict:
    return {"type": "input_text", "text": t}


def user(*parts) -> dict:
    return {"type": "message", "role": "user", "content": list(parts)}


def parts(message) -> list[tuple[str, object]]:
    """A gRPC ChatMessage's parts: (kind, text or image bytes)."""
    return [(p.WhichOneof("part"), getattr(p, p.WhichOneof("part"))) for p in message.parts]


def _app(**settings):
    router = FakeRouter(lambda gen: one_token(3))
    return router, front_app(stub=router, **settings)


def _call(app, method: str, path: str, body: dict | None = None, query: str = ""):
    raw = json.dumps(body).encode() if body is not None else b""
    status, _, reply = asyncio.run(asgi_call(app, method, path, raw, query))
    return status, reply


def test_text_and_images_reach_the_router_in_their_order():
    router, app = _app()
    body = {
        "instructions": "be brief",
        "input": [user(text("t5"), image(PNG, detail="low"), text("t6"), text("t7"), image(JPEG))],
    }
    status, reply = _call(app, "POST", "/v1/responses", body)
    assert status == 200, reply
    system, message = router.gens[0].chat.messages
    assert (system.role, system.content) == ("system", "be brief") and not system.parts
    assert message.role == "user" and message.content == ""
    # adjacent text parts are one text, as a message of text alone joins them
    assert parts(message) == [("text", "t5"), ("image", PNG), ("text", "t6t7"), ("image", JPEG)]


def test_a_message_of_text_alone_is_unchanged():
    body = ResponsesRequest.model_validate_json(json.dumps({"input": [user(text("a"), text("b"))]}))
    (message,) = body.as_chat().messages
    assert message.content == "ab"


def test_images_are_listed_back_and_replayed_by_previous_response_id():
    router, app = _app()
    first = {"input": [user(text("t5"), image(PNG, detail="high"), image(JPEG))]}
    status, reply = _call(app, "POST", "/v1/responses", first)
    assert status == 200, reply
    status, listed = _call(
        app, "GET", f"/v1/responses/{reply['id']}/input_items", query="order=asc"
    )
    assert status == 200, listed
    (item,) = listed["data"]
    assert item["role"] == "user" and item["content"] == [
        {"type": "input_text", "text": "t5"},
        {"type": "input_image", "image_url": url(PNG), "detail": "high"},
        {"type": "input_image", "image_url": url(JPEG), "detail": "auto"},
    ]
    # the stored images count toward the store's bytes (their data URLs, as stored)
    assert app.state.front.responses.bytes > len(url(PNG)) + len(url(JPEG))
    # the next turn replays them into the chat, before the new input
    then = {"previous_response_id": reply["id"], "input": [user(image(JPEG), text("t6"))]}
    status, second = _call(app, "POST", "/v1/responses", then)
    assert status == 200, second
    messages = router.gens[1].chat.messages
    assert [m.role for m in messages] == ["user", "assistant", "user"]
    assert parts(messages[0]) == [("text", "t5"), ("image", PNG), ("image", JPEG)]
    assert messages[1].content == "t8" and parts(messages[2]) == [("image", JPEG), ("text", "t6")]
    # a listed item sent back as input (the SDK's replay) is read as it was sent
    status, third = _call(app, "POST", "/v1/responses", {"input": [item]})
    assert status == 200, third
    assert parts(router.gens[2].chat.messages[0]) == parts(messages[0])


def test_a_conversation_keeps_and_replays_its_images():
    router, app = _app()
    status, conversation = _call(app, "POST", "/v1/conversations", {"items": [user(image(PNG))]})
    assert status == 200, conversation
    key = conversation["id"]
    status, reply = _call(app, "POST", "/v1/responses", {"conversation": key, "input": "t5"})
    assert status == 200, reply
    first, question = router.gens[0].chat.messages
    assert parts(first) == [("image", PNG)] and question.content == "t5"
    status, items = _call(app, "GET", f"/v1/conversations/{key}/items", query="order=asc")
    assert items["data"][0]["content"] == [
        {"type": "input_image", "image_url": url(PNG), "detail": "auto"}
    ]


def test_earlier_images_count_toward_a_requests_bound():
    router, app = _app()
    earlier = [user(*[image()] * (MAX_IMAGES - 1))]
    app.state.front.responses.put({"id": "resp_1"}, earlier, (0, 1), None)
    body = {"previous_response_id": "resp_1", "input": [user(image())]}
    status, reply = _call(app, "POST", "/v1/responses", body)  # 16: taken
    assert status == 200, reply
    status, reply = _call(app, "POST", "/v1/responses", {**body, "input": [user(image(), image())]})
    assert status == 400 and len(router.gens) == 1, reply
    error = reply["error"]
    assert error["param"] == "previous_response_id" and error["type"] == "invalid_request_error"
    assert f"at most {MAX_IMAGES} images in a request, got {MAX_IMAGES + 1}" in error["message"]


def _refusal(input_items) -> tuple[str, str]:
    with pytest.raises(ValidationError) as e:
        ResponsesRequest.model_validate_json(json.dumps({"input": input_items}))
    err = validation_error(e.value, RESPONSES_FIELDS)
    assert err.status == 400 and err.code == "invalid_value", err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    return err.param, err.message


FIELD = "input[0].content[0].image_url"


@pytest.mark.parametrize(
    "part, param, words",
    [
        (image(image_url="ftp://example.com/a.png"), FIELD, "http(s) link"),
        (image(image_url="data:image/png;base64,not base64!"), FIELD, "not valid base64"),
        (image(image_url="data:image/png;base64,QQ="), FIELD, "not valid base64"),
        (image(image_url="data:image/png;base64,"), FIELD, "no image"),
        ({"type": "input_image"}, FIELD, "Field required"),
        (image(file_id="file-1"), "input[0].content[0].file_id", "file_id are not served"),
        ({"type": "input_image", "file_id": "file-1"}, "input[0].content[0].file_id", "file_id"),
        (image(detail="ultra"), "input[0].content[0].detail", None),
        (image(uuid="u"), "input[0].content[0].uuid", "unknown field"),
        (image(image_url=5), FIELD, None),
        ({"type": "input_file", "file_data": "AAAA"}, "input", "'input_file'"),
    ],
    ids=[
        "link",
        "characters",
        "padding",
        "empty",
        "no-url",
        "file-id",
        "file-id-alone",
        "detail",
        "unknown-field",
        "not-text",
        "file-part",
    ],
)
def test_an_image_the_front_cannot_take_names_its_field(part, param, words):
    got, message = _refusal([user(part)])
    assert got == param, message
    assert words is None or words in message, message


def test_a_link_past_its_bound_is_refused():
    link = "https://example.com/" + "a" * 2048
    param, message = _refusal([user(image(image_url=link))])
    assert param == FIELD and "at most 2048 characters" in message, message


def test_an_image_file_over_its_bound_is_refused():
    assert _valid([user(image(b"x" * MAX_IMAGE_FILE_BYTES))])  # at the bound: taken
    param, message = _refusal([user(image(b"x" * (MAX_IMAGE_FILE_BYTES + 1)))])
    assert param == FIELD and "20 MiB" in message, message


def _valid(input_items) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps({"input": input_items}))


def test_the_inputs_images_are_bounded_as_a_requests():
    assert _valid([user(*[image()] * (MAX_IMAGES - 1)), user(image())])
    param, message = _refusal([user(*[image()] * MAX_IMAGES), user(image())])
    assert param == "input" and f"at most {MAX_IMAGES} images" in message, message


@pytest.mark.parametrize("role", ["system", "developer", "assistant"])
def test_images_only_in_user_messages(role):
    param, message = _refusal([{"type": "message", "role": role, "content": [image()]}])
    assert param == "input", message
    assert "only allowed in user messages" in message and role in message, message


def test_a_refusal_on_the_wire_is_openais_400():
    router, app = _app()
    body = {"input": [user(image(image_url="https://example.com/a.png"))]}
    status, reply = _call(app, "POST", "/v1/responses", body)
    assert status == 400 and not router.gens, reply  # (a link, where no host is allowed)
    assert reply["error"]["param"] == "input" and reply["error"]["type"] == "invalid_request_error"
    assert "allowed_media_domains is empty" in reply["error"]["message"]
