"""Images in prompts, for vision-language checkpoints (LLaVA): what an image becomes before the
language model sees it, and how a request keeps it until its prompt is computed.

A prompt with images is a text in which each image is one image token per image feature (the
checkpoint's processor, transformers' AutoProcessor, expands each "<image>" written in the text
into as many) and the images' pixel values, which the same processor makes. `ImageEncoder` runs
the checkpoint's vision tower and projector (transformers' own modules, built from its config,
with the checkpoint's weights), giving one embedding row per image token. `ImagePrompt` keeps a
request's images with it: the image tokens' positions, the pixel values, and the ids its
prefix-cache chain hashes in place of the prompt's (`image_cache_ids`), in which each image's
tokens are a number drawn from a hash of that image's pixels (negative, so no token id is one):
two prompts that differ only in an image never share a cached block, and the same image at the
same place does. The router computes the same ids for its KV index, and a decode worker for the
blocks a hand-off writes. The rows are encoded when a step first computes an image token (on
the engine's thread), not before: a decode worker whose prompt KV arrives from a prefill worker
never encodes. A prompt chunk carries the rows of the image tokens it computes
(`chunk_embeds`, SeqInput.embeds, plain data that reaches every tensor-parallel rank); the
language model's embedding of the step takes them in place of those tokens' own (`apply`). The
rows live as long as the request, so a preempted sequence recomputes its prompt from them. Under
pipeline stages a chunk's micro-batches each carry their share of its rows (model_runner.py
piece_embeds); only the first stage embeds.
"""

from __future__ import annotations

import torch

from pdserve.engine.errors import InvalidRequest
from pdserve.engine.image_keys import image_cache_ids, image_keys

# checkpoint name prefixes of the image encoder's parts (transformers 5 writes `model.`-prefixed
# names; checkpoints saved by 4.x have the bare ones)
_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# the language model's names, as the engine's families load them (model.*, lm_head.*)
_LANGUAGE_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def language_model_weights(weights):
    """A vision-language checkpoint's tensors as its language model's family names them; the
    image encoder's are left out (ImageEncoder loads those)."""
    for name, tensor in weights:
        if name.startswith(_TOWER_PREFIXES + _PROJECTOR_PREFIXES):
            continue
        for old, new in _LANGUAGE_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor


class ImageEncoder:
    """A LLaVA checkpoint's vision tower and projector, on the CPU in float32: pixel values of
    images in, one embedding row (the language model's hidden size) per image token out, as
    transformers' LlavaModel.get_image_features computes them."""

    def __init__(self, multimodal_config, model_dir: str):
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.config = multimodal_config
        self.tower = AutoModel.from_config(multimodal_config.vision_config).float().eval()
        self.projector = LlavaMultiModalProjector(multimodal_config).float().eval()
        _load(self.tower, model_dir, _TOWER_PREFIXES)
        _load(self.projector, model_dir, _PROJECTOR_PREFIXES)
        layer = multimodal_config.vision_feature_layer
        self.layers = [layer] if isinstance(layer, int) else list(layer)
        self.keep_cls = multimodal_config.vision_feature_select_strategy == "full"
        self._rows: dict[tuple[int, int], int] = {}  # (height, width) -> tokens_per_image

    def check(self, pixel_values: torch.Tensor) -> None:
        """Refuses pixel values the tower cannot take, before any step would run them: other
        channels than its own, or another size than its images' (a CLIP or SigLIP tower's
        position embeddings are for that size alone)."""
        vision = self.config.vision_config
        channels, height, width = pixel_values.shape[1:]
        size = getattr(vision, "image_size", None)
        want = (vision.num_channels, size, size) if size else (vision.num_channels, height, width)
        if (channels, height, width) != want:
            raise InvalidRequest(
                f"images must be pixel values of {want[0]} channels of {want[1]}x{want[2]} "
                f"(as the model's processor makes them), got {channels} of {height}x{width}"
            )

    def tokens_per_image(self, height: int, width: int) -> int:
        """How many rows `encode` gives one image of this size: counted once per size, by
        encoding a blank image (the tower's own patching and class token decide it)."""
        if (height, width) not in self._rows:
            blank = torch.zeros(1, self.config.vision_config.num_channels, height, width)
            self._rows[(height, width)] = self.encode(blank).shape[0]
        return self._rows[(height, width)]

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, channels, height, width] -> [images x tokens per image, hidden]."""
        out = self.tower(pixel_values.float(), output_hidden_states=True)
        states = [out.hidden_states[i] for i in self.layers]
        if not self.keep_cls:  # "default": the class token's feature is not an image token
            states = [s[:, 1:] for s in states]
        features = self.projector(torch.cat(states, dim=-1))
        return features.reshape(-1, features.shape[-1]).float()


def _load(module: torch.nn.Module, model_dir: str, prefixes: tuple[str, ...]) -> None:
    """`module`'s weights from the checkpoint's tensors under one of `prefixes`; every one of
    its parameters and buffers that the checkpoint should hold must be there."""
    from safetensors import safe_open

    from pdserve.engine.loader.safetensors_io import checkpoint_files

    state = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                for prefix in prefixes:
                    if name.startswith(prefix):
                        state[name[len(prefix) :]] = f.get_tensor(name).float()
    # a CLIP or SigLIP tower's names: its own under `vision_model.` (llava-hf's checkpoints), or
    # without it (what transformers 5 saves); the module's state decides
    own = next(iter(module.state_dict()), "")
    nested = "vision_model."
    if own.startswith(nested) and state and not any(k.startswith(nested) for k in state):
        state = {nested + k: v for k, v in state.items()}
    elif not own.startswith(nested):
        state = {k.removeprefix(nested): v for k, v in state.items()}
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("position_ids")]  # (a buffer, rebuilt)
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: the image encoder's weights do not match its config (missing "
            f"{missing[:4]}, unexpected {unexpected[:4]})"
        )


class ImagePrompt:
    """A request's images, as its prompt holds them: the image tokens' prompt positions
    (ascending), the pixel values, the ids its prefix-cache chain hashes, and, once a step has
    needed them, one embedding row per image token (`embeds`)."""

    def __init__(self, positions, pixel_values, cache_ids, encoder: ImageEncoder):
        self.positions: list[int] = positions
        self.pixel_values: torch.Tensor = pixel_values
        self.cache_ids: list[int] = cache_ids  # the prompt, each image's tokens its number
        self._encoder = encoder
        self._embeds: torch.Tensor | None = None

    @property
    def embeds(self) -> torch.Tensor:
        """[len(positions), hidden] float32, encoded on first use."""
        if self._embeds is None:
            self._embeds = self._encoder.encode(self.pixel_values)
        return self._embeds


def image_prompt(
    prompt_ids: list[int], image_token_id: int, pixel_values: torch.Tensor, encoder
) -> ImagePrompt:
    """The ImagePrompt of a prompt whose image tokens stand, image after image, for the rows
    `encoder` gives `pixel_values`; refuses pixel values the encoder cannot take
    (`ImageEncoder.check`) and a prompt whose image tokens are not as many as the images' rows
    (counted without encoding them: `ImageEncoder.tokens_per_image`)."""
    encoder.check(pixel_values)
    positions = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    num_images, height, width = pixel_values.shape[0], *pixel_values.shape[2:]
    rows = num_images * encoder.tokens_per_image(height, width)
    if len(positions) != rows:
        raise InvalidRequest(
            f"the prompt holds {len(positions)} image tokens (id {image_token_id}) but its "
            f"{num_images} image(s) give {rows} features: write one image placeholder per "
            f"image and let the model's processor expand it"
        )
    keys = image_keys(pixel_values)
    return ImagePrompt(
        positions, pixel_values, image_cache_ids(prompt_ids, image_token_id, keys), encoder
    )


def chunk_embeds(images: ImagePrompt | None, start: int, end: int) -> list:
    """The rows of the image tokens in prompt positions start..end-1, as a step carries them:
    [their offsets from `start`, the rows' float32 bytes]; [] where the chunk has none."""
    if images is None:
        return []
    picked = [j for j, p in enumerate(images.positions) if start <= p < end]
    if not picked:
        return []
    # (positions ascend, so the picked rows are consecutive)
    rows = images.embeds[picked[0] : picked[-1] + 1]
    return [[images.positions[j] - start for j in picked], rows.contiguous().numpy().tobytes()]


def apply(hidden: torch.Tensor, rows: torch.Tensor | None, values: torch.Tensor | None):
    """The step's embeddings with the image tokens' rows (the forward context's `image_rows`
    and `image_embeds`) in place of their tokens' own."""
    if rows is None:
        return hidden
    return hidden.index_copy(0, rows, values.to(hidden.dtype))
