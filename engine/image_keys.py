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
MULTIMODAL_ARCHITECTURES = (
    "LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "Idefics3ForConditionalGeneration",  # SmolVLM's too
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
)
# those whose language model attends each image's tokens to one another both ways (every token
# of an image sees the whole image, text stays causal: Gemma 3's prefix-LM masking of images)
BIDIRECTIONAL_IMAGE_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)


class ImageInputs(NamedTuple):
    """A prompt's images as the model's processor made them (torch tensors): pixel_values
    [images, channels, height, width] (LLaVA) or [images, tiles, channels, height, width], each
    image's tiles zero-padded to the prompt's most (LLaVA-NeXT's any-resolution tiling, Idefics
    3's split image), or, for Qwen2-VL and Qwen2.5-VL, the patches of every image one after
    another [patches, channels x frames x patch x patch]; image_sizes [images, 2], each image's
    (height, width) before resizing, where the encoder reads it (LLaVA-NeXT), else None;
    pixel_attention_mask [images, tiles, height, width], the pixels that are the image's rather
    than padding (Idefics 3), else None; image_grid_thw [images, 3], each image's grid of
    patches (frames, rows, columns), which says which patches are whose (Qwen2-VL), else None."""

    pixel_values: Any
    image_sizes: Any = None
    pixel_attention_mask: Any = None
    image_grid_thw: Any = None

    @property
    def count(self) -> int:
        if self.image_grid_thw is not None:
            return int(self.image_grid_thw.shape[0])
        return int(self.pixel_values.shape[0])

    def patch_rows(self) -> list[int]:
        """Each image's rows of pixel_values where they are patches (image_grid_thw given):
        frames x rows x columns of its grid; [] otherwise."""
        if self.image_grid_thw is None:
            return []
        return [t * h * w for t, h, w in self.image_grid_thw.tolist()]


def image_inputs(images) -> ImageInputs | None:
    """`images` as ImageInputs: None, ImageInputs, a mapping with "pixel_values" (and
    "image_sizes", "pixel_attention_mask" or "image_grid_thw", as a processor's output has
    them), or the pixel values alone."""
    if images is None or isinstance(images, ImageInputs):
        return images
    if isinstance(images, Mapping):
        return ImageInputs(
            images["pixel_values"],
            images.get("image_sizes"),
            images.get("pixel_attention_mask"),
            images.get("image_grid_thw"),
        )
    return ImageInputs(images)


def processor_counts(processor, images) -> list[int] | None:
    """Each image's count of image tokens as the model's processor (transformers') counts it
    from the image's size (`images`: PIL images); None where the processor does not say."""
    try:
        sizes = [(image.height, image.width) for image in images]
        counts = processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
        return [int(c) for c in counts]
    except Exception:  # (a processor that does not count, or an image it cannot size)
        return None


def processor_inputs(processor, out, images) -> tuple[ImageInputs, list[int] | None]:
    """The processor's output `out` for one prompt with `images` (PIL images) as ImageInputs of
    one row an image (`one_row_an_image`, with each image's tiles from its count of tokens where
    the processor has a count a tile, as Idefics 3's has), and each image's count of image
    tokens (`processor_counts`)."""
    counts = processor_counts(processor, images)
    per_tile = getattr(processor, "image_seq_len", None)
    tiles = [c // per_tile for c in counts] if counts and isinstance(per_tile, int) else []
    return one_row_an_image(out, tiles), counts


def one_row_an_image(out, tiles: list[int]) -> ImageInputs:
    """A processor's output for one prompt (a mapping with "pixel_values", maybe "image_sizes"
    and "pixel_attention_mask") as ImageInputs of one row an image. Idefics 3's processor puts
    every image's tiles of a prompt in one row [1, all tiles, ...]: `tiles` (each image's count,
    in order) splits that row, each image's zero-padded to the most, which its encoder drops as
    it drops the processor's own padding. Any other output is taken as it is."""
    images = image_inputs(out)
    values, mask = images.pixel_values, images.pixel_attention_mask
    if values.dim() != 5 or values.shape[0] != 1 or len(tiles) < 2 or sum(tiles) > values.shape[1]:
        return images
    most, start = max(tiles), 0
    rows = values.new_zeros((len(tiles), most, *values.shape[2:]))
    masks = None if mask is None else mask.new_zeros((len(tiles), most, *mask.shape[2:]))
    for i, n in enumerate(tiles):
        rows[i, :n] = values[0, start : start + n]
        if masks is not None:
            masks[i, :n] = mask[0, start : start + n]
        start += n
    return ImageInputs(rows, images.image_sizes, masks, images.image_grid_thw)


def image_keys(images) -> list[int]:
    """Each image's number in the prefix-cache ids (`images`: what `image_inputs` takes): a
    negative 62-bit number drawn from a hash of its pixel values' float32 bytes, without the
    all-zero tiles that pad it to another image's count (they depend on the other images of the
    prompt, and the encoder drops them), and of its size and pixel mask where the encoder reads
    them; where the pixel values are every image's patches in one run (Qwen2-VL), each image's
    patches and grid."""
    images = image_inputs(images)
    sizes, masks = images.image_sizes, images.pixel_attention_mask
    grids = images.image_grid_thw
    values = images.pixel_values.float()
    if grids is not None:  # one run of patches: each image's share, by its grid
        values = list(values.split(images.patch_rows()))
    keys = []
    for i, image in enumerate(values):
        n = None
        if image.dim() == 4:  # tiles: the trailing all-zero ones are padding
            n = image.shape[0]
            while n > 1 and not bool(image[n - 1].any()):
                n -= 1
            image = image[:n]
        digest = hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=8)
        if sizes is not None:
            digest.update(repr([int(v) for v in sizes[i]]).encode())
        if masks is not None:
            digest.update(masks[i][:n].bool().numpy().tobytes())
        if grids is not None:
            digest.update(repr([int(v) for v in grids[i]]).encode())
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
