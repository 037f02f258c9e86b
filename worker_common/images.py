"""A vision-language model's prompt images as the workers receive them (worker.PixelValues, which
the router fills from the model's processor: router/images.py) and hand them to the engine:
image_keys.ImageInputs of a float32 tensor of pixel values ([images, channels, height, width],
or [images, tiles, channels, height, width], or Qwen2-VL's run of patches) and, where the
message has them, the images' sizes [images, 2], pixel mask [images, tiles, height, width] and
grids of patches [images, 3]. The message is checked at the RPC
edge first (protos/limits.py check_pixel_values); nothing here keeps state.
"""

from __future__ import annotations

import torch

from pdserve.engine.image_keys import ImageInputs


def pixel_values(images) -> ImageInputs | None:
    """The inputs of a checked worker.PixelValues; None when it is unset (a prompt without
    images). Copies, so the request's message may go."""
    if not images.shape:
        return None
    flat = torch.frombuffer(bytearray(images.data), dtype=torch.float32)
    shape = list(images.shape)
    sizes = mask = grids = None
    if images.image_sizes:
        sizes = torch.tensor(list(images.image_sizes), dtype=torch.int64).reshape(-1, 2)
    if images.pixel_attention_mask:
        mask = torch.frombuffer(bytearray(images.pixel_attention_mask), dtype=torch.uint8)
        mask = mask.reshape(shape[:-3] + shape[-2:]).bool()
    if images.image_grid_thw:
        grids = torch.tensor(list(images.image_grid_thw), dtype=torch.int64).reshape(-1, 3)
    return ImageInputs(flat.reshape(shape), sizes, mask, grids)
