"""Idefics 3 (SmolVLM's class) in the engine (engine/multimodal.py): a tiny random
Idefics3ForConditionalGeneration (tests/helpers/vlm.py) whose processor splits each image into
tiles of 32x32 and a whole one, frames each tile's 4 image tokens with its own special tokens,
and puts every image's tiles of a prompt in one row with a pixel mask. The engine takes them one
row an image (image_keys.one_row_an_image, with each image's tiles from the processor's count),
so each image keys its own cached blocks; its greedy tokens equal transformers' own, one prompt
at a time and in a batch whose chunks cut images apart; the rows are counted from the real tiles
as the processor counts them; inputs its encoder cannot take are refused as they are added."""

from __future__ import annotations

import pytest
import torch

from helpers.vlm import (
    IDEFICS3_TILE_TOKENS,
    IMAGE_TOKEN_ID,
    hf_llava_greedy,
    llava_inputs,
    make_tiny_llava,
    random_images,
)
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.image_keys import image_cache_ids, image_keys, processor_inputs

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PREFIX = " ".join(f"t{i}" for i in range(20, 38))  # 18 words: a full block before the image


@pytest.fixture(scope="module")
def idefics(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("idefics3"))
    return path, make_tiny_llava(path, kind="idefics3")


@pytest.fixture(scope="module")
def llm(idefics):
    llm = LLM(idefics[0], dtype="float32", kv_cache_memory=16 << 20, max_model_len=512)
    yield llm
    llm.shutdown()


def _images(seed: int):
    """A square image (2x2 tiles and the whole: 5 tiles), a wide one (1x2 and the whole: 3), a
    small one (resized up to the processor's 64 first: 5 too)."""
    a, b, c = random_images(3, seed=seed, size=48)
    return a.resize((60, 60)), b.resize((70, 30)), c.resize((20, 24))


def _reference(idefics, text, images):
    path, model = idefics
    ids, inputs = llava_inputs(path, text, images, sizes=True)  # (HF's: one row of tiles)
    return hf_llava_greedy(model, ids, inputs, MAX_TOKENS)


def _prompt(text, images):
    return {"prompt": text, "multi_modal_data": {"image": list(images)}}


def _tokens(out):
    return list(out.outputs[0].token_ids)


def test_images_give_hf_s_tokens_one_prompt_at_a_time(idefics, llm):
    square, wide, small = _images(seed=1)
    cases = [
        (f"{PREFIX} <image> t7 t8 t9", [square]),
        (f"{PREFIX} <image> t7 t8 t9", [wide]),
        (f"<image> t5 <image> t6 <image> {PREFIX}", [wide, small, square]),
    ]
    got = [_tokens(llm.generate(_prompt(t, i), GREEDY, use_tqdm=False)[0]) for t, i in cases]
    want = [_reference(idefics, t, i) for t, i in cases]
    assert got == want
    assert want[0] != want[1]  # (the image decides: an engine that dropped it would fail)


def test_a_batch_with_chunks_cutting_images_apart_equals_hf(idefics):
    square, wide, small = _images(seed=2)
    cases = [
        (f"{PREFIX} <image> t5 <image>", [square, wide]),
        ("<image> t3 t4", [small]),
        (f"t9 {PREFIX} <image>", [wide]),
    ]
    llm = LLM(
        idefics[0],
        dtype="float32",
        kv_cache_memory=16 << 20,
        max_model_len=512,
        max_num_batched_tokens=16,  # every image's tokens span several steps
    )
    try:
        outs = llm.generate([_prompt(t, i) for t, i in cases], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [_tokens(o) for o in outs] == [_reference(idefics, t, i) for t, i in cases]


def test_one_row_an_image_keys_each_image_by_its_own_tiles(idefics, llm):
    from transformers import AutoProcessor

    square, wide, small = images = _images(seed=3)
    processor = AutoProcessor.from_pretrained(idefics[0])
    out = processor(text="<image> t1 <image> t2 <image>", images=list(images), return_tensors="pt")
    assert out["pixel_values"].shape[:2] == (1, 13)  # every tile of the prompt in one row
    inputs, counts = processor_inputs(processor, out, images)
    assert counts == [5 * IDEFICS3_TILE_TOKENS, 3 * IDEFICS3_TILE_TOKENS, 5 * IDEFICS3_TILE_TOKENS]
    assert inputs.pixel_values.shape[:2] == (3, 5)  # one row an image, zero-padded to 5 tiles
    assert inputs.pixel_attention_mask.shape == (3, 5, 32, 32)
    engine = llm.engine
    assert engine.image_encoder.rows(inputs) == counts  # the real tiles, as the processor says
    ids = out["input_ids"][0].tolist()
    assert sum(counts) == ids.count(IMAGE_TOKEN_ID)
    keys = image_keys(inputs)
    assert engine.cache_ids(ids, inputs) == image_cache_ids(ids, IMAGE_TOKEN_ID, keys, counts)
    # an image's key is its own: the wide image alone (3 tiles, unpadded) keys as it does here
    alone_out = processor(text="<image>", images=[wide], return_tensors="pt")
    alone, _ = processor_inputs(processor, alone_out, [wide])
    assert image_keys(alone) == [keys[1]] and len(set(keys)) == 3


def test_the_same_image_is_cached_and_another_is_not(llm):
    square, wide, _ = _images(seed=4)
    text = f"{PREFIX} <image> t7 t8 t9"
    first = llm.generate(_prompt(text, [wide]), GREEDY, use_tqdm=False)[0]
    again = llm.generate(_prompt(text, [wide]), GREEDY, use_tqdm=False)[0]
    other = llm.generate(_prompt(text, [square]), GREEDY, use_tqdm=False)[0]
    assert _tokens(again) == _tokens(first)
    assert again.num_cached_tokens == len(first.prompt_token_ids) // 16 * 16
    assert other.num_cached_tokens == 16  # the text before the image only


def test_inputs_the_encoder_cannot_take_are_refused_as_added(idefics, llm):
    _, wide, small = _images(seed=5)
    ids, inputs = llava_inputs(idefics[0], "<image> t1", [wide], sizes=True)
    values, mask = inputs["pixel_values"], inputs["pixel_attention_mask"]
    engine = llm.engine
    bad = [
        (dict(inputs, pixel_attention_mask=mask[:, :, :16]), "pixel_attention_mask"),
        (values[0], "tiles"),  # 4-D
        (dict(inputs, pixel_values=torch.zeros_like(values)), "all zeros"),
        (dict(inputs, pixel_values=values[:, :2], pixel_attention_mask=mask[:, :2]), "features"),
    ]
    for i, (images, said) in enumerate(bad):
        with pytest.raises(InvalidRequest, match=said):
            engine.add_request(f"bad-{i}", ids, GREEDY, images=images)
    assert not engine.has_unfinished_requests()
    out = llm.generate(_prompt("<image> t1", [small]), GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
