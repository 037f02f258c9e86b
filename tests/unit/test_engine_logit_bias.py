"""logit_bias, allowed_token_ids and bad_words (OpenAI's and vLLM's): greedy tokens against HF
transformers running its own logits processors (SequenceBiasLogitsProcessor,
PrefixConstrainedLogitsProcessor, NoBadWordsLogitsProcessor) on the same tiny model, the same
tokens with n-gram speculation on, vLLM's order against a penalty, vLLM's tokenization of bad
words, the refusals of ids the model does not have, and cache_salt's prefix-cache namespaces."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from helpers.engine import KV, greedy
from helpers.models import random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import BadSamplingParams
from pdserve.engine.sampler import SamplingRow, process_logits

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 12


@pytest.fixture(scope="module")
def bias_llm(refs):
    model_dir, hf, *_ = refs("llama-gqa")
    return LLM(model_dir, kv_cache_memory=KV, block_size=16, max_num_batched_tokens=64), hf


def hf_processed_greedy(model, prompt: list[int], processors: LogitsProcessorList) -> list[int]:
    """Argmax after HF's own logits processors, the whole sequence recomputed each step (a tiny
    model: simplest is safest for a reference)."""
    ids, out = torch.tensor([prompt]), []
    with torch.inference_mode():
        for _ in range(NEW):
            scores = processors(ids, model(ids).logits[:, -1, :].float())
            out.append(int(scores[0].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


def _plain(llm, prompt) -> list[int]:
    return list(llm.generate(prompt, greedy(NEW), use_tqdm=False)[0].outputs[0].token_ids)


def test_logit_bias_greedy_equals_hf_sequence_bias(bias_llm):
    llm, hf = bias_llm
    prompt = random_prompts([19], seed=61)[0]
    plain = _plain(llm, prompt)
    # push the third token's choice away and pull another token up: the output must change
    bias = {plain[2]: -100.0, (plain[2] + 7) % 64: 4.5, plain[0]: -2.0}
    out = llm.generate(prompt, greedy(NEW, logit_bias=bias), use_tqdm=False)[0].outputs[0]
    ref = LogitsProcessorList([SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])])
    assert list(out.token_ids) == hf_processed_greedy(hf, prompt, ref)
    assert list(out.token_ids) != plain
    assert plain[2] not in out.token_ids
    assert_no_leaks(llm.engine)


def test_allowed_token_ids_greedy_equals_hf_prefix_constraint(bias_llm):
    llm, hf = bias_llm
    prompt = random_prompts([23], seed=62)[0]
    plain = _plain(llm, prompt)
    allowed = sorted({5, 9, 17, 33, 40} - set(plain[:1]))
    out = llm.generate(prompt, greedy(NEW, allowed_token_ids=allowed), use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    ref = LogitsProcessorList([PrefixConstrainedLogitsProcessor(lambda _b, _ids: allowed, 1)])
    assert tokens == hf_processed_greedy(hf, prompt, ref)
    assert set(tokens) <= set(allowed)
    assert_no_leaks(llm.engine)


def test_bias_and_allowed_ids_in_a_batch_touch_only_their_rows(bias_llm):
    llm, _ = bias_llm
    prompts = random_prompts([9, 30, 14], seed=63)
    alone = [_plain(llm, p) for p in prompts]
    allowed = [3, 4, 5]
    params = [greedy(NEW), greedy(NEW, allowed_token_ids=allowed), greedy(NEW)]
    batch = llm.generate(prompts, params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in batch]
    assert got[0] == alone[0] and got[2] == alone[2]
    assert set(got[1]) <= set(allowed)


def test_bad_words_greedy_equals_hf_no_bad_words(bias_llm):
    llm, hf = bias_llm
    prompt = random_prompts([21], seed=65)[0]
    plain = _plain(llm, prompt)
    # a two-token word the plain output says (banned only where its first token was just said)
    # and a one-token word banned everywhere, of tokens the word-level test tokenizer spells
    tok = llm.get_tokenizer()

    def spelled(ids):
        return tok.encode(" ".join(f"t{t}" for t in ids), add_special_tokens=False) == list(ids)

    j = next(j for j in range(1, NEW - 1) if spelled(plain[j : j + 2]))
    pair = plain[j : j + 2]
    single = next(t for t in plain[j + 2 :] if spelled([t]) and t not in pair)
    words = [f"t{pair[0]} t{pair[1]}", f"t{single}"]
    out = llm.generate(prompt, greedy(NEW, bad_words=words), use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    ids = [tuple(pair), (single,)]
    ref = LogitsProcessorList([NoBadWordsLogitsProcessor([list(w) for w in ids], eos_token_id=1)])
    assert tokens == hf_processed_greedy(hf, prompt, ref) != plain
    assert single not in tokens
    assert all(tuple(tokens[j : j + 2]) != tuple(pair) for j in range(len(tokens) - 1))
    assert_no_leaks(llm.engine)


def test_bad_words_are_tokenized_as_vllm_does(bias_llm):
    """Each word as the text's start and after a space; the spaced form only where it gives
    other tokens of the same count (here the word-level tokenizer gives the same ones)."""
    from pdserve.engine.tokenizer import bad_words_token_ids

    llm, _ = bias_llm
    assert bad_words_token_ids(llm.get_tokenizer(), ["t5 t9", " t7"]) == ((5, 9), (7,))


def test_speculation_keeps_the_biased_tokens(refs):
    model_dir, *_ = refs("llama-gqa")
    prompt = random_prompts([16], seed=64)[0] * 3  # repeats: the n-gram guesser proposes
    bias = {7: 3.0, 11: -100.0}
    params = greedy(NEW, logit_bias=bias, bad_words=["t9 t9", "t13"])
    plain = LLM(model_dir, kv_cache_memory=KV, block_size=16)
    spec = LLM(
        model_dir,
        kv_cache_memory=KV,
        block_size=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert spec.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
    plain.shutdown()
    spec.shutdown()


def test_bias_comes_before_the_repetition_penalty():
    """vLLM's order: the bias moves a logit, then the penalty scales the result (a positive
    logit biased below zero is pushed further down, not shrunk)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={0: -3.0})
    row = SamplingRow(params, prompt_token_ids=[0], output_token_ids=[], generator=None)
    out = process_logits(logits, [row])
    assert out[0].tolist() == [(2.0 - 3.0) * 2.0, 1.0, 0.5, 0.0]
    assert logits[0, 0] == 2.0  # the caller's logits are not touched


def test_a_grammar_s_only_tokens_outside_allowed_ids_stand():
    logits = torch.tensor([[float("-inf"), 1.0, float("-inf"), 0.5]])  # a grammar allows 1 and 3
    params = SamplingParams(temperature=0, allowed_token_ids=[0, 2])
    row = SamplingRow(params, prompt_token_ids=[0], output_token_ids=[], generator=None)
    assert process_logits(logits, [row], grammar_rows={0})[0].tolist() == logits[0].tolist()
    assert process_logits(logits, [row])[0].isinf().all()  # no grammar: the mask holds


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"logit_bias": {5: 100.5}}, "logit_bias[5] must be in [-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "token ids must be >= 0"),
        ({"logit_bias": {3: float("nan")}}, "must be finite"),
        ({"logit_bias": [1, 2]}, "entries are (token id, bias)"),
        ({"logit_bias": "x"}, "mapping of token id to bias"),
        ({"allowed_token_ids": [-4]}, "only ids >= 0"),
        ({"bad_words": [""]}, "must not contain empty strings"),
        ({"bad_words": ["x"] * 129}, "at most 128 are allowed"),
    ],
)
def test_bad_values_are_refused_at_construction(kwargs, message):
    with pytest.raises(BadSamplingParams, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_ids_past_the_vocabulary_are_refused_before_any_work(bias_llm):
    llm, _ = bias_llm
    vocab = llm.engine.model_config.vocab_size
    for kwargs in (
        {"logit_bias": {vocab: 1.0}},
        {"allowed_token_ids": [1, vocab + 3]},
    ):
        with pytest.raises(BadSamplingParams, match=f"below the vocabulary size {vocab}"):
            llm.generate([1, 2, 3], greedy(4, **kwargs), use_tqdm=False)
    with_ids = greedy(4).with_bad_words_token_ids([[2, vocab]])
    with pytest.raises(BadSamplingParams, match=f"below the vocabulary size {vocab}"):
        llm.generate([1, 2, 3], with_ids, use_tqdm=False)
    with pytest.raises(BadSamplingParams, match="an empty word"):
        greedy(4).with_bad_words_token_ids([[1], []])
    assert_no_leaks(llm.engine)


def test_params_stay_hashable_and_normalized():
    a = SamplingParams(logit_bias={9: 1, 2: -0.5})
    b = SamplingParams(logit_bias=[(2, -0.5), (9, 1.0)])
    assert a == b and hash(a) == hash(b)
    assert a.logit_bias == ((2, -0.5), (9, 1.0))
    assert SamplingParams(logit_bias={}).logit_bias == () and not SamplingParams().shapes_logits


def test_cache_salt_shares_cached_blocks_only_within_one_salt(refs):
    """vLLM's cache_salt: a prompt cached under one salt is a hit for the same salt only (not
    for another salt, nor for unsalted requests, nor they for it); the tokens stay the same."""
    model_dir, *_ = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=16)
    prompt = random_prompts([70], seed=66)[0]  # four full blocks

    def run(salt: str) -> tuple[int, list[int]]:
        out = llm.generate(prompt, greedy(4, cache_salt=salt), use_tqdm=False)[0]
        return out.num_cached_tokens, list(out.outputs[0].token_ids)

    first, tokens = run("tenant-a")
    assert first == 0
    assert run("tenant-a") == (64, tokens)
    assert run("tenant-b") == (0, tokens)
    assert run("") == (0, tokens)  # unsalted: not the salted blocks
    assert run("")[0] == 64 and run("tenant-c")[0] == 0
    assert_no_leaks(llm.engine)
    llm.shutdown()


def test_cached_properties_follow_what_the_params_hold():
    """greedy and shapes_logits are cached on the frozen params (read every row every step): a
    copy made after one was read answers for itself, and so does the copy that gains bad words'
    ids after it was made (with_bad_words_token_ids sets them on it)."""
    p = SamplingParams(temperature=0.0)
    assert p.greedy and not p.shapes_logits
    words = p.with_bad_words_token_ids([[5]])
    assert words.shapes_logits and not p.shapes_logits
    hot = p.with_output(p.output_kind)
    assert hot.greedy and not hot.shapes_logits
    assert pickle.loads(pickle.dumps(words)).shapes_logits
    assert not SamplingParams(temperature=0.7).greedy
    read = SamplingParams(temperature=0.0)
    assert not read.shapes_logits
    read._put("_bad_words_ids", ((5,),))  # (a value set after a read: the cache goes with it)
    assert read.shapes_logits
