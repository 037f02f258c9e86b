"""Gemma 3 with images in the engine, on a tiny random model (tests/helpers/vlm.py
make_tiny_gemma3_vl). Its language model attends each image's tokens to one another both ways
(transformers' token_type_ids blocks), text causally; its sliding layers keep their window's
floor for image tokens too, while an image token sees the rest of its image above it. The
engine computes an image's tokens in one step (Sequence.fit_chunk: a chunk ends before an image
or after it) and attends them under a mask that lets each see through its image's end.

Greedy tokens equal transformers' own with its bidirectional image mask, and differ from its
causal reading for these prompts (so the check can fail); they do so with one and two images,
in a batch whose token budget (8) is half an image, and when the prefix cache serves a prompt
up to the middle of an image, and with pan and scan's crops; the chunk rule's cuts are checked
on their own.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers.models import hf_greedy
from helpers.vlm import (
    GEMMA3_IMAGE_TOKEN_ID,
    GEMMA3_IMAGE_TOKENS,
    hf_gemma3_vl,
    make_tiny_gemma3_vl,
    random_images,
    vlm_prompt,
)
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.multimodal import image_blocks
from pdserve.engine.request import Sequence

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
IMAGE = "<start_of_image>"
# (text, images): the image after 2 words, two images, an image right at the start, text alone
PROMPTS = (
    (f"t5 t6 {IMAGE} t7 t8 t9", 1),
    (f"t5 t6 {IMAGE} t7 t8 {IMAGE} t9", 2),
    (f"{IMAGE} t40 t41 t42 t43", 1),
    ("t11 t12 t13 t14 t15", 0),
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3-vl"))
    model = make_tiny_gemma3_vl(path, seed=1)  # (seed 0 reads one test prompt alike both ways)
    llm = _llm(path)
    yield SimpleNamespace(path=path, model=model, llm=llm)
    llm.shutdown()


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory=16 << 20, max_model_len=512, **kwargs)


def _prompts(seed: int = 0):
    return [(text, random_images(count, seed + i)) for i, (text, count) in enumerate(PROMPTS)]


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate([vlm_prompt(t, im) if im else t for t, im in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_hf_with_bidirectional_images(gemma):
    prompts = _prompts()
    want = [hf_gemma3_vl(gemma.path, gemma.model, t, im, MAX_TOKENS) for t, im in prompts]
    causal = [
        hf_gemma3_vl(gemma.path, gemma.model, t, im, MAX_TOKENS, two_way=False)
        for t, im in prompts[:3]
    ]
    # the check can fail: HF's causal reading of these images gives other tokens
    assert all(c != w for c, w in zip(causal, want))
    assert [_tokens(gemma.llm, [p])[0] for p in prompts] == want


def test_chunks_of_half_an_image(gemma):
    """A token budget of 8: each chunk that reaches an image ends before it or runs through its
    end (16 tokens, past the budget), and a batch of prompts shares the steps."""
    prompts = _prompts(seed=10)
    want = [hf_gemma3_vl(gemma.path, gemma.model, t, im, MAX_TOKENS) for t, im in prompts]
    llm = _llm(gemma.path, max_num_batched_tokens=8, max_num_seqs=4)
    try:
        assert _tokens(llm, prompts) == want
    finally:
        llm.shutdown()


def test_prefix_cache_ends_inside_an_image(gemma):
    """The second run of a prompt starts from its first block of 16, cached, which ends inside
    its image (the image's tokens are 11 to 26): the rest of the image attends to the cached
    part and to itself both ways."""
    words = " ".join(f"t{i}" for i in range(60, 70))
    text, images = f"{words} {IMAGE} t9", random_images(1, 7)
    want = hf_gemma3_vl(gemma.path, gemma.model, text, images, MAX_TOKENS)
    first, again = (gemma.llm.generate([vlm_prompt(text, images)], GREEDY)[0] for _ in range(2))
    ids = first.prompt_token_ids
    image = [i for i, t in enumerate(ids) if t == GEMMA3_IMAGE_TOKEN_ID]
    assert image[0] < again.num_cached_tokens == 16 < image[-1]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == want


def test_pan_and_scan_crops_are_images_of_their_own(gemma):
    """Gemma 3's pan and scan (a processor argument, per prompt here) adds crops of a wide image
    after it, each its own block of 16 tokens attended both ways: HF's tokens."""
    from transformers import AutoProcessor

    kwargs = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=8)
    wide = random_images(1, 3, size=96)[0].resize((96, 32))
    text = f"t5 t6 {IMAGE} t7"
    out = AutoProcessor.from_pretrained(gemma.path)(
        text=text, images=[wide], return_tensors="pt", **kwargs
    )
    assert out["pixel_values"].shape[0] == 4  # the image and three crops
    ids = out["input_ids"][0].tolist()
    extra = {k: out[k] for k in ("pixel_values", "token_type_ids")}
    want = hf_greedy(gemma.model, ids, MAX_TOKENS, **extra)
    prompt = dict(vlm_prompt(text, [wide]), mm_processor_kwargs=kwargs)
    got = gemma.llm.generate([prompt], GREEDY)[0]
    assert got.prompt_token_ids == ids and got.outputs[0].token_ids == want


def _seq(computed: int, blocks) -> Sequence:
    seq = Sequence(0, "r", 0, list(range(64)), SamplingParams())
    seq.num_computed_tokens = computed
    seq.images = SimpleNamespace(blocks=blocks)
    return seq


@pytest.mark.parametrize(
    "computed, offered, fitted",
    [
        (0, 2, 2),  # ends before the image
        (0, 3, 3),  # ends at its start
        (0, 10, 3),  # would end inside it: up to its start
        (3, 4, 16),  # starts at it: through its end, past what was offered
        (10, 2, 9),  # starts inside it (a cached prefix): through its end
        (0, 19, 19),  # ends at its end
        (0, 25, 22),  # through the first image, would end inside the second: its start
        (19, 40, 40),  # past the second image
    ],
)
def test_fit_chunk(computed, offered, fitted):
    assert _seq(computed, ((3, 19), (22, 38))).fit_chunk(offered) == fitted


def test_fit_chunk_without_two_way_images():
    assert _seq(0, ()).fit_chunk(10) == 10
    assert Sequence(0, "r", 0, list(range(64)), SamplingParams()).fit_chunk(10) == 10


def test_image_blocks_are_runs_of_image_tokens():
    assert image_blocks([3, 4, 5, 9, 10, 12]) == ((3, 6), (9, 11), (12, 13))
    assert image_blocks(list(range(5, 5 + GEMMA3_IMAGE_TOKENS))) == ((5, 21),)
    assert image_blocks([]) == ()
