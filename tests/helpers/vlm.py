"""Tiny random LLaVA models for the engine's vision-language tests: transformers' own
`LlavaForConditionalGeneration` in float32, a 2-layer 32-wide CLIP vision tower over 32x32 images
(8x8 patches: 16 patches and a CLS token) and a 2-layer 64-wide Llama (4 query heads, 2 KV heads),
saved as a Hugging Face directory with a processor (`AutoProcessor.from_pretrained` gives a
LlavaProcessor) whose tokenizer is models.py's word-level one ("t0".."t255") plus the "<image>"
special token (id 256), which the processor expands into 16 image tokens per image. The same
with `kind="llava-next"`: `LlavaNextForConditionalGeneration` (any-resolution tiles of 32x32 on
the grids NEXT_PINPOINTS, unpadded to the image's aspect, a row-end embedding), whose processor
expands each image into a count that follows its size (`image_sizes` goes with the pixel
values). And with `kind="idefics3"`: `Idefics3ForConditionalGeneration` (SmolVLM's class; a
2-layer Idefics 3 vision tower over 32x32 tiles, its connector merging 2x2 patches: 4 image
tokens a tile), whose processor splits an image into up to 2x2 tiles of 32 and a whole one,
writing each tile's tokens between its own special tokens, and puts every image's tiles of a
prompt in one row with a pixel mask. `make_tiny_qwen2_vl` saves Qwen2-VL's, Qwen2.5-VL's and
Qwen3-VL's classes (vision transformers over 8x8 patches merged 2x2, a Qwen2 or Qwen3 language
model with 3-D rotary positions), whose processor `qwen2_vl_processor` builds;
`make_tiny_gemma3_vl` Gemma 3's (a SigLIP tower pooled into 16 tokens an image, which its
language model attends both ways). This module also owns the seeded random
images the tests feed it, the processor's output for one prompt, and HF's own greedy
continuation of a prompt with its images: the reference the engine must match.
"""

from __future__ import annotations

import torch

from helpers.models import TINY_CONFIG, hf_greedy

IMAGE_SIZE = 32
PATCH_SIZE = 8
IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 256  # right after the word-level vocabulary "t0".."t255"
# "default" drops the CLS token: one image token per patch
IMAGE_TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2
VISION_CONFIG = dict(
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    projection_dim=32,
)
TEXT_CONFIG = dict(  # models.py's tiny shape, with the image token in its vocabulary
    TINY_CONFIG,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=IMAGE_TOKEN_ID + 2,  # one unused id more: an even vocabulary splits over TP 2
    eos_token_id=1,
    bos_token_id=0,
)
# Each image's text and then the user's text, words of the vocabulary only: anything else
# ("USER:", a newline) would be the unknown token t0.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }} "
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image> "
    "{% elif item['type'] == 'text' %}{{ item['text'] }} {% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
)


NEXT_PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # LLaVA-NeXT's grids: up to 2x2 tiles of 32
# Idefics 3's special tokens after "<image>" (ids 257 on): what frames a tile's image tokens
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<global-img>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]
IDEFICS3_TILE_TOKENS = 4  # (32 / 8)^2 patches, merged 2x2 by the connector


def make_tiny_llava(path, seed: int = 0, text: str = "llama", kind: str = "llava"):
    """Save a random tiny LLaVA (CLIP vision tower, Llama text model; kind "llava" or
    "llava-next") and its processor to `path`; returns the HF model. The projector's weights
    (and LLaVA-NeXT's row-end embedding) are drawn wider than HF's initialisation (std 0.02), so
    that the image features, not only the text, decide the greedy tokens."""
    import transformers
    from transformers import CLIPVisionConfig, LlamaConfig

    if text != "llama":
        raise ValueError(f"unknown text model {text!r}: only 'llama'")
    if kind not in ("llava", "llava-next", "idefics3"):
        raise ValueError(f"unknown kind {kind!r}: 'llava', 'llava-next' or 'idefics3'")
    common = dict(
        vision_config=CLIPVisionConfig(**VISION_CONFIG),
        text_config=LlamaConfig(**TEXT_CONFIG),
        image_token_id=IMAGE_TOKEN_ID,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
    )
    torch.manual_seed(seed)
    if kind == "idefics3":
        model = _tiny_idefics3()
        model.eval().save_pretrained(path)
        _tiny_idefics3_processor().save_pretrained(path)
        return model
    if kind == "llava":
        config = transformers.LlavaConfig(**common, image_seq_length=IMAGE_TOKENS_PER_IMAGE)
        model = transformers.LlavaForConditionalGeneration(config)
    else:
        config = transformers.LlavaNextConfig(**common, image_grid_pinpoints=NEXT_PINPOINTS)
        model = transformers.LlavaNextForConditionalGeneration(config)
    with torch.no_grad():
        projector = model.model.multi_modal_projector
        for linear in (projector.linear_1, projector.linear_2):
            linear.weight.normal_(0, linear.in_features**-0.5)
            linear.bias.normal_(0, 0.1)
        if kind == "llava-next":
            model.model.image_newline.normal_(0, 1.0)
    model.eval().save_pretrained(path)

    tokenizer = _tokenizer()
    crop = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    if kind == "llava":
        image_processor = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE}, crop_size=crop
        )
        processor = transformers.LlavaProcessor
    else:
        image_processor = transformers.LlavaNextImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE}, crop_size=crop, image_grid_pinpoints=NEXT_PINPOINTS
        )
        processor = transformers.LlavaNextProcessor
    processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # the CLS token, which "default" then drops
    ).save_pretrained(path)
    return model


# Qwen2-VL's special tokens after "<image>" (ids 257 on): its image token and what frames an image
QWEN2_VL_TOKENS = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
QWEN2_VL_IMAGE_TOKEN_ID = IMAGE_TOKEN_ID + 1
QWEN_VL_KINDS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "qwen3.5-vl")
QWEN_VL_IDS = dict(  # the configs' special token ids: QWEN2_VL_TOKENS' order
    image_token_id=QWEN2_VL_IMAGE_TOKEN_ID,
    vision_start_token_id=QWEN2_VL_IMAGE_TOKEN_ID + 1,
    vision_end_token_id=QWEN2_VL_IMAGE_TOKEN_ID + 2,
    video_token_id=QWEN2_VL_IMAGE_TOKEN_ID + 3,
)
QWEN2_VL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "<image> ", "<|vision_start|><|image_pad|><|vision_end|> "
)


def make_tiny_qwen2_vl(path, seed: int = 0, kind: str = "qwen2-vl"):
    """Save a random tiny Qwen2-VL (`kind` "qwen2-vl"), Qwen2.5-VL ("qwen2.5-vl", whose
    vision transformer attends in windows of 2x2 merged cells but in its last block) or
    Qwen3-VL ("qwen3-vl": a Qwen3 language model of three layers whose M-RoPE sections
    interleave, and DeepStack features of both vision blocks added after its first two layers;
    "qwen3-vl-moe": the same over a Qwen3-MoE of 4 experts, 2 a token) with
    models.py's tokenizer and QWEN2_VL_TOKENS to `path`; returns the HF model. The language
    model is TEXT_CONFIG's shape (head size 16: M-RoPE sections of 2, 3 and 3 frequency pairs,
    Qwen3-VL's 4, 2 and 2). The processor is not saved (`qwen2_vl_processor` builds it:
    transformers' Qwen2-VL and Qwen3-VL processors need torchvision for their video part, and
    this project's CPU machines have none)."""
    if kind not in QWEN_VL_KINDS:
        raise ValueError(f"unknown kind {kind!r}: one of {QWEN_VL_KINDS}")
    if kind.startswith("qwen3-vl"):
        return _save_qwen_vl(path, _tiny_qwen3_vl(seed, moe=kind == "qwen3-vl-moe"))
    if kind == "qwen3.5-vl":
        return _save_qwen_vl(path, _tiny_qwen3_5_vl(seed))
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(
        TEXT_CONFIG,
        vocab_size=IMAGE_TOKEN_ID + 1 + len(QWEN2_VL_TOKENS) + 1,
        rope_parameters=rope,
        tie_word_embeddings=False,
    )
    vision = dict(patch_size=PATCH_SIZE, spatial_merge_size=2, temporal_patch_size=2, depth=2)
    common = dict(QWEN_VL_IDS, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if kind == "qwen2-vl":
        vision.update(embed_dim=32, num_heads=2, hidden_size=TEXT_CONFIG["hidden_size"])
        config = transformers.Qwen2VLConfig(vision_config=vision, text_config=text, **common)
        model = transformers.Qwen2VLForConditionalGeneration(config)
    else:
        vision.update(
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=TEXT_CONFIG["hidden_size"],
            window_size=2 * 2 * PATCH_SIZE,
            fullatt_block_indexes=[1],
        )
        config = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, **common)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():
        # the merger's output wider than HF's initialisation, so the images count, and queries
        # and keys too, so attention is sharp enough that the rotary positions count
        for linear in model.model.visual.merger.mlp:
            if isinstance(linear, torch.nn.Linear):
                linear.weight.normal_(0, linear.in_features**-0.5)
        for layer in model.model.language_model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.normal_(0, 2 * proj.in_features**-0.5)
                proj.bias.normal_(0, 0.5)
    return _save_qwen_vl(path, model)


# Qwen3-VL's and Qwen3.5's tiny vision tower (Qwen3-VL adds its DeepStack layers)
QWEN3_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=PATCH_SIZE,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=TEXT_CONFIG["hidden_size"],
    num_position_embeddings=16,  # a 4x4 grid, resampled to each image's
)


def _tiny_qwen3_vl(seed: int, moe: bool):
    """A random tiny Qwen3VLForConditionalGeneration (make_tiny_qwen2_vl's "qwen3-vl"), or
    Qwen3VLMoeForConditionalGeneration ("qwen3-vl-moe")."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
    text = dict(
        TEXT_CONFIG,
        vocab_size=IMAGE_TOKEN_ID + 1 + len(QWEN2_VL_TOKENS) + 1,
        head_dim=TEXT_CONFIG["hidden_size"] // TEXT_CONFIG["num_attention_heads"],
        num_hidden_layers=3,  # (a feature added after the last layer changes no sampled token)
        rope_parameters=rope,
    )
    if moe:  # (the experts narrower than the hidden size: the fused tensors' layout shows)
        text.update(moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
    vision = dict(QWEN3_VISION, deepstack_visual_indexes=[0, 1])
    classes = {
        False: (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration),
        True: (transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration),
    }
    config_class, model_class = classes[moe]
    config = config_class(
        vision_config=vision, text_config=text, tie_word_embeddings=False, **QWEN_VL_IDS
    )
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        # the mergers' outputs wider than HF's initialisation, so the images and each DeepStack
        # feature count; the q/k norms' scales too, so that the rotary positions count
        visual = model.model.visual
        for merger in (visual.merger, *visual.deepstack_merger_list):
            for linear in (merger.linear_fc1, merger.linear_fc2):
                linear.weight.normal_(0, linear.in_features**-0.5)
        for layer in model.model.language_model.layers:
            layer.self_attn.q_norm.weight.fill_(2.0)
            layer.self_attn.k_norm.weight.fill_(2.0)
    return model


def _tiny_qwen3_5_vl(seed: int):
    """A random tiny Qwen3_5ForConditionalGeneration (make_tiny_qwen2_vl's "qwen3.5-vl"): three
    Gated DeltaNet layers and a gated full-attention one that turns half of each 16-value head,
    its interleaved M-RoPE sections 2, 1 and 1 frequency pairs; Qwen3-VL's vision tower without
    DeepStack."""
    import transformers

    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.5,
    }
    text = dict(
        TEXT_CONFIG,
        vocab_size=IMAGE_TOKEN_ID + 1 + len(QWEN2_VL_TOKENS) + 1,
        head_dim=16,
        num_hidden_layers=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        rope_parameters=rope,
    )
    config = transformers.Qwen3_5Config(
        vision_config=QWEN3_VISION, text_config=text, tie_word_embeddings=False, **QWEN_VL_IDS
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():  # (as _tiny_qwen3_vl's: the images and the positions count)
        merger = model.model.visual.merger
        for linear in (merger.linear_fc1, merger.linear_fc2):
            linear.weight.normal_(0, linear.in_features**-0.5)
        for layer in model.model.language_model.layers:
            if hasattr(layer, "self_attn"):  # (x * (1 + w): a scale of 2)
                layer.self_attn.q_norm.weight.fill_(1.0)
                layer.self_attn.k_norm.weight.fill_(1.0)
    return model


def _save_qwen_vl(path, model):
    model.eval().save_pretrained(path)
    tokenizer = _tokenizer(QWEN2_VL_TOKENS)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE  # (as a checkpoint's tokenizer holds it)
    tokenizer.save_pretrained(path)
    return model


def qwen2_vl_processor(kind: str = "qwen2-vl"):
    """Transformers' Qwen2-VL processor (Qwen3-VL's for a `kind` "qwen3-vl...", the same but for
    videos) for make_tiny_qwen2_vl's models (images of 16 to 64x64 pixels, in 8x8 patches merged
    2x2), built without its video part: its class checks that part against a torchvision class,
    skipped here for the part left out."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: (
        None if arg is None else check(self, name, arg)
    )
    cls = (
        transformers.Qwen3VLProcessor
        if kind.startswith(("qwen3-vl", "qwen3.5"))
        else transformers.Qwen2VLProcessor
    )
    try:
        return cls(
            image_processor=transformers.Qwen2VLImageProcessorPil(
                min_pixels=16 * 16,
                max_pixels=64 * 64,
                patch_size=PATCH_SIZE,
                merge_size=2,
                temporal_patch_size=2,
            ),
            tokenizer=_tokenizer(QWEN2_VL_TOKENS),
            video_processor=None,
            chat_template=QWEN2_VL_CHAT_TEMPLATE,
        )
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def hf_qwen2_vl(
    model, text: str, images, max_tokens: int, kind: str = "qwen2-vl", **processor_kwargs
) -> list[int]:
    """HF's greedy tokens for `text` with `images` on a make_tiny_qwen2_vl model of `kind`, as
    `qwen2_vl_processor` makes the prompt (with `processor_kwargs` in its call). HF's model
    keeps the last prompt's position shift (rope_deltas) for the steps after a prompt's own, so
    a prompt without images would inherit the one before's: it is cleared first."""
    processor = qwen2_vl_processor(kind)
    images = list(images) or None
    out = processor(text=text, images=images, return_tensors="pt", **processor_kwargs)
    model.model.rope_deltas = None
    extra = {k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out}
    ids = out["input_ids"][0].tolist()
    return hf_greedy(model, ids, max_tokens, mm_token_type_ids=out["mm_token_type_ids"], **extra)


GEMMA3_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")  # ids 256-258
GEMMA3_IMAGE_TOKEN_ID = 257
GEMMA3_IMAGE_TOKENS = 16  # an image's tokens: 8x8 patches of 4 pixels, pooled 2x2
GEMMA3_WINDOW = 8  # its sliding layers' window: shorter than an image


def make_tiny_gemma3_vl(path, seed: int = 0):
    """Save a random tiny Gemma 3 (transformers' `Gemma3ForConditionalGeneration`: a 2-layer
    SigLIP tower over 32x32 images in 4x4 patches, average-pooled 2x2 into 16 image tokens; a
    3-layer Gemma 3 text model, sliding, full, sliding, whose window of 8 is shorter than an
    image) and its processor, which writes each "<start_of_image>" of a text as that token, the
    image's 16 tokens and "<end_of_image>"; returns the HF model. Its language model attends
    each image's tokens to one another both ways. The projector is drawn wider than HF's
    initialisation (zeros), so that the images decide the greedy tokens."""
    import transformers

    text = dict(
        TEXT_CONFIG,
        vocab_size=IMAGE_TOKEN_ID + len(GEMMA3_TOKENS) + 1,
        num_hidden_layers=3,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=GEMMA3_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    vision = {k: v for k, v in VISION_CONFIG.items() if k != "projection_dim"}
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**text),
        vision_config=transformers.SiglipVisionConfig(**dict(vision, patch_size=4)),
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        boi_token_index=IMAGE_TOKEN_ID,
        image_token_index=GEMMA3_IMAGE_TOKEN_ID,
        eoi_token_index=GEMMA3_IMAGE_TOKEN_ID + 1,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        weight = model.model.multi_modal_projector.mm_input_projection_weight
        weight.normal_(0, weight.shape[0] ** -0.5)
    model.save_pretrained(path)
    boi, image, eoi = GEMMA3_TOKENS
    tokenizer = _word_tokenizer(
        extra_special_tokens={"boi_token": boi, "image_token": image, "eoi_token": eoi}
    )
    assert tokenizer.image_token_id == GEMMA3_IMAGE_TOKEN_ID
    transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        ),
        tokenizer=tokenizer,
        image_seq_length=GEMMA3_IMAGE_TOKENS,
        chat_template=CHAT_TEMPLATE.replace("<image>", boi),
    ).save_pretrained(path)
    return model


def hf_gemma3_vl(path, model, text: str, images, max_tokens: int, two_way: bool = True):
    """HF's greedy tokens for `text` with `images` on a make_tiny_gemma3_vl model, its prompt as
    the saved processor makes it; two_way=False: without the processor's token_type_ids, so
    HF attends the images causally (what the tests show the engine does not do)."""
    from transformers import AutoProcessor

    out = AutoProcessor.from_pretrained(path)(
        text=text, images=list(images) or None, return_tensors="pt"
    )
    extra = {k: out[k] for k in ("pixel_values", "token_type_ids") if k in out}
    if not two_way:
        extra.pop("token_type_ids")
    return hf_greedy(model, out["input_ids"][0].tolist(), max_tokens, **extra)


def _word_tokenizer(**kwargs):
    """models.py's word-level tokenizer ("t0".."t255"), `kwargs` to its constructor."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", **kwargs)


def _tokenizer(extra=()):
    """models.py's word-level tokenizer ("t0".."t255") with "<image>" (id 256) and `extra`
    special tokens after it."""
    tokenizer = _word_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, *extra]})
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    return tokenizer


def _tiny_idefics3():
    import transformers

    vision = {k: v for k, v in VISION_CONFIG.items() if k != "projection_dim"}
    text = dict(TEXT_CONFIG, vocab_size=IMAGE_TOKEN_ID + 1 + len(IDEFICS3_TOKENS) + 1)
    config = transformers.Idefics3Config(
        vision_config=transformers.Idefics3VisionConfig(**vision),
        text_config=transformers.LlamaConfig(**text),
        image_token_id=IMAGE_TOKEN_ID,
        scale_factor=2,
    )
    model = transformers.Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        proj = model.model.connector.modality_projection.proj
        proj.weight.normal_(0, proj.in_features**-0.5)
    return model


def _tiny_idefics3_processor():
    import transformers

    return transformers.Idefics3Processor(
        image_processor=transformers.Idefics3ImageProcessorPil(
            size={"longest_edge": 2 * IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE}
        ),
        tokenizer=_tokenizer(IDEFICS3_TOKENS),
        image_seq_len=IDEFICS3_TILE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )


def random_images(n: int, seed: int = 0, size: int = IMAGE_SIZE):
    """`n` RGB images of `size` x `size` uniformly random pixels, the same for the same seed."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (n, size, size, 3), generator=g, dtype=torch.uint8)
    return [Image.fromarray(p.numpy()) for p in pixels]  # uint8 H x W x 3: RGB


def llava_inputs(path, prompt_text: str, images, sizes: bool = False):
    """The processor's token ids (each "<image>" of `prompt_text` expanded into the image's
    tokens) and pixel values (one 3 x 32 x 32 row per image; LLaVA-NeXT: its tiles; Idefics 3:
    every image's tiles in one row) for one prompt; with `sizes`, the pixel values are a dict
    with the processor's image_sizes and pixel_attention_mask too where it makes them (what
    LLaVA-NeXT's and Idefics 3's encoders read)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    out = processor(text=prompt_text, images=list(images) or None, return_tensors="pt")
    pixels = out.get("pixel_values")
    if sizes and pixels is not None:
        names = ("pixel_values", "image_sizes", "pixel_attention_mask")
        pixels = {k: out[k] for k in names if k in out}
    return out["input_ids"][0].tolist(), pixels


def hf_llava_greedy(model, input_ids, pixel_values, max_new_tokens: int) -> list[int]:
    """HF's own LLaVA's greedy tokens (models.hf_greedy: EOS ignored, `logits_to_keep=1`), the
    pixel values (or llava_inputs' dict of them) going with the prompt's step only."""
    extra = pixel_values if isinstance(pixel_values, dict) else {"pixel_values": pixel_values}
    return hf_greedy(model, input_ids, max_new_tokens, **extra)


def shaped_images(seed: int, *sizes):
    """Random images resized to `sizes` ((width, height) each): images of several shapes."""
    return [image.resize(size) for image, size in zip(random_images(len(sizes), seed, 48), sizes)]


def vlm_prompt(text: str, images) -> dict:
    """LLM.generate's prompt of `text` with `images` (vLLM's multi_modal_data)."""
    return {"prompt": text, "multi_modal_data": {"image": list(images)}}


def hf_reference(model_dir: str, model, text: str, images, max_tokens: int) -> list[int]:
    """HF's greedy tokens for `text` with `images`, as the model's processor makes the prompt."""
    ids, inputs = llava_inputs(model_dir, text, images, sizes=True)
    return hf_llava_greedy(model, ids, inputs, max_tokens)
