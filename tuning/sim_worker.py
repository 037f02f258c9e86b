"""One simulated replica: engine/scheduler.py's policy over token counts (no tensors), for
tuning/simulator.py, which creates one Worker per replica for each run. A step is planned
(`schedule`, which returns its duration from the profile's step model) and then applied
(`complete`), as the engine's plan -> execute -> apply.

Slow path: the scheduler's loops, sequence by sequence (chunked prefill within the token budget,
preemption of the most recently admitted sequences when blocks run out, FCFS admission above a 1%
watermark while fewer than max_num_seqs run). tests/unit/test_sim_vs_scheduler.py runs the same
traces through engine/scheduler.py (prefix caching off: not modelled here) and checks that every
step schedules the same requests with the same token counts, on both paths. Fast path: when
every step has the same shape, sequences are not touched one by one (`_enter_fast_path` says
when and how). It gives the same answers as the slow path (tests/unit/test_tuning.py checks),
much faster for big decode batches.
"""

from __future__ import annotations

import heapq
from collections import deque

from pdserve.tuning.perf_model import StepModel


class Seq:
    __slots__ = (
        "req",
        "num_tokens",
        "computed",
        "blocks",
        "prefill_only",
        "done",
        "base_step",
        "key",
    )

    def __init__(self, req, num_tokens: int, computed: int, blocks: int, prefill_only: bool):
        self.req, self.num_tokens, self.computed = req, num_tokens, computed
        self.blocks, self.prefill_only, self.done = blocks, prefill_only, False
        self.base_step = self.key = 0


def least_used(worker: Worker) -> tuple[int, int]:
    """The decode router's preference as a key for the highest-key pickers (router/pool.py
    decode_order): the fewest KV blocks in use, then the most free."""
    return worker.free - worker.num_blocks, worker.free


class Worker:
    """One replica, planned and applied step by step (see the module docstring)."""

    def __init__(
        self,
        model: StepModel,
        block_size: int,
        capacity_tokens: int,
        budget: int,
        max_seqs: int,
        is_prefill: bool,
        fast: bool = True,
    ):
        self.is_prefill, self.fast = is_prefill, fast and not is_prefill
        self.model, self.bs = model, block_size
        self.budget, self.max_seqs = budget, max_seqs
        self.num_blocks = capacity_tokens // block_size
        self.free = self.num_blocks
        self.watermark = max(1, self.num_blocks // 100)
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.joining: list[Seq] = []  # committed while a step ran: they join the next one
        self.queued_tokens = 0  # sum of num_tokens - computed over its sequences
        self.pending_blocks = 0  # blocks its waiting prompts will take
        self.router_view = self.free  # its free blocks as the router sees them (colocated)
        self.router_tokens = 0  # prompt tokens the router charged to it, until their first token
        self.busy = False
        self.calls: list = []  # (fn, request): RPCs that wait for the step in flight
        self.plan: list[tuple[Seq, int, int]] | None = None  # None: a fast-path step
        self.step_has_prompt = False  # the planned step computes prompt tokens (prefill or mixed)
        self.step_start = 0.0
        self.link_free = 0.0
        self.num_preemptions = 0
        self.speed: tuple[tuple[float, ...], int] | None = None  # (speed trace, start window)
        # fast path
        self.lazy = False
        self.step_no = 0
        self.phase_counts = [0] * block_size
        self.finishing: list = []  # heap of (last step, tiebreak, seq)
        self.num_lazy = 0
        self.lazy_context = 0  # sum of computed over the lazy sequences
        self.tiebreak = 0

    # ---- intake ---------------------------------------------------------------------------------
    def enqueue(self, seq: Seq) -> None:
        self.waiting.append(seq)
        self.queued_tokens += seq.num_tokens - seq.computed
        self.pending_blocks += (seq.num_tokens + self.bs - 1) // self.bs

    def join(self, seq: Seq) -> None:
        """A committed reservation: decodes from the next step on."""
        self.joining.append(seq)
        self.queued_tokens += seq.num_tokens - seq.computed

    # ---- fast path ------------------------------------------------------------------------------
    def _add_lazy(self, seq: Seq) -> None:
        seq.base_step = self.step_no
        seq.key = (self.step_no - seq.computed) % self.bs  # steps s with s % bs == key open a block
        self.phase_counts[seq.key] += 1
        r = seq.req
        heapq.heappush(
            self.finishing, (self.step_no + r.output - r.num_out - 1, self.tiebreak, seq)
        )
        self.tiebreak += 1
        self.num_lazy += 1
        self.lazy_context += seq.computed

    def _catch_up(self, seq: Seq) -> None:
        k = self.step_no - seq.base_step
        seq.computed += k
        seq.num_tokens = seq.computed + 1
        seq.blocks = (seq.computed + self.bs - 1) // self.bs
        seq.req.num_out += k
        seq.base_step = self.step_no

    def _leave_fast_path(self) -> None:
        for seq in self.running:
            self._catch_up(seq)
        self.lazy = False
        self.phase_counts = [0] * self.bs
        self.finishing = []
        self.num_lazy = self.lazy_context = 0

    def _enter_fast_path(self) -> bool:
        """Enters the fast path when every running sequence is decoding (one token per step after
        its first token; a prompt whose last chunk is one token is not decoding yet), nothing
        waits and the batch fits the token budget; `schedule` leaves it when that changes or a
        step's new blocks are not free. Meanwhile steps are identical in shape: counts per
        block-boundary phase give each step's new blocks, a heap gives the step at which each
        sequence finishes, and a sequence's own counters catch up (computed += steps since it
        joined) when the worker leaves the fast path."""
        bs = self.bs
        if (
            self.waiting
            or not self.running
            or len(self.running) > self.budget
            or any(
                s.num_tokens - s.computed != 1
                or s.computed == 0
                or s.req.num_out == 0
                or s.blocks != (s.computed + bs - 1) // bs
                for s in self.running
            )
        ):
            return False
        self.lazy = True
        for seq in self.running:
            self._add_lazy(seq)
        return True

    # ---- planning -------------------------------------------------------------------------------
    def schedule(self) -> float:
        """Plans the next step; returns its duration (0 when there is nothing to do)."""
        if self.joining:
            joining, self.joining = self.joining, []
            self.running += joining
            if self.lazy:
                for seq in joining:
                    self._add_lazy(seq)
        if self.lazy or (self.fast and self._enter_fast_path()):
            need = self.phase_counts[self.step_no % self.bs]
            if not self.waiting and self.num_lazy <= self.budget and need <= self.free:
                self.free -= need
                self.plan = None
                self.step_has_prompt = False
                n = self.num_lazy
                return self.model.decode_time(n, self.lazy_context + n)
            self._leave_fast_path()
        return self._schedule_slow()

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.free += seq.blocks
        seq.blocks = 0
        self.queued_tokens += seq.computed
        seq.computed = 0
        self.waiting.appendleft(seq)
        self.pending_blocks += (seq.num_tokens + self.bs - 1) // self.bs
        self.num_preemptions += 1

    def _schedule_slow(self) -> float:
        bs, budget, running = self.bs, self.budget, self.running
        plan = []
        preempted = False
        tokens = pairs = num_dec = dec_ctx = 0
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            start = seq.computed
            n = seq.num_tokens - start
            if n > budget:
                n = budget
            need = (start + n + bs - 1) // bs - seq.blocks
            if need > 0:
                while need > self.free and running[-1] is not seq:
                    self._preempt(running[-1])
                    preempted = True
                if need > self.free:
                    self._preempt(seq)
                    preempted = True
                    break
                self.free -= need
                seq.blocks += need
            plan.append((seq, start, n))
            budget -= n
            tokens += n
            if n == 1 and start > 0:
                num_dec += 1
                dec_ctx += start + 1
            else:
                pairs += n * (start + n)
            i += 1
        waiting = self.waiting
        while not preempted and waiting and budget > 0 and len(running) < self.max_seqs:
            seq = waiting[0]
            need = (seq.num_tokens + bs - 1) // bs
            if need + self.watermark > self.free:
                break
            waiting.popleft()
            self.pending_blocks -= need
            self.free -= need
            seq.blocks = need
            seq.computed = 0
            running.append(seq)
            n = min(seq.num_tokens, budget)
            plan.append((seq, 0, n))
            budget -= n
            tokens += n
            pairs += n * n
        self.plan = plan
        self.step_has_prompt = num_dec != tokens
        if not plan:
            return 0.0
        if num_dec == tokens:
            return self.model.decode_time(num_dec, dec_ctx)
        return self.model.prefill_time(tokens, pairs, dec_ctx)

    @property
    def has_plan(self) -> bool:
        return self.plan is None or bool(self.plan)

    # ---- applying a step ------------------------------------------------------------------------
    def complete(self, first: list, done: list, prefilled: list) -> int:
        """Applies the planned step: requests that got their first token, finished, or finished
        their prompt on a prefill worker go to the lists. Returns the tokens computed."""
        if self.plan is None:
            return self._complete_fast(done)
        any_done = False
        step_tokens = 0
        for seq, start, n in self.plan:
            seq.computed = start + n
            self.queued_tokens -= n
            step_tokens += n
            if seq.computed < seq.num_tokens:
                continue
            r = seq.req
            if seq.prefill_only:
                seq.done = any_done = True
                self.free += seq.blocks
                prefilled.append(r)
                continue
            seq.num_tokens += 1
            r.num_out += 1
            if r.num_out == 1:
                first.append(r)
            if r.num_out >= r.output:
                seq.done = any_done = True
                self.free += seq.blocks
                done.append(r)
            else:
                self.queued_tokens += 1
        if any_done:
            self.running = [s for s in self.running if not s.done]
        self.step_no += 1
        return step_tokens

    def _complete_fast(self, done: list) -> int:
        step = self.step_no
        n = self.num_lazy
        self.step_no += 1
        self.lazy_context += n
        fin = self.finishing
        if fin and fin[0][0] == step:
            bs = self.bs
            while fin and fin[0][0] == step:
                seq = heapq.heappop(fin)[2]
                computed = seq.computed + self.step_no - seq.base_step
                seq.computed, seq.num_tokens = computed, computed + 1
                seq.req.num_out = seq.req.output
                self.free += (computed + bs - 1) // bs
                self.phase_counts[seq.key] -= 1
                self.num_lazy -= 1
                self.lazy_context -= computed
                self.queued_tokens -= 1
                seq.done = True
                done.append(seq.req)
            self.running = [s for s in self.running if not s.done]
            if not self.running:
                self._leave_fast_path()
        return n
