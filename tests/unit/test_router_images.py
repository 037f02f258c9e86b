"""A chat's images on the router (router/images.py, router/text.py) and at the workers' edge
(protos/limits.py check_pixel_values), without a vision-language model: images sent to a model of
text only are refused by name, as are too many images, too many bytes of them, an image of too
many pixels and bytes that are no image; pixel values whose shape and data disagree or that
exceed the bounds are refused before a worker reads them. (A tiny LLaVA through the cluster:
tests/integration/test_llava_cluster.py.)"""

from __future__ import annotations

import io
import math

import grpc
import pytest

from pdserve.engine.tokenizer import load_tokenizer
from pdserve.protos.limits import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    MAX_PIXEL_VALUE_BYTES,
    check_pixel_values,
)
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.router.images import ChatImages
from pdserve.router.text import BadRequest, PromptEncoder


def png(width: int, height: int, mode: str = "RGB") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new(mode, (width, height)).save(out, format="PNG")
    return out.getvalue()


def chat_with(*files: bytes) -> pdserve_pb2.GenerateRequest:
    message = pdserve_pb2.ChatMessage(role="user", parts=[pdserve_pb2.ContentPart(text="t5")])
    for f in files:
        message.parts.add(image=f)
    return pdserve_pb2.GenerateRequest(chat=pdserve_pb2.ChatMessages(messages=[message]))


def test_a_model_of_text_only_refuses_images_and_still_reads_text(tiny_models):
    tok = load_tokenizer(tiny_models("llama-gqa")[0])
    tok.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    encoder = PromptEncoder(tok, 256)
    try:
        with pytest.raises(BadRequest) as refused:
            encoder.encode_with_images(chat_with(png(4, 4)))
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "takes no images" in refused.value.message
        text = pdserve_pb2.ChatMessage(role="user", content="t5 t6")
        request = pdserve_pb2.GenerateRequest(chat=pdserve_pb2.ChatMessages(messages=[text]))
        assert encoder.encode_with_images(request) == ([5, 6], None)
    finally:
        encoder.close()


def test_image_files_over_the_bounds_or_not_images_are_refused():
    images = ChatImages("/nowhere", 256, BadRequest)  # (the processor is never loaded here)
    small = png(2, 2)
    with pytest.raises(BadRequest, match=f"at most {MAX_IMAGES} are allowed"):
        images._check_files([small] * (MAX_IMAGES + 1))
    with pytest.raises(BadRequest, match="bytes; at most"):
        images._check_files([b"x" * (17 << 20)] * 2)
    with pytest.raises(BadRequest, match="an image file is over"):
        images._check_files([b"x" * (21 << 20)])
    images._check_files([small] * MAX_IMAGES)  # within every bound
    with pytest.raises(BadRequest, match="not an image file"):
        images._open(b"GIF89a but not one", "chat.messages[0]")
    with pytest.raises(BadRequest, match="6001x6001 pixels"):  # refused before it is decoded
        images._open(png(6001, 6001, mode="1"), "chat.messages[0]")
    assert images._open(small, "chat.messages[0]").size == (2, 2)
    with pytest.raises(BadRequest, match="processor .* does not load") as no_processor:
        images.load()  # (a directory without the model's processor files)
    assert no_processor.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_pixel_values_are_checked_at_the_workers_edge():
    def values(shape, nbytes=None, sizes=(), mask=b""):
        size = 4 * math.prod(shape) if len(shape) in (4, 5) else 0
        return worker_pb2.PixelValues(
            shape=shape,
            data=b"\0" * (size if nbytes is None else nbytes),
            image_sizes=sizes,
            pixel_attention_mask=mask,
        )

    assert check_pixel_values(worker_pb2.PixelValues()) is None  # unset: a prompt of text
    assert check_pixel_values(values([2, 3, 8, 8])) is None
    assert check_pixel_values(values([2, 5, 3, 8, 8], sizes=[40, 40, 30, 70])) is None  # tiles
    assert check_pixel_values(values([2, 5, 3, 8, 8], mask=b"\1" * 640)) is None  # Idefics 3
    # SmolVLM's largest image: 16 tiles of 512x512 and the whole one (51 MiB)
    assert check_pixel_values(values([1, 17, 3, 512, 512], mask=b"\1" * 17 * 512 * 512)) is None
    cases = {
        "4 or 5 positive sizes": values([3, 8, 8]),
        "positive": values([1, 0, 8, 8]),
        f"at most {MAX_IMAGES}": values([MAX_IMAGES + 1, 1, 1, 1]),
        "bytes, but shape": values([1, 3, 8, 8], nbytes=10),
        f"at most {MAX_PIXEL_VALUE_BYTES}": worker_pb2.PixelValues(shape=[16, 3, 1024, 1024]),
        "a height and a width for each of the 2": values([2, 5, 3, 8, 8], sizes=[40, 40, 30]),
        "positive heights": values([1, 5, 3, 8, 8], sizes=[0, 40]),
        f"at most {MAX_IMAGE_PIXELS} pixels": values([1, 5, 3, 8, 8], sizes=[10**5, 10**5]),
        "a byte a pixel of [images, tiles, height, width] (640": values(
            [2, 5, 3, 8, 8], mask=b"\1" * 639
        ),
        "(64 for shape [1, 3, 8, 8], 5 sizes)": values([1, 3, 8, 8], mask=b"\1" * 64),
        "only bytes 0 and 1": values([2, 5, 3, 8, 8], mask=b"\2" * 640),
    }
    for words, message in cases.items():
        refusal = check_pixel_values(message)
        assert refusal is not None and refusal.code == grpc.StatusCode.INVALID_ARGUMENT, words
        assert words in refusal.message, (words, refusal.message)


def test_parts_of_text_alone_read_as_the_message_s_content(tiny_models):
    tok = load_tokenizer(tiny_models("llama-gqa")[0])
    tok.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    encoder = PromptEncoder(tok, 256)
    try:
        parts = [pdserve_pb2.ContentPart(text="t5 t6"), pdserve_pb2.ContentPart(text="t7")]
        message = pdserve_pb2.ChatMessage(role="user", parts=parts)
        request = pdserve_pb2.GenerateRequest(chat=pdserve_pb2.ChatMessages(messages=[message]))
        assert encoder.encode_with_images(request) == ([5, 6, 7], None)
        message.content = "t8"  # both: refused
        request = pdserve_pb2.GenerateRequest(chat=pdserve_pb2.ChatMessages(messages=[message]))
        with pytest.raises(BadRequest, match="both content and parts"):
            encoder.encode_with_images(request)
    finally:
        encoder.close()
