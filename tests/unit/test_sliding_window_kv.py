"""Sliding-window models keep their KV bounded by the window (engine/kv_window.py): a tiny Mistral
whose every layer slides over 32 tokens (tests/helpers/arch.py "mistral-sw"), token for token
against HF greedy, while the blocks a sequence holds stay within the window's bound: a long
generation, a KV pool too small for a full-length sequence, the prefix cache and preemption
around released blocks, n>1 forks, and a hand-off into another engine's reservation."""

from __future__ import annotations

import pytest

from helpers.arch import build_arch_model
from helpers.engine import KV, CopySink, greedy
from helpers.models import hf_greedy, random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_window import max_blocks_held, release_skipped
from pdserve.engine.request import Sequence
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW, BS, BUDGET = 32, 4, 32
# Between steps, and during a decode step, a sequence holds its window's blocks and at most one
# more (the window need not start on a block boundary): ceil(32 / 4) + 1.
DECODE_BOUND = -(-WINDOW // BS) + 1
CHUNK_BOUND = max_blocks_held(WINDOW, BS, BUDGET)  # during a prompt chunk of BUDGET tokens
PER_BLOCK = 2 * 2 * BS * 2 * 16 * 4  # K and V, 2 layers, 4 tokens, 2 kv heads of 16, float32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral-sw")
    hf = build_arch_model(path, "mistral-sw", max_position_embeddings=1024)
    assert hf.config.sliding_window == WINDOW
    return str(path), hf


@pytest.fixture(scope="module")
def reference(model):
    """HF greedy continuations, computed once per (prompt, length)."""
    cache: dict = {}

    def get(prompt, n):
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(model[1], prompt, n)
        return cache[key]

    return get


def engine(model_dir, **kw):
    args = dict(dtype="float32", kv_cache_memory=KV, block_size=BS, max_num_batched_tokens=BUDGET)
    args.update(kw)
    return LLM(model_dir, **args).engine


def step_all(eng, bound, max_steps=5000):
    """Steps `eng` to the end, checking after every step that no running sequence holds more
    than `bound` blocks; returns the final outputs by request id."""
    done = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            return done
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.block_manager.check_consistency()
        for seq in eng.scheduler.running:
            held = [b for b in seq.block_ids if b != eng.block_manager.null_block]
            assert len(held) <= bound, f"{seq.request_id} holds {len(held)} blocks"
    raise AssertionError("engine did not finish")


def test_long_generation_holds_a_window_of_blocks(model, reference):
    """200 new tokens (the window rolls six times) on 4-token blocks: at most ceil(32/4) + 1
    blocks in use at every step."""
    eng = engine(model[0])
    assert eng.model_config.kv_window == WINDOW and eng.block_manager.null_block is not None
    prompt = random_prompts([20], seed=5)[0]
    eng.add_request("long", prompt, greedy(200))
    peak = 0
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        peak = max(peak, eng.block_manager.num_used_blocks)
        assert eng.block_manager.num_used_blocks <= DECODE_BOUND
    assert peak == DECODE_BOUND
    assert out.finished and out.outputs[0].token_ids == reference(prompt, 200)
    assert_no_leaks(eng)


def test_pool_too_small_for_a_full_length_sequence(model, reference, tmp_path):
    """31 blocks (124 tokens) serve a 100-token prompt and 200 new tokens; a model without a
    window is refused such a pool for its max_model_len."""
    eng = engine(model[0], kv_cache_memory=32 * PER_BLOCK)
    assert eng.block_manager.num_blocks == 31  # the 32nd is the null block
    assert eng.config.max_model_len > eng.block_manager.num_blocks * BS
    prompt = random_prompts([100], seed=6)[0]
    eng.add_request("small", prompt, greedy(200))
    done = step_all(eng, CHUNK_BOUND)
    assert done["small"].outputs[0].token_ids == reference(prompt, 200)
    assert_no_leaks(eng)

    plain = tmp_path / "plain"
    build_arch_model(plain, "llama", max_position_embeddings=1024)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(plain), dtype="float32", kv_cache_memory=32 * PER_BLOCK, block_size=BS)


def test_released_blocks_stay_cached_until_reused():
    """Blocks a window leaves stay in the prefix cache as evictable blocks; once the allocator
    reuses the chain's first block, the chain no longer matches at all."""
    bm = BlockManager(16, BS, null_block=16)
    prompt = list(range(2, 22))  # 5 full blocks
    seq = Sequence(0, "r", 0, prompt, SamplingParams())
    seq.block_ids = bm.allocate(5)
    others = bm.allocate(11)  # the rest of the pool: the released blocks are next in line
    seq.num_computed_tokens = 20
    seq.num_hashed_blocks = bm.register_full_blocks(seq.block_ids, prompt, 0, 20)
    first = seq.block_ids[0]
    assert release_skipped(bm, seq, window=9) == 3  # positions 0..11: no query from 20 reads them
    assert seq.block_ids[:3] == [16] * 3 and bm.num_used_blocks == 2 + 11
    assert bm.find_cached_prefix(prompt, 20)[0] == first  # the whole chain still matches
    assert len(bm.find_cached_prefix(prompt, 20)) == 5
    (reused,) = bm.allocate(1)  # the oldest free block: the first one released
    assert reused == first
    assert bm.find_cached_prefix(prompt, 20) == []
    bm.free(seq.block_ids + others + [reused])
    bm.check_consistency()
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_preemption_and_forks(model, reference):
    """A small pool, four long sequences at once (preempted and recomputed), an n=2 request
    forked after its window has left the prompt's first blocks, then the prompts again: hits
    where the chain survived, recompute where it did not, the same tokens every time."""
    # the plain policy, so that all four prompts are admitted at once and crowd the small pool
    # (the long-prefill policy runs one long prompt at a time: tests/unit/test_long_prefill.py)
    eng = engine(model[0], kv_cache_memory=40 * PER_BLOCK, prefill_step_target_s=0)
    prompts = random_prompts([60, 45, 90, 33], seed=7)
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, greedy(150))
    eng.add_request("fork", prompts[2], greedy(80, n=2))
    done = step_all(eng, CHUNK_BOUND)
    assert eng.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert done[f"p{i}"].outputs[0].token_ids == reference(p, 150), f"prompt {i}"
    assert [o.token_ids for o in done["fork"].outputs] == [reference(prompts[2], 80)] * 2
    assert_no_leaks(eng)

    # A pool large enough to keep every released block: the second run hits the whole chain.
    big = engine(model[0])
    for rid in ("a", "b"):
        big.add_request(rid, prompts[2], greedy(40))
        done = step_all(big, CHUNK_BOUND)
        assert done[rid].outputs[0].token_ids == reference(prompts[2], 40)
    assert done["b"].num_cached_tokens == (len(prompts[2]) - 1) // BS * BS
    assert_no_leaks(big)


def test_handoff_of_a_prompt_longer_than_the_window(model, reference):
    """A prefill-only engine (4-token blocks, 32-token chunks) pushes a 150-token prompt's KV into
    a decode engine's reservation (16-token blocks), which gives back what lies before the window
    at its commit and decodes 200 tokens holding a window's worth of blocks."""
    a = engine(model[0])
    b = engine(model[0], block_size=16)
    prompt = random_prompts([150], seed=8)[0]
    res = b.reserve("h", prompt, greedy(200))
    assert len(res.block_ids) == -(-150 // 16)  # the whole prompt arrives: all of it is held
    sink = CopySink(b, res, a.model_config.num_layers)
    a.add_request("h", prompt, greedy(200), prefill_only=True, kv_sink=sink)
    outs = []
    while a.has_unfinished_requests():
        outs += a.step()
        sink.step += 1
        for seq in a.scheduler.running:  # the prefill side gives back blocks between chunks too
            assert len([x for x in seq.block_ids if x != a.block_manager.null_block]) <= (
                CHUNK_BOUND
            )
    sink.check(len(prompt))
    first = outs[-1].outputs[0].token_ids
    b.commit("h", first[:1])
    seq = b.scheduler.running[0]
    held = [x for x in seq.block_ids if x != b.block_manager.null_block]
    assert len(held) <= -(-WINDOW // 16) + 1 < len(seq.block_ids)
    done = step_all(b, -(-WINDOW // 16) + 1)
    assert done["h"].outputs[0].token_ids == reference(prompt, 200)
    assert_no_leaks(a)
    assert_no_leaks(b)
