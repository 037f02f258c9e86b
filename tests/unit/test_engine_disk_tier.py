"""The engine with a host tier smaller than the working set and a disk tier below it
(engine/kv_disk_tier.py) under eviction pressure: a tiny KV pool, several conversations cycling,
so that a conversation's blocks leave the pool, then host memory, before it comes back. The later
turns restore their prefix from disk (disk hits counted by source); greedy tokens equal those of
recomputing, and tokens and logprobs are bit-identical to an engine whose host tier holds
everything (the same KV bytes, from memory). Damaged files are refused and recomputed with the
same tokens. Shutdown removes every file."""

from __future__ import annotations

import os

import pytest

from helpers.engine import KV, greedy, tier_settings
from helpers.models import random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 16
POOL_BLOCKS = 24  # 384 tokens: one conversation's turn fits, two do not
CONVERSATIONS, TURNS, NEW_TOKENS = 3, 3, 8


def converse(llm: LLM, between=None):
    """Each round sends every conversation its next turn (its previous prompt, the answer and a
    new message); returns every turn's (tokens, logprobs) and cached tokens, in order.
    between(turn): called after each round."""
    firsts = random_prompts([150, 170, 190], seed=21)
    messages = random_prompts([20] * (CONVERSATIONS * TURNS), seed=22)
    history = list(firsts)
    outs, cached = [], []
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            (out,) = llm.generate([history[c]], greedy(NEW_TOKENS, logprobs=True), use_tqdm=False)
            o = out.outputs[0]
            outs.append((list(o.token_ids), list(o.logprobs)))
            cached.append(out.num_cached_tokens)
            history[c] = history[c] + list(o.token_ids) + messages[turn * CONVERSATIONS + c]
        if between is not None:
            between(turn)
    return outs, cached


@pytest.fixture(scope="module")
def setup(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    per_block, common = tier_settings(model_dir, POOL_BLOCKS, BS)
    off = LLM(model_dir, **common)
    recomputed = converse(off)
    off.shutdown()
    # a host tier that holds every block: the same KV bytes come back from memory
    big = LLM(model_dir, kv_host_tier_bytes=200 * per_block, **common)
    from_memory = converse(big)
    assert big.engine.block_manager.tier.evicted == 0
    big.shutdown()
    return model_dir, per_block, common, recomputed, from_memory


def test_blocks_pushed_to_disk_are_served_from_it_with_the_same_bits(setup, tmp_path):
    model_dir, per_block, common, (want, cached_off), (mem, cached_mem) = setup
    llm = LLM(
        model_dir,
        kv_host_tier_bytes=8 * per_block,  # far less than the conversations' ~60 blocks
        kv_disk_tier_bytes=200 * (per_block + 4096),
        kv_disk_tier_dir=str(tmp_path),
        **common,
    )
    bm = llm.engine.block_manager
    host, disk = bm.tier, bm.tier.disk
    assert disk is not None and disk.dir.startswith(str(tmp_path))
    got, cached = converse(llm)
    assert [t for t, _ in got] == [t for t, _ in want]  # greedy tokens as recomputed
    assert got == mem and cached == cached_mem  # tokens and logprobs bit-identical
    assert sum(cached[CONVERSATIONS:]) > sum(cached_off[CONVERSATIONS:])
    assert disk.stored > 0 and disk.restored > 0 and disk.refused == 0
    assert bm.hit_tokens_disk == disk.restored * BS > 0
    assert host.peak_bytes <= host.capacity_bytes
    assert disk.peak_bytes <= disk.capacity_bytes
    assert disk.flush(30) and 0 < disk.files_bytes() <= disk.capacity_bytes
    stats = disk.stats()
    assert stats["kv_disk_tier_restored"] == disk.restored
    assert_no_leaks(llm.engine)
    directory = disk.dir
    llm.shutdown()
    assert not os.path.exists(directory)  # every file, and the directory, removed
    assert os.listdir(tmp_path) == []


def test_damaged_files_are_refused_and_recomputed(setup, tmp_path):
    model_dir, per_block, common, (want, _), _ = setup
    llm = LLM(
        model_dir,
        kv_host_tier_bytes=8 * per_block,
        kv_disk_tier_bytes=200 * (per_block + 4096),
        kv_disk_tier_dir=str(tmp_path),
        **common,
    )
    disk = llm.engine.block_manager.tier.disk
    damaged = []

    def damage(turn):
        assert disk.flush(30)
        for name in sorted(os.listdir(disk.dir)):  # a flipped byte in every file
            path = os.path.join(disk.dir, name)
            with open(path, "r+b") as f:
                f.seek(-5, os.SEEK_END)
                b = f.read(1)
                f.seek(-5, os.SEEK_END)
                f.write(bytes([b[0] ^ 0x10]))
            damaged.append(name)

    got, _ = converse(llm, between=damage)
    assert damaged and disk.refused > 0
    assert [t for t, _ in got] == [t for t, _ in want]  # recomputed: the same greedy tokens
    assert_no_leaks(llm.engine)
    llm.shutdown()
    assert os.listdir(tmp_path) == []


def test_the_options_are_validated(tiny_models, tmp_path):
    model_dir, _ = tiny_models("llama-gqa")
    with pytest.raises(ValueError, match="kv_disk_tier_bytes"):
        LLM(model_dir, kv_cache_memory=KV, kv_disk_tier_bytes=-1)
    with pytest.raises(ValueError, match="kv_disk_tier_bytes"):
        LLM(model_dir, kv_cache_memory=KV, kv_disk_tier_bytes=1 << 20)  # no host tier
    with pytest.raises(ValueError, match="kv_disk_tier_dir"):
        LLM(model_dir, kv_cache_memory=KV, kv_disk_tier_dir="")
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(ValueError, match="kv_disk_tier_dir"):
        LLM(
            model_dir,
            kv_cache_memory=KV,
            kv_host_tier_bytes=1 << 20,
            kv_disk_tier_bytes=1 << 20,
            kv_disk_tier_dir=str(blocker / "sub"),
        )
