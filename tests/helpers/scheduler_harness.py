"""The scheduler test harness: a Scheduler + BlockManager driven by a fake runner (no model).

The fake runner keeps a fake KV cache: every slot it writes holds a key for (the token at that
position, every token before it). Before a scheduled chunk runs, every position it attends to
(`[0, start)`) must hold exactly the key this sequence would have written there, so a prefix-cache
hit, a fork copy or a recompute that serves the wrong KV fails the test, as does a write into a
block that another sequence shares or the prefix cache has registered. It also remembers which text
each full block's KV was computed for, and every check asserts that each block in the prefix cache
is registered under exactly that text's chained hash (so a lookup can only ever serve it to that
text).

With `window` (a model whose every layer slides), a chunk must find the right KV only at the
window - 1 positions before it; the blocks before those are given back, their table entries are
the null block (index num_blocks), and every check also bounds the blocks a sequence holds.

Not a test module: the test_scheduler*.py modules import it as `from helpers.scheduler_harness import ...`
(tests/helpers/ is a package on pytest's sys.path).
"""

from __future__ import annotations

import pdserve.engine.block_manager as block_manager_mod
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_window import max_blocks_held, skipped_blocks
from pdserve.engine.request import FinishReason, SeqStatus, Sequence
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, StepOutput, StepPlan

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
    def __init__(
        self,
        num_blocks=64,
        block_size=4,
        caching=True,
        *,
        budget=64,
        max_num_seqs=8,
        max_model_len=10_000,
        token_fn=default_token,
        window=None,
    ):
        null = num_blocks if window is not None else None
        self.bm = BlockManager(num_blocks, block_size, caching, null_block=null)
        self.sched = Scheduler(
            self.bm,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            eos_token_ids=(EOS,),
            kv_window=window,
        )
        self.window = window
        self.bs = block_size
        self.token_fn = token_fn
        self.kv: dict[tuple[int, int], int] = {}
        self.kv_text: dict[int, tuple[int, ...]] = {}  # full block -> tokens [0, end of block)
        # (hash function, a block's text) -> (its hash, its parent's): check() asks for the same
        # chains every step, and computing each from its first block made long prompts quadratic
        self._chains: dict = {}
        self.seqs: list[Sequence] = []  # every sequence made, in order (tests append too)
        # check() reads the sequences not yet seen finished: a finished one is checked once to
        # hold no block, then left out (finishing is final, and a block it took again would
        # still show in the reference counts, which the live sequences alone must explain)
        self._live: list[Sequence] = []
        self._taken = 0  # how many of self.seqs have joined self._live
        self._ids = 0

    # ---- building requests ----
    def new(self, prompt, request_id=None, index=0, **params) -> Sequence:
        seq = Sequence(
            self._ids, request_id or f"r{self._ids}", index, list(prompt), SamplingParams(**params)
        )
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
        lo = 0 if self.window is None else max(0, upto - self.window + 1)
        for p in range(lo, upto):
            assert seq.block_ids[p // self.bs] != self.bm.null_block, f"position {p} released"
            assert self.kv.get(self._slot(seq, p)) == keys[p], (
                f"seq {seq.seq_id} position {p}: wrong KV in block {seq.block_ids[p // self.bs]}"
            )

    def _write(self, seq, start, end, keys):
        for p in range(start, end):
            b = seq.block_ids[p // self.bs]
            assert self.bm.ref_count(b) == 1, f"write into shared block {b}"
            assert self.bm.blocks[b].hash is None, f"write into cached block {b}"
            self.kv[(b, p % self.bs)] = keys[p]
            if p % self.bs == self.bs - 1:
                self.kv_text[b] = tuple(seq.token_ids[: p + 1])
            else:
                self.kv_text.pop(b, None)

    def execute(self, plan: StepPlan, tokens=None) -> StepOutput:
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
            keys = prefix_keys(seq.token_ids[: item.end])
            self._verify_reads(seq, item.start, keys)
            self._write(seq, item.start, item.end, keys)
        assert plan.num_tokens <= self.sched.max_num_batched_tokens
        assert len(plan.rows) == len(plan.row_seqs) == len(plan.row_logits)
        if tokens is None:
            tokens = [self.token_fn(s) for s in plan.row_seqs]
        elif callable(tokens):
            tokens = [tokens(s) for s in plan.row_seqs]
        return StepOutput(token_ids=list(tokens), logprobs=None)

    def step(self, tokens=None) -> StepPlan:
        plan = self.sched.schedule()
        self.check()
        if not plan.is_empty:
            result = self.execute(plan, tokens)
            self.sched.update(plan, result)
        self.check()
        return plan

    def reserve(self, seq, children=()):
        self.sched.reserve(seq, list(children))
        self.seqs += [seq, *children]
        self.check()

    def commit(self, seq, first_token):
        """first_token: one, or (n>1) one per sequence of the reserved family."""
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
    def _chain(self, text: tuple) -> tuple:
        """(the hash of the block ending `text`, its parent's), as block_hash chains them from
        the first block; each text's pair computed once."""
        fn = block_manager_mod.block_hash
        todo, end = [], len(text)
        while end and (fn, text[:end]) not in self._chains:
            todo.append(end)
            end -= self.bs
        parent = self._chains[(fn, text[:end])][0] if end else None
        for end in reversed(todo):
            pair = (fn(parent, text[end - self.bs : end]), parent)
            self._chains[(fn, text[:end])] = pair
            parent = pair[0]
        return self._chains[(fn, text)]

    def check(self):
        bm, sched = self.bm, self.sched
        bm.check_consistency()
        for block in bm.blocks:
            if block.hash is None:
                continue
            text = self.kv_text.get(block.block_id)
            assert text is not None and len(text) % self.bs == 0, f"block {block.block_id}"
            parent, grand = self._chain(tuple(text))
            assert (block.hash, block.parent_hash, block.token_ids) == (
                parent,
                grand,
                text[-self.bs :],
            ), f"block {block.block_id} cached under another text"
        refs = [0] * bm.num_blocks
        self._live += self.seqs[self._taken :]
        self._taken = len(self.seqs)
        seqs = self._live
        for seq in seqs:
            held = [b for b in seq.block_ids if b != bm.null_block]
            assert len(set(held)) == len(held)
            for b in held:
                refs[b] += 1
            if self.window is not None and seq.status == SeqStatus.RUNNING:
                most = max_blocks_held(self.window, self.bs, sched.max_num_batched_tokens)
                assert len(held) <= most, f"seq {seq.seq_id} holds {len(held)} blocks"
                skip = skipped_blocks(seq.num_computed_tokens, self.window, self.bs)
                assert seq.block_ids[:skip] == [bm.null_block] * skip
            if seq.status == SeqStatus.FINISHED:
                assert seq.block_ids == []
            if seq.status in (SeqStatus.WAITING, SeqStatus.FORK_PENDING):
                assert seq.block_ids == [] and seq.num_computed_tokens == 0
            if seq.status == SeqStatus.RUNNING:
                assert (
                    bm.blocks_needed(seq.num_computed_tokens)
                    <= len(seq.block_ids)
                    <= bm.blocks_needed(seq.num_tokens)
                )
                assert seq.num_hashed_blocks <= seq.num_computed_tokens // self.bs
        held = [b for blocks in sched.reserved_copies.values() for b in blocks]  # n>1 forks' copies
        for b in held:
            refs[b] += 1
        assert refs == [b.ref_count for b in bm.blocks]
        assert sum(len(s.block_ids) - s.block_ids.count(bm.null_block) for s in seqs) + len(
            held
        ) == sum(b.ref_count for b in bm.blocks)
        assert set(sched.reserved_copies) <= set(sched.reserved)
        running = [s.seq_id for s in seqs if s.status == SeqStatus.RUNNING]
        waiting = [s.seq_id for s in seqs if s.status == SeqStatus.WAITING]
        assert sorted(s.seq_id for s in sched.running) == sorted(running)
        assert sorted(s.seq_id for s in sched.waiting) == sorted(waiting)
        assert sorted(sched.reserved) == sorted(
            s.seq_id for s in seqs if s.status == SeqStatus.RESERVED
        )
        pending = sorted(c.seq_id for cs in sched.fork_children.values() for c in cs)
        assert pending == sorted(s.seq_id for s in seqs if s.status == SeqStatus.FORK_PENDING)
        self._live = [s for s in seqs if s.status != SeqStatus.FINISHED]

    def assert_no_leaks(self):
        """Every block is free or evictable (cached, ref 0), and the accounting is consistent."""
        self.check()
        assert self.sched.num_unfinished == 0
        assert not self.sched.fork_children and not self.sched.reserved
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)


def sched_view(plan):
    return [(s.seq.seq_id, s.start, s.num_new_tokens) for s in plan.scheduled]


def abort_request(h, family):
    """As the engine aborts a request: every sequence, the parent first."""
    live = [s for s in family if s.status != SeqStatus.FINISHED]
    for seq in family:
        h.finish(seq, FinishReason.ABORT)
    assert all(s.status == SeqStatus.FINISHED and s.block_ids == [] for s in family)
    assert all(s.finish_reason == FinishReason.ABORT for s in live)
