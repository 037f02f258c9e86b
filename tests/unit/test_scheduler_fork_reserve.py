"""Scheduler n > 1 forks, reserve/commit (the decode side of a prefill/decode handoff) and aborts at
every stage, with the fake runner of scheduler_harness.py (no model)."""

from __future__ import annotations

import pytest

from helpers.scheduler_harness import EOS, Harness, abort_request, sched_view
from pdserve.engine.block_manager import NoFreeBlocks
from pdserve.engine.request import FinishReason, SeqStatus

# ---- n > 1 --------------------------------------------------------------------------------------


def test_n_parallel_fork_shares_full_blocks_and_copies_partial():
    h = Harness(num_blocks=32, block_size=4, budget=64)
    other = h.add(range(50, 53), max_tokens=8, ignore_eos=True)[0]
    parent, c1, c2 = fam = h.add(range(10, 20), n=3, max_tokens=4, ignore_eos=True)
    assert [s.status for s in fam] == [
        SeqStatus.WAITING,
        SeqStatus.FORK_PENDING,
        SeqStatus.FORK_PENDING,
    ]
    assert h.sched.fork_children[parent.seq_id] == [c1, c2]
    assert h.sched.num_unfinished == 2
    plan = h.step()
    # only the parent computes the prompt; its logits row feeds three sampling rows
    assert sched_view(plan) == [(other.seq_id, 0, 3), (parent.seq_id, 0, 10)]
    assert plan.row_seqs == [other, parent, c1, c2]
    assert plan.row_logits == [0, 1, 1, 1]
    assert [list(r.output_token_ids) for r in plan.rows] == [[], [], [], []]
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
    assert sched_view(plan) == [
        (other.seq_id, 3, 1),
        (parent.seq_id, 10, 1),
        (c1.seq_id, 10, 1),
        (c2.seq_id, 10, 1),
    ]
    assert plan.row_logits == [0, 1, 2, 3]
    assert h.step().block_copies == []
    h.run()
    assert [s.num_output_tokens for s in fam] == [4, 4, 4]
    assert len({tuple(s.output_token_ids) for s in fam}) == 3  # each sampled on its own
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
    assert child.status == SeqStatus.RUNNING  # the one free block became its copy
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


# ---- reserve / commit ---------------------------------------------------------------------------


def test_reserve_commit():
    h = Harness(num_blocks=16, block_size=4, budget=64)
    seq = h.new(range(10, 20), max_tokens=3, ignore_eos=True)
    h.reserve(seq)
    assert seq.status == SeqStatus.RESERVED and h.sched.reserved == {seq.seq_id: seq}
    assert seq.block_ids == [0, 1, 2] and h.bm.num_free_blocks == 13
    assert h.sched.num_unfinished == 1
    assert h.step().is_empty  # held, not scheduled
    h.commit(seq, [42])
    assert seq.status == SeqStatus.RUNNING and h.sched.reserved == {}
    assert seq.num_computed_tokens == 10 and seq.output_token_ids == [42]
    assert seq.num_hashed_blocks == 2  # the committed full blocks are now cached
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
    h.commit(a, [EOS])
    h.commit(b, [5])
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
    seq = h.new(range(10, 30), max_tokens=3)  # 5 blocks
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
    parent, child = h.add(range(10, 16), n=2, max_tokens=3)  # 1 full + 1 partial block
    h.step()
    assert parent.status == SeqStatus.FINISHED and child.status == SeqStatus.RUNNING
    (copy,) = h.sched._pending_copies
    r = h.new(range(30, 42), max_tokens=2)  # needs all 3 free blocks
    try:
        h.reserve(r)
    except NoFreeBlocks:
        pass
    else:
        assert not set(r.block_ids) & set(copy)
        h.commit(r, [5])
    h.run()  # the fake runner checks the child reads its prompt's KV from the copied block
    assert child.num_output_tokens == 3
    h.assert_no_leaks()


# ---- abort at every stage -------------------------------------------------------------------


@pytest.mark.parametrize(
    "stage",
    [
        "waiting",
        "prefill",
        "decode",
        "reserved",
        "fork_pending",
        "forked",
        "preempted",
        "during_step",
    ],
)
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
            abort_request(h, fam)
            h.sched.update(plan, result)
            h.check()
            assert fam[0].num_output_tokens == 0
    if stage != "during_step":
        abort_request(h, fam)
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


# ---- n > 1 on the disaggregated path ------------------------------------------------------------
def reserved_family(h, prompt, n, **params):
    rid = f"res{h._ids}"
    fam = [h.new(prompt, rid, i, n=n, **params) for i in range(n)]
    h.reserve(fam[0], fam[1:])
    return fam


def test_reserve_of_n_holds_the_fork_copies_and_commit_forks_copy_on_write():
    h = Harness(num_blocks=16, block_size=4, budget=64)
    parent, c1, c2 = fam = reserved_family(h, range(10, 20), 3, max_tokens=4, ignore_eos=True)
    assert parent.status == SeqStatus.RESERVED and len(parent.block_ids) == 3
    assert [c.status for c in (c1, c2)] == [SeqStatus.FORK_PENDING] * 2
    assert h.bm.num_free_blocks == 16 - 3 - 2  # the prompt's blocks and one copy per child
    h.commit(parent, [5, 6, 7])
    assert all(s.status == SeqStatus.RUNNING for s in fam)
    assert [s.output_token_ids for s in fam] == [[5], [6], [7]]
    full, partial = parent.block_ids[:2], parent.block_ids[2]
    assert all(c.block_ids[:2] == full and c.block_ids[2] != partial for c in (c1, c2))
    assert [h.bm.ref_count(b) for b in full] == [3, 3]
    assert h.sched.reserved_copies == {} and h.bm.num_free_blocks == 16 - 5
    plan = h.step()  # the copies run first; the fake runner checks each child reads its prompt
    assert plan.block_copies == [(partial, c1.block_ids[2]), (partial, c2.block_ids[2])]
    h.run()
    assert [s.num_output_tokens for s in fam] == [4, 4, 4]
    h.assert_no_leaks()


def test_reserve_of_n_with_whole_blocks_holds_no_copies_and_aborts_free_everything():
    h = Harness(num_blocks=8, block_size=4, budget=64)
    fam = reserved_family(h, range(10, 18), 3, max_tokens=3, ignore_eos=True)
    assert h.bm.num_free_blocks == 8 - 2  # the children share both blocks at the commit
    h.commit(fam[0], [5, 6, 7])
    assert all(s.block_ids == fam[0].block_ids for s in fam)
    h.run()
    h.assert_no_leaks()
    fam = reserved_family(h, range(30, 39), 4, max_tokens=3)
    assert h.bm.num_free_blocks == 8 - 3 - 3
    abort_request(h, fam)  # before the commit: the copies go back too
    assert h.sched.reserved_copies == {} and h.sched.fork_children == {}
    h.assert_no_leaks()


def test_reserve_of_n_takes_nothing_when_the_copies_do_not_fit():
    h = Harness(num_blocks=5, block_size=4)
    (other,) = h.add(range(40, 43), max_tokens=3, ignore_eos=True)
    h.step()  # 1 block taken: the prompt's 3 blocks fit, not with 2 copies
    seqs = [h.new(range(10, 19), "full", i, n=3, max_tokens=2) for i in range(3)]
    with pytest.raises(NoFreeBlocks):
        h.sched.reserve(seqs[0], seqs[1:])
    assert h.bm.num_free_blocks == 4 and h.sched.reserved == {} and h.sched.fork_children == {}
    assert all(s.status == SeqStatus.WAITING for s in seqs)
    h.run()
    fam = reserved_family(h, range(10, 19), 3, max_tokens=2)  # now it fits: 3 + 2 of 5
    assert h.bm.num_free_blocks == 0
    h.commit(fam[0], [5, 6, 7])
    h.run()
    h.assert_no_leaks()


def test_commit_whose_parent_stops_on_its_first_token_keeps_the_children():
    h = Harness(num_blocks=16, block_size=4, budget=64)
    parent, c1, c2 = fam = reserved_family(h, range(10, 19), 3, max_tokens=3)
    h.commit(parent, [EOS, 6, 7])
    assert parent.status == SeqStatus.FINISHED and parent.finish_reason == FinishReason.STOP
    assert c1.status == c2.status == SeqStatus.RUNNING
    h.run()  # the copies of the freed parent's last block still run before anyone reuses it
    assert [s.num_output_tokens for s in fam] == [1, 3, 3]
    h.assert_no_leaks()


def test_prefill_only_n_samples_every_first_token_and_only_the_first_holds_kv():
    h = Harness(num_blocks=16, block_size=4, budget=64)
    fam = [h.new(range(10, 19), "p", i, n=3, max_tokens=8) for i in range(3)]
    for s in fam:
        s.prefill_only = True
    h.seqs += fam
    h.sched.add(fam)
    plan = h.step()
    assert plan.row_seqs == fam and plan.row_logits == [0, 0, 0]
    assert all(s.finish_reason == FinishReason.PREFILL_DONE for s in fam)
    assert [s.num_output_tokens for s in fam] == [1, 1, 1] and plan.block_copies == []
    assert h.sched._pending_copies == []
    h.assert_no_leaks()
