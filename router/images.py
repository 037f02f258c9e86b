"""A vision-language model's chat images on the router: from the image files a client sends
(pdserve.v1.ContentPart) to the token ids and pixel values the workers run.

`ChatImages` belongs to the router's PromptEncoder (router/text.py) when the deployment serves a
vision-language checkpoint (LLaVA, LLaVA-NeXT, Idefics 3, Qwen2-VL), and runs on the encoder's one
thread. For a chat whose messages hold images it opens each file with Pillow (bounded first:
MAX_IMAGES images, each file MAX_IMAGE_FILE_BYTES and MAX_IMAGE_PIXELS, all files
MAX_REQUEST_IMAGE_BYTES, from protos/limits.py), places the images in the conversation as the
chat template reads them (an {"type": "image"} part where the template loops over a message's
parts, else a placeholder line ahead of the message's text, as vLLM and the engine's LLM.chat
do), and after the template has rendered the chat, lets the model's processor (transformers'
AutoProcessor, loaded from the model's directory on the encoder's thread as the router starts)
expand each placeholder into the image's tokens and make the pixel values, taken one row an
image (engine/image_keys.py processor_inputs). `PromptImages` is what a call then carries: the
images' inputs as the workers take them (worker.PixelValues, sent with Reserve and Prefill)
and each image's key and count of tokens, so that the router's KV index and prefix affinity
hash the same ids the workers' prefix caches do (engine/multimodal.py image_cache_ids).
Nothing here outlives a call but the processor.
"""

from __future__ import annotations

import io

import grpc

from pdserve.engine.image_keys import (
    image_cache_ids,
    image_inputs,
    image_keys,
    processor_inputs,
)
from pdserve.protos.limits import (
    MAX_IMAGE_FILE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    MAX_PIXEL_VALUE_BYTES,
    MAX_REQUEST_IMAGE_BYTES,
)
from pdserve.protos.pdserve.v1 import worker_pb2


class PromptImages:
    """One prompt's images as a call carries them to the workers: their pixel values, one row
    an image or Qwen2-VL's run of patches (and LLaVA-NeXT's image sizes, Idefics 3's pixel
    masks, Qwen2-VL's grids), and, for the router's own KV index, each image's key and its
    count of image tokens (as the processor counts them; None: the same for every image)."""

    def __init__(self, inputs, image_token_id: int, counts: list[int] | None = None):
        inputs = image_inputs(inputs)
        values = inputs.pixel_values.float().contiguous()
        sizes, mask = inputs.image_sizes, inputs.pixel_attention_mask
        grids = inputs.image_grid_thw
        self.pixels = worker_pb2.PixelValues(
            shape=list(values.shape),
            data=values.numpy().tobytes(),
            image_sizes=[] if sizes is None else [int(v) for v in sizes.reshape(-1)],
            pixel_attention_mask=b"" if mask is None else mask.bool().numpy().tobytes(),
            image_grid_thw=[] if grids is None else [int(v) for v in grids.reshape(-1)],
        )
        self.keys = image_keys(inputs)
        self.token = image_token_id
        self.counts = counts

    def keyed(self, tokens) -> list[int]:
        """`tokens` (the prompt, maybe with tokens after it) as the prefix caches hash them."""
        return image_cache_ids(list(tokens), self.token, self.keys, self.counts)


def has_images(chat) -> bool:
    return any(p.WhichOneof("part") == "image" for m in chat.messages for p in m.parts)


def parts_as_content(chat, bad_request):
    """A copy of a chat without images whose messages' parts (text only) are joined into their
    content, one per line (as OpenAI's text parts are), for the chat template."""
    out = type(chat)()
    out.CopyFrom(chat)
    for i, m in enumerate(out.messages):
        if not m.parts:
            continue
        if m.content:
            raise bad_request(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chat.messages[{i}] has both content and parts: send one of them",
            )
        m.content = "\n".join(p.text for p in m.parts if p.text)
        del m.parts[:]
    return out


class ChatImages:
    """The model's processor and what the router does with a chat's images (the module
    docstring); every method but the constructor runs on the encoder's thread."""

    def __init__(
        self,
        model_dir: str,
        image_token_id: int,
        bad_request,
        most: int = MAX_IMAGES,
        processor_kwargs: dict | None = None,
    ):
        self.model_dir, self.token = model_dir, image_token_id
        self.most = most  # the images one prompt may hold (router.limit_mm_per_prompt)
        # more arguments of the processor's call (router.mm_processor_kwargs)
        self.processor_kwargs = dict(processor_kwargs or {})
        self.bad_request = bad_request  # (code, message) -> the exception to raise
        self._processor = None
        self._formats: dict[str, str] = {}  # chat template -> "openai" | "string"

    def load(self):
        """The model's processor, loaded on first use; a checkpoint without a working one refuses
        images (FAILED_PRECONDITION, saying why), and the router goes on serving text."""
        if self._processor is None:
            from transformers import AutoProcessor

            try:
                self._processor = AutoProcessor.from_pretrained(self.model_dir)
            except Exception as e:
                raise self.bad_request(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the model's processor (its directory's preprocessor and tokenizer files) "
                    f"does not load, so images cannot be read: {str(e)[:300]}",
                ) from None
        return self._processor

    def chat_template(self) -> str | None:
        return getattr(self.load(), "chat_template", None)

    def contents(self, chat, template: str) -> tuple[list, list]:
        """(each message's content as the template reads it, the images opened, in order)."""
        if template not in self._formats:
            from pdserve.engine.chat_content import content_format

            self._formats[template] = content_format(template)
        openai_format = self._formats[template] == "openai"
        placeholder = getattr(self.load(), "image_token", None) or "<image>"
        files = [p.image for m in chat.messages for p in m.parts if p.WhichOneof("part") == "image"]
        self._check_files(files)
        images, out = [], []
        for i, m in enumerate(chat.messages):
            if not m.parts:
                out.append(m.content)
                continue
            if m.content:
                raise self.bad_request(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"chat.messages[{i}] has both content and parts: send one of them",
                )
            parts = []
            for p in m.parts:
                if p.WhichOneof("part") == "image":
                    images.append(self._open(p.image, f"chat.messages[{i}]"))
                    parts.append({"type": "image"})
                elif p.text:
                    parts.append({"type": "text", "text": p.text})
            if openai_format and m.role != "tool":
                out.append(parts)
            else:  # vLLM's "string" format: a placeholder line per image, then the text
                shown = sum(part["type"] == "image" for part in parts)
                text = "\n".join(part["text"] for part in parts if part["type"] == "text")
                out.append(f"{placeholder}\n" * shown + text)
        return out, images

    def _check_files(self, files: list[bytes]) -> None:
        too = None
        if len(files) > self.most:
            too = f"the chat holds {len(files)} images; at most {self.most} are allowed"
            if self.most < MAX_IMAGES:
                too += " on this deployment (router.limit_mm_per_prompt)"
        elif sum(map(len, files)) > MAX_REQUEST_IMAGE_BYTES:
            too = (
                f"the chat's image files take {sum(map(len, files))} bytes; at most "
                f"{MAX_REQUEST_IMAGE_BYTES} are allowed"
            )
        elif any(len(f) > MAX_IMAGE_FILE_BYTES for f in files):
            too = f"an image file is over {MAX_IMAGE_FILE_BYTES} bytes: send a smaller one"
        if too:
            raise self.bad_request(grpc.StatusCode.INVALID_ARGUMENT, too)

    def _open(self, data: bytes, where: str):
        """The image in `data`, decoded, once its size in pixels is known to be within bounds."""
        from PIL import Image

        try:
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise self.bad_request(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where}: an image of {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} "
                    f"pixels are allowed: send a smaller one",
                )
            image.load()
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise self.bad_request(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: an image part's bytes are not an image file this server opens "
                f"(PNG, JPEG, WebP, GIF, ...): {str(e)[:200]}",
            ) from None
        return image

    def encode(self, rendered: str, images: list, add_special_tokens: bool):
        """(the prompt's ids, PromptImages) of a rendered chat and its images."""
        try:
            out = self.load()(
                text=rendered,
                images=images,
                return_tensors="pt",
                add_special_tokens=add_special_tokens,
                **self.processor_kwargs,
            )
        except Exception as e:  # an image the processor cannot take (its mode, its size)
            raise self.bad_request(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the model's processor refused the chat's images: {str(e)[:300]}",
            ) from None
        ids = out["input_ids"][0].tolist()
        inputs, counts = processor_inputs(self.load(), out, images)
        size = 4 * inputs.pixel_values.numel()  # (one row an image, as the workers get them)
        if size > MAX_PIXEL_VALUE_BYTES:
            raise self.bad_request(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the chat's images make {size} bytes of pixel values; at most "
                f"{MAX_PIXEL_VALUE_BYTES} are allowed: send fewer or smaller images",
            )
        if counts is not None and sum(counts) != ids.count(self.token):
            counts = None  # (the keys then split the image tokens evenly: a fixed count's way)
        return ids, PromptImages(inputs, self.token, counts)
