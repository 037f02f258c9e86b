"""Images in prompts, for vision-language checkpoints (LLaVA, LLaVA-NeXT, Idefics 3, Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3.5 and Gemma 3): what an image becomes before the language model sees it,
and how a request keeps it until its prompt is computed.

A prompt with images is a text in which each image is one image token per image feature (the
checkpoint's processor, transformers' AutoProcessor, expands each "<image>" written in the text
into as many: a fixed count for LLaVA, one that follows the image's size and aspect for
LLaVA-NeXT's tiles, a count of tiles for Idefics 3's, merged cells of a grid of patches for
Qwen2-VL's) and the images' inputs (`ImageInputs`: pixel values, LLaVA-NeXT's original sizes,
Idefics 3's pixel mask, Qwen2-VL's grids), which the same processor makes. `ImageEncoder` runs
the checkpoint's own `get_image_features` (transformers' model class, built on the meta device,
with only the vision tower, the projector or connector and LLaVA-NeXT's row-end embedding made
real and loaded: the language model is the engine's),
giving one embedding row per image token; a twin of it all on the meta device counts each
image's rows from shapes alone (Idefics 3's: its real tiles, a fixed count each), so a prompt
whose image tokens do not match its images, or images the encoder cannot take, is refused as
it is added, never in a step.
`ImagePrompt` keeps a request's images with it: the image tokens' positions, the inputs, and the
ids its prefix-cache chain hashes in place of the prompt's (`image_cache_ids`), in which each
image's tokens are a number drawn from a hash of that image (negative, so no token id is one):
two prompts that differ only in an image never share a cached block, and the same image at the
same place does. The router computes the same ids for its KV index, and a decode worker for the
blocks a hand-off writes. The rows are encoded when a step first computes an image token (on
the engine's thread), not before: a decode worker whose prompt KV arrives from a prefill worker
never encodes. A prompt chunk carries the rows of the image tokens it computes
(`chunk_embeds`, SeqInput.embeds, plain data that reaches every tensor-parallel rank); the
language model's embedding of the step takes them in place of those tokens' own (`apply`). The
rows live as long as the request, so a preempted sequence recomputes its prompt from them. Under
pipeline stages a chunk's micro-batches each carry their share of its rows (model_runner.py
piece_embeds); only the first stage embeds. Qwen2-VL's language model places tokens in 3-D
(`mrope_positions`, kept with the request): a chunk carries where its tokens sit
(`chunk_rope`, SeqInput.rope_shift and .rope_rows), as plain data too. Qwen3-VL's rows are
wider: each image token's embedding is followed by its DeepStack features, which the stage
that holds each of the first layers adds after that layer (`deepstack`). Gemma 3's image tokens
attend to one another both ways: `ImagePrompt.blocks` holds each image's run of positions, which
the scheduler never cuts (engine/request.py Sequence.fit_chunk) and the model runner's span mask
opens (model_runner.py _prefill_span).
"""

from __future__ import annotations

import inspect
import threading

import numpy as np
import torch

from pdserve.engine.errors import InvalidRequest
from pdserve.engine.image_keys import (
    BIDIRECTIONAL_IMAGE_ARCHITECTURES,
    ImageInputs,
    image_cache_ids,
    image_inputs,
    image_keys,
)

# The model class's parts by attribute: its language model (the engine runs its own) and its
# vision tower (built from its config, so that buffers a checkpoint does not hold, such as CLIP's
# position ids, are made as transformers makes them); every other part (LLaVA's projector, Idefics
# 3's connector) and the class's own tensors (LLaVA-NeXT's row-end embedding) are loaded as they
# are. A checkpoint names each under `model.` (transformers 5) or bare (saved by 4.x).
_LANGUAGE_PARTS = ("language_model", "text_model")
_TOWER_PARTS = ("vision_tower", "vision_model", "visual")
_ENCODER_PREFIXES = tuple(
    f"{root}{part}."
    for part in ("vision_tower", "vision_model", "visual", "multi_modal_projector", "connector")
    for root in ("model.", "")
)
_OWN_NAMES = ("image_newline", "model.image_newline")
ROWS_REMEMBERED = 1024  # ImageEncoder.rows' counts kept, per shape and image sizes
# the language model's names, as the engine's families load them (model.*, lm_head.*)
_LANGUAGE_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.text_model.", "model."),
)


def language_model_weights(weights):
    """A vision-language checkpoint's tensors as its language model's family names them; the
    image encoder's are left out (ImageEncoder loads those)."""
    for name, tensor in weights:
        if name.startswith(_ENCODER_PREFIXES) or name in _OWN_NAMES:
            continue
        for old, new in _LANGUAGE_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor


class ImageEncoder:
    """A vision-language checkpoint's image encoder, on the CPU in float32: the images' inputs in,
    one embedding row (the language model's hidden size) per image token out, as transformers'
    `get_image_features` of the checkpoint's model class computes them (LLaVA's; LLaVA-NeXT's
    with its tiles, unpadding and row-end embedding; Idefics 3's tiles through its connector)."""

    def __init__(self, multimodal_config, model_dir: str):
        from transformers import AutoModel

        self.config = multimodal_config
        with torch.device("meta"):
            self._shapes = AutoModel.from_config(multimodal_config).eval()  # counts rows only
            model = AutoModel.from_config(multimodal_config).eval()
        for name, part in list(model.named_children()):
            if name in _LANGUAGE_PARTS:
                continue  # (left on the meta device: never run)
            if name in _TOWER_PARTS:  # (its class, as the model's own __init__ builds it)
                part = type(part)._from_config(multimodal_config.vision_config).float().eval()
                setattr(model, name, part)
            else:
                part.to_empty(device="cpu")
            _load(part, model_dir, (f"model.{name}.", f"{name}."))
        for name, _ in list(model.named_parameters(recurse=False)):  # LLaVA-NeXT's newline
            model.register_parameter(name, torch.nn.Parameter(_tensor(model_dir, name), False))
        self.model = model
        takes = inspect.signature(model.get_image_features).parameters
        self._takes = {
            k for k in ("image_sizes", "pixel_attention_mask", "image_grid_thw") if k in takes
        }
        # Qwen2-VL's and Qwen2.5-VL's: every image's patches in one run, a grid each, whose
        # cells the merger joins merge x merge into one row; their language model places the
        # image tokens by 3-D positions (`mrope_positions`)
        self._patches = "image_grid_thw" in self._takes
        self.merge = int(getattr(multimodal_config.vision_config, "spatial_merge_size", 1))
        self.mrope = self._patches  # (Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's)
        # Gemma 3's: an image's tokens attend to one another both ways (`image_blocks`)
        self.bidirectional = multimodal_config.architectures[0] in BIDIRECTIONAL_IMAGE_ARCHITECTURES
        # Qwen3-VL's DeepStack: features of early vision layers, one row per image token each,
        # added to the hidden states after the language model's first layers (`deepstack`)
        vision = multimodal_config.vision_config
        self.deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or ())
        # LLaVA-NeXT's any-resolution tiles and Idefics 3's split images: 5-D pixel values
        self._tiled = (
            hasattr(multimodal_config, "image_grid_pinpoints")
            or "pixel_attention_mask" in self._takes
        )
        self._needs_sizes = hasattr(multimodal_config, "image_grid_pinpoints")
        # Idefics 3: each real tile (not all zeros: what its encoder keeps) gives this many rows
        # (its patches, merged scale_factor x scale_factor by the connector)
        scale = getattr(multimodal_config, "scale_factor", None)
        self._rows_per_tile = (
            (vision.image_size // vision.patch_size) ** 2 // scale**2 if scale else None
        )
        self._rows: dict[tuple, list[int]] = {}  # (shape, sizes) -> rows of each image
        self._lock = threading.Lock()

    def _kwargs(self, images: ImageInputs, device=None) -> dict:
        values = images.pixel_values.float()
        kwargs = {"pixel_values": values if device is None else values.to(device)}
        if "image_sizes" in self._takes and images.image_sizes is not None:
            kwargs["image_sizes"] = images.image_sizes
        if self._patches:
            grids = images.image_grid_thw
            kwargs["image_grid_thw"] = grids if device is None else grids.to(device)
        mask = images.pixel_attention_mask
        if "pixel_attention_mask" in self._takes and mask is not None:
            kwargs["pixel_attention_mask"] = (
                mask.bool() if device is None else mask.bool().to(device)
            )
        return kwargs

    def check(self, images: ImageInputs) -> None:
        """Refuses inputs the encoder cannot take, before any step would run them: pixel values
        of another rank or channels than its own, or another size than its images' (a CLIP or
        SigLIP tower's position embeddings are for that size alone); image sizes missing where
        it reads them, or of another shape than [images, 2] positive sizes; a pixel mask of
        another shape than the pixel values' without their channels."""
        vision = self.config.vision_config
        if self._patches:
            return self._check_patches(images)
        values, sizes, mask, grids = images
        if grids is not None:
            raise InvalidRequest(
                f"image_grid_thw is for models whose images are runs of patches (Qwen2-VL); "
                f"{self.config.architectures[0]} takes none"
            )
        rank = 5 if self._tiled else 4
        form = "[images, channels, height, width]"
        if self._tiled:
            form = "[images, tiles, channels, height, width]"
        if values.dim() != rank or values.shape[0] < 1 or min(values.shape) < 1:
            raise InvalidRequest(
                f"images must be pixel values {form}, got a shape of {list(values.shape)}"
            )
        channels, height, width = values.shape[-3:]
        size = getattr(vision, "image_size", None)
        want = (vision.num_channels, size, size) if size else (vision.num_channels, height, width)
        if (channels, height, width) != want:
            raise InvalidRequest(
                f"images must be pixel values of {want[0]} channels of {want[1]}x{want[2]} "
                f"(as the model's processor makes them), got {channels} of {height}x{width}"
            )
        if mask is not None and (
            "pixel_attention_mask" not in self._takes
            or tuple(mask.shape) != (*values.shape[:-3], height, width)
        ):
            raise InvalidRequest(
                f"a pixel_attention_mask must be [images, tiles, height, width] as the pixel "
                f"values are, for a model that reads one (got {list(mask.shape)} beside "
                f"{list(values.shape)})"
            )
        if not self._needs_sizes:
            return
        if (
            sizes is None
            or sizes.dim() != 2
            or tuple(sizes.shape) != (values.shape[0], 2)
            or sizes.is_floating_point()
            or int(sizes.min()) < 1
        ):
            got = None if sizes is None else list(sizes.shape)
            raise InvalidRequest(
                f"{self.config.architectures[0]} needs each image's size before resizing: "
                f"image_sizes [images, 2] of positive (height, width), as the model's "
                f"processor makes them (got {got} for {values.shape[0]} images)"
            )

    def _check_patches(self, images: ImageInputs) -> None:
        """Qwen2-VL's inputs: the patches [patches, channels x frames x patch x patch] of every
        image in one run and a grid [images, 3] of positive (frames, rows, columns), the rows
        and columns multiples of the merge, that together count the patches; nothing else."""
        vision = self.config.vision_config
        values, sizes, mask, grids = images
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        if values.dim() != 2 or values.shape[1] != width or values.shape[0] < 1:
            raise InvalidRequest(
                f"images must be pixel values [patches, {width}] (every image's patches, as the "
                f"model's processor makes them), got a shape of {list(values.shape)}"
            )
        if sizes is not None or mask is not None:
            raise InvalidRequest(
                f"{self.config.architectures[0]} reads no image_sizes or pixel_attention_mask: "
                f"send the pixel values and image_grid_thw"
            )
        if (
            grids is None
            or grids.dim() != 2
            or grids.shape[0] < 1
            or grids.shape[1] != 3
            or grids.is_floating_point()
            or int(grids.min()) < 1
            or bool((grids[:, 1:] % self.merge).any())
            or sum(images.patch_rows()) != values.shape[0]
        ):
            got = None if grids is None else grids.tolist()[:4]
            raise InvalidRequest(
                f"{self.config.architectures[0]} needs each image's grid of patches: "
                f"image_grid_thw [images, 3] of positive (frames, rows, columns), rows and "
                f"columns multiples of {self.merge}, counting the {values.shape[0]} patches, as "
                f"the model's processor makes them (got {got})"
            )

    def rows(self, images: ImageInputs) -> list[int]:
        """How many rows `encode` gives each image (`check`ed inputs): for Idefics 3 its real
        tiles times the rows of one, else worked out from shapes on the meta device (nothing is
        computed); InvalidRequest where the encoder would fail on these inputs or give an image
        no row. Remembered per shape and sizes (the last ROWS_REMEMBERED of them). Any thread
        may call it (a prefill worker's peer fetch keys a prompt on its call's thread)."""
        if self._patches:  # the merger joins merge x merge patches into one row
            return [n // self.merge**2 for n in images.patch_rows()]
        if self._rows_per_tile is not None:
            real = (images.pixel_values != 0).flatten(2).any(-1).sum(-1).tolist()
            if min(real) < 1:
                raise InvalidRequest("an image's pixel values are all zeros: no tile to encode")
            return [n * self._rows_per_tile for n in real]
        sizes = images.image_sizes
        named = None if sizes is None else tuple(tuple(pair) for pair in sizes.tolist())
        key = (tuple(images.pixel_values.shape), named)
        with self._lock:
            known = self._rows.get(key)
        if known is None:
            try:
                with torch.inference_mode():
                    out = self._shapes.get_image_features(
                        **self._kwargs(images, "meta"), return_dict=True
                    ).pooler_output
            except Exception as e:  # the encoder's own shape checks, on the meta device
                raise InvalidRequest(
                    f"the images do not fit the model's image encoder ({e}): send them as the "
                    f"model's processor makes them"
                ) from None
            known = _per_image_rows(out, images.count)
            with self._lock:
                if len(self._rows) >= ROWS_REMEMBERED:  # (the oldest goes: clients set sizes)
                    self._rows.pop(next(iter(self._rows)))
                self._rows[key] = known
        return known

    @torch.inference_mode()
    def encode(self, images: ImageInputs) -> torch.Tensor:
        """The images' rows, image after image: [sum of rows(images), hidden] float32; with
        DeepStack (Qwen3-VL), each row followed by its token's feature of each early vision
        layer: [rows, hidden x (1 + self.deepstack)]."""
        out = self.model.get_image_features(**self._kwargs(images), return_dict=True)
        parts = [_rows(out.pooler_output)]
        if self.deepstack:
            parts += [_rows(f) for f in out.deepstack_features]
        return torch.cat(parts, dim=1).float()


def _rows(features) -> torch.Tensor:
    """get_image_features' rows [rows, hidden]: from a tensor [..., hidden] or one an image."""
    if isinstance(features, torch.Tensor):
        return features.reshape(-1, features.shape[-1])
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in features])


def _per_image_rows(features, count: int) -> list[int]:
    """Each image's rows in get_image_features' pooler_output: a tensor [images, rows, hidden]
    (fixed-size encoders) or one tensor an image."""
    if isinstance(features, torch.Tensor):
        if features.dim() == 3 and features.shape[0] == count:
            return [int(features.shape[1])] * count
        raise InvalidRequest(f"the image encoder gave features of shape {list(features.shape)}")
    return [int(f.reshape(-1, f.shape[-1]).shape[0]) for f in features]


def _tensor(model_dir: str, name: str) -> torch.Tensor:
    """The checkpoint's tensor of a parameter of the model class itself (LLaVA-NeXT's
    image_newline), saved under its bare name or under `model.`."""
    from safetensors import safe_open

    from pdserve.engine.loader.safetensors_io import checkpoint_files

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in (name, "model." + name):
                if key in f.keys():
                    return f.get_tensor(key).float()
    raise ValueError(f"{model_dir}: the image encoder's {name} is not in the checkpoint")


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
    (ascending), the images' inputs, the ids its prefix-cache chain hashes, and, once a step has
    needed them, one embedding row per image token (`embeds`)."""

    def __init__(self, positions, images: ImageInputs, cache_ids, encoder: ImageEncoder, rope=None):
        self.positions: list[int] = positions
        self.images: ImageInputs = images
        self.cache_ids: list[int] = cache_ids  # the prompt, each image's tokens its number
        self._encoder = encoder
        self._embeds: torch.Tensor | None = None
        # Qwen2-VL's 3-D rotary positions of the prompt's tokens [3, prompt length], and the
        # shift of every token after the prompt (`mrope_positions`); None: positions as usual
        self.rope: np.ndarray | None = None
        self.rope_shift = 0
        if rope is not None:
            self.rope, self.rope_shift = rope
        # Gemma 3's: the [start, end) of each image's run of tokens, which attend to one
        # another both ways, so a prompt chunk never ends inside one; () for causal images
        self.blocks: tuple[tuple[int, int], ...] = (
            image_blocks(positions) if encoder is not None and encoder.bidirectional else ()
        )

    @property
    def embeds(self) -> torch.Tensor:
        """[len(positions), hidden] float32, encoded on first use."""
        if self._embeds is None:
            self._embeds = self._encoder.encode(self.images)
        return self._embeds


def image_prompt(prompt_ids: list[int], image_token_id: int, images, encoder) -> ImagePrompt:
    """The ImagePrompt of a prompt whose image tokens stand, image after image, for the rows
    `encoder` gives `images` (what image_keys.image_inputs takes); refuses inputs the encoder
    cannot take (`ImageEncoder.check`, then its count on the meta device) and a prompt whose
    image tokens are not as many as the images' rows."""
    images = image_inputs(images)
    encoder.check(images)
    positions = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    counts = encoder.rows(images)
    if len(positions) != sum(counts):
        raise InvalidRequest(
            f"the prompt holds {len(positions)} image tokens (id {image_token_id}) but its "
            f"{images.count} image(s) give {sum(counts)} features: write one image placeholder "
            f"per image and let the model's processor expand it"
        )
    keys = image_keys(images)
    rope = None
    if encoder.mrope:
        rope = mrope_positions(len(prompt_ids), positions, images, encoder.merge)
    return ImagePrompt(
        positions,
        images,
        image_cache_ids(prompt_ids, image_token_id, keys, counts),
        encoder,
        rope,
    )


def image_blocks(positions: list[int]) -> tuple[tuple[int, int], ...]:
    """The runs of consecutive image-token positions, [start, end) each: Gemma 3's image blocks,
    as transformers groups them (token_type_ids' runs of image tokens; its processor writes each
    image's tokens between a start and an end token, so two images never touch)."""
    blocks, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            blocks.append((start, p + 1))
            start = None
    return tuple(blocks)


def mrope_positions(
    length: int, image_positions: list[int], images: ImageInputs, merge: int
) -> tuple[np.ndarray, int]:
    """Qwen2-VL's rotary positions (M-RoPE) of a prompt of `length` tokens whose image tokens
    sit at `image_positions`, each image's as one run: [3, length] (frame, row, column) and
    the shift of every later token's position from its index. A text token's three are its
    place in the text, counted on from the last image's largest; an image's token is at its
    cell of the merged grid (frame, row, column), each offset by the position it starts at,
    after which the text goes on from that plus its larger side in rows. As transformers'
    `get_rope_index` places them; the shift (then at most 0) is its `rope_deltas`."""
    rows = np.empty((3, length), dtype=np.int64)
    at, nxt, j = 0, 0, 0  # the next text position, prompt index and image token
    for frames, height, width in images.image_grid_thw.tolist():
        h, w = height // merge, width // merge
        n = frames * h * w
        first = image_positions[j]
        if image_positions[j + n - 1] != first + n - 1:
            raise InvalidRequest(
                "each image's tokens must be one run in the prompt: write one placeholder per "
                "image and let the model's processor expand it"
            )
        rows[:, nxt:first] = np.arange(at, at + first - nxt)
        at += first - nxt
        grid = np.indices((frames, h, w)).reshape(3, -1)
        rows[:, first : first + n] = grid + at
        at += max(h, w)
        nxt, j = first + n, j + n
    rows[:, nxt:] = np.arange(at, at + length - nxt)
    return rows, int(rows.max()) + 1 - length if length else 0


def chunk_rope(images: ImagePrompt | None, start: int, end: int) -> tuple[int, list]:
    """Where tokens start..end-1 of a sequence sit for the rotary embedding, as a step
    carries it (SeqInput.rope_shift and .rope_rows): (a shift of every one from its index, [])
    where they are in one line (text, or every token after the prompt), else (0, their
    [3, end - start] positions as lists); (0, []) for a prompt without M-RoPE positions."""
    if images is None or images.rope is None:
        return 0, []
    rope, shift = images.rope, images.rope_shift
    length = rope.shape[1]
    if start >= length:
        return shift, []
    part = rope[:, start:end]
    if end > length:
        part = np.concatenate([part, np.tile(np.arange(length, end) + shift, (3, 1))], axis=1)
    line = part[0] - np.arange(start, end)
    if (part[0] == part[1]).all() and (part[0] == part[2]).all() and (line == line[0]).all():
        return int(line[0]), []
    return 0, part.tolist()


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
    and `image_embeds`, the first hidden-size columns of them) in place of their tokens' own."""
    if rows is None:
        return hidden
    return hidden.index_copy(0, rows, values[:, : hidden.shape[1]].to(hidden.dtype))


def deepstack(hidden: torch.Tensor, layer: int, rows: torch.Tensor | None, values) -> torch.Tensor:
    """The hidden states after the language model's layer `layer` (its index in the whole
    model) with, where the image tokens' rows carry a DeepStack feature for that layer (Qwen3-VL:
    the rows' next hidden-size columns after the embedding's, one block a layer), that feature
    added at their tokens, as transformers' `_deepstack_process`; else `hidden` itself."""
    width = hidden.shape[1]
    if rows is None or values.shape[1] < (layer + 2) * width:
        return hidden
    block = values[:, (layer + 1) * width : (layer + 2) * width]
    return hidden.index_add(0, rows, block.to(hidden.dtype))
