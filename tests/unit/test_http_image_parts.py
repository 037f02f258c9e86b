"""A chat's images on the HTTP front (router/openai/protocol.py): OpenAI's image_url parts, as
base64 data URLs, become the gRPC message's parts (text and image files, in order); a message
without images keeps its content string; every image the front cannot take is a 400 in OpenAI's
error shape, naming the field. The models and chat_messages are called directly: no sockets."""

from __future__ import annotations

import base64
import json

import pytest
from pydantic import ValidationError

from pdserve.protos.limits import MAX_IMAGE_FILE_BYTES, MAX_IMAGES, MAX_REQUEST_IMAGE_BYTES
from pdserve.router.openai.errors import validation_error
from pdserve.router.openai.protocol import (
    KNOWN_FIELDS,
    ChatCompletionRequest,
    TokenizeRequest,
    chat_messages,
)

PNG = b"\x89PNG\r\n\x1a\n not really a png"  # the front does not open it: the encoder does
JPEG = b"\xff\xd8\xff\xe0 nor a jpeg"


def url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image(data: bytes = PNG, **fields) -> dict:
    return {"type": "image_url", "image_url": {"url": url(data), **fields}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def user(*parts) -> dict:
    return {"role": "user", "content": list(parts)}


def chat(*messages, model=ChatCompletionRequest):
    return model.model_validate_json(json.dumps({"messages": list(messages)}))


def refusal(*messages, model=ChatCompletionRequest):
    """The 400 the front answers for `messages`: (param, message)."""
    with pytest.raises(ValidationError) as e:
        chat(*messages, model=model)
    err = validation_error(e.value, KNOWN_FIELDS)
    assert err.status == 400 and err.code == "invalid_value", err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    return err.param, err.message


def test_text_and_images_become_parts_in_their_order():
    body = chat(
        {"role": "system", "content": "be brief"},
        user(text("t5"), image(PNG, detail="low"), text("t6"), text("t7"), image(JPEG)),
    )
    system, message = chat_messages(body).messages
    assert system.content == "be brief" and not system.parts
    assert message.role == "user" and message.content == ""
    kinds = [(p.WhichOneof("part"), getattr(p, p.WhichOneof("part"))) for p in message.parts]
    assert kinds == [
        ("text", "t5"),
        ("image", PNG),
        ("text", "t6"),
        ("text", "t7"),
        ("image", JPEG),
    ]
    # the text, for the checks that read it (the prompt's size), is the text parts only
    assert body.messages[1].text() == "t5\nt6\nt7"
    assert body.messages[1].images() == [PNG, JPEG]


def test_image_url_as_a_bare_string_is_read_as_vllm_reads_it():
    body = chat(user({"type": "image_url", "image_url": url(JPEG, "image/jpeg")}, text("t5")))
    (message,) = chat_messages(body).messages
    assert [p.WhichOneof("part") for p in message.parts] == ["image", "text"]
    assert message.parts[0].image == JPEG and message.parts[1].text == "t5"


def test_a_chat_without_images_is_unchanged():
    body = chat(
        {"role": "system", "content": "s"},
        user(text("t5"), text("t6")),
        {"role": "assistant", "content": [text("t7")]},
    )
    got = chat_messages(body)
    assert [(m.role, m.content) for m in got.messages] == [
        ("system", "s"),
        ("user", "t5\nt6"),
        ("assistant", "t7"),
    ]
    assert not any(m.parts for m in got.messages)


def test_tokenize_takes_images_as_chat_completions_does():
    body = chat(user(text("t5"), image()), model=TokenizeRequest)
    (message,) = chat_messages(body).messages
    assert [p.WhichOneof("part") for p in message.parts] == ["text", "image"]
    too_many = user(*[image()] * (MAX_IMAGES + 1))
    param, message = refusal(too_many, model=TokenizeRequest)
    assert param == "messages" and f"at most {MAX_IMAGES} images" in message


@pytest.mark.parametrize("link", ["file:///a.png", "x", "ftp://example.com/a.png"])
def test_a_url_other_than_data_or_http_is_refused(link):
    """(An http(s) link is kept for the chat route to fetch, where the deployment allows its
    host: tests/unit/test_media_domains.py.)"""
    for part in (
        {"type": "image_url", "image_url": {"url": link}},
        {"type": "image_url", "image_url": link},
    ):
        param, message = refusal(user(part))
        assert param == "messages[0].content[0].image_url"
        assert "base64 data URL" in message and "allowed_media_domains" in message


@pytest.mark.parametrize(
    "data_url, words",
    [
        ("data:image/png;base64,not base64!", "not valid base64"),
        ("data:image/png;base64,QQ=", "not valid base64"),  # bad padding
        ("data:image/png,%89PNG", "base64 data URL"),  # a data URL, not a base64 one
        ("data:image/png;base64,", "no image"),
    ],
    ids=["characters", "padding", "not-base64-url", "empty"],
)
def test_bad_data_is_refused(data_url, words):
    param, message = refusal(user({"type": "image_url", "image_url": {"url": data_url}}))
    assert param == "messages[0].content[0].image_url" and words in message, message


def test_an_image_file_over_its_bound_is_refused():
    assert chat(user(image(b"x" * MAX_IMAGE_FILE_BYTES)))  # at the bound: taken
    param, message = refusal(user(image(b"x" * (MAX_IMAGE_FILE_BYTES + 1))))
    assert param == "messages[0].content[0].image_url"
    assert f"{MAX_IMAGE_FILE_BYTES + 1} bytes" in message and "20 MiB" in message
    # far past it: refused by the data's length, before it is decoded
    huge = "data:image/png;base64," + "A" * (MAX_IMAGE_FILE_BYTES * 2)
    param, message = refusal(user({"type": "image_url", "image_url": huge}))
    assert param == "messages[0].content[0].image_url" and "20 MiB" in message


def test_a_request_over_its_image_bounds_is_refused():
    # the count, across all messages together
    assert chat(user(*[image()] * (MAX_IMAGES - 1)), user(image()))
    param, message = refusal(user(*[image()] * (MAX_IMAGES - 1)), user(image(), image()))
    assert param == "messages" and f"at most {MAX_IMAGES} images" in message
    assert f"got {MAX_IMAGES + 1}" in message
    # the bytes of all the files together
    big = image(b"x" * (MAX_REQUEST_IMAGE_BYTES // 2 + 1))
    param, message = refusal(user(big), user(big))
    assert param == "messages" and "32 MiB of image files" in message


@pytest.mark.parametrize("role", ["system", "developer", "assistant", "tool"])
def test_images_only_in_user_messages(role):
    message = {"role": role, "content": [text("t5"), image()]}
    if role == "tool":
        message["tool_call_id"] = "c1"
    param, why = refusal(message)
    assert param == "messages[0].content"
    assert "only allowed in user messages" in why and role in why


@pytest.mark.parametrize(
    "part",
    [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
        {"type": "file", "file": {"file_data": "AAAA"}},
        {"type": "image_pil", "image_pil": None},
        "t5",
    ],
    ids=["input_audio", "video_url", "file", "image_pil", "bare-string"],
)
def test_other_parts_stay_refused(part):
    param, message = refusal(user(text("t5"), part))
    assert param == "messages[0].content"
    assert "not supported" in message and "'text'" in message and "'image_url'" in message


@pytest.mark.parametrize(
    "image_url, param",
    [
        ({"url": url(PNG), "detail": "ultra"}, "messages[0].content[0].image_url.detail"),
        ({"url": url(PNG), "uuid": "u"}, "messages[0].content[0].image_url.uuid"),
        ({"detail": "low"}, "messages[0].content[0].image_url.url"),
        (3, "messages[0].content[0].image_url"),
    ],
    ids=["detail", "unknown-field", "no-url", "not-an-object"],
)
def test_a_malformed_image_url_names_its_field(image_url, param):
    got, _ = refusal(user({"type": "image_url", "image_url": image_url}))
    assert got == param
