"""The decode graphs' host-side inputs (engine/cuda_graphs.py step_rows, burst_rows) against
the row-by-row lists they replaced, on random sequences: the same numbers in the same places."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from pdserve.engine.cuda_graphs import burst_rows, step_rows

SPARE = 999 * 16


def _seqs(rng: random.Random, n: int, bs: int, ahead: int):
    """n decode rows, each with the blocks its position (and `ahead` more steps) needs, and
    sometimes a few more after them, as a sequence's block list can hold."""
    seqs = []
    for _ in range(n):
        start = rng.randrange(0, 200)
        held = -(-(start + ahead) // bs) + rng.choice((0, 0, 1, 3))
        seqs.append(
            SimpleNamespace(
                start=start,
                token_ids=[rng.randrange(50_000)],
                block_ids=rng.sample(range(1, 900), held),
            )
        )
    return seqs


def _step_lists(seqs, b, w, bs, spare):
    rows = []
    for s in seqs:
        pos = s.start
        used = -(-(pos + 1) // bs)
        slot = s.block_ids[pos // bs] * bs + pos % bs
        rows.append([s.token_ids[0], pos, slot, pos + 1, *s.block_ids[:used]] + [0] * (w - used))
    return rows + [[0, 0, spare, 1] + [0] * w] * (b - len(seqs))


def _burst_lists(seqs, b, w, steps, bs, spare):
    head, per_step = [], [[] for _ in range(steps)]
    for s in seqs:
        used = -(-(s.start + steps) // bs)
        head += [s.token_ids[0], *s.block_ids[:used], *[0] * (w - used)]
        for j, rows in enumerate(per_step):
            pos = s.start + j
            rows += [pos, s.block_ids[pos // bs] * bs + pos % bs, pos + 1]
    head += [0] * ((1 + w) * (b - len(seqs)))
    for rows in per_step:
        rows += [0, spare, 1] * (b - len(seqs))
    return head + sum(per_step, [])


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("n,b", [(1, 1), (3, 4), (20, 24), (256, 256)])
def test_step_rows_are_the_lists(bs, n, b):
    rng = random.Random(bs * 1000 + n)
    seqs = _seqs(rng, n, bs, 1)
    w = max(-(-(s.start + 1) // bs) for s in seqs) + rng.choice((0, 2))
    got = step_rows(seqs, b, w, bs, SPARE)
    assert got.dtype == np.int64 and got.shape == (b, 4 + w)
    assert got.tolist() == _step_lists(seqs, b, w, bs, SPARE)


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("steps", [1, 2, 7])
@pytest.mark.parametrize("n,b", [(1, 2), (5, 8), (256, 256)])
def test_burst_rows_are_the_lists(bs, steps, n, b):
    rng = random.Random(bs * 100 + steps * 10 + n)
    seqs = _seqs(rng, n, bs, steps)
    w = max(-(-(s.start + steps) // bs) for s in seqs) + rng.choice((0, 1))
    head, plan = burst_rows(seqs, b, w, steps, bs, SPARE)
    assert head.shape == (b, 1 + w) and plan.shape == (steps, b, 3)
    flat = np.concatenate((head.ravel(), plan.ravel())).tolist()
    assert flat == _burst_lists(seqs, b, w, steps, bs, SPARE)
