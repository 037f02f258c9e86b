"""A vision-language model at tensor parallel 2 (engine/multimodal.py): the image tokens' rows go
to the follower rank inside each step's plain data (SeqInput.embeds), and a batch of prompts with
images, cut into chunks, gives transformers' greedy tokens. The model, the references and one
rank: tests/unit/test_llava.py."""

from __future__ import annotations

from helpers.vlm import hf_llava_greedy, llava_inputs, make_tiny_llava, random_images
from pdserve.engine import LLM, SamplingParams

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
