"""CUDA graphs of decode-only steps: one launch replays every kernel of the model's forward.

A decode step of a small model on a GPU is bound by kernel launches, not by the GPU: SmolLM2's
30 layers issue several hundred small kernels per token, each a few microseconds of Python and
driver time. `DecodeGraphs` records the whole forward (embedding, layers, final norm, LM head)
once per shape and replays it, as vLLM and SGLang do for decode. Each graph also takes its rows'
argmax on the device, so an all-greedy step (`run_greedy`) copies back only the token ids: into
pinned host memory, without blocking, then one event waited for. A burst (`run_burst`) replays
up to EngineConfig.decode_burst such steps back to back: one input copy, each step's argmax
copied into the next replay's token buffer on the device, the positions, slots and context
lengths of every step precomputed (each row's blocks already hold them), one wait for all tokens.

Shapes are bucketed so a handful of graphs cover every step: the batch is padded up to the next
size in BATCH_BUCKETS and the block table's width to the next power of two. Every graph reads its
inputs from the same static buffers (token ids, positions, cache slots, block tables, context
lengths), which `run` fills before each replay. A padded row writes its K/V into a spare block at
the end of the cache that no request owns (ModelRunner allocates it when graphs are on) and
attends to one token, so it costs work but touches nothing real.

Lifecycle: the ModelRunner makes one `DecodeGraphs` at start when `applies_to` says the config
can use graphs (CUDA, one TP rank, cuda_graphs on); graphs are captured lazily on the first step
of each bucket, share one memory pool, and live as long as the runner. On CPU the same padded
forward runs eagerly, which is how the tests check the padding on any machine.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from pdserve.engine.forward_context import AttentionMetadata, forward_context
from pdserve.engine.sampler import argmax

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_WIDTH_BLOCKS = 4  # the narrowest block table a graph is recorded for
MAX_GRAPHS = 96  # beyond this many recorded shapes, further shapes run eagerly


def applies_to(device: torch.device, tp: int, enabled: bool) -> bool:
    """Whether a runner with this device and TP size records decode graphs."""
    return enabled and device.type == "cuda" and tp == 1


def batch_bucket(n: int) -> int | None:
    """The smallest bucket that holds n decodes, or None above the largest."""
    for b in BATCH_BUCKETS:
        if b >= n:
            return b
    return None


def _tables(seqs, used: np.ndarray, w: int) -> np.ndarray:
    """[len(seqs), w]: each sequence's first used[i] blocks, zero after them."""
    table = np.zeros((len(seqs), w), dtype=np.int64)
    table[np.arange(w) < used[:, None]] = np.fromiter(
        itertools.chain.from_iterable(s.block_ids[:u] for s, u in zip(seqs, used.tolist())),
        dtype=np.int64,
    )
    return table


def step_rows(seqs, b: int, w: int, bs: int, spare_slot: int) -> np.ndarray:
    """A decode step's inputs, [b, 4 + w] int64: each sequence's token, position, cache slot,
    context length and block table (w blocks wide), then b - len(seqs) padded rows (token 0 at
    position 0 into the spare slot, one token of context, no blocks). Built in numpy: the
    step's few thousand numbers cost a Python list and torch.tensor far more."""
    n = len(seqs)
    rows = np.zeros((b, 4 + w), dtype=np.int64)
    pos = np.fromiter((s.start for s in seqs), dtype=np.int64, count=n)
    table = rows[:n, 4:] = _tables(seqs, (pos + bs) // bs, w)  # (blocks up to position pos)
    rows[:n, 0] = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=n)
    rows[:n, 1] = pos
    rows[:n, 2] = table[np.arange(n), pos // bs] * bs + pos % bs
    rows[:n, 3] = pos + 1
    rows[n:, 2] = spare_slot
    rows[n:, 3] = 1
    return rows


def burst_rows(seqs, b: int, w: int, steps: int, bs: int, spare_slot: int):
    """A burst's inputs (DecodeGraphs.run_burst): [b, 1 + w], each row's first token and block
    table (padded rows zero), and [steps, b, 3], each step's position, cache slot and context
    length per row (padded rows: position 0, the spare slot, one token)."""
    n = len(seqs)
    head = np.zeros((b, 1 + w), dtype=np.int64)
    start = np.fromiter((s.start for s in seqs), dtype=np.int64, count=n)
    table = head[:n, 1:] = _tables(seqs, (start + steps + bs - 1) // bs, w)
    head[:n, 0] = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=n)
    plan = np.zeros((steps, b, 3), dtype=np.int64)
    pos = start[None, :] + np.arange(steps)[:, None]  # [steps, n]
    plan[:, :n, 0] = pos
    plan[:, :n, 1] = table[np.arange(n)[None, :], pos // bs] * bs + pos % bs
    plan[:, :n, 2] = pos + 1
    plan[:, n:, 1] = spare_slot
    plan[:, n:, 2] = 1
    return head, plan


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, spare_block: int):
        """runner: the ModelRunner (its model, kv_cache, block_size and device); max_batch: the
        most decodes one step holds (the scheduler's max_num_seqs); spare_block: the cache block
        that padded rows write into. Off CUDA the padded forward runs eagerly (tests)."""
        self.runner = runner
        self.capture = runner.device.type == "cuda"
        self.max_batch = batch_bucket(max_batch) or BATCH_BUCKETS[-1]
        bs = runner.block_size
        self.max_blocks = -(-runner.config.max_model_len // bs)
        self.spare_slot = spare_block * bs
        dev = runner.device
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), self.spare_slot, dtype=torch.long, device=dev)
        self.tables = torch.zeros(n, self.max_blocks, dtype=torch.long, device=dev)
        self.lens = torch.ones(n, dtype=torch.long, device=dev)
        self._graphs: dict[tuple[int, int], tuple] = {}  # (graph, logits, argmax)
        self._pool = None

    def width_bucket(self, blocks: int) -> int:
        w = MIN_WIDTH_BLOCKS
        while w < blocks:
            w *= 2
        return min(w, self.max_blocks)

    def shape_for(self, seqs) -> tuple[int, int] | None:
        """The (batch, width) bucket of a decode-only step's sequences, or None where the step
        does not fit one (too many rows; graphs full)."""
        b = batch_bucket(len(seqs))
        if b is None or b > self.max_batch:
            return None
        bs = self.runner.block_size
        blocks = max(-(-(s.start + 1) // bs) for s in seqs)
        key = (b, self.width_bucket(blocks))
        if key not in self._graphs and len(self._graphs) >= MAX_GRAPHS:
            return None
        return key

    def run(self, seqs, key: tuple[int, int]) -> torch.Tensor:
        """Logits [len(seqs), vocab] of one decode-only step (each seq one token)."""
        return self._step(seqs, key)[0][: len(seqs)]

    def run_greedy(self, seqs, key: tuple[int, int]) -> list[int]:
        """Each row's argmax token of one decode-only step in which every row is greedy and
        nothing changes its logits: only the token ids cross to the host."""
        return self._to_host(self._step(seqs, key)[1][: len(seqs)]).tolist()

    def _step(self, seqs, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Fills the static buffers with this step's rows and runs (or replays) the forward:
        the bucket's logits and argmax tensors, padded rows included."""
        b, w = key
        rows = step_rows(seqs, b, w, self.runner.block_size, self.spare_slot)
        # one host-to-device transfer for the step's inputs
        dev = torch.from_numpy(rows).to(self.runner.device)
        self.input_ids[:b].copy_(dev[:, 0])
        self.positions[:b].copy_(dev[:, 1])
        self.slots[:b].copy_(dev[:, 2])
        self.lens[:b].copy_(dev[:, 3])
        self.tables[:b, :w].copy_(dev[:, 4:])
        return self._launch(key)

    def _launch(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of bucket key on the static buffers as they are: replayed (recorded first
        if new) on CUDA, eager elsewhere. Returns the bucket's logits and argmax."""
        b, w = key
        if not self.capture:
            return self._forward(b, w)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._record(b, w)
        entry[0].replay()
        return entry[1], entry[2]

    def burst_key(self, seqs, steps: int) -> tuple[int, int] | None:
        """The bucket of a burst of `steps` decode steps (its block tables as wide as the last
        step needs), or None where it fits no bucket."""
        b = batch_bucket(len(seqs))
        if b is None or b > self.max_batch:
            return None
        bs = self.runner.block_size
        key = (b, self.width_bucket(max(-(-(s.start + steps) // bs) for s in seqs)))
        if key not in self._graphs and len(self._graphs) >= MAX_GRAPHS:
            return None
        return key

    def run_burst(self, seqs, key: tuple[int, int], steps: int) -> list[list[int]]:
        """Tokens [step][row] of `steps` greedy decode steps run back to back from one input
        copy: step j's input token is step j - 1's argmax, on the device. Every row's block_ids
        must already hold its positions start .. start + steps - 1 (ModelRunner checks)."""
        b, w = key
        n = len(seqs)
        rows = burst_rows(seqs, b, w, steps, self.runner.block_size, self.spare_slot)
        # one host-to-device transfer for the whole burst's inputs
        flat = torch.from_numpy(np.concatenate([r.ravel() for r in rows]))
        flat = flat.to(self.runner.device)
        first = flat[: (1 + w) * b].view(b, 1 + w)
        plan = flat[(1 + w) * b :].view(steps, b, 3)
        self.input_ids[:b].copy_(first[:, 0])
        self.tables[:b, :w].copy_(first[:, 1:])
        out = torch.empty(steps, b, dtype=torch.long, device=self.runner.device)
        for j in range(steps):
            self.positions[:b].copy_(plan[j, :, 0])
            self.slots[:b].copy_(plan[j, :, 1])
            self.lens[:b].copy_(plan[j, :, 2])
            ids = self._launch(key)[1]
            out[j].copy_(ids[:b])
            self.input_ids[:b].copy_(ids[:b])  # the next step's input, without the host
        return self._to_host(out[:, :n].contiguous()).tolist()

    def _to_host(self, ids: torch.Tensor) -> torch.Tensor:
        """ids on the host: on CUDA through pinned memory, copied without blocking, then one
        event waited for."""
        if not self.capture:
            return ids
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return host

    def _forward(self, b: int, w: int) -> torch.Tensor:
        """The model on the first b rows of the static buffers, block tables w blocks wide."""
        runner, bs = self.runner, self.runner.block_size
        lens = self.lens[:b]
        span = torch.arange(w * bs, device=lens.device)
        meta = AttentionMetadata(
            slot_mapping=self.slots[:b],
            num_decode_tokens=b,
            decode_block_tables=self.tables[:b, :w],
            decode_context_lens=lens,
            decode_mask=(span[None, :] < lens[:, None])[:, None, None, :],
            kv_cache=runner.kv_cache,
        )
        with forward_context(meta):
            hidden = runner.model(self.input_ids[:b], self.positions[:b])
        logits = runner.model.compute_logits(hidden)
        # the sampler's own argmax over the same float32 logits, so a greedy row's token does
        # not depend on where it is taken
        return logits, argmax(logits.float())

    def _record(self, b: int, w: int):
        """Captures the forward of bucket (b, w). The rows hold this step's inputs; the warm-up
        runs write the same K/V to the same slots that the replay then writes again."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(b, w)  # warm-up: lazy initialization stays out of the graph
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, ids = self._forward(b, w)
        if self._pool is None:
            self._pool = graph.pool()
        return graph, logits, ids

    @property
    def recorded(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)
