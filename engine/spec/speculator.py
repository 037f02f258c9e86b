"""The Speculator: how many guesses each sequence checks, the guesses, and what a check taught.

An LLMEngine with a speculative_config owns one Speculator. Its scheduler calls `set_budgets`
as a plan starts (the gate picks how many guesses each decoding sequence may check; prompt
lookup makes its guesses here, since they cost nothing, or the request's predicted output does:
engine/spec/prediction.py); the engine step calls `propose` before
the step executes (a draft model makes its guesses now that the scheduler has given the
sequences blocks for them; seeded generators are noted; the sampling rows are rebuilt) and
`observe` after the scheduler applied the results (counts, the draft's KV position, the
generators, the gate's timings). The scheduler plans a checking sequence as 1 + k tokens and
samples at each of its positions; `Scheduler.update` keeps the guesses up to the first
disagreement plus the sample there (verify.py), and drops the KV of the rest.

Losslessness. Position j's token is sampled from the target's logits there exactly as without
speculation: the same processing (penalties and min_tokens see the guesses before j as output),
and, at temperature > 0, the same noise, because a seeded sequence's generator draws one noise
vector per position in order and is wound back to just after the positions it kept. A guess is
kept when it equals that sample. So every output token is the target's own sample, greedy or not,
and a seeded request gives the same tokens whether the gate speculated at a step or not. For a
prompt-lookup guess g this is the standard rule (keep g with probability p(g), else a sample of p
without g); a draft model samples its guesses with the same noise, so it agrees with the target
wherever the two distributions put that noise's winner on the same token. Sequences without a
seed get a private generator here, so their draft and target share noise too.

Not speculated: prefill-only requests, structured output (the grammar would have to follow the
guesses), requests with speculative=False, and sequences within a token of max_tokens or
max_model_len.
"""

from __future__ import annotations

import time

import torch

from pdserve.engine.request import SeqStatus, Sequence
from pdserve.engine.sampler import make_generator, skip_sample_draw
from pdserve.engine.scheduler import StepPlan
from pdserve.engine.spec.config import HEAD_METHODS
from pdserve.engine.spec.gate import Offer, SpecGate
from pdserve.engine.spec.ngram import History
from pdserve.engine.spec.prediction import Prediction


class _SeqSpec:
    """What the speculator keeps per sequence (Sequence.spec_state)."""

    __slots__ = ("history", "accepted", "rejected", "prediction", "from_prediction", "run")

    def __init__(self, prediction: tuple[int, ...], run: int) -> None:
        self.history = History()
        self.accepted = 0
        self.rejected = 0
        # the request's predicted output (engine/spec/prediction.py), and whether this step's
        # guesses came from it
        self.prediction = Prediction(prediction) if prediction else None
        self.from_prediction = False
        # the most guesses the next step takes from the prediction: num_speculative_tokens at
        # first and after a miss, doubled (up to num_prediction_tokens) after a run kept whole,
        # so an edited prediction wastes short runs where it diverges
        self.run = run


class Speculator:
    def __init__(self, engine):
        self.scheduler = engine.scheduler  # rebuilds a plan's sampling rows once it has guesses
        self.cfg = engine.config.speculative_config
        self.max_k = self.cfg.num_speculative_tokens  # a lookup's or a draft's guesses
        self.prediction_k = self.cfg.prediction_k  # a predicted output's (0: none read)
        self.top_k = max(self.max_k, self.prediction_k)
        self.vocab = engine.model_config.vocab_size
        self.eos = engine.model_config.eos_token_ids
        self.max_model_len = engine.config.max_model_len
        self.draft = None
        if self.cfg.method == "draft_model":
            from pdserve.engine.spec.draft import DraftModel

            self.draft = DraftModel(
                engine.config, engine.draft_dir, engine.draft_model_config, engine.runner.num_blocks
            )
        elif self.cfg.method in HEAD_METHODS:
            from pdserve.engine.spec.eagle import EagleDrafter

            self.draft = EagleDrafter(engine)
        prior = 0.7 if self.draft is not None else 0.5
        self.gate = SpecGate(self.top_k, prior, self.cfg.disable_by_batch_size)
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        # guesses kept per position; past num_speculative_tokens only a prediction's runs reach
        self.accepted_per_pos = [0] * self.max_k
        self._states: dict[int, torch.Tensor] = {}  # seq_id -> its generator state before a check
        self._t0 = 0.0
        self._draft_s = 0.0

    @property
    def mode_note(self) -> str:
        note = f"speculative decoding: {self.cfg.to_dict()}"
        if self.draft is not None:
            note += f"; draft {self.draft.mode_note}"
        return note

    def reset_counters(self) -> None:
        """Forgets what was counted (the engine's warm-up request is no user's); what the gate
        measured stays, which is what warming up is for."""
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.accepted_per_pos = [0] * self.max_k
        if self.draft is not None:
            self.draft.prefill_tokens = 0

    def stats(self) -> dict:
        return dict(
            spec_drafts=self.drafts,
            spec_draft_tokens=self.draft_tokens,
            spec_accepted_tokens=self.accepted_tokens,
            spec_accepted_per_pos=list(self.accepted_per_pos),
            spec_draft_prefill_tokens=self.draft.prefill_tokens if self.draft else 0,
        )

    def _limit(self, seq: Sequence) -> int:
        """The most guesses `seq` may check next step (0: it may not speculate)."""
        p = seq.params
        if (
            seq.status != SeqStatus.RUNNING
            or seq.num_tokens - seq.num_computed_tokens != 1
            or seq.num_output_tokens == 0
            or not p.speculative
            or seq.grammar is not None
            or seq.prefill_only
        ):
            return 0
        # the step appends up to k + 1 tokens: stay within max_tokens and max_model_len
        room = min(p.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        most = self.prediction_k if p.prediction_token_ids and self.prediction_k else self.max_k
        return max(0, min(most, room))

    def set_budgets(self, running: list[Sequence]) -> None:
        """Each running sequence's spec_budget for the plan being made (and prompt lookup's
        guesses); called by the scheduler as the plan starts, so the gate sees its batch."""
        self._t0 = time.perf_counter()
        self._draft_s = 0.0
        offers, seqs = [], []
        for seq in running:
            seq.spec_budget = 0
            seq.spec_token_ids = []
            limit = self._limit(seq)
            if not limit:
                continue
            st = seq.spec_state
            if st is None:
                st = seq.spec_state = _SeqSpec(seq.params.prediction_token_ids, self.max_k)
            if self.draft is None:
                guesses = self._guesses(seq, st, limit)
                seq.spec_token_ids = guesses
                limit = len(guesses)
            catch_up = 0 if self.draft is None else self.draft.catch_up(seq)
            left = seq.params.max_tokens - seq.num_output_tokens
            offers.append(Offer(limit, st.accepted, st.rejected, catch_up, left))
            seqs.append(seq)
        if not seqs:
            return
        ks = self.gate.choose(len(running), offers, self.draft is not None)
        for seq, k in zip(seqs, ks):
            seq.spec_budget = k
            del seq.spec_token_ids[k:]
            if k and seq.generator is None and not seq.params.greedy:
                # a private stream, so the draft and the target sample each position alike
                seed = int(torch.randint(0, 2**62, (1,)).item())
                seq.generator = make_generator(seed)

    def _guesses(self, seq: Sequence, st: _SeqSpec, limit: int) -> list[int]:
        """Prompt lookup's guesses (at most num_speculative_tokens), or the request's
        prediction's where it has some (at most its run length: _SeqSpec.run)."""
        guesses = []
        if st.prediction is not None:
            guesses = st.prediction.propose(
                seq.token_ids, seq.num_prompt_tokens, min(limit, st.run), self.cfg.prompt_lookup_min
            )
        st.from_prediction = bool(guesses)
        if not guesses:
            st.history.sync(seq.token_ids)
            guesses = st.history.propose(
                min(limit, self.max_k), self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max
            )
        return guesses

    def propose(self, plan: StepPlan) -> None:
        """The guesses of every checking sequence in `plan`, before the step executes."""
        items = [i for i in plan.scheduled if i.num_spec]
        if not items:
            return
        if self.draft is None:
            for item in items:
                item.spec_token_ids = list(item.seq.spec_token_ids[: item.num_spec])
                item.drop_guesses(len(item.spec_token_ids))
        else:
            t0 = time.perf_counter()
            self.draft.propose(items, self.eos, self.gate.draft)
            self._draft_s = time.perf_counter() - t0
        self.scheduler.plan_rollbacks(plan)  # (a hybrid's states, copied before the guesses)
        self._states = {}
        for item in plan.scheduled:
            seq = item.seq
            if item.num_spec and seq.generator is not None and not seq.params.greedy:
                self._states[seq.seq_id] = seq.generator.get_state()
        self.scheduler.build_rows(plan)

    def observe(self, plan: StepPlan, inp=None, out=None) -> list[tuple]:
        """What the executed and applied step taught: counters, the draft's KV position, each
        seeded generator wound back to just after the kept positions, the gate's timing; an
        EAGLE head then runs over what the step kept (its ModelInput `inp` and StepOutput
        `out`): returns what it ran (EagleDrafter.absorb)."""
        spec_rows = 0
        for item in plan.scheduled:
            k = item.num_spec
            if not k:
                continue
            seq, a = item.seq, item.accepted
            spec_rows += k
            self.drafts += 1
            self.draft_tokens += k
            self.accepted_tokens += a
            if a > len(self.accepted_per_pos):
                self.accepted_per_pos += [0] * (a - len(self.accepted_per_pos))
            for j in range(a):
                self.accepted_per_pos[j] += 1
            st = seq.spec_state
            rejected = int(a < k)
            st.accepted += a
            st.rejected += rejected
            if st.from_prediction:
                seq.prediction_accepted += a
                seq.prediction_rejected += k - a
                st.run = min(2 * st.run, self.prediction_k) if a == k else self.max_k
            self.gate.record(a, rejected)
            if self.draft is not None:
                # its KV holds the guesses it was fed (all but the last) up to the first rejected
                seq.draft_computed = item.start + 1 + min(a, k - 1)
            state = self._states.get(seq.seq_id)
            if state is not None and a < k and seq.status == SeqStatus.RUNNING:
                # wind the stream back to just after the positions kept (a guesses + 1)
                seq.generator.set_state(state)
                for _ in range(a + 1):
                    skip_sample_draw(seq.generator, self.vocab)
        self._states = {}
        elapsed = time.perf_counter() - self._t0 - self._draft_s
        self.gate.target.observe(plan.num_tokens, elapsed)
        if self.draft is None or out is None:
            return []
        return self.draft.absorb(plan, inp, out)
