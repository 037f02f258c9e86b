"""How a prompt's images key its prefix-cache blocks, shared by the engine (engine/multimodal.py),
the workers and the router (router/images.py), which must all hash the same ids: each image's
tokens become one number drawn from a hash of that image's pixel values. Also which checkpoints
are vision-language ones. Imports nothing of the project (the router may use it); pure functions.
"""

from __future__ import annotations

import hashlib

# vision-language checkpoints: an image encoder (transformers' own modules: engine/multimodal.py)
# in front of a language model of a family the engine serves (engine/config.py)
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration",)


def image_keys(pixel_values) -> list[int]:
    """Each image's number in the prefix-cache ids (pixel_values: a torch tensor [images, ...]):
    a negative 62-bit number drawn from a hash of its pixel values' float32 bytes."""
    keys = []
    for image in pixel_values.float():
        digest = hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=8).digest()
        keys.append(-1 - (int.from_bytes(digest, "little") >> 2))
    return keys


def image_cache_ids(prompt_ids: list[int], image_token_id: int, keys: list[int]) -> list[int]:
    """The prompt as its prefix-cache chain hashes it: its image tokens, in order, split evenly
    between the images, each image's replaced by its key (`image_keys`)."""
    positions = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    out = list(prompt_ids)
    if not keys or len(positions) % len(keys):
        return out
    per_image = len(positions) // len(keys)
    for i, p in enumerate(positions):
        out[p] = keys[i // per_image]
    return out
