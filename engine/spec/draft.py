"""The draft model of speculative decoding (speculative_config method "draft_model").

A DraftModel is a second ModelRunner in the engine's process: its own weights (another
checkpoint, or the target's own with quantization "int8"/"int4", loaded again and quantized),
and its own KV cache with exactly as many blocks as the target's, indexed by the same block ids.
It runs whole on the engine's first rank (one stage, one TP rank: `_ALONE`), also where the
target runs in pipeline stages or tensor parallel; the verify step goes through every stage and
rank as any step does.
So the target's block manager holds the draft's KV too: a sequence's blocks carry both models'
KV for the same positions, and preemption and finishing free both at once. kv_cache_memory is the
target's: the draft's cache comes on top of it (in bfloat16 on a CPU, where the compiled decode
kernel reads it, so a self draft adds half the target's float32 cache), so turning a draft on
never shrinks how many tokens the engine holds.

A sequence's `draft_computed` counts the leading tokens whose draft KV is in place. It starts at
0 wherever the target's KV came from somewhere else (a prefill worker's hand-off, the prefix
cache, a preemption's recompute), and the draft catches up on the decode worker itself, in
chunks of at most CATCH_UP_TOKENS a step across sequences, before it guesses for that sequence;
every such prompt token is counted (spec_draft_prefill_tokens). Why catch up here rather than
push draft KV from the prefill worker: docs/architecture.md, "Speculative decoding".

Guesses are sampled from the draft with the sequence's own sampling parameters and a copy of its
random generator, so the draft's noise for each position is the one the target will sample that
position with (engine/spec/speculator.py says why that keeps outputs unchanged and acceptance high).
"""

from __future__ import annotations

import json
import os
import time

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.model_runner import ModelInput, SeqInput
from pdserve.engine.parallel import TPState, tp_scope
from pdserve.engine.precision import start_runner
from pdserve.engine.sampler import SamplingRow
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec.config import HEAD_METHODS

# draft prompt tokens computed per step, across sequences: a catch-up step stalls every stream on
# the worker, and its cost grows with its tokens about linearly, so small chunks bound the stall
# at no cost in total
CATCH_UP_TOKENS = 64
_GREEDY = SamplingParams(temperature=0.0)
# the draft runs whole on the engine's first rank (one stage, one TP rank), also when the target
# runs in pipeline stages: the draft is small, and the first rank is the one that guesses
_ALONE = TPState()


def load_draft_config(config: EngineConfig, target: ModelConfig, target_dir: str):
    """(the draft's directory, its ModelConfig), checked against the target's; ValueError says
    what does not fit."""
    from transformers import AutoConfig

    from pdserve.engine.loader import resolve_model

    spec = config.speculative_config
    if target.kv_window is not None:
        raise ValueError(
            "speculative_config method 'draft_model' is not available for a model whose every "
            "layer slides (its blocks leave the window); use method 'ngram'"
        )
    draft_dir = target_dir if spec.model == "self" else str(resolve_model(spec.model))
    with open(os.path.join(draft_dir, "config.json")) as f:
        raw = json.load(f)
    if raw.get("speculators_model_type") or any(
        "Eagle" in a for a in raw.get("architectures") or []
    ):
        raise ValueError(
            f"speculative_config.model {spec.model!r} is an EAGLE head, not a model: give "
            "method 'eagle3' (or 'eagle' for an EAGLE-1 head)"
        )
    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(draft_dir))
    if mc.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({mc.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size}): a draft must share the target's tokenizer"
        )
    if mc.kv_window is not None:
        raise ValueError("a draft model whose every layer slides is not supported")
    if mc.recurrent_layers:
        raise ValueError(
            "a draft model with recurrent layers (a hybrid) is not supported: pick a draft of "
            "attention layers, or method 'ngram'"
        )
    return draft_dir, mc


def plan_draft(config: EngineConfig, target: ModelConfig, target_dir: str):
    """(config, draft_dir, draft ModelConfig): for a draft_model, EAGLE or MTP
    speculative_config, the draft's (the head's) checked place and shape; else two Nones. The
    config comes back unchanged."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return config, None, None
    if spec.method in HEAD_METHODS:
        from pdserve.engine.spec.eagle import load_head_config

        draft_dir, mc = load_head_config(config, target, target_dir)
    else:
        draft_dir, mc = load_draft_config(config, target, target_dir)
    return config, draft_dir, mc


def _block_bytes(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return mc.kv_bytes_per_token(dtype) * block_size


def draft_dtype(config: EngineConfig) -> str:
    spec = config.speculative_config
    return config.dtype if spec.dtype == "auto" else spec.dtype


def _dtype(name: str) -> torch.dtype:
    from pdserve.engine.config import _DTYPES

    return _DTYPES[name]


class DraftModel:
    def __init__(self, config: EngineConfig, draft_dir: str, mc: ModelConfig, num_blocks: int):
        spec = config.speculative_config
        dtype = draft_dtype(config)
        # guesses need no more: half the bytes where the decode kernel reads bf16 (a CPU)
        kv_dtype = "bfloat16" if config.device == "cpu" and dtype == "float32" else dtype
        self.config = EngineConfig(
            model=draft_dir,
            dtype=dtype,
            quantization=spec.quantization,
            device=config.device,
            kv_cache_dtype=kv_dtype,
            kv_cache_memory=num_blocks * _block_bytes(mc, config.block_size, _dtype(kv_dtype)),
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=min(config.max_model_len, mc.max_position_embeddings),
            seed=config.seed,
            cuda_graphs=False,
        ).resolve(mc)
        if self.config.max_model_len < config.max_model_len:
            raise ValueError(
                f"the draft model reaches {mc.max_position_embeddings} positions, fewer than "
                f"max_model_len={config.max_model_len}: lower max_model_len or pick another draft"
            )
        with tp_scope(_ALONE):  # the whole draft on this rank, whatever the target's layout
            self.runner = start_runner(self.config, mc, draft_dir)
        if self.runner.num_blocks != num_blocks:  # the same block ids must index both caches
            raise RuntimeError(
                f"draft KV cache has {self.runner.num_blocks} blocks, the target {num_blocks}"
            )
        self.mode_note = self.runner.mode_note
        self.prefill_tokens = 0  # prompt tokens computed to catch up (spec_draft_prefill_tokens)

    def catch_up(self, seq) -> int:
        """The prompt tokens the draft must compute before it can guess for `seq` (the gate
        charges them)."""
        return max(0, seq.num_tokens - seq.draft_computed - 2)

    def absorb(self, plan, inp, out) -> list[tuple]:
        """(A draft model learns nothing from the target's step: an EAGLE head does.)"""
        return []

    def propose(self, items, eos_token_ids, costs) -> None:
        """Fills each scheduled item's spec_token_ids with up to item.num_spec guesses (fewer:
        item.drop_guesses); `costs` (a StepCosts) learns each draft step's time."""
        budget = CATCH_UP_TOKENS
        first, active = [], []
        for item in items:
            seq = item.seq
            todo = seq.num_tokens - seq.draft_computed
            if todo > 2:  # the draft lacks more than the usual last one or two tokens
                n = min(todo, budget)
                budget -= n
                self.prefill_tokens += max(
                    0, min(seq.draft_computed + n, seq.num_prompt_tokens) - seq.draft_computed
                )
                if n < todo:  # catching up takes more steps: no guesses for it this one
                    if n:
                        first.append((None, seq, seq.draft_computed, n))
                        seq.draft_computed += n
                    item.drop_guesses(0)
                    continue
            first.append((item, seq, seq.draft_computed, todo))
            active.append(item)
        if not first:
            return
        gens = {id(item): _copy(item.seq.generator) for item in active}
        for item in active:
            item.spec_token_ids.clear()
        # the first step: what each sequence lacks, and a guess after it
        inputs, rows, take = [], [], []
        for item, seq, start, n in first:
            # a few tokens after a context (the last guess and the token after it, when every
            # guess was kept) run as decode rows, much faster than a prompt chunk; only the last
            # row's sample is the guess, the others sample greedily and are dropped
            rows_n = n if item is not None and 1 < n <= 4 and start > 0 else 1
            inputs.append(
                SeqInput(
                    seq.token_ids[start : start + n],
                    start,
                    seq.block_ids,
                    item is not None,
                    num_logits=rows_n,
                )
            )
            if item is not None:
                rows += [SamplingRow(_GREEDY, (), (), None)] * (rows_n - 1)
                rows.append(self._row(seq, item, gens[id(item)], eos_token_ids))
                take.append(len(rows) - 1)
        self._step(inputs, rows, active, costs, take)
        for item, seq, start, n in first:
            if item is not None:
                seq.draft_computed = start + n
        # then one token a step for the sequences that want more guesses
        for j in range(1, max((i.num_spec for i in active), default=0)):
            more = [i for i in active if i.num_spec > j]
            inputs = [
                SeqInput([i.spec_token_ids[j - 1]], i.seq.num_tokens - 1 + j, i.seq.block_ids, True)
                for i in more
            ]
            rows = [self._row(i.seq, i, gens[id(i)], eos_token_ids) for i in more]
            self._step(inputs, rows, more, costs)

    def _step(self, inputs, rows, items, costs, take=None) -> None:
        """One draft forward; the sample of row take[i] (default: row i) is items[i]'s guess."""
        t0 = time.perf_counter()
        with tp_scope(_ALONE):
            tokens = self.runner.execute(
                ModelInput(inputs, []), rows, list(range(len(rows)))
            ).token_ids
        costs.observe(sum(len(i.token_ids) for i in inputs), time.perf_counter() - t0)
        for item, row in zip(items, take if take is not None else range(len(items))):
            item.spec_token_ids.append(tokens[row])

    @staticmethod
    def _row(seq, item, generator, eos_token_ids) -> SamplingRow:
        p = seq.params
        seen = committed = seq.output_token_ids
        if item.spec_token_ids and p.reads_history:
            seen = seen + item.spec_token_ids
        return SamplingRow(
            p, seq.prompt_token_ids, seen, generator, eos_token_ids, seq.thinking, len(committed)
        )


def _copy(generator: torch.Generator | None) -> torch.Generator | None:
    """A generator at the same point of the same stream (the original does not move)."""
    if generator is None:
        return None
    g = torch.Generator(device=generator.device)
    g.set_state(generator.get_state())
    return g
