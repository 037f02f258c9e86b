"""The vision-language families beside LLaVA (tests/unit/test_llava.py) in the engine
(engine/multimodal.py), on tiny random models (tests/helpers/vlm.py):

- LLaVA-NeXT, whose images become a count of tokens that follows each image's size and aspect
  (tiles on a grid, unpadded, a row-end embedding); the processor pads each image's tiles to the
  prompt's most and gives each image's original size.
- Idefics 3 (SmolVLM's class), whose processor splits each image into tiles and a whole one,
  frames each tile's tokens with its own special tokens, and puts every image's tiles of a
  prompt in one row with a pixel mask; the engine takes them one row an image
  (image_keys.processor_inputs).

For both: greedy tokens for prompts with images of several shapes equal transformers' own, one
prompt at a time and in a batch whose chunks cut images apart; the same image is served from the
prefix cache and another is not. Then each family's own: rows counted without encoding as the
processor counts them, each image keyed by itself (not by the padding another image causes), and
inputs the encoder cannot take refused as they are added, by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers.vlm import (
    IDEFICS3_TILE_TOKENS,
    IMAGE_TOKEN_ID,
    hf_reference,
    llava_inputs,
    make_tiny_llava,
    shaped_images,
    vlm_prompt,
)
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.image_keys import (
    image_cache_ids,
    image_inputs,
    image_keys,
    processor_inputs,
)

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PREFIX = " ".join(f"t{i}" for i in range(20, 38))  # 18 words: a full block before the image
KINDS = ("llava-next", "idefics3")
# three images of three shapes each: LLaVA-NeXT's a square, a wide and a tall one (each its own
# grid of tiles); Idefics 3's a square (2x2 tiles and the whole: 5), a wide (1x2 and the whole:
# 3) and a small one (resized up to the processor's 64 first: 5 too)
SHAPES = {
    "llava-next": ((40, 40), (70, 30), (24, 60)),
    "idefics3": ((60, 60), (70, 30), (20, 24)),
}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """kind -> its tiny model's directory, HF model and an LLM on it, each built once."""
    built = {}

    def get(kind: str):
        if kind not in built:
            path = str(tmp_path_factory.mktemp(kind))
            model = make_tiny_llava(path, kind=kind)
            llm = LLM(path, dtype="float32", kv_cache_memory=16 << 20, max_model_len=512)
            built[kind] = SimpleNamespace(path=path, model=model, llm=llm)
        return built[kind]

    yield get
    for family in built.values():
        family.llm.shutdown()


def _images(kind: str, seed: int):
    return shaped_images(seed, *SHAPES[kind])


def _tokens(out):
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("kind", KINDS)
def test_images_of_every_shape_give_hf_s_tokens(families, kind):
    f = families(kind)
    a, b, c = _images(kind, seed=1)
    cases = [
        (f"{PREFIX} <image> t7 t8 t9", [a]),
        (f"{PREFIX} <image> t7 t8 t9", [b]),
        (f"<image> t5 <image> t6 <image> {PREFIX}", [b, c, a]),
    ]
    got = [_tokens(f.llm.generate(vlm_prompt(t, i), GREEDY, use_tqdm=False)[0]) for t, i in cases]
    want = [hf_reference(f.path, f.model, t, i, MAX_TOKENS) for t, i in cases]
    assert got == want
    assert want[0] != want[1]  # (the image decides: an engine that dropped it would fail)


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_with_chunks_cutting_images_apart_equals_hf(families, kind):
    f = families(kind)
    a, b, c = _images(kind, seed=2)
    cases = [
        (f"{PREFIX} <image> t5 <image>", [b, c]),
        ("<image> t3 t4", [a]),
        (f"t9 {PREFIX} <image>", [c]),
    ]
    llm = LLM(
        f.path,
        dtype="float32",
        kv_cache_memory=16 << 20,
        max_model_len=512,
        max_num_batched_tokens=16,  # every image's tokens span several steps
    )
    try:
        outs = llm.generate([vlm_prompt(t, i) for t, i in cases], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    want = [hf_reference(f.path, f.model, t, i, MAX_TOKENS) for t, i in cases]
    assert [_tokens(o) for o in outs] == want


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_image_is_cached_and_another_is_not(families, kind):
    llm = families(kind).llm
    a, b, _ = _images(kind, seed=5)
    text = f"{PREFIX} <image> t7 t8 t9"
    first = llm.generate(vlm_prompt(text, [b]), GREEDY, use_tqdm=False)[0]
    again = llm.generate(vlm_prompt(text, [b]), GREEDY, use_tqdm=False)[0]
    other = llm.generate(vlm_prompt(text, [a]), GREEDY, use_tqdm=False)[0]
    assert _tokens(again) == _tokens(first)
    # every full block, the image's too (the prompt's last token is always computed)
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 16 * 16
    assert other.num_cached_tokens == 16  # the text before the image only


def _refused_as_added(llm, ids, bad, serves) -> None:
    """Each (images, words) of `bad` is an InvalidRequest saying `words` as it is added; then
    the engine, holding nothing of them, serves `serves` (an image) as ever."""
    engine = llm.engine
    for i, (images, said) in enumerate(bad):
        with pytest.raises(InvalidRequest, match=said):
            engine.add_request(f"bad-{i}", ids, GREEDY, images=images)
    assert not engine.has_unfinished_requests()
    out = llm.generate(vlm_prompt("<image> t1", [serves]), GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS


# ---- LLaVA-NeXT ---------------------------------------------------------------------------


def test_next_rows_are_counted_on_the_meta_device_as_the_processor_counts_them(
    families, monkeypatch
):
    from transformers import AutoProcessor

    f = families("llava-next")
    images = _images("llava-next", seed=3)
    ids, inputs = llava_inputs(f.path, "<image> t1 <image> t2 <image>", images, sizes=True)
    encoder = f.llm.engine.image_encoder
    monkeypatch.setattr(encoder, "encode", lambda *a: pytest.fail("counting encoded"))
    rows = encoder.rows(image_inputs(inputs))
    processor = AutoProcessor.from_pretrained(f.path)
    sizes = [(image.height, image.width) for image in images]
    assert rows == processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
    assert len(set(rows)) == 3 and sum(rows) == ids.count(IMAGE_TOKEN_ID)
    # the engine's cache ids give each image its own count of its key, as the router's do
    keys = image_keys(inputs)
    cache_ids = f.llm.engine.cache_ids(ids, inputs)
    assert cache_ids == image_cache_ids(ids, IMAGE_TOKEN_ID, keys, rows)
    assert [cache_ids.count(k) for k in keys] == rows


def test_next_an_image_s_key_ignores_the_tiles_that_pad_it(families):
    """The processor pads each image's tiles to the prompt's most: a wide image (2x1 tiles and
    the whole image: 3) beside a square one (2x2 and the whole: 5) carries two zero tiles it
    does not carry alone."""
    path = families("llava-next").path
    square, wide, _ = _images("llava-next", seed=4)
    _, alone = llava_inputs(path, "<image>", [wide], sizes=True)
    _, both = llava_inputs(path, "<image> <image>", [square, wide], sizes=True)
    assert alone["pixel_values"].shape[1] < both["pixel_values"].shape[1]
    assert image_keys(both)[1] == image_keys(alone)[0]
    assert image_keys(both)[0] != image_keys(alone)[0]
    # the size is part of the key: the same pixels read as another size are another image
    other = dict(alone, image_sizes=alone["image_sizes"] + 1)
    assert image_keys(other) != image_keys(alone)


def test_next_inputs_the_encoder_cannot_take_are_refused_as_added(families):
    f = families("llava-next")
    square, wide, _ = _images("llava-next", seed=6)
    ids, inputs = llava_inputs(f.path, "<image> t1", [wide], sizes=True)
    values, sizes = inputs["pixel_values"], inputs["image_sizes"]
    bad = [
        ({"pixel_values": values}, "image_sizes"),  # sizes missing
        (values[:, 0], "tiles"),  # 4-D: no tiles
        (dict(inputs, pixel_values=values[:, :2]), "do not fit"),  # tiles cut
        (dict(inputs, image_sizes=torch.tensor([[0, 70]])), "positive"),
        (dict(inputs, image_sizes=sizes.float()), "positive"),
        (dict(inputs, image_sizes=torch.tensor([[30, 30]])), "features"),  # another count
    ]
    _refused_as_added(f.llm, ids, bad, square)


# ---- Idefics 3 ----------------------------------------------------------------------------


def test_idefics3_one_row_an_image_keys_each_image_by_its_own_tiles(families):
    from transformers import AutoProcessor

    f = families("idefics3")
    square, wide, small = images = _images("idefics3", seed=3)
    processor = AutoProcessor.from_pretrained(f.path)
    out = processor(text="<image> t1 <image> t2 <image>", images=list(images), return_tensors="pt")
    assert out["pixel_values"].shape[:2] == (1, 13)  # every tile of the prompt in one row
    inputs, counts = processor_inputs(processor, out, images)
    assert counts == [5 * IDEFICS3_TILE_TOKENS, 3 * IDEFICS3_TILE_TOKENS, 5 * IDEFICS3_TILE_TOKENS]
    assert inputs.pixel_values.shape[:2] == (3, 5)  # one row an image, zero-padded to 5 tiles
    assert inputs.pixel_attention_mask.shape == (3, 5, 32, 32)
    engine = f.llm.engine
    assert engine.image_encoder.rows(inputs) == counts  # the real tiles, as the processor says
    ids = out["input_ids"][0].tolist()
    assert sum(counts) == ids.count(IMAGE_TOKEN_ID)
    keys = image_keys(inputs)
    assert engine.cache_ids(ids, inputs) == image_cache_ids(ids, IMAGE_TOKEN_ID, keys, counts)
    # an image's key is its own: the wide image alone (3 tiles, unpadded) keys as it does here
    alone_out = processor(text="<image>", images=[wide], return_tensors="pt")
    alone, _ = processor_inputs(processor, alone_out, [wide])
    assert image_keys(alone) == [keys[1]] and len(set(keys)) == 3


def test_idefics3_inputs_the_encoder_cannot_take_are_refused_as_added(families):
    f = families("idefics3")
    _, wide, small = _images("idefics3", seed=5)
    ids, inputs = llava_inputs(f.path, "<image> t1", [wide], sizes=True)
    values, mask = inputs["pixel_values"], inputs["pixel_attention_mask"]
    bad = [
        (dict(inputs, pixel_attention_mask=mask[:, :, :16]), "pixel_attention_mask"),
        (values[0], "tiles"),  # 4-D
        (dict(inputs, pixel_values=torch.zeros_like(values)), "all zeros"),
        (dict(inputs, pixel_values=values[:, :2], pixel_attention_mask=mask[:, :2]), "features"),
    ]
    _refused_as_added(f.llm, ids, bad, small)
