"""Continuous batching: decide which tokens of which sequences run in the next step.

Request lifecycle in one engine:
  add -> WAITING --admit (prefix-cache lookup, blocks for the whole prompt)--> RUNNING
  RUNNING: every step computes `num_tokens - num_computed_tokens` tokens (a prefill chunk, or one
           decode token) within the step's token budget; a step that reaches the end samples.
  RUNNING --blocks run out--> preempted (blocks freed, recomputed later) -> front of WAITING
  reserve -> RESERVED (blocks written by another engine) --commit(first token)--> RUNNING
           n>1: the reservation also holds one block per child for the copy of the prompt's
           partial last block; commit(n first tokens) forks the children as below and appends
           each its own first token (they were sampled by the engine that ran the prompt)
  any -> FINISHED (stop, length, abort, prefill_done, pooled): blocks freed (full ones stay cached)
Priority (vLLM's priority scheduling; Sequence.priority, lower first): the waiting queue is kept
in priority order, first come first served within equal values (a new or forked sequence goes
behind those of its value, a preempted one in front of them); each step plans the running
sequences in priority order (a stable sort: admission order within equal values), so the last of
them, the one preempted first when blocks run out, has the highest value and was admitted last.
With every priority equal (the router's fcfs policy sends 0 alone) this is plain FCFS, as before.
Pooling requests (Sequence.pooling: embeddings) run their prompt as a prefill does, get no
sampling row, and finish (pooled) at the step that computes their last token; their blocks are
freed then (full ones stay in the prefix cache). "mean" pooling needs every prompt position's
hidden state, so it takes no prefix-cache hit, as prompt logprobs do.
n>1: the first sequence prefills; the other n-1 wait in FORK_PENDING, sample from the same logits
and take the prompt's blocks by reference, with the partial last block copied (copy-on-write).
Sliding windows (kv_window: every layer slides): after each step a sequence gives back the blocks
its window has left (engine/kv_window.py), and a prompt is admitted with the blocks of its first
chunk only, its later chunks taking theirs as they run, so a sequence holds about a window's
worth of blocks however long it grows. A reservation holds every prompt block the other engine
writes (all but prefix-cache hits that lie before the window) and gives back what lies before the
window at its commit.
A hybrid model's sequence also holds a recurrent-state slot (engine/recurrent_state.py); with the
prefix cache on, its prefix hit ends at the last cached block whose state a free slot keeps, and
states are kept at a prompt's last block boundary (mid-chunk, by the layers: _plan_keep) and
at the latest boundary past it (_admit_blocks, _keep_state).

Long prefills (prefill_step_target_s > 0, EngineConfig's; 0 keeps the plain policy below): a
step's time grows with its tokens and, at long contexts, with the context each of them attends
to, so a 7,000-token prompt cut into budget-sized chunks makes steps of many seconds on a CPU,
and a short prompt that arrives meanwhile waits for the whole prompt. With a target, the
scheduler sizes the chunk of a long prefill from the step times it measures (`observe_step`:
seconds per token of the steps that computed a prompt chunk, each step weighing half, so one
slow step on a busy machine does not halve the next chunk; `long_chunk` = the target's worth of
tokens, in whole blocks, between one block and the token budget, and at most twice the last
long chunk, the first one at most LONG_START_BLOCKS blocks: a rate measured on short prompts
underestimates a chunk's cost deeper into a long one, and growing from a small first chunk keeps
the first steps within the target while the rate is learnt). A prefill is long
when what it computes (its sequence less the prefix-cache hits of its admission) is longer than
the token budget (it takes several steps anyway) and it has more tokens left than that chunk; a
prompt whose uncached part fits the budget runs whole, as before (a conversation's next turn
over its cached earlier turns too, however long the conversation). Each
step then plans: running sequences that are not long prefills (decodes first, as before, and
short partial prefills), then waiting prompts first come first served (a long one is admitted
only while no other long prefill runs, and short prompts behind it pass it), then the long
prefills, one chunk between them. A step that admits a new short prompt gives the long
prefills that were already running no tokens, so the newcomer's first token waits at most for
the step already running; never two steps in a row, so a stream of short prompts cannot starve
a long one. vLLM V1 caps a long prefill's chunk at long_prefill_token_threshold and vLLM V0
limits concurrent long partial prefills (max_long_partial_prefills); this policy does both, in
seconds rather than tokens, because here a chunk's cost at 6,000 tokens of context is several
times its cost at the start of the prompt.

Prefill beside running streams (max_step_slowdown > 0, EngineConfig's; 0 keeps the policies above):
on a decode worker a prompt, or a conversation's new turn whose earlier turns it holds
(planner/local_prefill.py), is computed in the steps that also decode the running streams, and
every one of those streams waits for the whole step. With a slowdown x, a step that decodes at
least one stream computes at most `stream_prefill_cap` prompt tokens in all, its prefill pieces and
admissions sharing them in planning order: x times a plain decode step's seconds over the seconds a
prompt token adds to a step, both measured (`observe_step`: steps that only decode set the first,
steps that decode and prefill set the second, the average of what they took beyond it over the
average of their prompt tokens, each step weighing half; a prefill alone bounds it from above until
then), so such a step takes about (1 + x) plain decode steps. The cap is at least one token, at
most twice the larger of a block and what the last capped step was given, within the token budget;
one block until a decode step and a prompt token's cost are measured. A step with no stream to
decode is not capped: a turn alone runs at full speed.

LoRA adapters (max_loras, vLLM's meaning: the adapters one batch may run): a step runs sequences
of at most `max_loras` distinct adapters (the base model counts for none), planned in the order
above. A running or waiting sequence of a further adapter is deferred (a running one keeps its
blocks and runs no tokens this step), and so is every adapter sequence after it in that order, so
a later request of an adapter already in the step cannot keep it there for ever: the deferred
adapter's sequences run once those planned before them leave, first come first served. The base
model's sequences are never deferred. An engine without enable_lora has no such bound.

Images whose tokens attend to one another both ways (Gemma 3): every piece a policy above sizes
for a prompt goes through `Sequence.fit_chunk`, which ends it before such an image or runs it
through the image's end (past the budget or cap by less than one image, so a budget smaller
than an image still makes progress), since each token of the image must see the whole image in
the step that computes it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdserve.engine.block_manager import BlockManager, NoFreeBlocks
from pdserve.engine.kv_window import release_skipped, skipped_blocks
from pdserve.engine.recurrent_state import NoFreeSlots, SlotPool
from pdserve.engine.request import FinishReason, SeqStatus, Sequence
from pdserve.engine.sampler import OutputTail, SamplingRow
from pdserve.engine.spec.verify import check_rows, kept_tokens

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig, ModelConfig


# the first chunk of a long prefill, in blocks, before the measured rate lets it grow (module
# docstring: the long-prefill policy)
LONG_START_BLOCKS = 4


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int
    num_new_tokens: int  # guesses included
    # speculative decoding: the step also computes this many guessed tokens after the sequence's
    # last one (spec_token_ids, filled in before the step runs), and samples at each of them
    num_spec: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    accepted: int = 0  # guesses the step's samples agreed with (set by update)
    # a hybrid's state kept by the prefix cache mid-chunk: after keep_at of these tokens, into
    # slot keep_slot (-1: none), registered once the step has run (Scheduler._plan_keep)
    keep_at: int = 0
    keep_slot: int = -1
    # a hybrid's state before this step's guesses, copied into this slot as the step starts
    # (-1: none): the sequence takes it back when a guess is rejected (Scheduler.plan_rollbacks)
    rollback_slot: int = -1

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        return self.end - self.num_spec == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes: the sequence's, then the guesses."""
        own = self.seq.token_ids[self.start : self.end - self.num_spec]
        return own + self.spec_token_ids if self.num_spec else own

    def drop_guesses(self, keep: int) -> None:
        """Checks only the first `keep` guesses (fewer were made, or none is wanted)."""
        self.num_new_tokens -= self.num_spec - keep
        self.num_spec = keep
        del self.spec_token_ids[keep:]


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq]
    rows: list[SamplingRow] = field(default_factory=list)
    row_seqs: list[Sequence] = field(default_factory=list)  # which sequence each row samples for
    row_logits: list[int] = field(default_factory=list)  # which logits row (sampling seq) feeds it
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # (source, destination) recurrent-state slots a hybrid model's forks start from
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.block_copies and not self.state_copies


@dataclass
class StepOutput:
    """What executing a plan gives back: the one record of a step's results (ModelRunner.execute
    fills it on rank 0; other ranks get an empty one)."""

    token_ids: list[int] = field(default_factory=list)  # one per sampling row
    logprobs: list[float] | None = None  # the sampled tokens' (rows asking for logprobs)
    # index in plan.scheduled -> per computed position with a prompt target, {token id: logprob}
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    # index in plan.scheduled -> a pooling request's part of this step (float32, CPU): its last
    # token's final hidden state ("last", at its last chunk only) or its chunk's sum ("mean")
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)
    # per ModelInput sequence, its rows of the hidden states the runner exposes (an EAGLE head's
    # input, engine/spec/eagle.py); None: not asked for
    hidden: list[torch.Tensor] | None = None


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        stop_eos_token_ids: tuple[int, ...] = (),
        kv_window: int | None = None,
        prefill_step_target_s: float = 0.0,
        max_loras: int | None = None,
        max_step_slowdown: float = 0.0,
        state_slots: int = 0,
    ):
        self.bm = block_manager
        # a hybrid model's recurrent-state slots (engine/recurrent_state.py): a sequence holds
        # one while it holds blocks; None: the model has no linear-attention layers
        self.slots = SlotPool(state_slots) if state_slots else None
        self._pending_state_copies: list[tuple[int, int]] = []
        # with the prefix cache on, free slots keep the states after cached blocks: a hybrid's
        # prefix hit ends at the last block whose state is kept (_with_state)
        self.keep_states = bool(state_slots) and block_manager.enable_prefix_caching
        if self.keep_states:
            block_manager.kept_states = self.slots
            self.slots.on_push_out = self._save_state
            self.slots.on_change = block_manager.state_changed
        # distinct LoRA adapters a step may run (module docstring); None: no bound
        self.max_loras = max_loras
        # the long-prefill policy (module docstring): seconds a long prefill's step should take;
        # 0: off. sec_per_token: what the last step that computed a prompt chunk took per token
        self.prefill_step_target_s = prefill_step_target_s
        self.sec_per_token: float | None = None
        self._long_yielded = False  # the long prefills gave the last step to a newcomer
        self._long_grant: int | None = None  # tokens the long prefills got at their last step
        # prefill beside running streams (module docstring): the slowdown x (0: off), a plain
        # decode step's seconds, the seconds a prompt token adds beside decodes (and, until that
        # is measured, a prompt token's seconds in a step that decodes nothing), and the prompt
        # tokens the last capped step was given
        self.max_step_slowdown = max_step_slowdown
        self.decode_step_s: float | None = None
        self.stream_token_s: float | None = None
        self.alone_token_s: float | None = None
        self._stream_grant: int | None = None
        self._extra_s: float | None = None  # (averages stream_token_s is the ratio of)
        self._extra_tokens: float | None = None
        # The attention window of a model whose every layer slides, else None.
        self.kv_window = kv_window
        if kv_window is not None and block_manager.null_block is None:
            raise ValueError("a sliding-window scheduler needs a block manager with a null block")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        # those of them only generation_config.json lists: the stop reason when one ends a sequence
        self.stop_eos_token_ids = stop_eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved: dict[int, Sequence] = {}
        self.fork_children: dict[int, list[Sequence]] = {}
        # reserved parent seq_id -> blocks held for its children's fork copies until the commit
        self.reserved_copies: dict[int, list[int]] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0
        # speculative decoding (engine/spec): sets each running sequence's guess budget
        # (Sequence.spec_budget) as a plan starts; None: this engine does not speculate
        self.speculator = None
        # keep a sliver free so admissions do not immediately force decodes into preemption
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)

    @classmethod
    def for_engine(
        cls,
        config: EngineConfig,
        model_config: ModelConfig,
        runner,
    ) -> Scheduler:
        """The scheduler of an engine (config: its resolved EngineConfig) over its rank 0
        runner's pool: num_blocks blocks; null_block, its index outside the pool (sliding
        windows); state_slots, a hybrid model's recurrent-state slots (0 for others)."""
        num_blocks, null_block = runner.num_blocks, runner.null_block
        window = model_config.kv_window
        bm = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            null_block=null_block if window is not None else None,
        )
        return cls(
            bm,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            eos_token_ids=model_config.eos_token_ids,
            stop_eos_token_ids=model_config.generation_eos_token_ids,
            kv_window=window,
            prefill_step_target_s=config.prefill_step_target_s,
            max_loras=config.max_loras if config.enable_lora else None,
            max_step_slowdown=config.max_step_slowdown,
            state_slots=runner.state_slots,
        )

    # ---- intake ---------------------------------------------------------------------------------
    def add(self, seqs: list[Sequence]) -> None:
        parent, children = seqs[0], seqs[1:]
        if children:
            for child in children:
                child.status = SeqStatus.FORK_PENDING
            self.fork_children[parent.seq_id] = children
        self._enqueue(parent)

    def _enqueue(self, seq: Sequence) -> None:
        """`seq` joins the waiting queue behind every sequence of its priority or a lower value."""
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].priority > seq.priority:
            i -= 1
        self.waiting.insert(i, seq)

    def _requeue(self, seq: Sequence) -> None:
        """A preempted `seq` goes back in front of the waiting sequences of its priority."""
        i = 0
        while i < len(self.waiting) and self.waiting[i].priority < seq.priority:
            i += 1
        self.waiting.insert(i, seq)

    def reserve(self, seq: Sequence, children: list[Sequence] = ()) -> None:
        """Hold blocks for a prompt whose KV another engine will write; raises NoFreeBlocks.
        children: the request's other n-1 sequences (n>1), forked at the commit; one block each
        is held for the copy of a partial last prompt block, so the commit never runs short."""
        # a copy the next step still has to make may involve blocks that are free by now (the parent
        # stopped on its first token, the child was aborted): another engine must not write them
        # before that copy runs, so keep them out of this reservation
        pinned = [b for copy in self._pending_copies for b in copy if self.bm.ref_count(b) == 0]
        self.bm.take(pinned)
        # (likewise a state copy's source slot: a forked parent that finished gave it back)
        if self.slots is not None:
            self.slots.avoid = {slot for copy in self._pending_state_copies for slot in copy}
        copies = len(children) if seq.num_tokens % self.bm.block_size else 0
        try:
            cached = self.bm.find_cached_prefix(
                seq.cache_token_ids,
                seq.num_tokens,
                seq.num_tokens,
                watermark=copies,
                root=seq.cache_root,
            )
            # the copies count as a watermark: all of the family's blocks are free, or none is taken
            self._admit_blocks(seq, cached, seq.num_tokens, watermark=copies, remote=True)
            held = self.bm.allocate(copies)
        finally:
            self.bm.free(pinned)
            if self.slots is not None:
                self.slots.avoid = set()
        seq.status = SeqStatus.RESERVED
        self.reserved[seq.seq_id] = seq
        if children:
            for child in children:
                child.status = SeqStatus.FORK_PENDING
            self.fork_children[seq.seq_id] = list(children)
            self.reserved_copies[seq.seq_id] = held

    def commit(
        self, seq: Sequence, first_token_ids: list[int], logprobs: list[float] | None = None
    ) -> None:
        """The reserved prompt's KV is in place: continue decoding from the first tokens (one per
        sequence, in index order; n>1: the children fork from `seq` on copy-on-write blocks)."""
        tokens = list(first_token_ids)
        del self.reserved[seq.seq_id]
        seq.num_computed_tokens = seq.num_tokens
        seq.num_hashed_blocks = self.bm.register_full_blocks(
            seq.block_ids,
            seq.cache_token_ids,
            seq.num_hashed_blocks,
            seq.num_computed_tokens,
            seq.cache_root,
        )
        release_skipped(self.bm, seq, self.kv_window)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        children = list(self.fork_children.get(seq.seq_id, []))
        self.bm.free(self.reserved_copies.pop(seq.seq_id, []))  # for _fork to allocate at once
        # fork before appending any token, as update() does: a parent that stops on its first
        # token must not take its children down with it
        for child in children:
            self._fork(seq, child)
        lps = list(logprobs) if logprobs else [None] * len(tokens)
        self._append_token(seq, tokens[0], lps[0])
        for child, token, logprob in zip(children, tokens[1:], lps[1:]):
            self._append_token(child, token, logprob)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason=None) -> None:
        if seq.status == SeqStatus.FINISHED:
            return
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SeqStatus.RESERVED:
            del self.reserved[seq.seq_id]
            self.bm.free(self.reserved_copies.pop(seq.seq_id, []))
        self.bm.free(seq.block_ids)
        seq.block_ids = []
        self._give_back_slot(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        for child in self.fork_children.pop(seq.seq_id, []):
            self.finish(child, reason, stop_reason)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.reserved)

    # ---- planning -------------------------------------------------------------------------------
    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """The engine ran `plan` in `seconds`: a step that computed a prompt chunk (and at least a
        block of tokens, so a step's fixed cost does not dominate) sets the seconds per token the
        next long chunk is sized from; steps that decode set what a prefill beside running
        streams may compute (module docstring)."""
        if seconds <= 0:
            return
        if self.max_step_slowdown:
            self._observe_streams(plan, seconds)
        tokens = plan.num_tokens
        if not self.prefill_step_target_s or tokens < self.bm.block_size:
            return
        if any(s.num_new_tokens - s.num_spec > 1 for s in plan.scheduled):
            rate = seconds / tokens
            old = self.sec_per_token
            self.sec_per_token = rate if old is None else (old + rate) / 2

    def _observe_streams(self, plan: StepPlan, seconds: float) -> None:
        """The step costs the stream cap is sized from (module docstring)."""
        prefill = sum(s.num_new_tokens for s in plan.scheduled if not _decodes(s))
        decodes = len(plan.scheduled) - sum(1 for s in plan.scheduled if not _decodes(s))
        if not decodes:
            if prefill:
                self.alone_token_s = _halfway(self.alone_token_s, seconds / prefill)
        elif not prefill:
            self.decode_step_s = _halfway(self.decode_step_s, seconds)
        elif self.decode_step_s is not None:
            # the seconds beyond a plain decode step over the prompt tokens, each averaged on
            # its own (not their ratio step by step: a step's noise over the one or two tokens
            # of a small chunk would swamp it, and only upwards once cut at zero)
            self._extra_s = _halfway(self._extra_s, seconds - self.decode_step_s)
            self._extra_tokens = _halfway(self._extra_tokens, float(prefill))
            self.stream_token_s = max(self._extra_s, 0.0) / self._extra_tokens

    def stream_prefill_cap(self) -> int:
        """The prompt tokens a step that decodes running streams may compute besides (module
        docstring): max_step_slowdown times a plain decode step over a prompt token's measured
        cost, at least one, at most twice the larger of a block and the last capped step's grant,
        and the token budget; one block until a decode step and a prompt token's cost are measured."""
        bs, budget = self.bm.block_size, self.max_num_batched_tokens
        per_token = self.stream_token_s if self.stream_token_s is not None else self.alone_token_s
        if self.decode_step_s is None or per_token is None:
            return max(1, min(bs, budget))
        want = budget if per_token <= 0 else self.max_step_slowdown * self.decode_step_s / per_token
        grown = 2 * max(self._stream_grant or 0, bs)
        return max(1, min(int(want), grown, budget))

    def _stream_cap(self) -> _Cap:
        """This step's bound on prompt tokens: stream_prefill_cap while a running sequence
        decodes and the policy is on, else none."""
        if not self.max_step_slowdown or not any(_decoding(s) for s in self.running):
            return _Cap(None)
        return _Cap(self.stream_prefill_cap())

    def long_chunk(self) -> int:
        """The tokens a long prefill computes in one step: prefill_step_target_s worth at the
        measured rate, in whole blocks, between one block and the token budget, at most twice
        the last long chunk (LONG_START_BLOCKS blocks for the first); the budget while the policy
        is off or nothing was measured yet."""
        budget = self.max_num_batched_tokens
        if not self.prefill_step_target_s or self.sec_per_token is None:
            return budget
        bs = self.bm.block_size
        n = int(self.prefill_step_target_s / self.sec_per_token) // bs * bs
        grown = LONG_START_BLOCKS * bs if self._long_grant is None else 2 * self._long_grant
        return max(min(bs, budget), min(budget, n, grown))

    def schedule(self) -> StepPlan:
        # priority order (a stable sort: admission order within equal values); the last one is
        # the first preempted (module docstring)
        self.running.sort(key=_priority)
        if self.speculator is not None:
            self.speculator.set_budgets(self.running)
        cap = self._stream_cap()
        if self.prefill_step_target_s:
            return self._schedule_long_aware(cap)
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        gate = _AdapterGate(self.max_loras)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not gate.admits(seq):
                i += 1  # another adapter's turn first: it keeps its blocks (module docstring)
                continue
            left = seq.num_tokens - seq.num_computed_tokens
            if not _decoding(seq):
                left = min(left, cap.room(budget))
                if left <= 0:
                    i += 1  # the streams' step is full: it keeps its blocks, waits a step
                    continue
            n = seq.fit_chunk(min(left, budget))
            # a decode may also check guesses (speculative decoding), if blocks and budget allow
            spec = min(seq.spec_budget, budget - n) if _spec_may(seq, n) else 0
            need = self.bm.blocks_needed(seq.num_computed_tokens + n + spec) - len(seq.block_ids)
            if spec and need > self.bm.num_free_blocks:
                spec = 0  # guesses never preempt anyone
                need = self.bm.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_ids)
            while need > self.bm.num_free_blocks and self.running[-1] is not seq:
                self._preempt(self.running[-1])
                preempted = True
            if need > self.bm.num_free_blocks:
                self._preempt(seq)
                preempted = True
                break
            if need > 0:
                seq.block_ids += self.bm.allocate(need, after=_run_end(seq.block_ids))
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n + spec, spec))
            gate.take(seq)
            budget -= n + spec
            if not _decoding(seq):
                cap.take(n)
            i += 1
        w = 0
        while (
            not preempted
            and w < len(self.waiting)
            and cap.room(budget) > 0
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[w]
            if not gate.admits(seq):
                w += 1  # deferred: the base model's prompts behind it may pass it
                continue
            room = cap.room(budget)
            cached = self._cached_for_admission(seq)
            # A sliding window admits the first chunk's blocks; the rest come as the chunks run.
            first = min(seq.num_tokens, len(cached) * self.bm.block_size + room)
            upto = seq.num_tokens if self.kv_window is None else first
            try:
                self._admit_blocks(seq, cached, upto, watermark=self.watermark_blocks)
            except NoFreeBlocks:
                break
            del self.waiting[w]
            gate.take(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = seq.fit_chunk(min(seq.num_tokens - seq.num_computed_tokens, room))
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
            cap.take(n)
        self._note_grant(cap)
        return self._finish_plan(scheduled)

    def _note_grant(self, cap: _Cap) -> None:
        """Remembers what a capped step gave the prompts (stream_prefill_cap grows from it)."""
        if cap.limit is not None and cap.used:
            self._stream_grant = cap.used

    def _finish_plan(self, scheduled: list[ScheduledSeq]) -> StepPlan:
        if self.keep_states:
            for item in scheduled:
                self._plan_keep(item)
        plan = StepPlan(
            scheduled,
            block_copies=self._pending_copies,
            state_copies=self._pending_state_copies,
        )
        self._pending_copies, self._pending_state_copies = [], []
        self.build_rows(plan)
        return plan

    def _schedule_long_aware(self, cap: _Cap) -> StepPlan:
        """schedule() under the long-prefill policy (module docstring); `cap`: the bound on
        this step's prompt tokens (prefill beside running streams)."""
        chunk = self.long_chunk()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        longs: list[Sequence] = []  # running long prefills, planned last
        preempted = False
        gate = _AdapterGate(self.max_loras)
        gated = self.max_loras is not None
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if gated:
                if not gate.admits(seq):
                    i += 1  # another adapter's turn first (module docstring)
                    continue
                gate.take(seq)  # (a long prefill planned last holds its adapter's place too)
            left = len(seq.token_ids) - seq.num_computed_tokens
            if left > chunk and self._is_long(seq, left, chunk, seq.num_cached_tokens):
                longs.append(seq)
                i += 1
                continue
            # (as _decoding: a decode computes its one last token, after some output)
            prefill = left != 1 or len(seq.token_ids) == len(seq.prompt_token_ids)
            if prefill:
                left = min(left, cap.room(budget))
                if left <= 0:
                    i += 1  # the streams' step is full: it keeps its blocks, waits a step
                    continue
            before = self.num_preemptions
            item = self._plan_running(seq, left, budget)
            preempted |= self.num_preemptions > before  # (only sequences after this one)
            if item is None:
                break
            scheduled.append(item)
            budget -= item.num_new_tokens
            if prefill:
                cap.take(item.num_new_tokens)
            i += 1
        running_longs = list(longs)
        admitted_short = False
        if not preempted:
            budget, admitted_short = self._admit_waiting(chunk, budget, scheduled, longs, gate, cap)
        # a newcomer's first step runs without the chunk of a long prefill that was already
        # running (one admitted with it runs after it), but never two steps in a row
        yielded = admitted_short and bool(running_longs) and not self._long_yielded
        self._long_yielded = yielded
        allowance = 0 if yielded or preempted else min(chunk, cap.room(budget))
        granted = 0
        for seq in longs:
            if allowance <= 0:
                break
            item = self._plan_running(seq, allowance, allowance, may_preempt=False)
            if item is None:
                continue  # no block for its next chunk now (sliding window): it waits a step
            scheduled.append(item)
            allowance -= item.num_new_tokens
            granted += item.num_new_tokens
            cap.take(item.num_new_tokens)
        if not longs:
            self._long_grant = None  # the next long prefill starts small again
        elif granted:
            self._long_grant = granted
        self._note_grant(cap)
        return self._finish_plan(scheduled)

    def _admit_waiting(
        self,
        chunk: int,
        budget: int,
        scheduled: list[ScheduledSeq],
        longs: list[Sequence],
        gate: _AdapterGate,
        cap: _Cap,
    ) -> tuple[int, bool]:
        """The waiting prompts admitted this step, first come first served within `budget` (and
        `cap`): a short one is scheduled into `scheduled`, a long one joins `longs` (only while
        no other long prefill runs; the short ones behind it pass it). Returns the budget left
        and whether a short prompt was admitted."""
        admitted_short = False
        w = 0
        while (
            w < len(self.waiting) and cap.room(budget) > 0 and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[w]
            if not gate.admits(seq):
                w += 1  # deferred (module docstring)
                continue
            room = cap.room(budget)
            cached = self._cached_for_admission(seq)
            left = seq.num_tokens - len(cached) * self.bm.block_size
            long = self._is_long(seq, left, chunk, len(cached) * self.bm.block_size)
            if long and longs:  # one long prefill at a time: the short ones behind it pass it
                w += 1
                continue
            # a sliding window admits the blocks of the first piece this prompt computes: a
            # short one's whole prompt within the budget, a long one's first chunk
            piece = min(room, chunk) if long else room
            first = min(seq.num_tokens, len(cached) * self.bm.block_size + piece)
            upto = seq.num_tokens if self.kv_window is None else first
            try:
                self._admit_blocks(seq, cached, upto, watermark=self.watermark_blocks)
            except NoFreeBlocks:
                break
            del self.waiting[w]
            gate.take(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if long:
                longs.append(seq)
                continue
            n = seq.fit_chunk(min(seq.num_tokens - seq.num_computed_tokens, room))
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
            cap.take(n)
            admitted_short = True
        return budget, admitted_short

    def _cached_for_admission(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting `seq` would start from if admitted now (restored from the
        host tier only when the admission fits, watermark kept), under its adapter's chain root;
        none where every prompt position must be computed (prompt logprobs, mean pooling)."""
        if _every_position(seq):
            return []
        cached = self.bm.find_cached_prefix(
            seq.cache_token_ids,
            seq.num_tokens - 1,
            seq.num_tokens,
            self.watermark_blocks,
            root=seq.cache_root,
        )
        return cached if self.slots is None else self._with_state(cached)

    def _with_state(self, cached: list[int]) -> list[int]:
        """A hybrid's prefix hit: the cached blocks through the last one whose state is kept
        (its recurrent layers start from that state; without one, from the prompt's start), or
        held by the host tier: copied back into a slot then, kept there again (a restore the
        tier refuses moves on to an earlier block)."""
        if not self.keep_states:
            return []
        tier = self.bm.tier
        for n in range(len(cached), 0, -1):
            block_hash = self.bm.blocks[cached[n - 1]].hash
            if block_hash in self.slots:
                return cached[:n]
            if tier is None or not tier.has_state(block_hash):
                continue
            slot = self.claim_state_slot(block_hash)
            if slot is None:
                continue
            if tier.load_state(block_hash, slot):
                return cached[:n]
            self.slots.drop(block_hash)
        return []

    def claim_state_slot(self, block_hash: int) -> int | None:
        """A slot, now keeping the state after `block_hash`, for a state its caller writes at
        once (restored from the host tier, or fetched from a peer): never one the next step's
        copies read or write (SlotPool.claim); None: no such slot."""
        busy = {s for copy in self._pending_state_copies for s in copy} | self.slots.avoid
        return self.slots.claim(block_hash, busy)

    def _save_state(self, block_hash: int, slot: int) -> None:
        """A kept state leaving its slot (SlotPool.on_push_out) goes to the host tier, if any;
        not one whose copy into that slot the next step has still to make (its bytes are not
        that state yet)."""
        if self.bm.tier is None or any(dst == slot for _, dst in self._pending_state_copies):
            return
        self.bm.save_state(block_hash, slot)

    def _is_long(self, seq: Sequence, left: int, chunk: int, cached: int) -> bool:
        """Whether `seq`, with `left` tokens to compute and `cached` leading ones served from the
        prefix cache at its admission, is a long prefill: what it computes is longer than the
        token budget (it takes several steps anyway) and more is left than one long chunk. A
        prompt whose uncached part fits the budget runs whole, as without the policy (a
        conversation's next turn over its cached earlier turns among them)."""
        return seq.num_tokens - cached > self.max_num_batched_tokens and left > chunk

    def _plan_running(
        self, seq: Sequence, limit: int, budget: int, may_preempt: bool = True
    ) -> ScheduledSeq | None:
        """The next piece of running `seq` (at most `limit` tokens of its own, plus guesses
        within `budget`), its blocks allocated; preempts sequences after it in `running` (and
        then itself) when the blocks run out, returning None once it is preempted itself. With
        may_preempt=False nobody is preempted: None when the blocks are not there."""
        computed = seq.num_computed_tokens
        n = seq.fit_chunk(min(len(seq.token_ids) - computed, limit, budget))
        spec = min(seq.spec_budget, budget - n) if seq.spec_budget and _spec_may(seq, n) else 0
        need = -(-(computed + n + spec) // self.bm.block_size) - len(seq.block_ids)
        if need <= 0:  # its blocks hold the piece (most decodes): nothing to allocate or preempt
            return ScheduledSeq(seq, computed, n + spec, spec)
        if spec and need > self.bm.num_free_blocks:
            spec = 0  # guesses never preempt anyone
            need = self.bm.blocks_needed(computed + n) - len(seq.block_ids)
        if need > self.bm.num_free_blocks and not may_preempt:
            return None
        while need > self.bm.num_free_blocks and self.running[-1] is not seq:
            self._preempt(self.running[-1])
        if need > self.bm.num_free_blocks:
            self._preempt(seq)
            return None
        if need > 0:
            seq.block_ids += self.bm.allocate(need, after=_run_end(seq.block_ids))
        return ScheduledSeq(seq, seq.num_computed_tokens, n + spec, spec)

    def build_rows(self, plan: StepPlan) -> None:
        """The plan's sampling rows: one per sampling sequence (and per n>1 child taking its first
        token), or, for a sequence checking guesses, one per position it samples at
        (engine/spec/verify.py)."""
        plan.rows, plan.row_seqs, plan.row_logits = rows, row_seqs, row_logits = [], [], []
        eos = self.eos_token_ids
        logits_row = 0
        for item in plan.scheduled:
            seq = item.seq
            # (item.samples, inlined: this runs for every row every step)
            if seq.pooling is not None or (
                item.start + item.num_new_tokens - item.num_spec != len(seq.token_ids)
            ):
                continue  # (a pooling request samples nothing)
            if item.num_spec:
                checks = check_rows(item, eos)
                rows += checks
                row_seqs += [seq] * len(checks)
                row_logits += range(logits_row, logits_row + len(checks))
                logits_row += len(checks)
                continue
            if len(seq.token_ids) != len(seq.prompt_token_ids):  # (most rows: a running decode)
                family = (seq,)
            else:  # its first token: its forks' too
                family = (seq, *self.fork_children.get(seq.seq_id, ()))
            for member in family:
                prompt, tokens = member.prompt_token_ids, member.token_ids
                rows.append(
                    SamplingRow(
                        member.params,
                        prompt,
                        OutputTail(tokens, len(prompt)),
                        member.generator,
                        eos,
                        member.thinking,
                        len(tokens) - len(prompt),
                    )
                )
                row_seqs.append(member)
                row_logits.append(logits_row)
            logits_row += 1

    def _admit_blocks(
        self, seq: Sequence, cached: list[int], num_tokens: int, watermark: int, remote=False
    ):
        """Blocks for the first `num_tokens` tokens: the prefix-cache hits `cached` and new ones.
        Hits that lie wholly before a sliding window are not taken: the null block stands in.
        remote: a reservation, whose KV and state another engine computes (a hybrid's state
        arrives whole, whatever KV this one had cached)."""
        skip = skipped_blocks(len(cached) * self.bm.block_size, self.kv_window, self.bm.block_size)
        live = cached[skip:]
        revived = sum(1 for b in live if self.bm.ref_count(b) == 0)
        need = self.bm.blocks_needed(num_tokens) - len(cached)
        if need + revived + watermark > self.bm.num_free_blocks:
            raise NoFreeBlocks(f"need {need + revived} KV blocks, {self.bm.num_free_blocks} free")
        # a hybrid's hit starts from a kept state (now the most recently used: the last kept
        # state a take evicts, so the sequence takes its slot over, as it is, only where that is
        # the one free slot left); else the state is copied in before the step's resets
        source = None
        if cached and self.keep_states and not remote:
            source = self.slots.kept(self.bm.blocks[cached[-1]].hash)
        if self.slots is not None and seq.state_slot < 0:
            if not self.slots.num_free:
                raise NoFreeBlocks(f"all {self.slots.num_slots} recurrent-state slots are held")
            seq.state_slot = self.slots.take()
        if source is not None and seq.state_slot != source:
            self._pending_state_copies.append((source, seq.state_slot))
        self.bm.take(live)
        self.bm.count_hits(cached)  # prefix hits by source (device, or restored from host)
        seq.block_ids = (
            [self.bm.null_block] * skip + live + self.bm.allocate(need, after=_run_end(live))
        )
        seq.num_hashed_blocks = len(cached)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.bm.block_size

    def _plan_keep(self, item: ScheduledSeq) -> None:
        """A hybrid's prompt chunk that passes the prompt's last block boundary (the state a
        resubmitted prompt starts from: its hit ends there) keeps the state at that boundary,
        mid-chunk: the layers copy it into a spare slot after that many tokens
        (AttentionMetadata.state_spans), which update registers (`_keep_states`). A chunk that
        ends at the boundary keeps it after the step instead (`_keep_state`)."""
        seq, size = item.seq, self.bm.block_size
        boundary = (seq.num_prompt_tokens - 1) // size * size
        if not item.start < boundary < item.end or seq.state_slot < 0 or seq.pooling:
            return
        slot = self.slots.spare()
        if slot is not None:
            item.keep_at, item.keep_slot = boundary - item.start, slot

    def plan_rollbacks(self, plan: StepPlan) -> None:
        """A hybrid's sequences that check guesses (called once the guesses are made:
        engine/spec/speculator.py propose): a recurrent state cannot take back a rejected guess
        (the layers fold every token of the step into it), so the step first copies each such
        state into a spare slot. When every guess is kept the copy is dropped; else the
        sequence takes the copy as its state and computes again, in its next step, the tokens
        it kept (`_settle_rollback`): their KV is rewritten with the same values, and the state
        passes through them alone. No spare slot: no guesses this step."""
        if self.slots is None:
            return
        for item in plan.scheduled:
            if not item.num_spec:
                continue
            try:
                slot = self.slots.take()
            except NoFreeSlots:
                item.drop_guesses(0)
                continue
            item.rollback_slot = slot
            plan.state_copies.append((item.seq.state_slot, slot))

    def _settle_rollback(self, seq: Sequence, item: ScheduledSeq, end: int) -> int:
        """After a hybrid's step that checked guesses: the computed count it keeps (`end`, every
        guess kept; else the step's start, its state back to what it was then)."""
        slot, item.rollback_slot = item.rollback_slot, -1
        if item.accepted == item.num_spec:
            self.slots.give_back(slot)
            return end
        self.slots.give_back(seq.state_slot)
        seq.state_slot = slot
        return item.start

    def _keep_states(self, seq: Sequence, item: ScheduledSeq, end: int) -> None:
        """After a step that computed `seq` through `end`: the state it kept mid-chunk,
        registered under its block's hash (or its slot given back: the block was not hashed, or
        the cache keeps that state already), and its state at `end` where that is a block
        boundary the cache keeps (`_keep_state`)."""
        if item.keep_slot >= 0:
            slot, item.keep_slot = item.keep_slot, -1
            block_hash = self._block_hash(seq, item.start + item.keep_at)
            if block_hash is None or not self.slots.settle(block_hash, slot):
                self.slots.give_back(slot)
        if end % self.bm.block_size == 0 and end > item.start:
            self._keep_state(seq, end)

    def _release_keep(self, item: ScheduledSeq) -> None:
        """The slots of a state kept mid-chunk and of a state copied before guesses, for a
        sequence aborted while the step ran."""
        if item.keep_slot >= 0:
            self.slots.give_back(item.keep_slot)
            item.keep_slot = -1
        if item.rollback_slot >= 0:
            self.slots.give_back(item.rollback_slot)
            item.rollback_slot = -1

    def _block_hash(self, seq: Sequence, end: int) -> int | None:
        """The chain hash of `seq`'s block that ends at `end` (a block boundary), or None where
        that block is not hashed."""
        blocks = end // self.bm.block_size
        if blocks < 1 or seq.num_hashed_blocks < blocks:
            return None
        return self.bm.blocks[seq.block_ids[blocks - 1]].hash

    def _keep_state(self, seq: Sequence, end: int) -> None:
        """`seq`'s computed tokens just reached `end`, a block boundary: the cache keeps its
        state there when that is the prompt's last boundary or past the prompt (a
        conversation's next turn continues from there), then dropping the one it kept past the
        prompt before; a boundary inside the prompt keeps nothing."""
        size = self.bm.block_size
        last_in_prompt = (seq.num_prompt_tokens - 1) // size * size
        if end < last_in_prompt:
            return
        block_hash = self._block_hash(seq, end)
        if block_hash is None:
            return
        if end > last_in_prompt:
            if seq.snapshot_hash is not None and seq.snapshot_hash != block_hash:
                self.slots.drop(seq.snapshot_hash)
            seq.snapshot_hash = block_hash
        slot = self.slots.keep(block_hash)
        if slot is not None:  # (copied as the next step starts, before its forward)
            self._pending_state_copies.append((seq.state_slot, slot))

    def _give_back_slot(self, seq: Sequence) -> None:
        if self.slots is not None and seq.state_slot >= 0:
            self.slots.give_back(seq.state_slot)
            seq.state_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it is recomputed (prefix cache helps) when readmitted."""
        self.running.remove(seq)
        self.bm.free(seq.block_ids)
        seq.block_ids = []
        self._give_back_slot(seq)  # (its state starts over with the recomputation)
        seq.num_computed_tokens = seq.num_hashed_blocks = seq.draft_computed = 0
        seq.status = SeqStatus.WAITING
        seq.pooled = None  # a "mean" sum starts over with the recomputation
        self._requeue(seq)
        self.num_preemptions += 1

    # ---- applying a step's results --------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepOutput) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, finish what stops; returns each touched
        sequence once per token it received, in order.

        A sequence that checked guesses keeps the longest prefix of them its samples agree with
        and the sample after it (at least one token, as without speculation); the KV computed for
        the guesses after that is dropped: the computed count covers the kept tokens only, and
        blocks that hold nothing else go back to the pool (engine/spec/verify.py: the rule)."""
        first_row: dict[int, int] | None = None  # seq_id -> its first row, where guesses need it
        # seq_id -> (token, row of its logprob) to append, in order: the kept guesses, then the
        # sample at the first position not kept
        emitted: dict[int, list[tuple[int, int]]] = {}
        pooled: list[Sequence] = []  # pooling requests this step finished
        block_size = self.bm.block_size
        running = SeqStatus.RUNNING  # (read for every row: an enum member's lookup is not free)
        for i, item in enumerate(plan.scheduled):
            seq = item.seq
            if seq.status != running:  # aborted while the step ran
                self._release_keep(item)
                continue
            if seq.pooling is not None and self._pool(item, result.pooled.get(i)):
                pooled.append(seq)
                continue
            end = item.end
            if item.num_spec:
                if first_row is None:
                    first_row = {}
                    for row, s in enumerate(plan.row_seqs):
                        first_row.setdefault(s.seq_id, row)
                emitted[seq.seq_id] = kept_tokens(item, result.token_ids, first_row[seq.seq_id])
                end = item.end - item.num_spec + item.accepted
            if item.rollback_slot >= 0:
                end = self._settle_rollback(seq, item, end)
            seq.num_computed_tokens = end
            if end // block_size > seq.num_hashed_blocks:  # a block filled: it is hashed
                seq.num_hashed_blocks = self.bm.register_full_blocks(
                    seq.block_ids, seq.cache_token_ids, seq.num_hashed_blocks, end, seq.cache_root
                )
            if self.keep_states:
                self._keep_states(seq, item, end)
            if self.kv_window is not None:
                release_skipped(self.bm, seq, self.kv_window)
        # fork before appending any token, so a parent that stops on its first token
        # cannot take its not-yet-forked children down with it
        receives = [seq.status == running for seq in plan.row_seqs]
        if self.fork_children:
            parents = {s.request_id: s for s in plan.row_seqs if s.index == 0}
            for row, seq in enumerate(plan.row_seqs):
                if seq.status == SeqStatus.FORK_PENDING:
                    receives[row] = self._fork(parents[seq.request_id], seq)
        touched = []
        tokens, logprobs = result.token_ids, result.logprobs
        if not emitted:  # (no sequence checked guesses: a token a row)
            append = self._append_token
            for row, seq in enumerate(plan.row_seqs):
                if receives[row]:
                    append(seq, tokens[row], None if logprobs is None else logprobs[row])
                    touched.append(seq)
            return touched + pooled
        for row, seq in enumerate(plan.row_seqs):
            kept = emitted.get(seq.seq_id)
            if kept is not None:  # a sequence that checked guesses: all its tokens at its first row
                if row != kept[0][1]:
                    continue
                for token, r in kept:
                    if seq.status != running:
                        break  # a stop: what follows it is not output
                    logprob = result.logprobs[r] if result.logprobs is not None else None
                    self._append_token(seq, token, logprob)
                    touched.append(seq)
                keep = self.bm.blocks_needed(seq.num_tokens)
                if seq.status == running and len(seq.block_ids) > keep:
                    self.bm.free(seq.block_ids[keep:])  # they held only rejected guesses
                    del seq.block_ids[keep:]
            elif receives[row]:
                logprob = result.logprobs[row] if result.logprobs is not None else None
                self._append_token(seq, result.token_ids[row], logprob)
                touched.append(seq)
        return touched + pooled

    def _pool(self, item: ScheduledSeq, vector) -> bool:
        """A pooling request's step: adds this chunk's hidden states (`vector`: the runner's, the
        last token's or the chunk's sum); at its last token it finishes with the pooled vector
        (normalised when asked). Returns whether it finished."""
        seq = item.seq
        if vector is not None:
            seq.pooled = vector if seq.pooled is None else seq.pooled + vector
        if not item.samples:
            return False  # a chunk before the last: computed counts as any prefill's
        seq.num_computed_tokens = item.end
        # under the request's own cache root, as every prefill's: an adapter's blocks are not
        # the base model's
        seq.num_hashed_blocks = self.bm.register_full_blocks(
            seq.block_ids,
            seq.cache_token_ids,
            seq.num_hashed_blocks,
            seq.num_computed_tokens,
            seq.cache_root,
        )
        out = seq.pooled
        if out is not None and seq.pooling.pooling == "mean":
            out = out / seq.num_prompt_tokens
        if out is not None and seq.pooling.normalize and seq.pooling.pooling != "classify":
            out = torch.nn.functional.normalize(out, dim=-1)
        seq.pooled = out
        self.finish(seq, FinishReason.POOLED)
        return True

    def _fork(self, parent: Sequence, child: Sequence) -> bool:
        self.fork_children.get(parent.seq_id, []).remove(child)
        if not self.fork_children.get(parent.seq_id):
            self.fork_children.pop(parent.seq_id, None)
        if parent.status != SeqStatus.RUNNING:
            return False
        if child.prefill_only:  # it only takes its first token and finishes: no KV of its own
            return True
        if self.slots is not None and not self.slots.num_free:
            child.status = SeqStatus.WAITING  # no slot for its state: recomputed later
            self._enqueue(child)
            return True
        bs = self.bm.block_size
        num_full = parent.num_computed_tokens // bs
        shared = parent.block_ids[:num_full]
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_hashed_blocks = min(parent.num_hashed_blocks, num_full)
        if parent.num_computed_tokens % bs and self.bm.num_free_blocks > 0:
            self.bm.take(shared)
            (copy,) = self.bm.allocate(1)
            self._pending_copies.append((parent.block_ids[num_full], copy))
            child.block_ids = shared + [copy]
        elif parent.num_computed_tokens % bs == 0:
            self.bm.take(shared)
            child.block_ids = list(shared)
        else:  # no block for the copy: recompute the child later instead
            child.num_computed_tokens = child.num_hashed_blocks = 0
            child.status = SeqStatus.WAITING
            self._enqueue(child)
            return True
        if self.slots is not None:  # its state starts as a copy of its parent's
            child.state_slot = self.slots.take()
            self._pending_state_copies.append((parent.state_slot, child.state_slot))
        child.status = SeqStatus.RUNNING
        self.running.append(child)
        return True

    def _append_token(self, seq: Sequence, token_id: int, logprob: float | None) -> None:
        tokens = seq.token_ids
        tokens.append(token_id)
        if logprob is not None:
            seq.logprobs.append(logprob)
        p = seq.params
        num_out = len(tokens) - len(seq.prompt_token_ids)
        if seq.prefill_only:
            self.finish(seq, FinishReason.PREFILL_DONE)
        elif seq.grammar is not None and seq.grammar.accept(token_id):  # complete (or broken)
            self.finish(
                seq,
                FinishReason.STOP,
                "grammar rejected the token" if seq.grammar.rejected else None,
            )
        elif num_out >= p.min_tokens and not p.ignore_eos and token_id in self.eos_token_ids:
            # an end-of-sequence id only generation_config.json lists is the stop reason, as
            # vLLM counts those among a request's stop token ids
            reason = token_id if token_id in self.stop_eos_token_ids else None
            self.finish(seq, FinishReason.STOP, reason)
        elif num_out >= p.min_tokens and token_id in p.stop_token_ids:
            self.finish(seq, FinishReason.STOP, token_id)
        elif num_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish(seq, FinishReason.LENGTH)
        elif (
            p.detects_repetition
            and num_out >= p.min_tokens
            and p.repetition_detected(seq.token_ids, num_out)
        ):
            self.finish(seq, FinishReason.REPETITION, "repetition_detected")


class _AdapterGate:
    """One step's LoRA adapters, at most `max_loras` distinct ones (module docstring; None: no
    bound). `admits` says whether a sequence may run in the step, in planning order; once it
    refuses one, it refuses every adapter sequence after it (first come first served); `take`
    records the adapter of a sequence planned into the step."""

    def __init__(self, max_loras: int | None):
        self.max_loras = max_loras
        self.ids: set[int] = set()
        self.deferred = False

    def admits(self, seq: Sequence) -> bool:
        lora_id = seq.lora_id
        if not lora_id or self.max_loras is None:
            return True
        if not self.deferred and (lora_id in self.ids or len(self.ids) < self.max_loras):
            return True
        self.deferred = True
        return False

    def take(self, seq: Sequence) -> None:
        if seq.lora_id and self.max_loras is not None:
            self.ids.add(seq.lora_id)


class _Cap:
    """One step's bound on the prompt tokens it computes beside running streams (module
    docstring: prefill beside running streams); limit None: no bound but the token budget."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.used = 0

    def room(self, budget: int) -> int:
        """The prompt tokens the step may still take, with `budget` tokens left in it."""
        return budget if self.limit is None else min(budget, self.limit - self.used)

    def take(self, n: int) -> None:
        self.used += n


def _priority(seq: Sequence) -> int:
    return seq.priority


def _decoding(seq: Sequence) -> bool:
    """Whether running `seq` decodes: its prompt (and any recomputation) done, one token of its
    own left to compute (guesses aside)."""
    return seq.num_output_tokens > 0 and seq.num_tokens - seq.num_computed_tokens == 1


def _decodes(item: ScheduledSeq) -> bool:
    """Whether a planned piece is a decode (as _decoding, seen from the plan before update)."""
    return item.num_new_tokens - item.num_spec == 1 and _decoding(item.seq)


def _spec_may(seq: Sequence, n: int) -> bool:
    """Whether a piece of `n` tokens of `seq` may check guesses: its last token, not pooling."""
    return n == 1 == seq.num_tokens - seq.num_computed_tokens and seq.pooling is None


def _halfway(old: float | None, new: float) -> float:
    """An average in which each new measurement weighs half."""
    return new if old is None else (old + new) / 2


def _every_position(seq: Sequence) -> bool:
    """Whether `seq` needs every prompt position computed (no prefix-cache hit): prompt logprobs,
    or mean pooling."""
    return seq.params.prompt_logprobs is not None or (
        seq.pooling is not None and seq.pooling.pooling == "mean"
    )


def _run_end(block_ids: list[int]) -> int | None:
    """The block a sequence's next blocks should follow in memory (BlockManager.allocate's
    `after`): the last of those it holds."""
    return block_ids[-1] if block_ids else None
