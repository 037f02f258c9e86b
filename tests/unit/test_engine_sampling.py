"""Sampling through the engine on a tiny random model: seeded requests are batch invariant, n > 1
forks, stop token ids and stop strings, logprobs against HF, and aborts mid-generation."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.engine import KV, greedy
from helpers.models import hf_greedy, random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def words(token_ids) -> str:
    """What the tiny tokenizer decodes to: " t<id>" per token, special tokens (t0 bos, t1 eos) skipped."""
    return "".join(f" t{t}" for t in token_ids if t not in (0, 1))


@pytest.fixture(scope="module")
def sampling_llm(refs):
    model_dir, hf, *_ = refs("llama-gqa")
    return LLM(model_dir, kv_cache_memory=KV, block_size=16, max_num_batched_tokens=64), hf


def test_seeded_request_is_batch_invariant(sampling_llm):
    llm, _ = sampling_llm
    prompt = random_prompts([23], seed=41)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts([3, 50, 17, 90, 8], seed=42)
    other_params = [
        SamplingParams(temperature=t, max_tokens=m, ignore_eos=True, seed=s)
        for t, m, s in [(0.7, 20, None), (1.3, 5, 7), (0, 12, None), (1.0, 30, None), (0.5, 9, 99)]
    ]
    batch = llm.generate(
        others[:2] + [prompt] + others[2:],
        other_params[:2] + [params] + other_params[2:],
        use_tqdm=False,
    )
    assert batch[2].outputs[0].token_ids == alone
    again = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("prompt_len", [17, 32])  # partial last block (copy-on-write) and aligned
def test_n3_seeded_distinct_and_deterministic(sampling_llm, prompt_len):
    llm, _ = sampling_llm
    prompt = random_prompts([prompt_len], seed=43)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=77, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    runs = [[c.token_ids for c in out.outputs] for out in (first, second)]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert all(len(t) == 12 for t in runs[0])
    assert len({tuple(t) for t in runs[0]}) == 3
    assert runs[0] == runs[1]
    # the first sample is the n=1 stream of that seed
    single = llm.generate(
        prompt,
        SamplingParams(temperature=1.0, seed=77, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert single.outputs[0].token_ids == runs[0][0]
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("prompt_len", [17, 32])
def test_n2_greedy_equals_n1(sampling_llm, prompt_len):
    llm, hf = sampling_llm
    prompt = random_prompts([prompt_len], seed=44)[0]
    out = llm.generate(prompt, greedy(16, n=2), use_tqdm=False)[0]
    one = llm.generate(prompt, greedy(16), use_tqdm=False)[0].outputs[0]
    assert len(out.outputs) == 2
    assert (
        out.outputs[0].token_ids
        == out.outputs[1].token_ids
        == one.token_ids
        == hf_greedy(hf, prompt, 16)
    )
    assert out.outputs[0].text == out.outputs[1].text == one.text
    assert_no_leaks(llm.engine)


def test_stop_token_ids(sampling_llm):
    llm, _ = sampling_llm
    prompt = random_prompts([12], seed=45)[0]
    full = llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0].token_ids
    stop = full[6]
    j = full.index(stop)
    out = llm.generate(prompt, greedy(20, stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[: j + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert_no_leaks(llm.engine)


def test_stop_string(sampling_llm):
    llm, _ = sampling_llm
    prompt = random_prompts([12], seed=46)[0]
    full = llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0]
    assert full.text == words(full.token_ids)
    stop = f" t{full.token_ids[7]}"
    cut = full.text.index(stop)
    # the first token whose text completes the stop string ends the request
    j = next(k for k in range(len(full.token_ids)) if stop in words(full.token_ids[: k + 1]))
    out = llm.generate(prompt, greedy(20, stop=[stop, "never-appears"]), use_tqdm=False)[0].outputs[
        0
    ]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[: j + 1]
    kept = llm.generate(
        prompt, greedy(20, stop=stop, include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == full.text[: cut + len(stop)]
    assert_no_leaks(llm.engine)


def test_stop_string_spanning_two_tokens(sampling_llm):
    llm, _ = sampling_llm
    prompt = random_prompts([12], seed=49)[0]
    full = llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0]
    a, b = full.token_ids[4], full.token_ids[5]
    stop = f"{str(a)[-1]} t{str(b)[0]}"  # e.g. "7 t1": the end of one word, the start of the next
    cut = full.text.index(stop)
    j = next(k for k in range(len(full.token_ids)) if stop in words(full.token_ids[: k + 1]))
    out = llm.generate(prompt, greedy(20, stop=stop), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[: j + 1]
    assert_no_leaks(llm.engine)


def test_logprobs(sampling_llm):
    llm, hf = sampling_llm
    prompt = random_prompts([21], seed=47)[0]
    out = llm.generate(prompt, greedy(12, logprobs=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 12
    assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    for k, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = logp[len(prompt) - 1 + k]
        assert abs(lp - row.max().item()) < 1e-4, k
        assert abs(lp - row[tok].item()) < 1e-4, k
    sampled = llm.generate(
        prompt,
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(sampled.logprobs) == 12
    assert all(math.isfinite(lp) and lp <= 0 for lp in sampled.logprobs)
    plain = llm.generate(prompt, greedy(4), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None
    assert_no_leaks(llm.engine)


def test_abort_mid_generation_frees_blocks(sampling_llm):
    llm, _ = sampling_llm
    engine = llm.engine
    prompts = random_prompts([150, 30], seed=48)
    engine.add_request("long", prompts[0], greedy(50))  # 150 tokens at budget 64: 3 chunks
    engine.add_request("dec", prompts[1], greedy(50))
    engine.step()  # "long" is mid-prefill
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort("long")
    assert not engine.abort("long") and not engine.abort("never-added")
    for _ in range(5):  # "dec" prefills and decodes a few tokens
        outs = engine.step()
        assert all(o.request_id == "dec" for o in outs)
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort("dec")
    assert not any(o.request_id in ("long", "dec") for o in engine.step())
    assert_no_leaks(engine)
    # n>1 aborted before the fork (parent mid-prefill, children pending) and after it
    engine.add_request("prefork", prompts[0], SamplingParams(n=2, temperature=1.0, max_tokens=50))
    engine.step()
    assert engine.abort("prefork")
    assert_no_leaks(engine)
    engine.add_request(
        "fork", prompts[1], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=50)
    )
    for _ in range(3):
        engine.step()
    assert engine.abort("fork")
    assert_no_leaks(engine)
