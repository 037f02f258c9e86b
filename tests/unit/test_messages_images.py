"""Images on /v1/messages (router/openai/messages_api.py): a user's image blocks with a base64
source reach the router's gRPC chat as image parts (a data URL of media_type and data, decoded
there), in their order among the text blocks, joined turns and tool results included;
/v1/messages/count_tokens counts them; every image the front cannot take is a 400 in Anthropic's
error shape naming the field. On the request model directly, and on the front's ASGI app with a
fake router and a fake prompt encoder (no socket)."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from pydantic import ValidationError

from helpers.http_front import FakeRouter, asgi_call, front_app, one_token
from pdserve.protos.limits import MAX_IMAGE_FILE_BYTES, MAX_IMAGES
from pdserve.router.openai.errors import validation_error
from pdserve.router.openai.messages_api import MESSAGES_FIELDS, MessagesRequest
from pdserve.router.openai.protocol import chat_messages

PNG = b"\x89PNG\r\n\x1a\n not really a png"  # the front does not open it: the encoder does
GIF = b"GIF89a nor a gif"


def image(data: bytes = PNG, media_type: str = "image/png", **source) -> dict:
    """An image block; `source` fields replace its source's (b64: its data as sent)."""
    b64 = source.pop("b64", base64.b64encode(data).decode())
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": media_type, "data": b64, **source},
    }


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def user(*blocks) -> dict:
    return {"role": "user", "content": list(blocks)}


def body(*messages, **fields) -> dict:
    return {"model": "org/tiny", "max_tokens": 8, "messages": list(messages), **fields}


def grpc_chat(*messages):
    request = MessagesRequest.model_validate_json(json.dumps(body(*messages)))
    return chat_messages(request.as_chat())


def parts(message) -> list[tuple[str, object]]:
    """A gRPC ChatMessage's parts: (kind, text or image bytes)."""
    return [(p.WhichOneof("part"), getattr(p, p.WhichOneof("part"))) for p in message.parts]


def test_text_and_image_blocks_become_parts_in_their_order():
    (message,) = grpc_chat(
        user(text("t5"), image(PNG), text("t6"), image(GIF, "image/gif"), text("t7"))
    ).messages
    assert message.role == "user" and message.content == ""
    assert parts(message) == [
        ("text", "t5"),
        ("image", PNG),
        ("text", "t6"),
        ("image", GIF),
        ("text", "t7"),
    ]


def test_joined_turns_and_tool_results_keep_the_images_order():
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    chat = grpc_chat(
        {"role": "user", "content": "t5"},
        user(image(PNG)),  # joined to the turn before, as Anthropic joins them
        {"role": "assistant", "content": [use]},
        user(result, image(GIF, "image/gif"), text("t6")),
    )
    roles = [m.role for m in chat.messages]
    assert roles == ["user", "assistant", "tool", "user"]
    assert parts(chat.messages[0]) == [("text", "t5"), ("image", PNG)]
    assert chat.messages[2].content == "sunny"
    assert parts(chat.messages[3]) == [("image", GIF), ("text", "t6")]
    # an image alone after a tool result is a user turn of its own
    chat = grpc_chat(
        user(text("t5")), {"role": "assistant", "content": [use]}, user(result, image())
    )
    assert [m.role for m in chat.messages][-2:] == ["tool", "user"]
    assert parts(chat.messages[-1]) == [("image", PNG)]


def test_text_alone_is_unchanged():
    (message,) = grpc_chat(user(text("t5"), text("t6"))).messages
    assert message.content == "t5\nt6" and not message.parts


class _Encoder:
    """The router's prompt encoder, faked: a token per text part's word, 100 per image."""

    max_model_len = 4096

    def __init__(self):
        self.chats = []

    def tokenize_chat(self, chat, add_special_tokens=False):
        self.chats.append(chat)
        n = 0
        for m in chat.messages:
            n += len(m.content.split())
            for p in m.parts:
                n += 100 if p.WhichOneof("part") == "image" else len(p.text.split())
        return [1] * n


def _post(app, path: str, payload: dict):
    status, _, reply = asyncio.run(asgi_call(app, "POST", path, json.dumps(payload).encode()))
    return status, reply


def test_the_images_reach_the_router_and_count_tokens_counts_them():
    router, encoder = FakeRouter(lambda gen: one_token(3)), _Encoder()
    app = front_app(stub=router, encoder=encoder)
    payload = body(user(text("what is it"), image(PNG), image(GIF, "image/gif")))
    status, reply = _post(app, "/v1/messages", payload)
    assert status == 200 and reply["type"] == "message", reply
    (message,) = router.gens[0].chat.messages
    assert parts(message) == [("text", "what is it"), ("image", PNG), ("image", GIF)]
    del payload["max_tokens"]
    status, reply = _post(app, "/v1/messages/count_tokens", payload)
    assert status == 200 and reply == {"input_tokens": 3 + 200}, reply
    assert parts(encoder.chats[0].messages[0]) == parts(message)


def _refusal(*messages) -> tuple[str, str]:
    with pytest.raises(ValidationError) as e:
        MessagesRequest.model_validate_json(json.dumps(body(*messages)))
    err = validation_error(e.value, MESSAGES_FIELDS)
    assert err.status == 400 and err.code == "invalid_value", err.message
    return err.param, err.message


SOURCE = "messages[0].content[0].source"


@pytest.mark.parametrize(
    "block, param, words",
    [
        (
            {"type": "image", "source": {"type": "url", "url": "ftp://example.com/a.png"}},
            SOURCE,
            "a url source needs its url, an http(s) link",
        ),
        (
            {
                "type": "image",
                "source": {"type": "url", "url": "https://a.b/c.png", "data": "QQ=="},
            },
            SOURCE,
            "a url source holds its url alone",
        ),
        ({"type": "image", "source": {}}, "messages", f"{SOURCE}: blocks of type 'image'"),
        ({"type": "image"}, "messages", "base64 source ({'type'"),
        (
            {"type": "image", "source": {"type": "file", "file_id": "f"}},
            "messages",
            "not of type 'file'",
        ),
        (image(b64="not base64!"), f"{SOURCE}.data", "not valid base64"),
        (image(b64="QQ="), f"{SOURCE}.data", "not valid base64"),
        (image(b64=""), f"{SOURCE}.data", "no image"),
        (image(media_type="image/bmp"), f"{SOURCE}.media_type", "'image/webp'"),
        (image(extra=1), f"{SOURCE}.extra", "unknown field"),
        ({**image(), "title": "t"}, "messages[0].content[0].title", "unknown field"),
        (
            {"type": "document", "source": {}},
            "messages",
            "blocks of type 'document' are not supported",
        ),
    ],
    ids=[
        "url",
        "url-and-data",
        "empty-source",
        "no-source",
        "file-source",
        "characters",
        "padding",
        "empty",
        "media-type",
        "unknown-source-field",
        "unknown-field",
        "document",
    ],
)
def test_an_image_the_front_cannot_take_names_its_field(block, param, words):
    got, message = _refusal(user(block))
    assert got == param, message
    assert words in message, message


def test_an_image_file_over_its_bound_is_refused():
    assert grpc_chat(user(image(b"x" * MAX_IMAGE_FILE_BYTES)))  # at the bound: taken
    param, message = _refusal(user(image(b"x" * (MAX_IMAGE_FILE_BYTES + 1))))
    assert param == f"{SOURCE}.data" and "20 MiB" in message, message


def test_a_requests_images_are_bounded_as_chats():
    assert grpc_chat(user(*[image()] * (MAX_IMAGES - 1)), user(image()))
    param, message = _refusal(user(*[image()] * MAX_IMAGES), user(image()))
    assert param == "messages" and f"at most {MAX_IMAGES} images" in message, message


def test_images_only_in_a_users_blocks():
    param, message = _refusal(user(text("t5")), {"role": "assistant", "content": [image()]})
    assert param == "messages" and "assistant message cannot hold a image block" in message
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [image()]}
    param, message = _refusal(
        user(text("t5")), {"role": "assistant", "content": [use]}, user(result)
    )
    assert param == "messages" and "not supported in a tool_result's content" in message


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_refusal_on_the_wire_is_anthropics_400(path):
    router = FakeRouter(lambda gen: one_token(3))
    app = front_app(stub=router, encoder=_Encoder())
    block = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    payload = body(user(block))
    if path.endswith("count_tokens"):
        del payload["max_tokens"]
    status, reply = _post(app, path, payload)
    assert status == 400 and not router.gens, reply
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    assert "allowed_media_domains is empty" in reply["error"]["message"]  # (no host allowed)
