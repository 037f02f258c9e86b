"""Conversations on a hybrid model's prefix cache (tests/unit/test_hybrid_prefix_cache.py,
test_hybrid_host_tier.py, tests/integration/test_hybrid_host_tier_engines.py): HF's greedy tokens
and their logprobs to check a turn against, an engine shape with few recurrent-state slots and
a small KV pool, and conversations that outgrow them.

Not a test module: imported as `from helpers.hybrid_turns import ...`.
"""

from __future__ import annotations

import torch

from helpers.engine import KV, greedy

NEW = 10  # tokens each turn generates


def hf_greedy(hf, prompt: list[int], new: int) -> tuple[list[int], float]:
    """HF's greedy tokens and the sum of their logprobs (which a state a few tokens off moves,
    where the tokens of a tiny random model may not)."""
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    total = sum(
        float(torch.log_softmax(scores[0].float(), -1)[t]) for scores, t in zip(out.scores, tokens)
    )
    return tokens, total


def check_greedy(out, want) -> None:
    """An engine output (greedy, logprobs=0) against hf_greedy's."""
    tokens, total = want
    assert out.outputs[0].token_ids == tokens
    assert abs(out.outputs[0].cumulative_logprob - total) < 1e-3


def few_slots(model_dir: str, **kw) -> tuple[dict, int, int]:
    """Engine settings (with `kw`: tensor parallelism) of two or three recurrent-state slots and
    at least 26 KV blocks of 4 tokens beside them (four slots are allocated, for the start's
    probes), measured on a probe engine: (settings, slots, one slot's bytes on a rank)."""
    from pdserve.engine import LLM

    probe = LLM(model_dir, kv_cache_memory=KV, block_size=4, **kw)
    engine = probe.engine
    per_slot = engine.runner._state_bytes // engine.runner.states.num_slots
    per_block = engine.kv_cache[:, :, 0].numel() * engine.kv_cache.element_size()
    probe.shutdown()
    kv = 4 * per_slot + max(3 * per_slot // 2, 26 * per_block)
    shape = dict(
        kv_cache_memory=kv,
        block_size=4,
        max_num_batched_tokens=32,
        max_model_len=96,
        speculative_config=None,
        **kw,
    )
    return shape, kv // 2 // per_slot, per_slot


def past_the_slots(llm, slots: int) -> tuple[list, int]:
    """One conversation more than `slots`: each one's first turn, then each one's second (its
    first, the answer and a new message), then each first turn again. Returns every
    (prompt, output, the tokens the engine said it held for that prompt just before: the
    block manager's held_prefix_tokens) in order, and how many first turns lead it."""
    from helpers.models import random_prompts

    firsts = random_prompts([37, 33, 41, 35][: slots + 1], seed=5)
    news = random_prompts([5, 6, 7, 4][: slots + 1], seed=6)
    bm, outs, history = llm.engine.block_manager, [], []
    for c, first in enumerate(firsts):
        held = bm.held_prefix_tokens(first, len(first) - 1)
        (out,) = llm.generate([first], greedy(NEW, logprobs=0), use_tqdm=False)
        outs.append((first, out, held))
        history.append(first + out.outputs[0].token_ids + news[c])
    for prompt in [*history, *firsts]:
        held = bm.held_prefix_tokens(prompt, len(prompt) - 1)
        (out,) = llm.generate([prompt], greedy(NEW, logprobs=0), use_tqdm=False)
        outs.append((prompt, out, held))
    return outs, len(firsts)
