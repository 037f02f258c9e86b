"""How many guesses each sequence checks in the next step, so that speculation never slows a
worker down.

Checking k guesses costs k more rows in the target's forward pass (and, with a draft model, k
draft steps); it pays only while the tokens gained outweigh that. Whether they do depends on the
batch: one stream's step is bound by reading the weights, so extra rows are nearly free, while a
step of 32 streams on a CPU is bound by arithmetic and every extra row costs its share. So the
gate measures, rather than assumes:

- `StepCosts`: the wall time of a step against the rows it computed, kept as running averages in
  buckets about 40% apart, and read back by interpolation (beyond the largest row count seen, by
  extrapolating with an optimistic slope, so a batch size that has never speculated tries once
  and then knows; one choice in EXPLORE_EVERY forgets the larger steps' costs and so measures
  them again).
- acceptance: per sequence, guesses kept and guess runs cut short, shrunk toward the engine-wide
  rate (a sequence that quotes its prompt accepts far more than one that does not).

`choose` then picks, for the decoding sequences that have guesses on offer, the number k and the
set of sequences that maximize predicted tokens per second, and returns no speculation unless that
beats plain decoding by a margin. The expected tokens from k guesses accepted with probability a
each are 1 + a + ... + a^k (a run stops at the first rejection).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MARGIN = 0.03  # speculate only when predicted to be at least this much faster
PRIOR_WEIGHT = 2.0  # a sequence's own record counts against this many guesses' worth of prior
PRIOR_SLOPE = 0.1  # unseen row counts: one more row costs this fraction of an average row
DECAY = 0.9  # running averages keep this much of the old value per new sample
EXPLORE_EVERY = 50  # one choice in this many ignores what larger steps were measured to cost


class StepCosts:
    """Seconds per step against rows per step, from measured steps. A bucket's first step is
    replaced by its second (the first run of a new shape pays one-time costs: oneDNN builds its
    primitives per shape), then each bucket is a mean that turns into a running average."""

    def __init__(self) -> None:
        self._buckets: dict[int, list[float]] = {}  # bucket -> [steps seen, mean rows, seconds]
        self._points: list[tuple[float, float]] | None = None  # (rows, seconds) sorted, cached

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or seconds <= 0:
            return
        key = round(2 * math.log2(rows))
        self._points = None
        b = self._buckets.setdefault(key, [0, 0.0, 0.0])
        b[0] += 1
        w = 1.0 if b[0] <= 2 else max(1.0 / (b[0] - 1), 1 - DECAY)
        b[1] += w * (rows - b[1])
        b[2] += w * (seconds - b[2])

    @property
    def known(self) -> bool:
        return bool(self._buckets)

    def predict(self, rows: float, upto: float | None = None) -> float:
        """Seconds for a step of `rows` rows; upto: forget what was measured above that many rows
        (the gate explores now and then, so a bucket measured once in a bad moment is retried)."""
        if self._points is None:
            self._points = sorted((r, t) for _, r, t in self._buckets.values())
        points = self._points
        if upto is not None:  # (the smallest measure stays: something must anchor the guess)
            points = points[:1] + [p for p in points[1:] if p[0] <= upto * 1.2]
        if not points:
            return 0.0
        lo = None
        for r, t in points:
            if r >= rows:
                if lo is None:
                    return t * rows / r if rows < r else t  # below every measure: scale down
                r0, t0 = lo
                return t0 + (t - t0) * (rows - r0) / (r - r0)
            lo = (r, t)
        r1, t1 = points[-1]
        slope = PRIOR_SLOPE * t1 / r1
        if len(points) > 1:
            r0, t0 = points[-2]
            slope = max(slope, (t1 - t0) / (r1 - r0))
        return t1 + slope * (rows - r1)


@dataclass
class Offer:
    """A decoding sequence's chance to speculate: at most `limit` guesses (0: none on offer),
    with acceptance counts so far; with a draft model, the prompt tokens its draft must compute
    before its first guess (`catch_up`) and the tokens it may still make (`remaining`), over
    which that one-time cost is spread."""

    limit: int
    accepted: int
    rejected: int
    catch_up: int = 0
    remaining: int = 1 << 30


class SpecGate:
    def __init__(self, max_k: int, prior_acceptance: float, disable_by_batch_size: int | None):
        self.max_k = max_k
        self.disable_by_batch_size = disable_by_batch_size
        self.target = StepCosts()  # a target step (no draft work), by rows computed
        self.draft = StepCosts()  # one draft step, by rows computed
        self._accepted = prior_acceptance * 10.0  # engine-wide counts, decayed
        self._rejected = (1 - prior_acceptance) * 10.0
        self._chooses = 0

    def record(self, accepted: int, rejected: int) -> None:
        self._accepted = DECAY * self._accepted + accepted
        self._rejected = DECAY * self._rejected + rejected

    @property
    def acceptance(self) -> float:
        return self._accepted / max(1e-9, self._accepted + self._rejected)

    def seq_acceptance(self, offer: Offer) -> float:
        a = (offer.accepted + PRIOR_WEIGHT * self.acceptance) / (
            offer.accepted + offer.rejected + PRIOR_WEIGHT
        )
        return min(a, 0.99)

    def choose(self, base_rows: int, offers: list[Offer], uses_draft: bool) -> list[int]:
        """Guesses per offer (0: none) for a step that computes `base_rows` rows without them."""
        none = [0] * len(offers)
        if not offers or not self.target.known:
            return none
        if self.disable_by_batch_size is not None and base_rows > self.disable_by_batch_size:
            return none
        self._chooses += 1
        upto = base_rows if self._chooses % EXPLORE_EVERY == 0 else None
        plain = self.target.predict(base_rows)
        if plain <= 0:
            return none
        best_rate, best = base_rows / plain, none
        alphas = [self.seq_acceptance(o) for o in offers]
        order = sorted((i for i, o in enumerate(offers) if o.limit > 0), key=lambda i: -alphas[i])
        # (past every offer's limit a larger k would choose the same again)
        for k in range(1, min(self.max_k, max((o.limit for o in offers), default=0)) + 1):
            tokens, rows, chosen, extra = float(base_rows), base_rows, none[:], 0.0
            rate_k, lagging = 0.0, 0.0
            for i in order:
                ki = min(k, offers[i].limit)
                a = alphas[i]
                gain = (1 - a ** (ki + 1)) / (1 - a) - 1  # tokens beyond the one a decode makes
                n = sum(1 for c in chosen if c) + 1
                cost = self.target.predict(rows + ki, upto)
                if uses_draft:
                    # the draft's first step computes what each sequence lacks: one token, or
                    # two after a step that kept every guess (chance a^k), then k - 1 steps of
                    # one row each
                    first = n + lagging + a**ki
                    catch_up = self._catch_up(offers[i], gain)
                    cost += self._draft_step(first) + (k - 1) * self._draft_step(n)
                    cost += extra + catch_up
                if cost <= 0:
                    break
                rate = (tokens + gain) / cost
                if rate <= rate_k and rate_k > 0:
                    break  # the rest accept less: they would not pay either
                tokens, rows, rate_k = tokens + gain, rows + ki, rate
                chosen[i] = ki
                if uses_draft:
                    extra += catch_up
                    lagging += a**ki
            if rate_k > best_rate * (1 + MARGIN) and rate_k > best_rate:
                best_rate, best = rate_k, chosen
        return best

    def _catch_up(self, offer: Offer, gain: float) -> float:
        """A sequence's draft catch-up, in seconds per step of its remaining life."""
        if not offer.catch_up:
            return 0.0
        steps_left = max(1.0, offer.remaining / (1 + gain))
        return self._draft_step(offer.catch_up) / steps_left

    def _draft_step(self, rows: float) -> float:
        """One draft step of `rows` rows (the draft's steps are measured by rows computed)."""
        if self.draft.known:
            return self.draft.predict(rows)
        # no draft step measured yet: assume it costs a tenth of a target step
        return 0.1 * self.target.predict(rows)
