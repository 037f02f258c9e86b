"""Checking guesses: the sampling rows a checking sequence gets, and which guesses it keeps.

The scheduler plans a checking sequence as its one new token plus k guesses and samples at each
of the k + 1 positions. `check_rows` builds those positions' sampling rows, each seeing the
guesses before it as output so far, so penalties, min_tokens and bad words apply as they would
without speculation; the rows of one sequence are consecutive, so a seeded generator draws its
positions' noise in order. After the step, `kept_tokens` applies the acceptance rule: the
leading guesses equal to the target's sample at their position, then the sample at the first
position not kept (speculator.py says why this leaves every output token the target's own
sample). The scheduler appends those tokens and gives back the blocks that held only rejected
guesses. Both functions are pure: they read the plan item and write only its `accepted` count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.sampler import SamplingRow

if TYPE_CHECKING:
    from pdserve.engine.scheduler import ScheduledSeq


def accepted_prefix(samples: list[int], guesses: list[int]) -> int:
    """How many leading guesses a checking sequence keeps: those equal to the target's sample at
    their position, up to the first that is not."""
    a = 0
    while a < len(guesses) and samples[a] == guesses[a]:
        a += 1
    return a


def check_rows(item: ScheduledSeq, eos_token_ids: tuple[int, ...]) -> list[SamplingRow]:
    """One sampling row per position a checking sequence samples at (k guesses + 1)."""
    seq = item.seq
    out, p = seq.output_token_ids, seq.params
    history = p.reads_history
    rows = []
    for j in range(item.num_spec + 1):
        seen = out + item.spec_token_ids[:j] if history and j else out
        rows.append(
            SamplingRow(
                p, seq.prompt_token_ids, seen, seq.generator, eos_token_ids, seq.thinking, len(out)
            )
        )
    return rows


def kept_tokens(item: ScheduledSeq, token_ids: list[int], row: int) -> list[tuple[int, int]]:
    """(token, its sampling row) to append for a checking sequence whose rows start at `row`:
    the kept guesses, then the sample after them; sets `item.accepted`."""
    samples = token_ids[row : row + item.num_spec + 1]
    a = item.accepted = accepted_prefix(samples, item.spec_token_ids)
    tokens = item.spec_token_ids[:a] + [samples[a]]
    return list(zip(tokens, range(row, row + a + 1)))
