"""Decode bursts: all-greedy decode steps run ahead on the device, handed out one step at a time.

On CUDA the host's work between two decode steps (applying the token, planning the next step,
building its inputs) leaves the GPU idle. Where a step needs nothing from the host between tokens
(every row plain greedy, sampler.plain_greedy; nothing waiting to be scheduled; no guesses to
check, as a graph step has none; every row's blocks already hold the burst's positions), `Bursts.run` replays up to
EngineConfig.decode_burst decode graphs back to back (DecodeGraphs.run_burst) and returns the first
step's tokens. The scheduler still plans every step as usual: `Bursts.take` hands out the next
step's tokens only when that step is exactly the one the burst ran ahead for (the same rows at the
next positions, fed the burst's own tokens, on the same blocks); any other step (a stop, EOS or
max_tokens, an arrival, a sampled row, guesses to check) drops the rest, and the KV it wrote past that point lies in
blocks the sequences already held, which later steps overwrite or free as usual.

Lifecycle: the ModelRunner makes one `Bursts` beside its DecodeGraphs; the engine core sets
`allowed` before each step. Off CUDA bursts run only when PDSERVE_DECODE_BURSTS_ON_CPU=1 (tests
drive the graphs' eager path with it).
"""

from __future__ import annotations

import os

BURSTS_ON_CPU_ENV = "PDSERVE_DECODE_BURSTS_ON_CPU"


class Bursts:
    def __init__(self, graphs, max_steps: int, block_size: int):
        self.graphs = graphs
        self.max_steps = max_steps
        self.block_size = block_size
        # set by the engine core before each step: nothing waits to be scheduled
        self.allowed = False
        self._rows: list[tuple[int, tuple[int, ...]]] = []  # each row's start and blocks
        self._tokens: list[list[int]] = []  # [step][row], from the burst's first step
        self._next = 0

    @property
    def enabled(self) -> bool:
        on_device = self.graphs.capture or os.environ.get(BURSTS_ON_CPU_ENV) == "1"
        return self.max_steps > 1 and on_device

    def clear(self) -> None:
        self._tokens, self._rows, self._next = [], [], 0

    def take(self, seqs) -> list[int] | None:
        """This step's tokens from the burst run ahead, when the step is the very one it ran
        ahead for; otherwise None, and the rest of the burst is dropped."""
        j = self._next
        if not 0 < j < len(self._tokens) or len(seqs) != len(self._rows):
            self.clear()
            return None
        fed = self._tokens[j - 1]
        for i, s in enumerate(seqs):
            start, blocks = self._rows[i]
            same_blocks = tuple(s.block_ids[: len(blocks)]) == blocks
            if s.start != start + j or list(s.token_ids) != [fed[i]] or not same_blocks:
                self.clear()
                return None
        self._next += 1
        return self._tokens[j]

    def run(self, seqs, rows) -> list[int] | None:
        """The first step's tokens of a burst over these plain-greedy decode rows, or None where
        no burst of two steps or more applies."""
        self.clear()
        steps = self._steps(seqs, rows)
        key = self.graphs.burst_key(seqs, steps) if steps > 1 else None
        if key is None:
            return None
        self._tokens = self.graphs.run_burst(seqs, key, steps)
        bs = self.block_size
        self._rows = [(s.start, tuple(s.block_ids[: -(-(s.start + steps) // bs)])) for s in seqs]
        self._next = 1
        return self._tokens[0]

    def _steps(self, seqs, rows) -> int:
        """How many steps a burst may take: at most max_steps, within every row's blocks, and no
        more than the fewest tokens any row may still produce (max_tokens)."""
        if not (self.allowed and self.enabled):
            return 1
        steps = self.max_steps
        for s, r in zip(seqs, rows):
            steps = min(steps, len(s.block_ids) * self.block_size - s.start)
            if r.params.max_tokens is not None:
                steps = min(steps, r.params.max_tokens - len(r.output_token_ids))
        return steps
