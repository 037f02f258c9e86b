"""Pipeline parallelism with its stage processes: the tokens and prompt logprobs of PP=1 for
PP=2 and PP=3 (a 5-layer tiny Llama; SmolLM2's 30 layers at PP=3), TP=2 inside PP=2 stages,
each stage's KV cache holding its own layers only, and a long prompt's chunks pipelined across
steps (rank 0 not waiting for the later stage). (Refusals and the layer split:
tests/unit/test_engine_pp.py.)"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from helpers.engine import KV, greedy, run_until_done
from helpers.models import hf_greedy, make_tiny_model, random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(kv_cache_memory=KV, block_size=16, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    """A 5-layer tiny Llama (GQA), its prompts (the last two share a 40-token prefix) and PP=1's
    greedy tokens and prompt logprobs, which equal HF's greedy tokens."""
    path = str(tmp_path_factory.mktemp("tiny5"))
    hf = make_tiny_model(path, "llama-gqa", seed=5, num_hidden_layers=5)
    prompts = random_prompts([1, 17, 100, 63], seed=21)
    prefix = random_prompts([40], seed=22)[0]
    prompts += [prefix + tail for tail in random_prompts([5, 30], seed=23)]
    one = LLM(path, **KW)
    tokens = [o.outputs[0].token_ids for o in one.generate(prompts, greedy(), use_tqdm=False)]
    assert tokens == [hf_greedy(hf, p, len(t)) for p, t in zip(prompts, tokens)]
    logprobs = _prompt_logprobs(one, prompts[2])
    one.shutdown()
    return path, prompts, tokens, logprobs


def _prompt_logprobs(llm, prompt):
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)
    return out[0].prompt_logprobs


@pytest.mark.parametrize("pp,tp", [(2, 1), (3, 1), (2, 2)])
def test_stages_give_one_stages_tokens(five_layers, pp, tp):
    path, prompts, tokens, logprobs = five_layers
    llm = LLM(path, pipeline_parallel_size=pp, tensor_parallel_size=tp, **KW)
    try:
        got = llm.generate(prompts, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == tokens
        # a later, smaller batch over the same ranks: decodes and prefix hits across steps
        again = llm.generate(prompts[-2:], greedy(6), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [t[:6] for t in tokens[-2:]]
        got_lp = _prompt_logprobs(llm, prompts[2])
        if tp == 1:  # the same additions in the same order: the same numbers, not close ones
            assert got_lp == logprobs
        else:  # TP sums each row-parallel product's shards in another order
            assert [None if r is None else sorted(r) for r in got_lp] == [
                None if r is None else sorted(r) for r in logprobs
            ]
            for a, b in zip(got_lp[1:], logprobs[1:]):
                assert all(abs(a[t] - b[t]) < 1e-4 for t in b)
        # rank 0 (the first stage) holds the KV of its layers only: 2 of 5 with 2 stages
        assert llm.engine.kv_cache.shape[0] == 5 // pp
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
    assert llm.engine.tp is None


@pytest.mark.parametrize("pp", [3])  # three stages: more micro-batches in flight than two
def test_a_long_prefill_runs_in_micro_batches_with_one_stages_numbers(five_layers, pp, monkeypatch):
    """A step that prefills one long chunk runs in micro-batches through the stages
    (ModelRunner._micro_batches), after a prefix hit too, and gives PP=1's tokens and prompt
    logprobs exactly."""
    from pdserve.engine.model_runner import ModelRunner

    path = five_layers[0]
    first = random_prompts([450], seed=31)[0]
    second = first[:200] + random_prompts([300], seed=32)[0]  # 192 tokens from the cache
    kw = dict(kv_cache_memory=KV, block_size=16)

    def run(llm):
        out = []
        for prompt, logprobs in ((first, 2), (second, None)):  # (prompt logprobs skip the cache)
            params = SamplingParams(
                temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=logprobs
            )
            o = llm.generate(prompt, params, use_tqdm=False)[0]
            out.append((o.outputs[0].token_ids, o.prompt_logprobs, o.num_cached_tokens))
        return out

    one = LLM(path, **kw)
    want = run(one)
    one.shutdown()
    assert [c for _, _, c in want] == [0, 192]
    pieces = []
    forward_micro = ModelRunner._forward_micro

    def counted(self, parts, *args):
        pieces.append([(p.seqs[0].start, len(p.seqs[0].token_ids)) for p in parts])
        return forward_micro(self, parts, *args)

    monkeypatch.setattr(ModelRunner, "_forward_micro", counted)
    llm = LLM(path, pipeline_parallel_size=pp, **kw)
    try:
        assert run(llm) == want
        # every pipelined step ran in consecutive pieces; the first prompt's from position 0,
        # the second's from its 192 cached tokens
        assert pieces and all(len(step) >= 2 for step in pieces)
        for step in pieces:
            assert all(a + n == b for (a, n), (b, _) in zip(step, step[1:]))
        assert [step[0][0] for step in pieces].count(0) >= 1
        assert any(step[0][0] == 192 for step in pieces)
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


def _step_in_thread(engine, steps: int, done: list) -> threading.Thread:
    """`steps` engine steps on a thread of their own; each appends its outputs to `done`."""

    def run():
        for _ in range(steps):
            done.append(engine.step())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("budget", [64, 256])
def test_a_long_prompts_chunks_do_not_wait_for_the_later_stage(tmp_path, budget):
    """Rank 0 runs the chunks of a long prompt before the one that samples without waiting for
    the second stage (ModelRunner._hand_on, TPGroup.broadcast): with that stage's process
    stopped, rank 0 still finishes PP_STEPS_AHEAD such steps, and the next one waits (the
    bound); resumed, the stage catches up and the tokens are PP=1's. Chunks of 64 tokens run
    whole, of 256 in micro-batches. Without the pipelining across steps the first step waits for
    the stopped stage's hidden states and never returns."""
    from pdserve.engine.model_runner import PP_STEPS_AHEAD

    make_tiny_model(
        str(tmp_path), "llama-gqa", seed=7, num_hidden_layers=4, max_position_embeddings=2048
    )
    prompt = random_prompts([1100], seed=41)[0]
    kw = dict(
        kv_cache_memory=KV, block_size=16, max_num_batched_tokens=budget, prefill_step_target_s=0
    )
    params = greedy(4)
    one = LLM(str(tmp_path), **kw)
    want = one.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    one.shutdown()
    llm = LLM(str(tmp_path), pipeline_parallel_size=2, **kw)
    engine = llm.engine
    stage = engine.tp.procs[0]
    stopped = False
    try:
        engine.add_request("long", prompt, params)
        os.kill(stage.pid, signal.SIGSTOP)
        stopped = True
        done: list = []
        ahead = _step_in_thread(engine, PP_STEPS_AHEAD, done)
        ahead.join(timeout=120)  # (generous: a stopped stage can never make a waiting step end)
        assert not ahead.is_alive() and len(done) == PP_STEPS_AHEAD
        assert done == [[]] * PP_STEPS_AHEAD  # chunks that sample nothing: no output yet
        later: list = []
        bounded = _step_in_thread(engine, 1, later)
        bounded.join(timeout=1)
        assert bounded.is_alive() and not later  # the bound: it waits for the stopped stage
        os.kill(stage.pid, signal.SIGCONT)
        stopped = False
        bounded.join(timeout=120)
        assert not bounded.is_alive()
        outs = run_until_done(engine)
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == want
        assert_no_leaks(engine)
    finally:
        if stopped:
            os.kill(stage.pid, signal.SIGCONT)
        llm.shutdown()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "qwen2-moe", "mixtral", "llama4"])
def test_gemma_and_moe_families_in_two_stages(tmp_path, kind):
    """Gemma (its embedding scale, four norms a layer, sliding layers) and mixtures of experts
    (Llama 4's with chunked attention) split into stages as Llama does: PP=1's greedy tokens
    and prompt logprobs exactly."""
    from helpers.arch import arch_prompts, build_arch_model

    build_arch_model(tmp_path, kind)
    prompts = arch_prompts()[:4]
    kw = dict(dtype="float32", kv_cache_memory=KV)

    def run(llm):
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
        return tokens, _prompt_logprobs(llm, prompts[-1])

    one = LLM(str(tmp_path), **kw)
    want = run(one)
    one.shutdown()
    llm = LLM(str(tmp_path), pipeline_parallel_size=2, **kw)
    try:
        assert run(llm) == want
        assert llm.engine.kv_cache.shape[0] < llm.engine.model_config.num_layers
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


def test_smollm2_in_three_stages():
    """SmolLM2's 30 layers in 3 stages (a first, a middle and a last one) answer as one stage
    does, token for token. (Two stages are the tiny models' above, and the suite's time budget
    did not hold a second SmolLM2 run of them.)"""
    chats = [
        [{"role": "user", "content": q}]
        for q in ("What is the capital of France?", "Name three primary colors.")
    ]
    params = SamplingParams(temperature=0, max_tokens=24)
    kw = dict(dtype="float32", quantization=None, speculative_config=None)
    one = LLM("smollm2", **kw)
    want = [o.outputs[0].token_ids for o in one.chat(chats, params, use_tqdm=False)]
    one.shutdown()
    llm = LLM("smollm2", pipeline_parallel_size=3, **kw)
    try:
        got = [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)]
        assert got == want
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", ["same", "other"])
def test_a_draft_model_guesses_for_a_staged_target(five_layers, tmp_path, monkeypatch, draft):
    """Speculative decoding with a draft model over a target in two stages: the draft runs whole
    on the first rank, its guesses are checked through both stages, and the tokens are PP=1's
    without speculation. "same": the target's own checkpoint as its draft (every guess kept);
    "other": a draft of other weights (guesses rejected and rolled back)."""
    from pdserve.engine.spec.gate import SpecGate

    monkeypatch.setattr(  # every guess the draft can make is checked
        SpecGate, "choose", lambda self, base, offers, uses_draft: [o.limit for o in offers]
    )
    path, prompts, tokens, _ = five_layers
    draft_dir = path
    if draft == "other":
        draft_dir = str(tmp_path)
        make_tiny_model(draft_dir, "llama-gqa", seed=9, num_hidden_layers=2)
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    llm = LLM(path, pipeline_parallel_size=2, speculative_config=spec, **KW)
    try:
        layers = llm.engine.spec.draft.runner.kv_cache.shape[0]
        assert layers == (5 if draft == "same" else 2)  # the whole draft, on the first rank
        got = llm.generate(prompts, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == tokens
        stats = llm.engine.spec_stats()
        if draft == "same":
            assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0, stats
        else:
            assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"], stats
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
