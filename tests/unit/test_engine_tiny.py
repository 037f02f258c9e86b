"""End-to-end engine tests on tiny random models: HF equivalence, TP, disaggregation hooks,
input validation and sampling through the engine."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_no_leaks, hf_greedy, random_prompts
from engine import LLM, SamplingParams

KINDS = ["llama-gqa", "llama-mqa-tied", "llama3-rope", "qwen2-bias", "qwen2-yarn"]
LENGTHS = (1, 5, 16, 17, 40, 100, 200)
NEW = 24
SHARED_PREFIX = 48
KV = 1 << 22


def greedy(max_tokens: int = NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def words(token_ids) -> str:
    """What the tiny tokenizer decodes to: " t<id>" per token, special tokens (t0 bos, t1 eos) skipped."""
    return "".join(f" t{t}" for t in token_ids if t not in (0, 1))


def decoded(tok, prompt, output) -> str:
    """The output's text as the model's tokenizer decodes it after the prompt's last tokens
    (the qwen2 kinds get a byte-level decoder from AutoTokenizer, which joins words without spaces)."""
    ctx = prompt[-6:]
    before = tok.decode(ctx, skip_special_tokens=True)
    after = tok.decode(ctx + output, skip_special_tokens=True)
    assert after.startswith(before)
    return after[len(before):]


def run_until_done(engine, max_steps: int = 10_000) -> list:
    outs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        outs += engine.step()
    raise AssertionError("engine did not finish")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A 64-wide model gains nothing from a second thread, and on a shared 2-core machine OpenMP
    spin-waiting made each step ~20x slower (58 ms vs 2 ms); restored after this module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def refs(tiny_models):
    """kind -> (model_dir, hf_model, prompts, HF greedy continuations); prompts end with three
    that share a 48-token prefix, so the prefix cache has something to hit."""
    cache = {}

    def get(kind):
        if kind not in cache:
            model_dir, hf = tiny_models(kind)
            prompts = random_prompts(LENGTHS, seed=11)
            prefix = random_prompts([SHARED_PREFIX], seed=12)[0]
            prompts += [prefix + tail for tail in random_prompts([3, 20, 33], seed=13)]
            cache[kind] = (model_dir, hf, prompts, [hf_greedy(hf, p, NEW) for p in prompts])
        return cache[kind]
    return get


# ---------------------------------------------------------------------------------------------
# 1. HF equivalence
# ---------------------------------------------------------------------------------------------
# name: (LLM kwargs, submit one at a time?)
MODES = {
    "sequential-prefix-bs16": (dict(block_size=16, enable_prefix_caching=True,
                                    max_num_batched_tokens=64), True),
    "batched-prefix-bs16": (dict(block_size=16, enable_prefix_caching=True,
                                 max_num_batched_tokens=2048), False),
    "batched-noprefix-bs4": (dict(block_size=4, enable_prefix_caching=False,
                                  max_num_batched_tokens=2048), False),
    "chunk32-sequential-prefix-bs4": (dict(block_size=4, enable_prefix_caching=True,
                                           max_num_batched_tokens=32), True),
    "chunk32-batched-noprefix-bs16": (dict(block_size=16, enable_prefix_caching=False,
                                           max_num_batched_tokens=32), False),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_hf(refs, kind, mode):
    model_dir, _, prompts, expected = refs(kind)
    kwargs, sequential = MODES[mode]
    llm = LLM(model_dir, kv_cache_memory=KV, **kwargs)
    engine = llm.engine
    budget = kwargs["max_num_batched_tokens"]
    if sequential:
        outs = []
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy())
            steps, first_token_step, final = 0, None, None
            while engine.has_unfinished_requests():
                steps += 1
                for out in engine.step():
                    if first_token_step is None and out.outputs[0].token_ids:
                        first_token_step = steps
                    if out.finished:
                        final = out
            outs.append(final)
            # prefill ran in ceil(uncached / budget) steps, then one token per step
            uncached = len(prompt) - final.num_cached_tokens
            assert first_token_step == -(-uncached // budget), (len(prompt), final.num_cached_tokens)
            assert steps == first_token_step + NEW - 1
            if len(prompt) == 200 and budget == 32:
                assert first_token_step == 7
    else:
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for prompt, out, want in zip(prompts, outs, expected):
        comp = out.outputs[0]
        assert comp.token_ids == want, f"prompt of {len(prompt)} tokens"
        assert comp.finish_reason == "length"
        assert comp.text == decoded(llm.get_tokenizer(), prompt, want)
    cached = [o.num_cached_tokens for o in outs]
    if kwargs["enable_prefix_caching"] and sequential:
        # the 2nd and 3rd shared-prefix prompts reuse the first one's full prefix blocks
        assert cached[-2] == cached[-1] == SHARED_PREFIX
    if not kwargs["enable_prefix_caching"]:
        assert not any(cached)
    assert_no_leaks(engine)


def test_repeated_prompt_hits_cache_and_matches(refs):
    """The same prompts a second time: served mostly from the cache, same tokens."""
    model_dir, _, prompts, expected = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=16, max_num_batched_tokens=64)
    first = llm.generate(prompts, greedy(), use_tqdm=False)
    again = llm.generate(prompts, greedy(), use_tqdm=False)
    for prompt, a, b, want in zip(prompts, first, again, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == want
        # everything but the last token (which must be recomputed to sample) in full blocks
        assert b.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert_no_leaks(llm.engine)


def test_preemption_under_memory_pressure_matches_hf(refs):
    """A KV cache too small for the whole batch: sequences are preempted, recomputed, still exact."""
    model_dir, _, prompts, expected = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV, max_model_len=256)
    per_block = llm.engine.kv_cache[:, :, 0].numel() * llm.engine.kv_cache.element_size()
    llm = LLM(model_dir, kv_cache_memory=20 * per_block, max_model_len=256,
              max_num_batched_tokens=64)
    assert llm.engine.block_manager.num_blocks == 20
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)


# ---------------------------------------------------------------------------------------------
# 2. tensor parallelism
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-bias"])
def test_tp2_matches_tp1(refs, kind):
    model_dir, _, prompts, _ = refs(kind)
    prompts = [prompts[i] for i in (0, 3, 5, 6, 9)]   # 1, 17, 100, 200 and a shared-prefix one
    kw = dict(kv_cache_memory=KV, block_size=16, max_num_batched_tokens=64)
    tp1 = LLM(model_dir, **kw)
    want = [o.outputs[0].token_ids for o in tp1.generate(prompts, greedy(), use_tqdm=False)]
    llm = LLM(model_dir, tensor_parallel_size=2, **kw)
    try:
        got = llm.generate(prompts, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        # a later, smaller batch over the same ranks (decode + prefix hits across steps)
        again = llm.generate(prompts[:2], greedy(8), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [w[:8] for w in want[:2]]
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
    assert llm.engine.tp is None


def test_tp_must_divide_heads(refs):
    model_dir, _, prompts, expected = refs("llama-gqa")
    with pytest.raises(ValueError, match="tensor_parallel_size") as exc:
        llm = LLM(model_dir, kv_cache_memory=KV, tensor_parallel_size=3)
        llm.shutdown()
    assert "heads" in str(exc.value)
    # nothing of the refused group is left behind: a single-process engine still works
    import torch.distributed as dist
    assert not dist.is_initialized()
    llm = LLM(model_dir, kv_cache_memory=KV)
    assert llm.generate(prompts[1], greedy(), use_tqdm=False)[0].outputs[0].token_ids == expected[1]


def test_tp_zero_is_refused(refs):
    model_dir, *_ = refs("llama-gqa")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model_dir, kv_cache_memory=KV, tensor_parallel_size=0)


# ---------------------------------------------------------------------------------------------
# 3. prefill-only + external KV hooks
# ---------------------------------------------------------------------------------------------
class CopySink:
    """Copies each final token range of A's layer KV into B's reserved blocks, token by token."""

    def __init__(self, engine_b, reservation, num_layers: int):
        self.b = engine_b
        self.res = reservation
        self.num_layers = num_layers
        self.step = 0                 # set by the test before each A.step()
        self.calls: list[tuple[int, int, int, int]] = []   # (step, layer, start, end)

    def on_layer(self, layer_idx, layer_kv, block_ids, start, end):
        self.calls.append((self.step, layer_idx, start, end))
        nb, bs_a = layer_kv.shape[1], layer_kv.shape[2]
        assert layer_kv.shape[0] == 2 and layer_kv.shape[3:] == self.b.kv_cache.shape[4:]
        assert all(0 <= b < nb for b in block_ids)
        bs_b = self.res.block_size
        for t in range(max(start, self.res.num_cached_tokens), end):
            self.b.kv_cache[layer_idx, :, self.res.block_ids[t // bs_b], t % bs_b] = \
                layer_kv[:, block_ids[t // bs_a], t % bs_a]

    def check(self, prompt_len: int) -> None:
        steps = sorted({c[0] for c in self.calls})
        covered = 0
        for s in steps:
            calls = [c for c in self.calls if c[0] == s]
            assert [c[1] for c in calls] == list(range(self.num_layers)), "one call per layer, in order"
            ranges = {(c[2], c[3]) for c in calls}
            assert len(ranges) == 1, "every layer of a step publishes the same range"
            (start, end), = ranges
            assert start == covered and end > start, "ranges are consecutive"
            covered = end
        assert covered == prompt_len


@pytest.fixture(scope="module")
def disagg_reference(refs):
    model_dir, *_ = refs("qwen2-bias")
    llm = LLM(model_dir, kv_cache_memory=KV)
    cache = {}

    def get(prompt, max_tokens):
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            cache[key] = llm.generate(prompt, greedy(max_tokens), use_tqdm=False)[0].outputs[0].token_ids
        return cache[key]
    return get


@pytest.mark.parametrize("a_kw, b_kw", [
    (dict(block_size=16), dict(block_size=16)),
    (dict(block_size=16, max_num_batched_tokens=32), dict(block_size=16)),
    (dict(block_size=4, max_num_batched_tokens=24), dict(block_size=16)),
    (dict(block_size=16), dict(block_size=4)),
], ids=["same", "chunked", "a4-b16-chunked", "a16-b4"])
def test_prefill_only_to_reserved_blocks(refs, disagg_reference, a_kw, b_kw):
    model_dir, *_ = refs("qwen2-bias")
    a = LLM(model_dir, kv_cache_memory=KV, **a_kw).engine
    b = LLM(model_dir, kv_cache_memory=KV, **b_kw).engine
    num_layers = a.model_config.num_layers
    assert b.kv_cache.shape[:2] == (num_layers, 2)
    prefix = random_prompts([SHARED_PREFIX], seed=21)[0]
    prompts = [random_prompts([70], seed=22)[0], random_prompts([1], seed=23)[0],
               prefix + [5, 6, 7], prefix + [9] * 19]   # the last two hit both prefix caches
    max_tokens = 12
    budget = a.config.max_num_batched_tokens
    for i, prompt in enumerate(prompts):
        rid = f"d{i}"
        params = greedy(max_tokens)
        res = b.reserve(rid, prompt, params)
        assert res.block_size == b.config.block_size
        assert len(res.block_ids) == -(-len(prompt) // res.block_size)
        if i == 3:
            assert res.num_cached_tokens == SHARED_PREFIX
        sink = CopySink(b, res, num_layers)
        a.add_request(rid, prompt, params, prefill_only=True, kv_sink=sink)
        outs = []
        while a.has_unfinished_requests():
            sink.step += 1
            outs += a.step()
        first = outs[-1]
        assert first.finished and first.outputs[0].finish_reason == "prefill_done"
        assert len(first.outputs[0].token_ids) == 1
        sink.check(len(prompt))
        uncached = len(prompt) - (first.num_cached_tokens if i else 0)
        assert sink.step == max(1, -(-uncached // budget))
        assert_no_leaks(a)

        b.commit(rid, first.outputs[0].token_ids[0])
        final = [o for o in run_until_done(b) if o.finished]
        assert len(final) == 1 and final[0].request_id == rid
        tokens = final[0].outputs[0].token_ids
        assert tokens[0] == first.outputs[0].token_ids[0]
        assert tokens == disagg_reference(prompt, max_tokens)
        assert final[0].outputs[0].finish_reason == "length"
        assert_no_leaks(b)


def test_commit_that_finishes_at_once_is_reported(refs):
    """max_tokens=1: the committed first token ends the request; the next step reports it."""
    model_dir, *_ = refs("llama-gqa")
    b = LLM(model_dir, kv_cache_memory=KV).engine
    prompt = random_prompts([20], seed=5)[0]
    b.reserve("one", prompt, greedy(1))
    b.commit("one", 42)
    outs = run_until_done(b)
    assert [(o.request_id, o.finished, o.outputs[0].token_ids, o.outputs[0].finish_reason)
            for o in outs] == [("one", True, [42], "length")]
    assert_no_leaks(b)
    with pytest.raises(KeyError):
        b.commit("one", 42)


def test_commit_refuses_a_bad_first_token(refs):
    """An id outside the vocab would make the next step fail for every request in the batch."""
    model_dir, *_ = refs("llama-gqa")
    b = LLM(model_dir, kv_cache_memory=KV).engine
    b.reserve("r", random_prompts([20], seed=23)[0], greedy(12))
    for bad in (256, -1, True, 3.0):
        with pytest.raises(ValueError, match="first_token_id"):
            b.commit("r", bad)
    assert not b.step()                      # still only reserved: nothing ran
    b.commit("r", 7)
    final = [o for o in run_until_done(b) if o.finished]
    assert len(final[0].outputs[0].token_ids) == 12 and final[0].outputs[0].token_ids[0] == 7
    assert_no_leaks(b)


def test_reserve_beyond_capacity(refs):
    model_dir, *_ = refs("llama-gqa")
    probe = LLM(model_dir, kv_cache_memory=KV, max_model_len=64).engine
    per_block = probe.kv_cache[:, :, 0].numel() * probe.kv_cache.element_size()
    b = LLM(model_dir, kv_cache_memory=8 * per_block, max_model_len=64).engine
    prompts = random_prompts([40, 40, 40], seed=7)   # 3 blocks each, 8 blocks in all
    b.reserve("a", prompts[0], greedy(4))
    b.reserve("b", prompts[1], greedy(4))
    from engine.block_manager import NoFreeBlocks
    with pytest.raises(NoFreeBlocks):
        b.reserve("c", prompts[2], greedy(4))
    b.block_manager.check_consistency()
    assert b.block_manager.num_used_blocks == 6
    assert b.abort("a") and b.abort("b") and not b.abort("c")
    assert_no_leaks(b)


def test_reservation_abort_frees_blocks(refs):
    model_dir, *_ = refs("llama-gqa")
    b = LLM(model_dir, kv_cache_memory=KV).engine
    res = b.reserve("x", random_prompts([40], seed=6)[0], greedy(4))
    assert b.block_manager.num_used_blocks == len(res.block_ids) == 3
    assert b.abort("x")
    assert_no_leaks(b)


# ---------------------------------------------------------------------------------------------
# 4. bad input
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_llm(refs):
    model_dir, hf, *_ = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV, max_model_len=64, max_num_batched_tokens=32)
    prompt = random_prompts([30], seed=31)[0]
    return llm, prompt, hf_greedy(hf, prompt, 20)


BAD_REQUESTS = {
    "empty-str": (lambda: "", None, ("prompt", "non-empty")),
    "empty-list": (lambda: [[]], None, ("prompt", "non-empty")),
    "too-long": (lambda: list(range(2, 66)), None, ("max_model_len", "63")),
    "token-out-of-vocab": (lambda: [5, 256, 7], None, ("prompt", "[0, 256)")),
    "negative-token": (lambda: [5, -1, 7], None, ("prompt", "[0, 256)")),
    "max_tokens=0": (lambda: [5, 6], dict(max_tokens=0), ("max_tokens", ">= 1")),
    "top_p=0": (lambda: [5, 6], dict(top_p=0), ("top_p", "(0, 1]")),
    "top_p=1.5": (lambda: [5, 6], dict(top_p=1.5), ("top_p", "(0, 1]")),
    "temperature=-1": (lambda: [5, 6], dict(temperature=-1), ("temperature", ">= 0")),
    "n=0": (lambda: [5, 6], dict(n=0), ("n must", ">= 1")),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_engine_still_serves(small_llm, case):
    llm, prompt, want = small_llm
    make_prompt, params_kw, needles = BAD_REQUESTS[case]
    with pytest.raises(ValueError) as exc:
        params = SamplingParams(**params_kw) if params_kw else greedy()
        llm.generate(make_prompt(), params, use_tqdm=False)
    for needle in needles:
        assert needle in str(exc.value), str(exc.value)
    assert_no_leaks(llm.engine)
    assert llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0].token_ids == want
    assert_no_leaks(llm.engine)


def test_bad_prompt_in_batch_rolls_back_the_others(small_llm):
    llm, prompt, want = small_llm
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([prompt, prompt[:5], [300]], greedy(20), use_tqdm=False)
    assert_no_leaks(llm.engine)
    assert llm.generate([prompt], greedy(20), use_tqdm=False)[0].outputs[0].token_ids == want
    # the longest prompt that fits (63) runs to the context limit: finish "length" at 64 tokens
    out = llm.generate(list(range(2, 65)), greedy(20), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert_no_leaks(llm.engine)


def test_engine_level_bad_input(small_llm):
    llm, prompt, want = small_llm
    engine = llm.engine
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("bad", [], greedy())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.reserve("bad", list(range(2, 66)), greedy())
    with pytest.raises(ValueError, match="n must be 1"):
        engine.add_request("bad", prompt, SamplingParams(n=2), prefill_only=True)
    engine.add_request("dup", prompt, greedy(20))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", prompt, greedy(20))
    outs = [o for o in run_until_done(engine) if o.finished]
    assert [o.outputs[0].token_ids for o in outs] == [want]
    assert_no_leaks(engine)


@pytest.mark.parametrize("kwargs, field", [
    (dict(model="/nonexistent"), "model"),
    (dict(kv_cache_memory=1000), "kv_cache_memory"),
    (dict(kv_cache_memory=0), "kv_cache_memory"),
    (dict(block_size=3), "block_size"),
    (dict(block_size=0), "block_size"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_model_len=100_000), "max_model_len"),
])
def test_bad_engine_config(refs, kwargs, field):
    model_dir, *_ = refs("llama-gqa")
    kwargs = dict(dict(model=model_dir, kv_cache_memory=KV), **kwargs)
    with pytest.raises(ValueError) as exc:
        LLM(kwargs.pop("model"), **kwargs)
    assert field in str(exc.value), str(exc.value)
    if field == "block_size":
        assert "power of two" in str(exc.value)


# ---------------------------------------------------------------------------------------------
# 5. sampling through the engine
# ---------------------------------------------------------------------------------------------
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
    other_params = [SamplingParams(temperature=t, max_tokens=m, ignore_eos=True, seed=s)
                    for t, m, s in [(0.7, 20, None), (1.3, 5, 7), (0, 12, None), (1.0, 30, None),
                                    (0.5, 9, 99)]]
    batch = llm.generate(others[:2] + [prompt] + others[2:], other_params[:2] + [params] + other_params[2:],
                         use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    again = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("prompt_len", [17, 32])   # partial last block (copy-on-write) and aligned
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
    single = llm.generate(prompt, SamplingParams(temperature=1.0, seed=77, max_tokens=12,
                                                 ignore_eos=True), use_tqdm=False)[0]
    assert single.outputs[0].token_ids == runs[0][0]
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("prompt_len", [17, 32])
def test_n2_greedy_equals_n1(sampling_llm, prompt_len):
    llm, hf = sampling_llm
    prompt = random_prompts([prompt_len], seed=44)[0]
    out = llm.generate(prompt, greedy(16, n=2), use_tqdm=False)[0]
    one = llm.generate(prompt, greedy(16), use_tqdm=False)[0].outputs[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == one.token_ids == hf_greedy(hf, prompt, 16)
    assert out.outputs[0].text == out.outputs[1].text == one.text
    assert_no_leaks(llm.engine)


def test_stop_token_ids(sampling_llm):
    llm, _ = sampling_llm
    prompt = random_prompts([12], seed=45)[0]
    full = llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0].token_ids
    stop = full[6]
    j = full.index(stop)
    out = llm.generate(prompt, greedy(20, stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:j + 1]
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
    j = next(k for k in range(len(full.token_ids))
             if stop in words(full.token_ids[:k + 1]))
    out = llm.generate(prompt, greedy(20, stop=[stop, "never-appears"]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[:j + 1]
    kept = llm.generate(prompt, greedy(20, stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:cut + len(stop)]
    assert_no_leaks(llm.engine)


def test_stop_string_spanning_two_tokens(sampling_llm):
    llm, _ = sampling_llm
    prompt = random_prompts([12], seed=49)[0]
    full = llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0]
    a, b = full.token_ids[4], full.token_ids[5]
    stop = f"{str(a)[-1]} t{str(b)[0]}"   # e.g. "7 t1": the end of one word, the start of the next
    cut = full.text.index(stop)
    j = next(k for k in range(len(full.token_ids)) if stop in words(full.token_ids[:k + 1]))
    out = llm.generate(prompt, greedy(20, stop=stop), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[:j + 1]
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
    sampled = llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                                                  ignore_eos=True, logprobs=True),
                           use_tqdm=False)[0].outputs[0]
    assert len(sampled.logprobs) == 12
    assert all(math.isfinite(lp) and lp <= 0 for lp in sampled.logprobs)
    plain = llm.generate(prompt, greedy(4), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None
    assert_no_leaks(llm.engine)


def test_abort_mid_generation_frees_blocks(sampling_llm):
    llm, _ = sampling_llm
    engine = llm.engine
    prompts = random_prompts([150, 30], seed=48)
    engine.add_request("long", prompts[0], greedy(50))   # 150 tokens at budget 64: 3 chunks
    engine.add_request("dec", prompts[1], greedy(50))
    engine.step()                                      # "long" is mid-prefill
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort("long")
    assert not engine.abort("long") and not engine.abort("never-added")
    for _ in range(5):                                 # "dec" prefills and decodes a few tokens
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
    engine.add_request("fork", prompts[1], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.abort("fork")
    assert_no_leaks(engine)
