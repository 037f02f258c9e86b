"""vLLM's limit_mm_per_prompt: the images one prompt may hold, as `router.limit_mm_per_prompt`
(`pdserve up --limit-mm-per-prompt`, JSON or image=N) and as `LLM(limit_mm_per_prompt=...)`
(protos/limits.py image_limit reads both). Only images are served: another modality, a count
outside 0..16 or another shape is refused naming what to write. The router's own refusal of a
chat over the limit is tests/integration/test_llava_cluster.py's; the engine's is here, on a tiny
LLaVA (tests/helpers/vlm.py). The deployment's mm_processor_kwargs are read here too."""

from __future__ import annotations

import pytest

from helpers.up import flags_config
from pdserve.deploy.config.load import ConfigError, validate_config
from pdserve.protos.limits import MAX_IMAGES, image_limit


def test_the_reading_takes_images_only_within_the_bound():
    assert image_limit(None) == image_limit({}) == MAX_IMAGES
    assert image_limit({"image": 0}) == 0 and image_limit({"image": 3}) == 3
    for bad, said in [
        ({"video": 1}, "only images are served"),
        ({"image": 2, "audio": 1}, "only images are served"),
        ({"image": MAX_IMAGES + 1}, "from 0 to 16"),
        ({"image": -1}, "from 0 to 16"),
        ({"image": True}, "whole number"),
        ([2], "{'image': N}"),
    ]:
        with pytest.raises(ValueError, match=said):
            image_limit(bad)


def test_the_yaml_key_and_the_flag(tmp_path):
    cfg = validate_config({"router": {"limit_mm_per_prompt": {"image": 2}}})
    assert cfg.router.max_images() == 2
    assert validate_config({}).router.max_images() == MAX_IMAGES
    with pytest.raises(ConfigError, match="only images are served"):
        validate_config({"router": {"limit_mm_per_prompt": {"video": 1}}})
    for flag in ('{"image": 1}', "image=1"):
        cfg = flags_config(tmp_path, None, "--limit-mm-per-prompt", flag)
        assert cfg.router.max_images() == 1, flag
    with pytest.raises(ConfigError, match="image=N"):
        flags_config(tmp_path, None, "--limit-mm-per-prompt", "image=two")


def test_the_engine_refuses_a_prompt_over_the_limit(tmp_path):
    from helpers.vlm import make_tiny_llava, random_images, vlm_prompt
    from pdserve.engine import LLM, SamplingParams

    make_tiny_llava(str(tmp_path))
    llm = LLM(
        str(tmp_path), dtype="float32", kv_cache_memory=4 << 20, limit_mm_per_prompt={"image": 1}
    )
    greedy = SamplingParams(temperature=0, max_tokens=2)
    a, b = random_images(2)
    try:
        with pytest.raises(ValueError, match=r"2 images in one prompt; at most 1"):
            llm.generate(vlm_prompt("<image> t5 <image>", [a, b]), greedy, use_tqdm=False)
        out = llm.generate(vlm_prompt("<image> t5", [a]), greedy, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM(str(tmp_path), limit_mm_per_prompt={"image": 99})


def test_the_processor_kwargs_yaml_key_and_flag(tmp_path):
    """router.mm_processor_kwargs (`pdserve up --mm-processor-kwargs`, JSON): a dict of the
    processor call's arguments; the arguments the router passes itself, or no dict, refused by
    name. The router's use of them is tests/integration/test_llava_cluster.py's."""
    small = {"size": {"shortest_edge": 256, "longest_edge": 1024}}
    assert validate_config({}).router.mm_processor_kwargs == {}
    cfg = flags_config(
        tmp_path,
        None,
        "--mm-processor-kwargs",
        '{"size": {"shortest_edge": 256, "longest_edge": 1024}}',
    )
    assert cfg.router.mm_processor_kwargs == small
    for bad, said in [({"images": []}, "passes itself"), (["size"], "valid dictionary")]:
        with pytest.raises(ConfigError, match=said):
            validate_config({"router": {"mm_processor_kwargs": bad}})
