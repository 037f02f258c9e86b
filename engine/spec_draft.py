"""The draft model of speculative decoding (speculative_config method "draft_model").

A DraftModel is a second ModelRunner in the engine's process: its own weights (another
checkpoint, or the target's own with quantization "int8"/"int4", loaded again and quantized),
and its own KV cache with exactly as many blocks as the target's, indexed by the same block ids.
So the target's block manager holds the draft's KV too: a sequence's blocks carry both models'
KV for the same positions, preemption and finishing free both at once, and the kv_cache_memory
budget is split between the two in proportion to their bytes per block (`target_share`).

A sequence's `draft_computed` counts the leading tokens whose draft KV is in place. It starts at
0 wherever the target's KV came from somewhere else (a prefill worker's hand-off, the prefix
cache, a preemption's recompute), and the draft catches up on the decode worker itself, in
chunks of at most CATCH_UP_TOKENS a step across sequences, before it guesses for that sequence;
every such prompt token is counted (spec_draft_prefill_tokens). Why catch up here rather than
push draft KV from the prefill worker: docs/architecture.md, "Speculative decoding".

Guesses are sampled from the draft with the sequence's own sampling parameters and a copy of its
random generator, so the draft's noise for each position is the one the target will sample that
position with (engine/spec_decode.py says why that keeps outputs unchanged and acceptance high).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.model_runner import ModelInput, ModelRunner, SeqInput
from pdserve.engine.sampler import SamplingRow

CATCH_UP_TOKENS = 256  # draft prompt tokens computed per step, across sequences


def load_draft_config(config: EngineConfig, target: ModelConfig, target_dir: str):
    """(the draft's directory, its ModelConfig), checked against the target's; ValueError says
    what does not fit."""
    from transformers import AutoConfig

    from pdserve.engine.loader import resolve_model

    spec = config.speculative_config
    if config.tensor_parallel_size > 1:
        raise ValueError(
            "speculative_config method 'draft_model' runs with tensor_parallel_size 1 only; "
            "use method 'ngram' with tensor parallelism"
        )
    if target.kv_window is not None:
        raise ValueError(
            "speculative_config method 'draft_model' is not available for a model whose every "
            "layer slides (its blocks leave the window); use method 'ngram'"
        )
    draft_dir = target_dir if spec.model == "self" else str(resolve_model(spec.model))
    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(draft_dir))
    if mc.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({mc.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size}): a draft must share the target's tokenizer"
        )
    if mc.kv_window is not None:
        raise ValueError("a draft model whose every layer slides is not supported")
    return draft_dir, mc


def plan_draft(config: EngineConfig, target: ModelConfig, target_dir: str):
    """(config, draft_dir, draft ModelConfig): for a draft_model speculative_config, the target's
    config with its share of the KV budget and the draft's checked place and shape; else the
    config unchanged and two Nones."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return config, None, None
    draft_dir, mc = load_draft_config(config, target, target_dir)
    return target_share(config, target, mc), draft_dir, mc


def _block_bytes(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return mc.kv_bytes_per_token(dtype) * block_size


def draft_dtype(config: EngineConfig) -> str:
    spec = config.speculative_config
    return config.dtype if spec.dtype == "auto" else spec.dtype


def target_share(config: EngineConfig, target: ModelConfig, draft: ModelConfig) -> EngineConfig:
    """The resolved target config with kv_cache_memory cut to the target's share, so both caches
    fit the configured budget with equal block counts."""
    t = _block_bytes(target, config.block_size, config.kv_torch_dtype)
    d = _block_bytes(draft, config.block_size, _dtype(draft_dtype(config)))
    return dataclasses.replace(config, kv_cache_memory=config.kv_cache_memory * t // (t + d))


def _dtype(name: str) -> torch.dtype:
    from pdserve.engine.config import _DTYPES

    return _DTYPES[name]


class DraftModel:
    def __init__(self, config: EngineConfig, draft_dir: str, mc: ModelConfig, num_blocks: int):
        spec = config.speculative_config
        dtype = draft_dtype(config)
        self.config = EngineConfig(
            model=draft_dir,
            dtype=dtype,
            quantization=spec.quantization,
            device=config.device,
            kv_cache_memory=num_blocks * _block_bytes(mc, config.block_size, _dtype(dtype)),
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
        self.runner = ModelRunner(self.config, mc, draft_dir)
        if self.runner.num_blocks != num_blocks:  # the same block ids must index both caches
            raise RuntimeError(
                f"draft KV cache has {self.runner.num_blocks} blocks, the target {num_blocks}"
            )
        self.mode_note = self.runner.mode_note
        self.prefill_tokens = 0  # prompt tokens computed to catch up (spec_draft_prefill_tokens)

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
        inputs, rows = [], []
        for item, seq, start, n in first:
            inputs.append(
                SeqInput(seq.token_ids[start : start + n], start, seq.block_ids, item is not None)
            )
            if item is not None:
                rows.append(self._row(seq, item, gens[id(item)], eos_token_ids))
        self._step(inputs, rows, active, costs)
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

    def _step(self, inputs, rows, items, costs) -> None:
        t0 = time.perf_counter()
        tokens, _, _ = self.runner.execute(ModelInput(inputs, []), rows, list(range(len(rows))))
        costs.observe(sum(len(i.token_ids) for i in inputs), time.perf_counter() - t0)
        for item, token in zip(items, tokens):
            item.spec_token_ids.append(token)

    @staticmethod
    def _row(seq, item, generator, eos_token_ids) -> SamplingRow:
        p = seq.params
        seen = seq.output_token_ids
        if item.spec_token_ids and (p.has_penalties or p.min_tokens > 0):
            seen = seen + item.spec_token_ids
        return SamplingRow(p, seq.prompt_token_ids, seen, generator, eos_token_ids)


def _copy(generator: torch.Generator | None) -> torch.Generator | None:
    """A generator at the same point of the same stream (the original does not move)."""
    if generator is None:
        return None
    g = torch.Generator(device=generator.device)
    g.set_state(generator.get_state())
    return g
