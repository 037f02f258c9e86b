"""Scheduler + BlockManager with a fake runner (no model).

The fake runner keeps a fake KV cache: every slot it writes holds a key for (the token at that
position, every token before it). Before a scheduled chunk runs, every position it attends to
(`[0, start)`) must hold exactly the key this sequence would have written there, so a prefix-cache
hit, a fork copy or a recompute that serves the wrong KV fails the test, as does a write into a
block that another sequence shares or the prefix cache has registered. It also remembers which text
each full block's KV was computed for, and every check asserts that each block in the prefix cache
is registered under exactly that text's chained hash (so a lookup can only ever serve it to that
text).
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.block_manager as block_manager_mod
from engine.block_manager import BlockManager, NoFreeBlocks
from engine.request import FinishReason, Sequence, SeqStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, StepPlan, StepResult

EOS = 1


def prefix_keys(token_ids) -> list[int]:
    keys, h = [], 0
    for t in token_ids:
        h = hash((h, t))
        keys.append(h)
    return keys


def default_token(seq: Sequence) -> int:
    """Deterministic in (seq_id, position), never eos."""
    return 2 + hash((seq.seq_id, seq.num_tokens)) % 50


class Harness:
    def __init__(self, num_blocks=64, block_size=4, caching=True, *, budget=64, max_num_seqs=8,
                 max_model_len=10_000, token_fn=default_token):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.bm, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                               max_model_len=max_model_len, eos_token_ids=(EOS,))
        self.bs = block_size
        self.token_fn = token_fn
        self.kv: dict[tuple[int, int], int] = {}
        self.kv_text: dict[int, tuple[int, ...]] = {}   # full block -> tokens [0, end of block)
        self.seqs: list[Sequence] = []
        self._ids = 0

    # ---- building requests ----
    def new(self, prompt, request_id=None, index=0, **params) -> Sequence:
        seq = Sequence(self._ids, request_id or f"r{self._ids}", index, list(prompt),
                       SamplingParams(**params))
        self._ids += 1
        return seq

    def add(self, prompt, n=1, **params) -> list[Sequence]:
        rid = f"req{self._ids}"
        family = [self.new(prompt, rid, i, n=n, **params) for i in range(n)]
        self.seqs += family
        self.sched.add(family)
        self.check()
        return family

    # ---- the fake runner ----
    def _slot(self, seq, pos):
        return seq.block_ids[pos // self.bs], pos % self.bs

    def _verify_reads(self, seq, upto, keys):
        for p in range(upto):
            assert self.kv.get(self._slot(seq, p)) == keys[p], (
                f"seq {seq.seq_id} position {p}: wrong KV in block {seq.block_ids[p // self.bs]}")

    def _write(self, seq, start, end, keys):
        for p in range(start, end):
            b = seq.block_ids[p // self.bs]
            assert self.bm.ref_count(b) == 1, f"write into shared block {b}"
            assert self.bm.blocks[b].hash is None, f"write into cached block {b}"
            self.kv[(b, p % self.bs)] = keys[p]
            if p % self.bs == self.bs - 1:
                self.kv_text[b] = tuple(seq.token_ids[:p + 1])
            else:
                self.kv_text.pop(b, None)

    def execute(self, plan: StepPlan, tokens=None) -> StepResult:
        for src, dst in plan.block_copies:
            for off in range(self.bs):
                if (src, off) in self.kv:
                    self.kv[(dst, off)] = self.kv[(src, off)]
                else:
                    self.kv.pop((dst, off), None)
            if src in self.kv_text:
                self.kv_text[dst] = self.kv_text[src]
            else:
                self.kv_text.pop(dst, None)
        for item in plan.scheduled:
            seq = item.seq
            assert seq.status == SeqStatus.RUNNING and item.num_new_tokens > 0
            assert item.start == seq.num_computed_tokens
            assert len(seq.block_ids) >= self.bm.blocks_needed(item.end)
            keys = prefix_keys(seq.token_ids[:item.end])
            self._verify_reads(seq, item.start, keys)
            self._write(seq, item.start, item.end, keys)
        assert plan.num_tokens <= self.sched.max_num_batched_tokens
        assert len(plan.rows) == len(plan.row_seqs) == len(plan.row_logits)
        if tokens is None:
            tokens = [self.token_fn(s) for s in plan.row_seqs]
        elif callable(tokens):
            tokens = [tokens(s) for s in plan.row_seqs]
        return StepResult(token_ids=list(tokens), logprobs=None)

    def step(self, tokens=None) -> StepPlan:
        plan = self.sched.schedule()
        self.check()
        if not plan.is_empty:
            result = self.execute(plan, tokens)
            self.sched.update(plan, result)
        self.check()
        return plan

    def reserve(self, seq):
        self.sched.reserve(seq)
        self.seqs.append(seq)
        self.check()

    def commit(self, seq, first_token):
        """Another engine writes the prompt's KV into the reserved blocks, then we commit."""
        assert seq.status == SeqStatus.RESERVED
        keys = prefix_keys(seq.token_ids)
        self._verify_reads(seq, seq.num_cached_tokens, keys)
        self._write(seq, seq.num_cached_tokens, seq.num_tokens, keys)
        self.sched.commit(seq, first_token)
        self.check()

    def finish(self, seq, reason=FinishReason.ABORT, stop_reason=None):
        self.sched.finish(seq, reason, stop_reason)
        self.check()

    def run(self, max_steps=1000):
        for _ in range(max_steps):
            if self.sched.num_unfinished == 0:
                return
            self.step()
        raise AssertionError("did not drain")

    # ---- invariants ----
    def check(self):
        bm, sched = self.bm, self.sched
        bm.check_consistency()
        for block in bm.blocks:
            if block.hash is None:
                continue
            text = self.kv_text.get(block.block_id)
            assert text is not None and len(text) % self.bs == 0, f"block {block.block_id}"
            parent = None
            for i in range(len(text) // self.bs):
                grand, parent = parent, block_manager_mod.block_hash(
                    parent, text[i * self.bs:(i + 1) * self.bs])
            assert (block.hash, block.parent_hash, block.token_ids) == (
                parent, grand, text[-self.bs:]), f"block {block.block_id} cached under another text"
        refs = [0] * bm.num_blocks
        for seq in self.seqs:
            assert len(set(seq.block_ids)) == len(seq.block_ids)
            for b in seq.block_ids:
                refs[b] += 1
            if seq.status == SeqStatus.FINISHED:
                assert seq.block_ids == []
            if seq.status in (SeqStatus.WAITING, SeqStatus.FORK_PENDING):
                assert seq.block_ids == [] and seq.num_computed_tokens == 0
            if seq.status == SeqStatus.RUNNING:
                assert (bm.blocks_needed(seq.num_computed_tokens) <= len(seq.block_ids)
                        <= bm.blocks_needed(seq.num_tokens))
                assert seq.num_hashed_blocks <= seq.num_computed_tokens // self.bs
        assert refs == [b.ref_count for b in bm.blocks]
        assert sum(len(s.block_ids) for s in self.seqs) == sum(b.ref_count for b in bm.blocks)
        running = [s.seq_id for s in self.seqs if s.status == SeqStatus.RUNNING]
        waiting = [s.seq_id for s in self.seqs if s.status == SeqStatus.WAITING]
        assert sorted(s.seq_id for s in sched.running) == sorted(running)
        assert sorted(s.seq_id for s in sched.waiting) == sorted(waiting)
        assert sorted(sched.reserved) == sorted(
            s.seq_id for s in self.seqs if s.status == SeqStatus.RESERVED)
        pending = sorted(c.seq_id for cs in sched.fork_children.values() for c in cs)
        assert pending == sorted(s.seq_id for s in self.seqs if s.status == SeqStatus.FORK_PENDING)

    def assert_no_leaks(self):
        """Every block is free or evictable (cached, ref 0), and the accounting is consistent."""
        self.check()
        assert self.sched.num_unfinished == 0
        assert not self.sched.fork_children and not self.sched.reserved
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)


def sched_view(plan):
    return [(s.seq.seq_id, s.start, s.num_new_tokens) for s in plan.scheduled]


# ---- 1. chunked prefill ----------------------------------------------------------------------

def test_chunked_prefill_then_decode():
    h = Harness(num_blocks=16, block_size=16, budget=32)
    (seq,) = h.add(range(2, 102), max_tokens=3, ignore_eos=True)
    for start, n in ((0, 32), (32, 32), (64, 32)):
        plan = h.step()
        assert sched_view(plan) == [(seq.seq_id, start, n)]
        assert plan.rows == [] and plan.row_seqs == []          # mid-prompt: nothing sampled
        assert seq.num_computed_tokens == start + n
        assert seq.num_output_tokens == 0
    assert len(seq.block_ids) == 7                              # the whole prompt was allocated up front
    plan = h.step()
    assert sched_view(plan) == [(seq.seq_id, 96, 4)]
    assert plan.row_seqs == [seq] and plan.row_logits == [0]
    assert seq.num_computed_tokens == 100 and seq.num_output_tokens == 1
    for k in range(2):
        plan = h.step()
        assert sched_view(plan) == [(seq.seq_id, 100 + k, 1)]
        assert plan.row_seqs == [seq]
        assert seq.num_computed_tokens == 101 + k
    assert seq.status == SeqStatus.FINISHED and seq.finish_reason == FinishReason.LENGTH
    assert seq.num_output_tokens == 3
    assert h.step().is_empty
    h.assert_no_leaks()


# ---- 2. budget, order, admission -------------------------------------------------------------

def test_budget_shared_running_before_waiting_fcfs_and_max_num_seqs():
    h = Harness(num_blocks=64, block_size=4, budget=10, max_num_seqs=2)
    a = h.add(range(10, 16), max_tokens=4, ignore_eos=True)[0]
    b = h.add(range(20, 26), max_tokens=4, ignore_eos=True)[0]
    c = h.add(range(30, 36), max_tokens=4, ignore_eos=True)[0]
    plan = h.step()
    # FCFS: a whole, b gets what is left of the budget, c waits (max_num_seqs=2)
    assert sched_view(plan) == [(a.seq_id, 0, 6), (b.seq_id, 0, 4)]
    assert [s.seq_id for s in h.sched.waiting] == [c.seq_id]
    assert c.status == SeqStatus.WAITING and c.block_ids == []
    plan = h.step()
    # running first: a's decode and the rest of b's prompt; c still waits
    assert sched_view(plan) == [(a.seq_id, 6, 1), (b.seq_id, 4, 2)]
    assert plan.row_seqs == [a, b] and plan.row_logits == [0, 1]
    h.step()
    h.step()          # a gets its 4th token and finishes
    assert a.status == SeqStatus.FINISHED and a.num_output_tokens == 4
    plan = h.step()
    assert sched_view(plan) == [(b.seq_id, 8, 1), (c.seq_id, 0, 6)]   # decode before admission
    h.run()
    assert [s.num_output_tokens for s in (a, b, c)] == [4, 4, 4]
    h.assert_no_leaks()


def test_decodes_take_the_budget_before_admissions():
    h = Harness(num_blocks=64, block_size=4, budget=4, max_num_seqs=8)
    running = [h.add([10 + i], max_tokens=10, ignore_eos=True)[0] for i in range(4)]
    plan = h.step()
    assert sched_view(plan) == [(s.seq_id, 0, 1) for s in running]
    late = h.add(range(50, 58), max_tokens=1)[0]
    for _ in range(3):
        plan = h.step()
        # the four decodes use the whole budget: the newcomer is not admitted
        assert sched_view(plan) == [(s.seq_id, s.num_computed_tokens - 1, 1) for s in running]
        assert late.status == SeqStatus.WAITING
    for s in running[1:]:
        h.finish(s, FinishReason.ABORT)
    plan = h.step()
    assert sched_view(plan) == [(running[0].seq_id, 4, 1), (late.seq_id, 0, 3)]
    h.finish(running[0])
    h.run()
    assert late.num_output_tokens == 1
    h.assert_no_leaks()


def test_admission_waits_for_blocks_and_keeps_fcfs():
    # 8 blocks, watermark 1: the first prompt takes 6 blocks, the second (3 blocks) cannot be
    # admitted, and a later small one must not jump the queue
    h = Harness(num_blocks=8, block_size=4, budget=64, max_num_seqs=8, caching=False)
    a = h.add(range(10, 34), max_tokens=2, ignore_eos=True)[0]
    b = h.add(range(40, 52), max_tokens=1)[0]
    c = h.add([60], max_tokens=1)[0]
    plan = h.step()
    assert sched_view(plan) == [(a.seq_id, 0, 24)]
    assert [s.seq_id for s in h.sched.waiting] == [b.seq_id, c.seq_id]
    assert h.bm.num_free_blocks == 2
    plan = h.step()                   # a finishes
    assert a.status == SeqStatus.FINISHED
    plan = h.step()
    assert sched_view(plan) == [(b.seq_id, 0, 12), (c.seq_id, 0, 1)]
    h.run()
    h.assert_no_leaks()


# ---- 3. preemption by recompute --------------------------------------------------------------

def _preemption_run(num_blocks):
    h = Harness(num_blocks=num_blocks, block_size=4, caching=False, budget=64, max_num_seqs=2)
    a = h.add(range(10, 18), max_tokens=12, ignore_eos=True)[0]
    b = h.add(range(20, 28), max_tokens=12, ignore_eos=True)[0]
    c = h.add(range(30, 34), max_tokens=2, ignore_eos=True)[0]
    return h, a, b, c


def test_preemption_by_recompute():
    ref, ra, rb, rc = _preemption_run(num_blocks=64)
    ref.run()
    assert ref.sched.num_preemptions == 0

    h, a, b, c = _preemption_run(num_blocks=8)
    for _ in range(9):
        plan = h.step()
        assert sched_view(plan) == [(a.seq_id, plan.scheduled[0].start, plan.scheduled[0].num_new_tokens),
                                    (b.seq_id, plan.scheduled[1].start, plan.scheduled[1].num_new_tokens)]
    assert a.num_tokens == b.num_tokens == 17 and h.bm.num_free_blocks == 0
    assert h.sched.num_preemptions == 0
    plan = h.step()
    # a needs a 5th block and none is free: the LAST running sequence (b) is preempted
    assert h.sched.num_preemptions == 1
    assert sched_view(plan) == [(a.seq_id, 16, 1)]
    assert b.status == SeqStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert [s.seq_id for s in h.sched.waiting] == [b.seq_id, c.seq_id]    # front of the queue
    assert b.num_output_tokens == 9
    assert h.bm.num_free_blocks == 3
    while a.status != SeqStatus.FINISHED:
        plan = h.step()
        assert b.seq_id not in [s.seq.seq_id for s in plan.scheduled]
    plan = h.step()
    # readmitted ahead of c; recomputes prompt + its 9 outputs in one chunk and samples
    assert sched_view(plan)[0] == (b.seq_id, 0, 17)
    assert plan.row_seqs[0] is b
    h.run()
    assert h.sched.num_preemptions == 1
    for x, y in ((a, ra), (b, rb), (c, rc)):
        assert x.finish_reason == y.finish_reason == FinishReason.LENGTH
        assert x.token_ids == y.token_ids
    assert b.num_output_tokens == 12
    h.assert_no_leaks()


def test_preemption_picks_the_last_running_sequence_and_requeues_it_first():
    h = Harness(num_blocks=9, block_size=4, caching=False, budget=64, max_num_seqs=3)
    a, b, c, d = (h.add(range(10 * i, 10 * i + 8), max_tokens=8, ignore_eos=True)[0]
                  for i in range(1, 5))
    plan = h.step()
    assert sched_view(plan) == [(a.seq_id, 0, 8), (b.seq_id, 0, 8), (c.seq_id, 0, 8)]
    assert list(h.sched.waiting) == [d]
    for k in range(4):
        plan = h.step()
        assert sched_view(plan) == [(x.seq_id, 8 + k, 1) for x in (a, b, c)]
    assert h.bm.num_free_blocks == 0 and h.sched.num_preemptions == 0
    plan = h.step()
    # a needs a 4th block: c (last) is preempted, never b; c's 3 blocks serve a and b
    assert sched_view(plan) == [(a.seq_id, 12, 1), (b.seq_id, 12, 1)]
    assert h.sched.num_preemptions == 1
    assert list(h.sched.waiting) == [c, d]
    assert c.block_ids == [] and c.num_computed_tokens == 0 and c.num_output_tokens == 5
    assert h.bm.num_free_blocks == 1
    h.step()
    plan = h.step()                  # a and b get their 8th token and finish
    assert sched_view(plan) == [(a.seq_id, 14, 1), (b.seq_id, 14, 1)]
    assert a.is_finished and b.is_finished
    plan = h.step()
    # c first (prompt + 4 outputs recomputed, then samples), then d
    assert sched_view(plan) == [(c.seq_id, 0, 13), (d.seq_id, 0, 8)]
    h.run()
    assert [x.num_output_tokens for x in (a, b, c, d)] == [8, 8, 8, 8]
    h.assert_no_leaks()


def test_admission_keeps_a_watermark_but_reservation_does_not():
    h = Harness(num_blocks=8, block_size=4, caching=False, budget=64)
    assert h.sched.watermark_blocks == 1
    a = h.add(range(10, 26), max_tokens=2, ignore_eos=True)[0]     # 4 blocks
    h.step()
    assert h.bm.num_free_blocks == 4
    b = h.add(range(30, 46), max_tokens=1)[0]                      # 4 more: would leave 0 free
    plan = h.step()
    assert sched_view(plan) == [(a.seq_id, 16, 1)] and b.status == SeqStatus.WAITING
    assert a.is_finished
    h.run()
    assert b.num_output_tokens == 1
    h.assert_no_leaks()
    # a prompt that needs the whole pool is never admitted, but can be reserved
    huge = h.add(range(100, 132), max_tokens=1)[0]
    assert h.step().is_empty and huge.status == SeqStatus.WAITING
    h.finish(huge)
    h.assert_no_leaks()
    big = h.new(range(100, 132), max_tokens=1)
    h.reserve(big)
    assert h.bm.num_free_blocks == 0
    h.finish(big)
    h.assert_no_leaks()


def test_preemption_with_prefix_cache_recomputes_only_the_uncached_tail():
    h = Harness(num_blocks=8, block_size=4, caching=True, budget=64, max_num_seqs=2)
    a = h.add(range(10, 18), max_tokens=12, ignore_eos=True)[0]
    b = h.add(range(20, 28), max_tokens=12, ignore_eos=True)[0]
    while h.sched.num_preemptions == 0:
        h.step()
    assert b.status == SeqStatus.WAITING
    while b.status == SeqStatus.WAITING:
        plan = h.step()
    # b's computed full blocks that a did not evict while b waited are served from the cache
    (item,) = [s for s in plan.scheduled if s.seq is b]
    assert item.start == b.num_cached_tokens > 0
    assert b.num_cached_tokens % 4 == 0
    assert item.end == b.num_computed_tokens == b.num_tokens - 1     # sampled at the end
    h.run()
    assert a.num_output_tokens == b.num_output_tokens == 12
    h.assert_no_leaks()


def test_running_sequence_preempts_itself_when_alone_and_short_of_blocks():
    # a reservation holds most of the pool; the only running sequence cannot grow
    h = Harness(num_blocks=4, block_size=4, caching=False, budget=64)
    a = h.add(range(10, 14), max_tokens=3, ignore_eos=True)[0]
    h.step()
    assert a.num_tokens == 5 and len(a.block_ids) == 1
    r = h.new(range(30, 42), max_tokens=1)
    h.reserve(r)
    assert h.bm.num_free_blocks == 0
    plan = h.step()
    assert plan.scheduled == [] and a.status == SeqStatus.WAITING
    assert h.sched.num_preemptions == 1
    h.finish(r)
    h.run()
    assert a.num_output_tokens == 3
    h.assert_no_leaks()


# ---- 4. prefix caching through the scheduler -------------------------------------------------

@pytest.mark.parametrize("first_alive", [True, False])
def test_prefix_cache_hit_shares_full_blocks(first_alive):
    prompt = list(range(100, 164))
    h = Harness(num_blocks=32, block_size=16, budget=256)
    a = h.add(prompt, max_tokens=20 if first_alive else 1, ignore_eos=True)[0]
    h.step()
    assert a.num_hashed_blocks == 4
    if not first_alive:
        assert a.status == SeqStatus.FINISHED
    b = h.add(prompt, max_tokens=2, ignore_eos=True)[0]
    free_before, a_before = h.bm.num_free_blocks, len(a.block_ids)
    plan = h.step()
    free_before -= len(a.block_ids) - a_before        # a's own decode block, if any
    # 3 cached blocks; the 4th is recomputed so the last prompt token yields logits
    assert b.num_cached_tokens == 48
    item = [s for s in plan.scheduled if s.seq is b][0]
    assert (item.start, item.num_new_tokens) == (48, 16)
    assert b.block_ids[:3] == a_blocks(h, prompt)[:3]
    assert b.block_ids[3] not in a_blocks(h, prompt)
    if first_alive:
        assert b.block_ids[:3] == a.block_ids[:3]
        assert [h.bm.ref_count(x) for x in b.block_ids] == [2, 2, 2, 1]
        assert h.bm.num_free_blocks == free_before - 1      # only the recomputed block is new
    else:
        assert [h.bm.ref_count(x) for x in b.block_ids] == [1, 1, 1, 1]
        assert h.bm.num_free_blocks == free_before - 4      # 3 revived + 1 new
    h.finish(a)
    h.run()
    h.assert_no_leaks()


def a_blocks(h, prompt):
    """The block ids the cache serves for `prompt` (full 64 tokens)."""
    return h.bm.find_cached_prefix(prompt, len(prompt))


def test_prefix_cache_off_never_shares():
    prompt = list(range(100, 164))
    h = Harness(num_blocks=32, block_size=16, budget=256, caching=False)
    a = h.add(prompt, max_tokens=20, ignore_eos=True)[0]
    h.step()
    b = h.add(prompt, max_tokens=2, ignore_eos=True)[0]
    plan = h.step()
    assert b.num_cached_tokens == 0 and b.num_computed_tokens == 64
    assert [s for s in plan.scheduled if s.seq is b][0].start == 0
    assert not set(a.block_ids) & set(b.block_ids)
    h.finish(a)
    h.run()
    h.assert_no_leaks()


def test_prefix_cache_partial_hit_and_decoded_blocks_are_cached():
    h = Harness(num_blocks=32, block_size=4, budget=256)
    a = h.add(range(10, 18), max_tokens=9, ignore_eos=True)[0]
    h.run()
    # a computed 16 tokens (its last sampled token never runs): its decoded tokens filled
    # blocks 2 and 3, so a prompt equal to a's text hits them
    assert a.num_tokens == 17
    b = h.add(a.token_ids[:16] + [99, 98], max_tokens=1)[0]
    h.step()
    assert b.num_cached_tokens == 16
    e = h.add(a.token_ids[:15], max_tokens=1)[0]
    h.step()
    assert e.num_cached_tokens == 12           # only whole blocks, within num_tokens - 1
    c = h.add(list(range(10, 18)) + [7, 7, 7, 7], max_tokens=1)[0]
    h.step()
    assert c.num_cached_tokens == 8            # stops at the first differing block
    h.run()
    h.assert_no_leaks()


def test_same_prompt_admitted_together_then_decoded_blocks_chain_correctly():
    """a and b prefill the same prompt in one step, so b's prompt blocks duplicate a's and are not
    registered. b's later decoded block must be cached under b's real chain (found by a prompt equal
    to b's text), never as the first block of an unrelated prompt."""
    h = Harness(num_blocks=32, block_size=4, budget=256)
    prompt = list(range(10, 18))
    a = h.add(prompt, max_tokens=1)[0]
    b = h.add(prompt, max_tokens=5, ignore_eos=True)[0]
    h.run()
    assert b.num_tokens == 13 and b.num_hashed_blocks == 3
    tail = b.token_ids[8:12]
    # the tail block of b at position 0 of another prompt: not served
    c = h.add(tail + [5, 5], max_tokens=1)[0]
    h.step()
    assert c.num_cached_tokens == 0
    # b's whole text: all three blocks served
    d = h.add(b.token_ids[:12] + [5], max_tokens=1)[0]
    h.step()
    assert d.num_cached_tokens == 12
    h.run()
    h.assert_no_leaks()


# ---- 5. stops ---------------------------------------------------------------------------------

def scripted(script):
    """Fake runner tokens: the k-th output token of each sequence is script[k]."""
    return lambda seq: script[seq.num_output_tokens]


@pytest.mark.parametrize("params, script, n_out, reason, stop_reason", [
    (dict(max_tokens=10), [5, 6, EOS, 7], 3, FinishReason.STOP, None),
    (dict(max_tokens=10), [EOS], 1, FinishReason.STOP, None),
    (dict(max_tokens=5, ignore_eos=True), [EOS] * 6, 5, FinishReason.LENGTH, None),
    (dict(max_tokens=10, min_tokens=3), [EOS, EOS, EOS, 5], 3, FinishReason.STOP, None),
    (dict(max_tokens=10, min_tokens=3), [EOS, 5, 6, 7, EOS, 8], 5, FinishReason.STOP, None),
    (dict(max_tokens=10, stop_token_ids=[7]), [5, 7, 8], 2, FinishReason.STOP, 7),
    (dict(max_tokens=10, stop_token_ids=[7], min_tokens=2), [7, 7, 8], 2, FinishReason.STOP, 7),
    (dict(max_tokens=10, stop_token_ids=[7], ignore_eos=True), [EOS, 7], 2, FinishReason.STOP, 7),
    (dict(max_tokens=3), [5, 6, 8, 9], 3, FinishReason.LENGTH, None),
    (dict(max_tokens=3), [5, 6, EOS], 3, FinishReason.STOP, None),
    (dict(max_tokens=1), [5], 1, FinishReason.LENGTH, None),
])
def test_stop_conditions(params, script, n_out, reason, stop_reason):
    h = Harness(token_fn=scripted(script))
    (seq,) = h.add(range(10, 16), **params)
    h.run()
    assert seq.num_output_tokens == n_out
    assert seq.output_token_ids == script[:n_out]
    assert (seq.finish_reason, seq.stop_reason) == (reason, stop_reason)
    h.assert_no_leaks()


def test_max_model_len_finishes_with_length():
    h = Harness(max_model_len=13)
    (seq,) = h.add(range(10, 20), max_tokens=100, ignore_eos=True)
    h.run()
    assert seq.num_tokens == 13 and seq.num_output_tokens == 3
    assert seq.finish_reason == FinishReason.LENGTH
    h.assert_no_leaks()


def test_prefill_only_finishes_after_first_token():
    h = Harness()
    (seq,) = h.add(range(10, 20), max_tokens=100)
    seq.prefill_only = True
    h.run()
    assert seq.num_output_tokens == 1 and seq.finish_reason == FinishReason.PREFILL_DONE
    h.assert_no_leaks()


# ---- 6. n > 1 -----------------------------------------------------------------------------------

def test_n_parallel_fork_shares_full_blocks_and_copies_partial():
    h = Harness(num_blocks=32, block_size=4, budget=64)
    other = h.add(range(50, 53), max_tokens=8, ignore_eos=True)[0]
    parent, c1, c2 = fam = h.add(range(10, 20), n=3, max_tokens=4, ignore_eos=True)
    assert [s.status for s in fam] == [SeqStatus.WAITING, SeqStatus.FORK_PENDING,
                                       SeqStatus.FORK_PENDING]
    assert h.sched.fork_children[parent.seq_id] == [c1, c2]
    assert h.sched.num_unfinished == 2
    plan = h.step()
    # only the parent computes the prompt; its logits row feeds three sampling rows
    assert sched_view(plan) == [(other.seq_id, 0, 3), (parent.seq_id, 0, 10)]
    assert plan.row_seqs == [other, parent, c1, c2]
    assert plan.row_logits == [0, 1, 1, 1]
    assert [r.output_token_ids for r in plan.rows] == [[], [], [], []]
    assert plan.block_copies == []
    assert all(s.status == SeqStatus.RUNNING for s in fam)
    assert all(s.num_output_tokens == 1 and s.num_computed_tokens == 10 for s in fam)
    assert h.sched.fork_children == {}
    full, partial = parent.block_ids[:2], parent.block_ids[2]
    for child in (c1, c2):
        assert child.block_ids[:2] == full
        assert child.block_ids[2] != partial
    assert [h.bm.ref_count(b) for b in full] == [3, 3]
    assert h.bm.ref_count(partial) == 1
    assert h.bm.ref_count(c1.block_ids[2]) == h.bm.ref_count(c2.block_ids[2]) == 1
    plan = h.step()
    assert plan.block_copies == [(partial, c1.block_ids[2]), (partial, c2.block_ids[2])]
    assert sched_view(plan) == [(other.seq_id, 3, 1), (parent.seq_id, 10, 1),
                                (c1.seq_id, 10, 1), (c2.seq_id, 10, 1)]
    assert plan.row_logits == [0, 1, 2, 3]
    assert h.step().block_copies == []
    h.run()
    assert [s.num_output_tokens for s in fam] == [4, 4, 4]
    assert len({tuple(s.output_token_ids) for s in fam}) == 3      # each sampled on its own
    h.assert_no_leaks()


def test_n_parallel_prompt_multiple_of_block_size_has_no_copies():
    h = Harness(num_blocks=32, block_size=4, budget=64)
    fam = h.add(range(10, 18), n=3, max_tokens=3, ignore_eos=True)
    h.step()
    assert fam[1].block_ids == fam[2].block_ids == fam[0].block_ids
    assert [h.bm.ref_count(b) for b in fam[0].block_ids] == [3, 3]
    plan = h.step()
    assert plan.block_copies == []
    # each now writes its own 3rd block
    assert len({s.block_ids[2] for s in fam}) == 3
    h.run()
    h.assert_no_leaks()


def test_n_parallel_parent_stopping_on_first_token_keeps_children():
    def tokens(seq):
        return EOS if seq.index == 0 else 5 + seq.index
    h = Harness(num_blocks=32, block_size=4, budget=64, token_fn=tokens)
    parent, c1, c2 = h.add(range(10, 20), n=3, max_tokens=3)
    h.step()
    assert parent.status == SeqStatus.FINISHED and parent.finish_reason == FinishReason.STOP
    assert parent.block_ids == []
    assert c1.status == c2.status == SeqStatus.RUNNING
    assert c1.output_token_ids == [6] and c2.output_token_ids == [7]
    assert [h.bm.ref_count(b) for b in c1.block_ids[:2]] == [2, 2]
    plan = h.step()
    assert len(plan.block_copies) == 2
    h.run()
    assert c1.output_token_ids == [6, 6, 6] and c2.output_token_ids == [7, 7, 7]
    assert c1.finish_reason == c2.finish_reason == FinishReason.LENGTH
    h.assert_no_leaks()


def test_n_parallel_chunked_parent_samples_children_only_at_the_end_of_the_prompt():
    h = Harness(num_blocks=32, block_size=4, budget=4)
    parent, child = h.add(range(10, 20), n=2, max_tokens=2, ignore_eos=True)
    for _ in range(2):
        plan = h.step()
        assert plan.row_seqs == [] and child.status == SeqStatus.FORK_PENDING
    plan = h.step()
    assert plan.row_seqs == [parent, child] and plan.row_logits == [0, 0]
    assert child.status == SeqStatus.RUNNING
    h.run()
    h.assert_no_leaks()


def test_n_parallel_child_without_a_free_block_for_its_copy_is_recomputed():
    # 4 blocks: the parent's 3 and the watermark; no block is left for a copy
    h = Harness(num_blocks=4, block_size=4, budget=64, caching=False)
    parent, child = h.add(range(10, 20), n=2, max_tokens=2, ignore_eos=True)
    h.step()
    assert child.status == SeqStatus.RUNNING      # the one free block became its copy
    assert h.bm.num_free_blocks == 0
    # 5 blocks; in the step that ends the parent's prompt a decode takes the last free block
    h2 = Harness(num_blocks=5, block_size=4, budget=8, caching=False)
    bystander = h2.add(range(50, 54), max_tokens=3, ignore_eos=True)[0]
    parent, child = h2.add(range(10, 20), n=2, max_tokens=2, ignore_eos=True)
    plan = h2.step()
    assert sched_view(plan) == [(bystander.seq_id, 0, 4), (parent.seq_id, 0, 4)]
    assert h2.bm.num_free_blocks == 1
    plan = h2.step()
    assert sched_view(plan) == [(bystander.seq_id, 4, 1), (parent.seq_id, 4, 6)]
    assert plan.row_seqs == [bystander, parent, child]
    # no block for the copy: the child got its token and waits to recompute prompt + token
    assert child.status == SeqStatus.WAITING and child.num_output_tokens == 1
    assert child.block_ids == [] and child.num_computed_tokens == 0
    assert h2.sched.fork_children == {}
    assert [h2.bm.ref_count(b) for b in parent.block_ids] == [1, 1, 1]
    h2.run()
    assert parent.num_output_tokens == child.num_output_tokens == 2
    h2.assert_no_leaks()
    h.run()
    h.assert_no_leaks()


# ---- 7. reserve / commit ------------------------------------------------------------------------

def test_reserve_commit():
    h = Harness(num_blocks=16, block_size=4, budget=64)
    seq = h.new(range(10, 20), max_tokens=3, ignore_eos=True)
    h.reserve(seq)
    assert seq.status == SeqStatus.RESERVED and h.sched.reserved == {seq.seq_id: seq}
    assert seq.block_ids == [0, 1, 2] and h.bm.num_free_blocks == 13
    assert h.sched.num_unfinished == 1
    assert h.step().is_empty                        # held, not scheduled
    h.commit(seq, 42)
    assert seq.status == SeqStatus.RUNNING and h.sched.reserved == {}
    assert seq.num_computed_tokens == 10 and seq.output_token_ids == [42]
    assert seq.num_hashed_blocks == 2               # the committed full blocks are now cached
    plan = h.step()
    assert sched_view(plan) == [(seq.seq_id, 10, 1)]
    h.run()
    assert seq.num_output_tokens == 3 and seq.finish_reason == FinishReason.LENGTH
    h.assert_no_leaks()
    # a second reservation of the same prompt gets the committed full blocks from the cache
    again = h.new(range(10, 20), max_tokens=3)
    h.reserve(again)
    assert again.num_cached_tokens == 8 and again.num_computed_tokens == 8
    h.finish(again)
    h.assert_no_leaks()


def test_commit_with_eos_or_max_tokens_finishes_at_once():
    h = Harness()
    a, b = h.new(range(10, 20), max_tokens=5), h.new(range(30, 40), max_tokens=1)
    h.reserve(a)
    h.reserve(b)
    h.commit(a, EOS)
    h.commit(b, 5)
    assert (a.finish_reason, b.finish_reason) == (FinishReason.STOP, FinishReason.LENGTH)
    h.assert_no_leaks()


def test_reserve_abort_frees_everything_and_unwritten_blocks_are_not_cached():
    h = Harness(num_blocks=8, block_size=4)
    seq = h.new(range(10, 22), max_tokens=3)
    h.reserve(seq)
    assert h.bm.num_free_blocks == 5
    h.finish(seq, FinishReason.ABORT)
    assert seq.status == SeqStatus.FINISHED and seq.finish_reason == FinishReason.ABORT
    assert h.sched.reserved == {}
    assert h.bm.find_cached_prefix(seq.token_ids, seq.num_tokens) == []
    h.assert_no_leaks()


def test_reserve_without_room_raises_and_changes_nothing():
    h = Harness(num_blocks=4, block_size=4)
    seq = h.new(range(10, 30), max_tokens=3)            # 5 blocks
    with pytest.raises(NoFreeBlocks):
        h.reserve(seq)
    assert seq.status == SeqStatus.WAITING and seq.block_ids == []
    assert h.sched.reserved == {} and h.bm.num_free_blocks == 4
    h.assert_no_leaks()


def test_reserve_never_hands_out_blocks_a_pending_fork_copy_still_reads():
    """The parent stops on its first token right after the fork, so its partial last block is free
    until the next step performs the copy. A reservation made in between must not get that block:
    another engine would overwrite it before the copy reads it."""
    def tokens(seq):
        return EOS if seq.index == 0 else 5
    h = Harness(num_blocks=5, block_size=4, budget=64, caching=False, token_fn=tokens)
    parent, child = h.add(range(10, 16), n=2, max_tokens=3)     # 1 full + 1 partial block
    h.step()
    assert parent.status == SeqStatus.FINISHED and child.status == SeqStatus.RUNNING
    (copy,) = h.sched._pending_copies
    r = h.new(range(30, 42), max_tokens=2)                   # needs all 3 free blocks
    try:
        h.reserve(r)
    except NoFreeBlocks:
        pass
    else:
        assert not set(r.block_ids) & set(copy)
        h.commit(r, 5)
    h.run()       # the fake runner checks the child reads its prompt's KV from the copied block
    assert child.num_output_tokens == 3
    h.assert_no_leaks()


# ---- 8. abort at every stage ----------------------------------------------------------------

def _abort_request(h, family):
    """As the engine aborts a request: every sequence, the parent first."""
    live = [s for s in family if s.status != SeqStatus.FINISHED]
    for seq in family:
        h.finish(seq, FinishReason.ABORT)
    assert all(s.status == SeqStatus.FINISHED and s.block_ids == [] for s in family)
    assert all(s.finish_reason == FinishReason.ABORT for s in live)


@pytest.mark.parametrize("stage", ["waiting", "prefill", "decode", "reserved", "fork_pending",
                                   "forked", "preempted", "during_step"])
def test_abort_at_every_stage_frees_everything(stage):
    h = Harness(num_blocks=16, block_size=4, budget=8)
    bystander = h.add(range(70, 75), max_tokens=6, ignore_eos=True)[0]
    if stage == "reserved":
        fam = [h.new(range(10, 30), max_tokens=5)]
        h.reserve(fam[0])
        assert fam[0].status == SeqStatus.RESERVED
    else:
        n = 3 if stage in ("fork_pending", "forked") else 1
        fam = h.add(range(10, 30), n=n, max_tokens=8, ignore_eos=True)
        if stage in ("prefill", "fork_pending"):
            h.step()
            h.step()
            assert fam[0].status == SeqStatus.RUNNING and 0 < fam[0].num_computed_tokens < 20
            if stage == "fork_pending":
                assert all(c.status == SeqStatus.FORK_PENDING for c in fam[1:])
        elif stage in ("decode", "forked"):
            while fam[0].num_output_tokens < 2:
                h.step()
            assert all(s.status == SeqStatus.RUNNING for s in fam)
        elif stage == "preempted":
            while fam[0].num_output_tokens < 1:
                h.step()
            h.sched._preempt(fam[0])
            h.check()
            assert fam[0].status == SeqStatus.WAITING
        elif stage == "during_step":
            h.step()
            plan = h.sched.schedule()
            result = h.execute(plan)
            _abort_request(h, fam)
            h.sched.update(plan, result)
            h.check()
            assert fam[0].num_output_tokens == 0
    if stage != "during_step":
        _abort_request(h, fam)
    assert all(s.block_ids == [] for s in fam)
    assert h.sched.fork_children == {}
    h.run()
    assert bystander.num_output_tokens == 6
    h.assert_no_leaks()


def test_finish_is_idempotent():
    h = Harness()
    (seq,) = h.add(range(10, 15), max_tokens=4)
    h.step()
    h.finish(seq, FinishReason.STOP, "x")
    h.finish(seq, FinishReason.ABORT)
    assert (seq.finish_reason, seq.stop_reason) == (FinishReason.STOP, "x")
    h.assert_no_leaks()


# ---- 9. property test ---------------------------------------------------------------------------

SYSTEM_PROMPTS = [[2 + (i * 7 + k) % 3 for i in range(80)] for k in range(3)]


def _random_prompt(rng, earlier=()):
    n = rng.randint(1, 80)
    if earlier and rng.random() < 0.25:  # a later turn: an earlier sequence's text, maybe shifted
        text = rng.choice(earlier).token_ids
        start = rng.choice((0, 0, 4 * rng.randint(0, len(text) // 4)))
        extra = [rng.choice((2, 3, 4)) for _ in range(rng.randint(0, 8))]
        return (text[start:] + extra)[:80] or [2]
    if rng.random() < 0.6:             # a shared prefix, so the cache gets hits (and collisions)
        base = rng.choice(SYSTEM_PROMPTS)
        k = rng.randint(0, n)
        return base[:k] + [rng.choice((2, 3, 4)) for _ in range(n - k)]
    return [rng.choice((2, 3)) for _ in range(n)]


def _random_params(rng, n=1):
    kw = dict(n=n, max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.3)
    if rng.random() < 0.2:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [4]
    return kw


def _property_run(seed, num_ops=1000, caching=True):
    rng = random.Random(seed)

    def token_fn(seq):
        return EOS if rng.random() < 0.06 else rng.choice((2, 3, 4))

    h = Harness(num_blocks=24, block_size=4, caching=caching, budget=rng.choice((16, 24, 48)),
                max_num_seqs=rng.choice((4, 6, 8)), max_model_len=92, token_fn=token_fn)
    requests: dict[str, list[Sequence]] = {}
    stats = dict(steps=0, aborts=0, finishes=0, reserves=0, commits=0, forks=0, hits=0)

    def live(fam):
        return any(s.status != SeqStatus.FINISHED for s in fam)

    for _ in range(num_ops):
        op = rng.choices(["add", "step", "abort", "finish", "reserve", "commit", "abort_mid_step"],
                         weights=[4, 10, 1, 1, 1, 1, 0.3])[0]
        if op == "add":
            prompt = _random_prompt(rng, h.seqs[-30:])
            # sometimes a burst of one prompt: copies computed side by side are not cached twice
            for _ in range(rng.choice((1, 1, 1, 1, 2, 3))):
                n = 2 if rng.random() < 0.2 else 1
                fam = h.add(prompt, **_random_params(rng, n))
                if rng.random() < 0.05 and n == 1:
                    fam[0].prefill_only = True
                requests[fam[0].request_id] = fam
                stats["forks"] += n - 1
        elif op == "step":
            plan = h.step()
            stats["steps"] += 1
            stats["hits"] += sum(1 for s in plan.scheduled if s.start and s.seq.num_cached_tokens)
        elif op in ("abort", "abort_mid_step"):
            alive = [fam for fam in requests.values() if live(fam)]
            if not alive:
                continue
            fam = rng.choice(alive)
            if op == "abort_mid_step":      # the abort lands while the forward runs
                plan = h.sched.schedule()
                h.check()
                result = h.execute(plan) if not plan.is_empty else None
                _abort_request(h, fam)
                if result is not None:
                    h.sched.update(plan, result)
                h.check()
            else:
                _abort_request(h, fam)
            stats["aborts"] += 1
        elif op == "finish":              # e.g. a stop string seen by the detokenizer
            cands = [s for s in h.seqs if s.status in (SeqStatus.RUNNING, SeqStatus.WAITING)
                     and s.num_output_tokens > 0]
            if cands:
                h.finish(rng.choice(cands), FinishReason.STOP, "stop")
                stats["finishes"] += 1
        elif op == "reserve":
            seq = h.new(_random_prompt(rng, h.seqs[-30:]), **_random_params(rng))
            try:
                h.reserve(seq)
            except NoFreeBlocks:
                h.check()
                continue
            requests[seq.request_id] = [seq]
            stats["reserves"] += 1
        elif op == "commit":
            if h.sched.reserved:
                seq = rng.choice(list(h.sched.reserved.values()))
                h.commit(seq, rng.choice((EOS, 2, 3, 4)))
                stats["commits"] += 1
        for s in h.seqs:
            if s.status != SeqStatus.FINISHED:
                assert s.num_tokens < 92 and s.num_output_tokens <= s.params.max_tokens
    return h, requests, stats


@pytest.mark.parametrize("seed, caching", [(0, True), (1, True), (2, True), (3, False)])
def test_property_random_operations_never_leak(seed, caching):
    h, requests, stats = _property_run(seed, caching=caching)
    assert h.sched.num_preemptions > 0, stats
    assert stats["aborts"] > 0 and stats["commits"] > 0 and stats["forks"] > 0, stats
    if caching:
        assert stats["hits"] > 0, stats
    for fam in requests.values():
        _abort_request(h, fam)
    h.assert_no_leaks()


def test_property_random_operations_drain_to_completion():
    """Same mix, but at the end every reservation is committed and the rest runs to completion:
    nothing is stuck in waiting, every sequence finishes for a reason of its own."""
    h, requests, stats = _property_run(seed=10, num_ops=600)
    for seq in list(h.sched.reserved.values()):
        h.commit(seq, 2)
    h.run(max_steps=5000)
    assert h.sched.num_preemptions > 0
    for fam in requests.values():
        for s in fam:
            assert s.status == SeqStatus.FINISHED and s.finish_reason is not None
            if s.finish_reason == FinishReason.LENGTH:
                assert s.num_output_tokens == s.params.max_tokens or s.num_tokens == 92
    h.assert_no_leaks()


@settings(derandomize=True, database=None, max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), caching=st.booleans())
def test_property_hypothesis_chosen_runs(seed, caching):
    h, requests, _ = _property_run(seed, num_ops=300, caching=caching)
    for fam in requests.values():
        _abort_request(h, fam)
    h.assert_no_leaks()
