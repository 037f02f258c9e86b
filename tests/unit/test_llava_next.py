"""LLaVA-NeXT in the engine (engine/multimodal.py): a tiny random LlavaNextForConditionalGeneration
(CLIP tower over 32x32 tiles on grids up to 2x2, Llama language model: tests/helpers/vlm.py),
whose images become a count of tokens that follows each image's size and aspect. Its greedy
tokens for prompts with images of different shapes equal transformers' own, one prompt at a time
and in a batch whose chunks cut images apart; each image's rows are counted on the meta device
(no encoding) as the processor counts them; an image's cache key does not change with the zero
tiles that pad it to a bigger image's count; inputs the encoder cannot take are refused as they
are added, by name."""

from __future__ import annotations

import pytest
import torch

from helpers.vlm import (
    IMAGE_TOKEN_ID,
    hf_llava_greedy,
    llava_inputs,
    make_tiny_llava,
    random_images,
)
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.image_keys import image_cache_ids, image_keys

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PREFIX = " ".join(f"t{i}" for i in range(20, 38))  # 18 words: a full block before the image


@pytest.fixture(scope="module")
def next_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llava-next"))
    return path, make_tiny_llava(path, kind="llava-next")


@pytest.fixture(scope="module")
def llm(next_model):
    llm = LLM(next_model[0], dtype="float32", kv_cache_memory=16 << 20, max_model_len=512)
    yield llm
    llm.shutdown()


def _images(seed: int):
    """Three images of three shapes: square, wide, tall (each its own grid of tiles)."""
    a, b, c = random_images(3, seed=seed, size=48)
    return a.resize((40, 40)), b.resize((70, 30)), c.resize((24, 60))


def _reference(next_model, text, images):
    path, model = next_model
    ids, inputs = llava_inputs(path, text, images, sizes=True)
    return hf_llava_greedy(model, ids, inputs, MAX_TOKENS)


def _prompt(text, images):
    return {"prompt": text, "multi_modal_data": {"image": list(images)}}


def _tokens(out):
    return list(out.outputs[0].token_ids)


def test_images_of_every_shape_give_hf_s_tokens(next_model, llm):
    square, wide, tall = _images(seed=1)
    cases = [
        (f"{PREFIX} <image> t7 t8 t9", [square]),
        (f"{PREFIX} <image> t7 t8 t9", [wide]),
        (f"<image> t5 <image> t6 {PREFIX}", [tall, square]),
    ]
    got = [_tokens(llm.generate(_prompt(t, i), GREEDY, use_tqdm=False)[0]) for t, i in cases]
    want = [_reference(next_model, t, i) for t, i in cases]
    assert got == want
    assert want[0] != want[1]  # (the image decides: an engine that dropped it would fail)


def test_a_batch_with_chunks_cutting_images_apart_equals_hf(next_model):
    square, wide, tall = _images(seed=2)
    cases = [
        (f"{PREFIX} <image> t5 <image>", [wide, tall]),
        ("<image> t3 t4", [square]),
        (f"t9 {PREFIX} <image>", [tall]),
    ]
    llm = LLM(
        next_model[0],
        dtype="float32",
        kv_cache_memory=16 << 20,
        max_model_len=512,
        max_num_batched_tokens=16,  # every image's tokens span several steps
    )
    try:
        outs = llm.generate([_prompt(t, i) for t, i in cases], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [_tokens(o) for o in outs] == [_reference(next_model, t, i) for t, i in cases]


def test_rows_are_counted_on_the_meta_device_as_the_processor_counts_them(
    next_model, llm, monkeypatch
):
    from transformers import AutoProcessor

    images = _images(seed=3)
    ids, inputs = llava_inputs(next_model[0], "<image> t1 <image> t2 <image>", images, sizes=True)
    encoder = llm.engine.image_encoder
    monkeypatch.setattr(encoder, "encode", lambda *a: pytest.fail("counting encoded"))
    from pdserve.engine.image_keys import image_inputs

    rows = encoder.rows(image_inputs(inputs))
    processor = AutoProcessor.from_pretrained(next_model[0])
    sizes = [(image.height, image.width) for image in images]
    assert rows == processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
    assert len(set(rows)) == 3 and sum(rows) == ids.count(IMAGE_TOKEN_ID)
    # the engine's cache ids give each image its own count of its key, as the router's do
    keys = image_keys(inputs)
    cache_ids = llm.engine.cache_ids(ids, inputs)
    assert cache_ids == image_cache_ids(ids, IMAGE_TOKEN_ID, keys, rows)
    assert [cache_ids.count(k) for k in keys] == rows


def test_an_image_s_key_ignores_the_tiles_that_pad_it(next_model):
    """The processor pads each image's tiles to the prompt's most: a wide image (2x1 tiles and
    the whole image: 3) beside a square one (2x2 and the whole: 5) carries two zero tiles it
    does not carry alone."""
    square, wide, _ = _images(seed=4)
    _, alone = llava_inputs(next_model[0], "<image>", [wide], sizes=True)
    _, both = llava_inputs(next_model[0], "<image> <image>", [square, wide], sizes=True)
    assert alone["pixel_values"].shape[1] < both["pixel_values"].shape[1]
    assert image_keys(both)[1] == image_keys(alone)[0]
    assert image_keys(both)[0] != image_keys(alone)[0]
    # the size is part of the key: the same pixels read as another size are another image
    other = dict(alone, image_sizes=alone["image_sizes"] + 1)
    assert image_keys(other) != image_keys(alone)


def test_the_same_image_is_cached_and_another_is_not(next_model, llm):
    square, wide, _ = _images(seed=5)
    text = f"{PREFIX} <image> t7 t8 t9"
    first = llm.generate(_prompt(text, [wide]), GREEDY, use_tqdm=False)[0]
    again = llm.generate(_prompt(text, [wide]), GREEDY, use_tqdm=False)[0]
    other = llm.generate(_prompt(text, [square]), GREEDY, use_tqdm=False)[0]
    assert _tokens(again) == _tokens(first)
    prompt_len = len(first.prompt_token_ids)
    assert again.num_cached_tokens >= prompt_len - 16  # every full block, the image's too
    assert other.num_cached_tokens == 16  # the text before the image only


def test_inputs_the_encoder_cannot_take_are_refused_as_added(next_model, llm):
    square, wide, _ = _images(seed=6)
    ids, inputs = llava_inputs(next_model[0], "<image> t1", [wide], sizes=True)
    engine = llm.engine
    bad = [
        ({"pixel_values": inputs["pixel_values"]}, "image_sizes"),  # sizes missing
        (inputs["pixel_values"][:, 0], "tiles"),  # 4-D: no tiles
        (dict(inputs, pixel_values=inputs["pixel_values"][:, :2]), "do not fit"),  # tiles cut
        (dict(inputs, image_sizes=torch.tensor([[0, 70]])), "positive"),
        (dict(inputs, image_sizes=inputs["image_sizes"].float()), "positive"),
        (dict(inputs, image_sizes=torch.tensor([[30, 30]])), "features"),  # another count
    ]
    for i, (images, said) in enumerate(bad):
        with pytest.raises(InvalidRequest, match=said):
            engine.add_request(f"bad-{i}", ids, GREEDY, images=images)
    assert not engine.has_unfinished_requests()
    # and it serves on
    out = llm.generate(_prompt("<image> t1", [square]), GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
