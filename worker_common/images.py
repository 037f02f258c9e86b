"""A vision-language model's prompt images as the workers receive them (worker.PixelValues, which
the router fills from the model's processor: router/text.py) and hand them to the engine: a
float32 tensor [images, channels, height, width]. The message is checked at the RPC edge first
(protos/limits.py check_pixel_values); nothing here keeps state.
"""

from __future__ import annotations

import torch


def pixel_values(images) -> torch.Tensor | None:
    """The tensor of a checked worker.PixelValues; None when it is unset (a prompt without
    images). A copy, so the request's message may go."""
    if not images.shape:
        return None
    flat = torch.frombuffer(bytearray(images.data), dtype=torch.float32)
    return flat.reshape(list(images.shape))
