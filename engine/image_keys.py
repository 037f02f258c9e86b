"""How a prompt's images key its prefix-cache blocks, shared by the engine (engine/multimodal.py),
the workers and the router (router/images.py), which must all hash the same ids: each image's
tokens become one number drawn from a hash of that image's pixel values (and, where the encoder
reads it, its size). Also which checkpoints are vision-language ones, and `ImageInputs`, what a
prompt's images are once its model's processor has made them. Imports nothing of the project
(the router may use it); pure functions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, NamedTuple

# vision-language checkpoints: an image encoder (transformers' own modules: engine/multimodal.py)
# in front of a language model of a family the engine serves (engine/config.py)
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration")


class ImageInputs(NamedTuple):
    """A prompt's images as the model's processor made them (torch tensors): pixel_values
    [images, channels, height, width] (LLaVA) or [images, tiles, channels, height, width], each
    image's tiles zero-padded to the prompt's most (LLaVA-NeXT's any-resolution tiling); and
    image_sizes [images, 2], each image's (height, width) before resizing, where the encoder
    reads it (LLaVA-NeXT), else None."""

    pixel_values: Any
    image_sizes: Any = None

    @property
    def count(self) -> int:
        return int(self.pixel_values.shape[0])


def image_inputs(images) -> ImageInputs | None:
    """`images` as ImageInputs: None, ImageInputs, a mapping with "pixel_values" (and
    "image_sizes", as a processor's output has them), or the pixel values alone."""
    if images is None or isinstance(images, ImageInputs):
        return images
    if isinstance(images, Mapping):
        return ImageInputs(images["pixel_values"], images.get("image_sizes"))
    return ImageInputs(images)


def image_keys(images) -> list[int]:
    """Each image's number in the prefix-cache ids (`images`: what `image_inputs` takes): a
    negative 62-bit number drawn from a hash of its pixel values' float32 bytes, without the
    all-zero tiles that pad it to another image's count (they depend on the other images of the
    prompt, and the encoder drops them), and of its size where the encoder reads one."""
    images = image_inputs(images)
    sizes = images.image_sizes
    keys = []
    for i, image in enumerate(images.pixel_values.float()):
        if image.dim() == 4:  # tiles: the trailing all-zero ones are padding
            n = image.shape[0]
            while n > 1 and not bool(image[n - 1].any()):
                n -= 1
            image = image[:n]
        digest = hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=8)
        if sizes is not None:
            digest.update(repr([int(v) for v in sizes[i]]).encode())
        keys.append(-1 - (int.from_bytes(digest.digest(), "little") >> 2))
    return keys


def image_cache_ids(
    prompt_ids: list[int], image_token_id: int, keys: list[int], counts: list[int] | None = None
) -> list[int]:
    """The prompt as its prefix-cache chain hashes it: its image tokens, in order, each image's
    (`counts` of them an image; None: split evenly between the images, as a fixed-size encoder
    gives them) replaced by its key (`image_keys`). Counts that do not add up to the prompt's
    image tokens key nothing (the engine refuses such a prompt)."""
    positions = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    out = list(prompt_ids)
    if not keys:
        return out
    if counts is None:
        if len(positions) % len(keys):
            return out
        counts = [len(positions) // len(keys)] * len(keys)
    if len(counts) != len(keys) or sum(counts) != len(positions):
        return out
    j = 0
    for key, count in zip(keys, counts):
        for p in positions[j : j + count]:
            out[p] = key
        j += count
    return out
