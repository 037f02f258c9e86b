"""A vision-language model at tensor parallel 2 and in pipeline stages (engine/multimodal.py): the
image tokens' rows go to the other ranks inside each step's plain data (SeqInput.embeds), and a
batch of prompts with images, cut into chunks, gives transformers' greedy tokens; under pipeline
stages a long prompt's chunk runs as micro-batches, each with its share of the rows (one image cut
between two of them). The same for Qwen3-VL's 3-D positions and DeepStack features (the second
stage adds the second layer's), which cover Qwen2-VL's positions too; and Gemma 3's images,
whose tokens attend to one another both ways, so that neither a chunk nor a micro-batch ends
inside one. The models, the references
and one rank: tests/unit/test_llava.py and test_qwen2_vl.py."""

from __future__ import annotations

import torch

from helpers.vlm import (
    GEMMA3_IMAGE_TOKEN_ID,
    hf_gemma3_vl,
    hf_llava_greedy,
    hf_qwen2_vl,
    llava_inputs,
    make_tiny_gemma3_vl,
    make_tiny_llava,
    make_tiny_qwen2_vl,
    qwen2_vl_processor,
    random_images,
)
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_runner import PP_MICRO_MIN_TOKENS

MAX_TOKENS = 8


def test_tp2_with_images_matches_hf(tmp_path):
    path = str(tmp_path / "llava")
    model = make_tiny_llava(path)
    a, b = random_images(2, seed=1)
    cases = [("t5 t6 <image> t7 t8 t9", [a]), ("<image> t3 <image>", [b, a])]
    want = [
        hf_llava_greedy(model, *llava_inputs(path, text, images), MAX_TOKENS)
        for text, images in cases
    ]
    llm = LLM(
        path,
        dtype="float32",
        tensor_parallel_size=2,
        kv_cache_memory=8 << 20,
        max_model_len=256,
        max_num_batched_tokens=8,
    )
    try:
        outs = llm.generate(
            [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_pipeline_stages_with_images_match_hf(tmp_path):
    path = str(tmp_path / "llava")
    model = make_tiny_llava(path)
    images = random_images(16, seed=2)
    # 16 images of 16 tokens, then a word after which the last image decides the tokens: 257
    # tokens, alone in their step, run as two micro-batches (of 129 and 128 tokens: the engine's
    # bound is 2 x 128), the ninth image cut between them
    cases = [(" ".join(["<image>"] * 16) + " t5", images), ("<image> t3 <image>", images[:2])]
    want = [
        hf_llava_greedy(model, *llava_inputs(path, text, imgs), MAX_TOKENS) for text, imgs in cases
    ]
    assert len(llava_inputs(path, *cases[0])[0]) == 257
    llm = LLM(
        path,
        dtype="float32",
        pipeline_parallel_size=2,
        kv_cache_memory=8 << 20,
        max_model_len=512,
        max_num_batched_tokens=512,
    )
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        got = [  # one at a time: a step of one sequence's chunk is what runs as micro-batches
            list(llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids)
            for p in [{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases]
        ]
    finally:
        llm.shutdown()
    assert got == want


def test_qwen3_vl_positions_and_deepstack_reach_every_rank_and_micro_batch(tmp_path):
    """Qwen3-VL's positions travel in each step's plain data (SeqInput.rope_rows and
    .rope_shift), and its DeepStack features with the image rows: at TP 2 with 8-token chunks,
    and in two pipeline stages, where a prompt of 14 images runs as two micro-batches that cut
    an image apart, each with its share of the positions and rows, and the second stage adds
    the feature of the layer it holds."""
    kind = "qwen3-vl"
    path = str(tmp_path / kind)
    model = make_tiny_qwen2_vl(path, kind=kind)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    many = random_images(14, seed=3, size=64)
    # five words, then 14 images of 18 tokens with their frames: 258 tokens, the micro-batches
    # of 129 cut the seventh image's last token from the rest
    long = "t20 t21 t22 t23 t24 " + f"{image} " * 14 + "t5"
    cases = [(f"t5 t6 {image} t7 t8 t9 {image}", many[:2]), (long, many)]
    want = [hf_qwen2_vl(model, text, images, MAX_TOKENS, kind) for text, images in cases]
    assert len(qwen2_vl_processor(kind)(text=long, images=many)["input_ids"][0]) == 258
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for kwargs in (
        dict(tensor_parallel_size=2, max_num_batched_tokens=8),
        dict(pipeline_parallel_size=2, max_num_batched_tokens=512),
    ):
        llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, max_model_len=512, **kwargs)
        llm._processor = qwen2_vl_processor(kind)  # (what the model's directory would load)
        try:
            got = [  # one at a time: a step of one sequence's chunk runs as micro-batches
                list(llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids)
                for p in [{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases]
            ]
        finally:
            llm.shutdown()
        assert got == want, kwargs


def test_gemma3_two_way_images_on_every_rank_and_stage(tmp_path):
    """Gemma 3's images, attended both ways: at TP 2 with 8-token chunks (half an image: each
    rank runs the same chunk through the image's end), and in two pipeline stages, where a
    prompt long enough for micro-batches, whose cuts would fall inside images, runs whole (a
    micro-batch ending inside an image would hide the image's later tokens from its earlier
    ones). Over so long a prompt that changes no greedy token, so the first token's log
    probabilities are checked against transformers' too (hiding them moves them by over 1e-3)."""
    path = str(tmp_path / "gemma3")
    model = make_tiny_gemma3_vl(path, seed=1)
    images = random_images(14, seed=4)
    long = "t20 t21 " + "<start_of_image> " * 14 + " ".join(f"t{30 + i}" for i in range(80))
    cases = [("t5 t6 <start_of_image> t7 t8 <start_of_image> t9", images[:2]), (long, images)]
    want = [hf_gemma3_vl(path, model, text, imgs, MAX_TOKENS) for text, imgs in cases]
    ids, first = _hf_gemma3_last_logprobs(path, model, long, images)
    size = -(-len(ids) // min(4, len(ids) // PP_MICRO_MIN_TOKENS))  # the engine's pieces
    assert any(ids[c - 1] == ids[c] == GEMMA3_IMAGE_TOKEN_ID for c in range(size, len(ids), size))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    for kwargs in (
        dict(tensor_parallel_size=2, max_num_batched_tokens=8),
        dict(pipeline_parallel_size=2, max_num_batched_tokens=512),
    ):
        llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, max_model_len=512, **kwargs)
        try:
            outs = [
                llm.generate(p, greedy, use_tqdm=False)[0].outputs[0]
                for p in [{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases]
            ]
        finally:
            llm.shutdown()
        assert [list(o.token_ids) for o in outs] == want, kwargs
        top = outs[1].logprobs[0]
        assert max(abs(float(lp) - first[t]) for t, lp in top.items()) < 3e-4, kwargs


def _hf_gemma3_last_logprobs(path, model, text, images):
    """The prompt's ids and transformers' log probabilities after it (its images both ways)."""
    from transformers import AutoProcessor

    out = AutoProcessor.from_pretrained(path)(text=text, images=images, return_tensors="pt")
    with torch.inference_mode():
        logits = model(**{k: out[k] for k in ("input_ids", "pixel_values", "token_type_ids")})
    return out["input_ids"][0].tolist(), logits.logits[0, -1].log_softmax(-1).tolist()
