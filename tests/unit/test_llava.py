"""A vision-language model in the engine (engine/multimodal.py): a tiny random LLaVA (CLIP tower,
Llama language model: tests/helpers/vlm.py) whose greedy tokens, for prompts with images, equal
transformers' own, one prompt at a time and in batches whose prompt chunks cut images apart; the
prefix cache shares a prompt's text before an image but never an image's blocks with another
image's, and reuses the same image's; prompts with image tokens but no images, and images where
the engine does not take them yet, are refused by name."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from helpers.vlm import (
    IMAGE_TOKEN_ID,
    IMAGE_TOKENS_PER_IMAGE,
    hf_llava_greedy,
    llava_inputs,
    make_tiny_llava,
    random_images,
)
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import InvalidRequest

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# text before the first image: 28 tokens (the test tokenizer splits each of "t10".."t19" into its
# special "t1" and an unknown "0"), one full block of them shared by every prompt here
PREFIX = " ".join(f"t{i}" for i in range(10, 28))


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llava"))
    return path, make_tiny_llava(path)


def _reference(llava, text, images):
    path, model = llava
    ids, pixels = llava_inputs(path, text, images)
    return hf_llava_greedy(model, ids, pixels, MAX_TOKENS)


def _prompt(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}}


# a prompt after which this tiny model's next tokens depend on the image (after most texts the
# last words decide them alone)
TEXT = f"{PREFIX} <image> t7 t8 t9"


def test_greedy_tokens_equal_hf_and_follow_the_image(llava):
    images = random_images(2, seed=1)
    text = TEXT
    llm = LLM(llava[0], dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)
    try:
        got = [
            list(llm.generate(_prompt(text, image), GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
            for image in images
        ]
    finally:
        llm.shutdown()
    want = [_reference(llava, text, [image]) for image in images]
    assert got == want
    assert want[0] != want[1]  # (the image decides: an engine that dropped it would fail)


def test_a_batch_with_chunks_cutting_images_apart_equals_hf(llava):
    """Two images in one prompt, image tokens first, last, and in a prompt given as token ids:
    every step computes at most 8 prompt tokens, so each image is cut across steps and beside
    other prompts' chunks."""
    a, b, c = random_images(3, seed=1)
    cases = [
        (f"{PREFIX} <image> t5 <image>", [a, b]),
        ("<image> t3 t4", [c]),
        (f"t9 {PREFIX} <image>", [b]),
    ]
    # each case's tokens depend on its images (the first on each of its two)
    assert _reference(llava, cases[0][0], [a, c]) != _reference(llava, *cases[0])
    assert _reference(llava, cases[0][0], [c, b]) != _reference(llava, *cases[0])
    assert _reference(llava, cases[1][0], [a]) != _reference(llava, *cases[1])
    assert _reference(llava, cases[2][0], [a]) != _reference(llava, *cases[2])
    llm = LLM(
        llava[0],
        dtype="float32",
        kv_cache_memory=8 << 20,
        max_model_len=256,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    try:
        prompts = [_prompt(text, images) for text, images in cases]
        ids, _ = llava_inputs(llava[0], *cases[0])
        prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": cases[0][1]}})
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    want = [_reference(llava, text, images) for text, images in cases]
    assert [list(o.outputs[0].token_ids) for o in outs] == [*want, want[0]]


def test_the_prefix_cache_shares_text_but_not_another_image(llava):
    a, b = random_images(2, seed=1)
    text = TEXT
    llm = LLM(llava[0], dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)
    try:

        def run(image):
            out = llm.generate(_prompt(text, image), GREEDY, use_tqdm=False)[0]
            return list(out.outputs[0].token_ids), out.num_cached_tokens

        first, cached_first = run(a)
        other, cached_other = run(b)
        again, cached_again = run(a)
    finally:
        llm.shutdown()
    prompt_len = 18 + IMAGE_TOKENS_PER_IMAGE + 3
    assert cached_first == 0
    assert cached_other == 16  # the text's one full block; the image's blocks are a's
    assert cached_again == (prompt_len - 1) // 16 * 16  # a's own blocks, image included
    assert first == again == _reference(llava, text, [a])
    assert other == _reference(llava, text, [b]) != first


def test_chat_takes_image_parts_as_vllm_does(llava):
    """image_pil and base64 data-URL image_url parts, in the "openai" content format (the
    template places the images) and the "string" one (a placeholder line ahead of the text, as
    vLLM writes it); a URL to fetch is refused."""
    a, b = random_images(2, seed=1)
    png = io.BytesIO()
    b.save(png, format="PNG")  # (lossless: the same pixels come back)
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [
        {"type": "text", "text": "t5 t6"},
        {"type": "image_pil", "image_pil": a},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "t7 t8"},
    ]
    llm = LLM(llava[0], dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)
    try:
        chat = [{"role": "user", "content": content}]
        openai_style = llm.chat(chat, GREEDY, use_tqdm=False)[0]
        string_style = llm.chat(
            chat, GREEDY, use_tqdm=False, chat_template_content_format="string"
        )[0]
        with pytest.raises(ValueError, match="base64 data URL"):
            remote = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
            llm.chat([{"role": "user", "content": [remote]}], GREEDY)
    finally:
        llm.shutdown()
    assert openai_style.prompt == "t5 t6 <image> <image> t7 t8 "
    assert string_style.prompt == "<image>\n<image>\nt5 t6\nt7 t8 "
    for out in (openai_style, string_style):
        assert list(out.outputs[0].token_ids) == _reference(llava, out.prompt, [a, b])


def test_a_reservation_keys_its_blocks_by_the_image_and_never_encodes_it(llava, monkeypatch):
    """The decode side of a hand-off (engine.reserve): the prompt's cached blocks are matched
    by its image (the same image's two blocks, another image's text block alone), and the image
    is not encoded, since the prompt's KV arrives from the prefill worker."""
    a, b = random_images(2, seed=1)
    llm = LLM(llava[0], dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)
    try:
        llm.generate(_prompt(TEXT, a), GREEDY, use_tqdm=False)  # a's blocks cached
        engine = llm.engine
        encoded = []
        real = engine.image_encoder.encode
        monkeypatch.setattr(engine.image_encoder, "encode", lambda p: encoded.append(p) or real(p))
        cached = {}
        for name, image in (("a", a), ("b", b)):
            ids, pixels = llava_inputs(llava[0], TEXT, [image])
            cached[name] = engine.reserve(name, ids, GREEDY, images=pixels).num_cached_tokens
            engine.abort(name)
        assert engine.cache_ids(ids, pixels) != ids  # (b's: its image tokens keyed)
    finally:
        llm.shutdown()
    assert cached == {"a": 32, "b": 16} and encoded == []


def test_a_preempted_prompt_with_an_image_is_recomputed_from_its_rows(llava, monkeypatch):
    """A sequence preempted mid-decode (its blocks freed, the prefix cache off so that nothing
    of it is kept) computes its prompt again from the image rows the request keeps: the image is
    encoded once, and the tokens are still HF's."""
    (image,) = random_images(1, seed=2)
    llm = LLM(
        llava[0],
        dtype="float32",
        kv_cache_memory=8 << 20,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    try:
        engine = llm.engine
        encoded = []
        real = engine.image_encoder.encode
        monkeypatch.setattr(engine.image_encoder, "encode", lambda p: encoded.append(p) or real(p))
        ids, pixels = llava_inputs(llava[0], TEXT, [image])
        engine.add_request("r", ids, GREEDY, images=pixels)
        outs = []
        for i in range(40):
            outs += engine.step()
            if i == 3:  # a few tokens in: preempted as a full cache would
                engine.scheduler._preempt(engine.scheduler.running[0])
            if outs and outs[-1].finished:
                break
    finally:
        llm.shutdown()
    assert engine.scheduler.num_preemptions == 1 and len(encoded) == 1
    assert list(outs[-1].outputs[0].token_ids) == _reference(llava, TEXT, [image])


def test_image_tokens_without_images_and_images_not_taken_are_refused(llava, tiny_models):
    llm = LLM(llava[0], dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)
    try:
        with pytest.raises(InvalidRequest, match="image tokens .* but no image"):
            llm.generate({"prompt_token_ids": [5, IMAGE_TOKEN_ID, 6]}, GREEDY, use_tqdm=False)
        (image,) = random_images(1, seed=3)
        with pytest.raises(InvalidRequest, match="16 features"):  # a placeholder not expanded
            llm.generate(
                {"prompt_token_ids": [5, IMAGE_TOKEN_ID, 6], "multi_modal_data": {"image": image}},
                GREEDY,
                use_tqdm=False,
            )
        with pytest.raises(ValueError, match="images only"):
            llm.generate({"prompt": "t5", "multi_modal_data": {"audio": b""}}, GREEDY)
        ids, _ = llava_inputs(llava[0], "t5 <image>", [image])
        with pytest.raises(InvalidRequest, match="images must be pixel values"):
            llm.engine.add_request("p", ids, GREEDY, images=torch.zeros(3, 32, 32))
        for shape in ((1, 4, 32, 32), (1, 3, 48, 48)):  # refused as added, not in a step
            with pytest.raises(InvalidRequest, match="3 channels of 32x32"):
                llm.engine.add_request("p", ids, GREEDY, images=torch.zeros(shape))
        # the engine still serves after every refusal
        assert llm.generate(_prompt("t5 <image>", image), GREEDY, use_tqdm=False)[0].outputs
    finally:
        llm.shutdown()
    text_only = LLM(tiny_models("llama-gqa")[0], dtype="float32", kv_cache_memory=4 << 20)
    try:
        with pytest.raises(ValueError, match="takes no images"):
            text_only.generate(_prompt("t5", image), GREEDY)
    finally:
        text_only.shutdown()


def test_a_micro_batch_takes_its_share_of_the_chunk_s_image_rows():
    """Under pipeline stages a chunk runs as micro-batches (engine/model_runner.py): each piece
    gets the rows of its own image tokens, offsets from its start (the whole path at PP 2:
    tests/integration/test_llava_tp.py)."""
    from pdserve.engine.model_runner import piece_embeds

    rows = torch.arange(12, dtype=torch.float32).view(4, 3)  # 4 image tokens, hidden 3
    embeds = [[5, 6, 7, 8], rows.numpy().tobytes()]
    first, second = piece_embeds(embeds, 0, 7), piece_embeds(embeds, 7, 14)
    assert first[0] == [5, 6] and second[0] == [0, 1]
    assert torch.equal(
        torch.frombuffer(bytearray(first[1]), dtype=torch.float32), rows[:2].flatten()
    )
    assert torch.equal(
        torch.frombuffer(bytearray(second[1]), dtype=torch.float32), rows[2:].flatten()
    )
    assert piece_embeds(embeds, 9, 20) == [] and piece_embeds([], 0, 7) == []
