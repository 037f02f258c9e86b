"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL in the engine (engine/multimodal.py, engine/layers/rotary.py),
on tiny random models (tests/helpers/vlm.py make_tiny_qwen2_vl). Their processor gives every
image's patches in one run with a grid each (image_grid_thw), and their language model places
tokens in 3-D (M-RoPE): an image's tokens at their cells of the merged grid, the text after an
image on from there, so every later token's position is shifted from its index. Qwen3-VL's
frequency sections interleave, and its early vision layers' features (DeepStack) are added to
the image tokens' hidden states after the language model's first layers; Qwen3-VL-MoE's language
model is a Qwen3-MoE, whose released checkpoints store each expert's matrices transposed.

Greedy tokens for prompts with images of several shapes, and for text alone, equal transformers'
own, one prompt at a time and (Qwen2-VL) in a batch whose 16-token chunks cut images apart; the
positions are transformers' `get_rope_index`, however a prompt is cut into chunks; the same
image is served from the prefix cache and another is not; inputs the encoder cannot take are
refused as they are added, by name; and the wire (worker.PixelValues) carries the grids from
the router's side to the workers' and refuses grids that do not count the patches.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.vlm import (
    QWEN2_VL_IMAGE_TOKEN_ID,
    TEXT_CONFIG,
    hf_qwen2_vl,
    make_tiny_qwen2_vl,
    qwen2_vl_processor,
    shaped_images,
    vlm_prompt,
)
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.image_keys import image_inputs
from pdserve.engine.multimodal import ImagePrompt, chunk_rope, mrope_positions

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PREFIX = " ".join(f"t{i}" for i in range(20, 38))  # 18 words: a full block before the image
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # what the chat template writes an image
KINDS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "qwen3.5-vl")
# a square, a wide and a tall image: merged grids of 2x2, 2x3 and 4x2 cells (the processor
# resizes each to multiples of 16 pixels: 8x8 patches, merged 2x2)
SHAPES = ((32, 32), (48, 24), (24, 64))


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """kind -> its tiny model's directory, HF model and an LLM on it (with the processor,
    which the engine would load from the directory where torchvision is installed), each
    built once."""
    built = {}

    def get(kind: str):
        if kind not in built:
            path = str(tmp_path_factory.mktemp(kind))
            model = make_tiny_qwen2_vl(path, kind=kind)
            built[kind] = SimpleNamespace(kind=kind, path=path, model=model, llm=_llm(path, kind))
        return built[kind]

    yield get
    for family in built.values():
        family.llm.shutdown()


def _llm(path: str, kind: str, **kwargs) -> LLM:
    llm = LLM(path, dtype="float32", kv_cache_memory=16 << 20, max_model_len=512, **kwargs)
    llm._processor = qwen2_vl_processor(kind)
    return llm


def _inputs(text: str, images):
    return qwen2_vl_processor()(text=text, images=list(images) or None, return_tensors="pt")


def _hf(family, text: str, images) -> list[int]:
    return hf_qwen2_vl(family.model, text, images, MAX_TOKENS, family.kind)


def _tokens(out):
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("kind", KINDS)
def test_images_of_several_shapes_and_text_alone_give_hf_s_tokens(families, kind):
    f = families(kind)
    a, b, c = shaped_images(1, *SHAPES)
    cases = [
        (f"{PREFIX} {IMAGE} t7 t8 t9", [a]),
        (f"{PREFIX} {IMAGE} t7 t8 t9", [b]),
        (f"{IMAGE} t5 {IMAGE} t6 {IMAGE} {PREFIX}", [b, c, a]),
        (f"{PREFIX} t7 t8 t9", []),
    ]
    # (text alone as the processor's tokenizer makes it, as HF's reference gets it: a Qwen3.5
    # checkpoint's own tokenizer class, which transformers picks by its model type, does not
    # read the tiny word-level vocabulary)
    words = f.llm._processor.tokenizer
    prompts = [vlm_prompt(t, i) if i else words.encode(t) for t, i in cases]
    got = [_tokens(f.llm.generate(p, GREEDY, use_tqdm=False)[0]) for p in prompts]
    want = [_hf(f, t, i) for t, i in cases]
    assert got == want
    assert want[0] != want[1]  # (the image decides: an engine that dropped it would fail)


@pytest.mark.parametrize("kind", ["qwen2-vl", "qwen3-vl"])
def test_a_batch_with_chunks_cutting_images_apart_equals_hf(families, kind):
    """16-token chunks cut images apart: each carries its share of the image rows (Qwen3-VL's
    with their DeepStack features) and of the positions."""
    f = families(kind)
    a, b, c = shaped_images(2, *SHAPES)
    cases = [
        (f"{PREFIX} {IMAGE} t5 {IMAGE}", [b, c]),
        (f"{IMAGE} t3 t4", [a]),
        (f"t9 {PREFIX} {IMAGE}", [c]),
    ]
    llm = _llm(f.path, kind, max_num_batched_tokens=16)  # images and text share chunks
    try:
        outs = llm.generate([vlm_prompt(t, i) for t, i in cases], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [_tokens(o) for o in outs] == [_hf(f, t, i) for t, i in cases]


@pytest.mark.parametrize("kind", ["qwen2-vl", "qwen3-vl"])
def test_positions_are_transformers_own_however_a_prompt_is_cut(families, kind):
    model = families(kind).model
    a, b, c = shaped_images(3, *SHAPES)
    out = _inputs(f"t5 {IMAGE} t6 t7 {IMAGE}{IMAGE} {PREFIX}", [c, a, b])
    ids = out["input_ids"][0].tolist()
    want, delta = model.model.get_rope_index(
        out["input_ids"], out["mm_token_type_ids"], out["image_grid_thw"]
    )
    spots = [i for i, t in enumerate(ids) if t == QWEN2_VL_IMAGE_TOKEN_ID]
    rows, shift = mrope_positions(len(ids), spots, image_inputs(dict(out)), merge=2)
    assert rows.tolist() == want[:, 0].tolist() and shift == int(delta) < 0
    # a step's share: cut anywhere, each piece is its positions or its index plus a shift, and
    # the tokens after the prompt (generated ones, recomputed after a preemption) go on at
    # their index plus the prompt's shift
    prompt = ImagePrompt(spots, None, ids, None, (rows, shift))
    end = len(ids) + 5
    cuts = [0, 3, 4, 11, 19, len(ids) - 1, len(ids) + 2, end]
    pieces = []
    for start, stop in zip(cuts, cuts[1:]):
        piece_shift, piece_rows = chunk_rope(prompt, start, stop)
        line = np.tile(np.arange(start, stop) + piece_shift, (3, 1))
        pieces.append(np.array(piece_rows) if piece_rows else line)
    line_after = np.tile(np.arange(len(ids), end) + shift, (3, 1))
    assert np.concatenate(pieces, 1).tolist() == np.concatenate([rows, line_after], 1).tolist()
    assert chunk_rope(prompt, 0, 2) == (0, [])  # text before any image: as usual


def test_the_same_image_is_cached_and_another_is_not(families):
    llm = families("qwen2-vl").llm
    a, b, _ = shaped_images(5, *SHAPES)
    text = f"{PREFIX} {IMAGE} t7 t8 t9 {PREFIX}"
    first = llm.generate(vlm_prompt(text, [b]), GREEDY, use_tqdm=False)[0]
    again = llm.generate(vlm_prompt(text, [b]), GREEDY, use_tqdm=False)[0]
    other = llm.generate(vlm_prompt(text, [a]), GREEDY, use_tqdm=False)[0]
    assert _tokens(again) == _tokens(first)
    # every full block, the image's and the shifted text's after it too
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 16 * 16 > 16
    assert other.num_cached_tokens == 16  # the text before the image only


def test_inputs_the_encoder_cannot_take_are_refused_as_added(families):
    f = families("qwen2-vl")
    a, b, _ = shaped_images(6, *SHAPES)
    out = _inputs(f"{IMAGE} t1", [b])
    ids = out["input_ids"][0].tolist()
    values, grids = out["pixel_values"], out["image_grid_thw"]
    first = ids.index(QWEN2_VL_IMAGE_TOKEN_ID)
    split = ids[: first + 1] + [5] + ids[first + 1 :]  # one of its tokens away from the rest
    bad = [
        (ids, values, "image_grid_thw"),  # the patches without their grid
        (ids, {"pixel_values": values, "image_grid_thw": grids + 2}, "image_grid_thw"),
        (ids, {"pixel_values": values[:, :100], "image_grid_thw": grids}, "pixel values"),
        (ids, {"pixel_values": values[:-8], "image_grid_thw": grids * 0 + 1}, "image_grid_thw"),
        (ids, dict(out, image_sizes=torch.tensor([[24, 48]])), "image_sizes"),
        (split, dict(out), "one run"),
    ]
    engine = f.llm.engine
    for i, (prompt, images, said) in enumerate(bad):
        images = images if isinstance(images, torch.Tensor) else dict(images)
        images = images if not isinstance(images, dict) else _processor_only(images)
        with pytest.raises(InvalidRequest, match=said):
            engine.add_request(f"bad-{i}", prompt, GREEDY, images=images)
    assert not engine.has_unfinished_requests()
    served = f.llm.generate(vlm_prompt(f"{IMAGE} t1", [a]), GREEDY, use_tqdm=False)[0]
    assert len(served.outputs[0].token_ids) == MAX_TOKENS


def _processor_only(images: dict) -> dict:
    keep = ("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask")
    return {k: v for k, v in images.items() if k in keep}


def test_the_wire_carries_the_grids_and_refuses_grids_that_miss_patches():
    from pdserve.protos.limits import check_pixel_values
    from pdserve.router.images import PromptImages
    from pdserve.worker_common.images import pixel_values

    a, b, _ = shaped_images(7, *SHAPES)
    out = _inputs(f"{IMAGE} {IMAGE}", [a, b])
    sent = PromptImages(out, QWEN2_VL_IMAGE_TOKEN_ID, [4, 6])
    assert check_pixel_values(sent.pixels) is None
    got = pixel_values(sent.pixels)
    assert torch.equal(got.pixel_values, out["pixel_values"])
    assert got.image_grid_thw.tolist() == out["image_grid_thw"].tolist()
    for field, value, said in [
        ("image_grid_thw", [1, 4, 4, 1, 4], "three numbers"),
        ("image_grid_thw", [1, 4, 4, 1, 4, 7], "add up"),
        ("image_grid_thw", [0, 4, 4, 1, 4, 6], "positive"),
        ("shape", [1, 40, 384], "2 positive sizes"),
    ]:
        bad = type(sent.pixels)()
        bad.CopyFrom(sent.pixels)
        bad.ClearField(field)
        getattr(bad, field).extend(value)
        refusal = check_pixel_values(bad)
        assert refusal is not None and said in refusal.message, (field, value)


def test_the_config_reads_the_sections_and_the_whole_checkpoint_s_tying():
    """Qwen2-VL's text config has no tie_word_embeddings (Qwen2-VL-2B ties its head to the
    embedding in the whole config), and its M-RoPE sections must cover half the head."""
    import transformers

    from pdserve.engine.config import ModelConfig

    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    text = dict(TEXT_CONFIG, rope_parameters=rope)
    config = transformers.Qwen2VLConfig(text_config=text, tie_word_embeddings=True)
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    model = ModelConfig.from_hf(config)
    assert model.tie_word_embeddings and model.mrope_section == (2, 3, 3)
    assert model.architecture == "Qwen2ForCausalLM" and model.attention_bias
    text["rope_parameters"]["mrope_section"] = [2, 3, 4]
    config = transformers.Qwen2VLConfig(text_config=text)
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    with pytest.raises(ValueError, match="mrope_section"):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize("section,head_dim", [((4, 2, 2), 16), ((24, 20, 20), 128)])
def test_qwen3_vl_s_interleaved_sections_turn_as_transformers_does(section, head_dim):
    """Each cos and sin column follows the axis transformers' Qwen3-VL rotary gives it (pair i
    by axis i % 3 while that axis has pairs left), for the tiny model's sections and the
    released checkpoints' default."""
    import transformers
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from pdserve.engine.layers.rotary import RotaryEmbedding, rope_inv_freq

    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": list(section)}
    text = transformers.Qwen3VLTextConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, rope_parameters=rope
    )
    positions = torch.randint(0, 200, (3, 40), generator=torch.Generator().manual_seed(0))
    x = torch.zeros(1, 40, head_dim)
    want_cos, want_sin = Qwen3VLTextRotaryEmbedding(text)(x, positions[:, None, :])
    inv_freq, factor = rope_inv_freq(text, "default", 1e4, head_dim)
    ours = RotaryEmbedding(inv_freq, factor, 256, section, mrope_interleaved=True)
    cos, sin = ours._mrope_rows(positions)
    torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=1e-6)
    runs = RotaryEmbedding(inv_freq, factor, 256, section)._mrope_rows(positions)[0]
    assert not torch.allclose(runs, want_cos[0])  # (the layout matters)


def test_qwen3_vl_s_config_is_a_qwen3_with_interleaved_sections():
    """A Qwen3-VL checkpoint is served by the Qwen3 family (Qwen3-VL-MoE's by Qwen3-MoE), with
    transformers' default sections (24, 20, 20) where its config names none, interleaved;
    Qwen2-VL's are not."""
    import transformers

    from pdserve.engine.config import ModelConfig

    config = transformers.Qwen3VLConfig()
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    config.text_config.rope_parameters.pop("mrope_section", None)
    model = ModelConfig.from_hf(config)
    assert model.architecture == "Qwen3ForCausalLM" and model.head_dim == 128
    assert model.mrope_section == (24, 20, 20) and model.mrope_interleaved
    config = transformers.Qwen2VLConfig()
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    assert not ModelConfig.from_hf(config).mrope_interleaved
    config = transformers.Qwen3VLMoeConfig()
    config.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    model = ModelConfig.from_hf(config)
    assert model.architecture == "Qwen3MoeForCausalLM" and model.mrope_interleaved


def test_qwen3_5_s_config_and_partial_interleaved_rotary_are_transformers_own():
    """A Qwen3.5 checkpoint (transformers' defaults: heads of 256, a quarter rotated) is served
    by the hybrid family with its images, its sections (11, 11, 10) interleaved over the 64
    rotated values of a head, each cos and sin column as transformers' Qwen3.5 rotary gives it;
    Qwen3.5-MoE's too."""
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.layers.rotary import RotaryEmbedding, rope_inv_freq

    config = transformers.Qwen3_5Config()
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    model = ModelConfig.from_hf(config)
    assert model.architecture == "Qwen3_5ForCausalLM" and model.head_dim == 256
    assert model.mrope_section == (11, 11, 10) and model.mrope_interleaved
    assert model.image_token_id is not None and model.recurrent_layers
    moe = transformers.Qwen3_5MoeConfig()
    moe.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    model = ModelConfig.from_hf(moe)
    assert model.architecture == "Qwen3_5MoeForCausalLM" and model.mrope_interleaved
    text = config.text_config
    positions = torch.randint(0, 200, (3, 40), generator=torch.Generator().manual_seed(0))
    want_cos, want_sin = Qwen3_5TextRotaryEmbedding(text)(
        torch.zeros(1, 40, 256), positions[:, None]
    )
    inv_freq, factor = rope_inv_freq(text, "default", text.rope_parameters["rope_theta"], 256)
    ours = RotaryEmbedding(inv_freq, factor, 256, (11, 11, 10), mrope_interleaved=True)
    cos, sin = ours._mrope_rows(positions)
    assert cos.shape[-1] == 64
    torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=1e-6)


def test_qwen3_vl_moe_s_released_expert_layout_loads_as_transformers_does(families, tmp_path):
    """Qwen3-VL-MoE's releases store the fused experts transposed ([E, hidden, 2 x size] and
    [E, size, hidden], what transformers transposes on load); transformers 5 saves them as it
    holds them. Both give HF's tokens; its LM head is its own (the whole config's
    tie_word_embeddings False beside the text config's True)."""
    import shutil

    from safetensors.torch import load_file, save_file

    f = families("qwen3-vl-moe")
    released = tmp_path / "released"
    shutil.copytree(f.path, released)
    tensors = load_file(released / "model.safetensors")
    fused = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 6
    for name in fused:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, released / "model.safetensors", metadata={"format": "pt"})
    (a,) = shaped_images(8, SHAPES[1])
    text = f"{PREFIX} {IMAGE} t7 t8 t9"
    llm = _llm(str(released), f.kind)
    try:
        got = _tokens(llm.generate(vlm_prompt(text, [a]), GREEDY, use_tqdm=False)[0])
    finally:
        llm.shutdown()
    assert got == _hf(f, text, [a])
    assert f.llm.engine.model_config.tie_word_embeddings is False


def test_mm_processor_kwargs_reach_the_processor_as_vllm_passes_them(families):
    """vLLM's mm_processor_kwargs: the LLM's for every prompt's images (here a `size` that
    bounds an image to 32x32 pixels: 4 tokens, not 16), a prompt dict's own over them, and
    LLM.chat's (48x48: 9); the tokens are HF's for the prompt the processor makes with them. Arguments the
    engine passes itself, or no dict, are refused by name."""
    f = families("qwen2-vl")
    (a,) = shaped_images(9, (64, 64))
    small = {"size": {"shortest_edge": 16 * 16, "longest_edge": 32 * 32}}
    text = f"{PREFIX} {IMAGE} t7 t8 t9"
    llm = _llm(f.path, f.kind, mm_processor_kwargs=small)
    try:
        bounded = llm.generate(vlm_prompt(text, [a]), GREEDY, use_tqdm=False)[0]
        whole = dict(
            vlm_prompt(text, [a]),
            mm_processor_kwargs={"size": {"shortest_edge": 256, "longest_edge": 4096}},
        )
        full = llm.generate(whole, GREEDY, use_tqdm=False)[0]
        chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": a}]}]
        medium = {"size": {"shortest_edge": 16 * 16, "longest_edge": 48 * 48}}
        chatted = llm.chat(chat, GREEDY, use_tqdm=False, mm_processor_kwargs=medium)[0]
        for bad in ({"text": "x"}, {"size": {"longest_edge": 4096}}):
            with pytest.raises(ValueError, match="mm_processor_kwargs"):
                llm.generate(dict(vlm_prompt(text, [a]), mm_processor_kwargs=bad), GREEDY)
    finally:
        llm.shutdown()
    count = lambda out: out.prompt_token_ids.count(QWEN2_VL_IMAGE_TOKEN_ID)  # noqa: E731
    assert (count(bounded), count(full), count(chatted)) == (4, 16, 9)
    made = qwen2_vl_processor()(text=text, images=[a], return_tensors="pt", **small)
    assert bounded.prompt_token_ids == made["input_ids"][0].tolist()
    assert _tokens(bounded) == hf_qwen2_vl(f.model, text, [a], MAX_TOKENS, **small)
    assert _tokens(full) == _hf(f, text, [a])
