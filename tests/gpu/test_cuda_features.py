"""The engine's features that have a CUDA path of their own, on the GPU: structured output (the
grammar's token mask applied to CUDA logits; greedy and sampled rows, with and without grammars,
in one batch), speculative decoding (prompt lookup with its own guesses and with random ones, a
draft model of other weights; each equal to no speculation, greedy and seeded), and logprobs
against HF's own distribution on the same GPU. tests/unit holds the same checks on CPU; this is
where they meet CUDA tensors, graph-replayed decode steps and the CUDA kernels."""

from __future__ import annotations

import pytest
import torch

from helpers.engine import greedy
from helpers.gpu import DEVICE, hf_greedy, hf_on
from helpers.models import random_prompts
from helpers.spec import run_spec
from helpers.structured import byte_level_model, check_output
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

ENGINE = dict(device=DEVICE, dtype="float32", kv_cache_memory=1 << 24, max_model_len=512)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
SPECS = [
    {"json_object": True},
    {"regex": r"[a-c]{2,5}-\d{3}"},
    {"choice": ["yes", "no", "maybe so"]},
    {"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}}}},
]


def _run(model_dir, prompts, params, spec=None):
    return run_spec(model_dir, prompts, params, spec, block_size=16, **ENGINE)


def test_structured_output_greedy_and_sampled_rows_in_one_batch(tiny_models, tmp_path):
    model_dir, _ = tiny_models("llama-gqa")
    byte_model = byte_level_model(model_dir, tmp_path / "byte-level")
    params = [SamplingParams(temperature=0, max_tokens=120, structured=s) for s in SPECS]
    params += [
        SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured=s)
        for i, s in enumerate(SPECS)
    ]
    params.append(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    llm = LLM(byte_model, block_size=16, speculative_config=None, **ENGINE)
    try:
        outs = llm.generate(["abc"] * len(params), params, use_tqdm=False)
        finished = 0
        for spec, req in zip(SPECS + SPECS, outs):
            out = req.outputs[0]
            if out.finish_reason == "stop":
                check_output(spec, out.text)
                finished += 1
        assert finished >= 4, [o.outputs[0].finish_reason for o in outs]
        for i in (1, 2):  # the regex and the choice always end within max_tokens
            assert outs[i].outputs[0].finish_reason == "stop"
        assert len(outs[-1].outputs[0].token_ids) == 8
        alone = llm.generate("abc", params[1], use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == outs[1].outputs[0].token_ids  # batch-invariant on CUDA too
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


def _self_quoting(n):
    # each prompt quotes itself, so prompt lookup has something to find
    return [p + p[: len(p) // 2] for p in random_prompts([5 + (7 * i) % 60 for i in range(n)])]


@pytest.mark.parametrize("spec", ["ngram", "bad-ngram", "draft"])
def test_speculation_gives_the_tokens_of_no_speculation(
    tiny_models, always_speculate, request, spec
):
    model_dir, _ = tiny_models("llama-gqa")
    prompts = _self_quoting(12)
    config = NGRAM
    if spec == "bad-ngram":
        request.getfixturevalue("bad_guesses")
    if spec == "draft":  # a draft of other weights: most guesses rejected, KV rolled back
        draft_dir, _ = tiny_models("llama3-rope")
        config = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    for params in (greedy(40), SamplingParams(temperature=0.9, seed=7, max_tokens=30)):
        want, _ = _run(model_dir, prompts, params)
        got, stats = _run(model_dir, prompts, params, config)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert stats["spec_drafts"] > 0
        if spec == "bad-ngram":
            assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_logprobs_are_hf_distribution_on_the_gpu(tiny_models):
    model_dir, hf = tiny_models("llama-gqa")
    hf = hf_on(hf)
    prompts = random_prompts([9, 40], seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=True, top_logprobs=3)
    outs, _ = _run(model_dir, prompts, params)
    for prompt, out in zip(prompts, outs):
        ref, logits = hf_greedy(hf, prompt, len(out.token_ids))
        assert out.token_ids == ref
        for step, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            want = torch.log_softmax(logits[step], -1)
            assert abs(float(lp) - float(want[tok])) < 1e-3, step
            top = want.topk(3)
            assert set(lp.top) == set(top.indices.tolist()), step
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(lp.top[t] - v) < 1e-3, step
