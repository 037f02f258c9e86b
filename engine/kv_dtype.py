"""The KV cache's dtype under kv_cache_dtype="auto" when the weights' mode is chosen by a probe.

This module owns one decision: whether an engine serving float32 activations on a CPU with
quantization="auto" (what dtype="auto" means there) keeps its KV cache in bfloat16 or float32.
Everywhere else "auto" follows the activations (EngineConfig.kv_torch_dtype), and an explicit
kv_cache_dtype is kept as given. engine/precision.py calls `choose_kv_dtype` once it has chosen
the weights' mode M, and the runner reallocates its cache when the answer is bfloat16.

The rule: the cache is bfloat16 when both hold, else float32.

1. Decode attention reads a bf16 cache faster on this CPU: the compiled paged decode kernel
   (`engine.attention.decode_kernel`) reads it in place, loading half the bytes and widening each
   value to float32 with a vector shift (a bf16 is a float32's upper half: no bf16 unit is
   needed, so `cpu_features().bf16_units` is not asked; AVX2 is, for the vector widening). With
   many sequences decode attention streams the whole cache every step and is memory-bound, so
   half the bytes is a faster decode. Without the kernel the torch path gathers the blocks and
   converts them on every read, so float32 is kept.
2. The probe scored in M with a bf16 cache passes engine/quality.judge against float32's: its
   perplexity within M's bound (`QUALITY_BOUNDS[M]`, the bound M itself passed; float32
   weights: bfloat16's bound), its top-1 agreement with float32 at least AGREEMENT_BOUND, and the
   chat prompts answered as float32 answers them. The probe is prefilled in chunks of KV_PROBE_CHUNK tokens, so every chunk after the
   first reads its context back from the cache, as served prompts and decodes do (a chunk attends
   its own K/V rounded as the cache holds them, engine/attention.py, so how the probe is cut does
   not change its score). It runs in a small bf16 cache of its own:
   the engine's cache is reallocated only once the answer is bfloat16, after the float32 one is
   released (the memory is never held twice, and the same kv_cache_memory bytes hold twice the
   blocks).

Both steps are deterministic: no timing at start-up, so a prefill worker and a decode worker on
the same kind of CPU with the same model choose the same cache dtype, which is part of the KV
transfer layout (engine_core.kv_layout_spec). Workers that still disagree (different CPUs) are
refused at the hand-off with a message naming the fix: set kv_cache_dtype on both.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention import model_decode_kernel
from pdserve.engine.cpu import cpu_features
from pdserve.engine.parallel import agree, is_first_rank

KV_PROBE_CHUNK = 64  # tokens a step when the probe is scored through a bf16 cache


def auto_kv_dtype_applies(config) -> bool:
    """Whether the cache's dtype is this module's to choose: kv_cache_dtype "auto" under float32
    activations on a CPU, with the weights' mode chosen by the probe (quantization="auto")."""
    return (
        config.kv_cache_dtype == "auto"
        and config.device == "cpu"
        and config.torch_dtype == torch.float32
        and config.quantization == "auto"
    )


def why_bf16_is_not_faster(runner) -> str | None:
    """None when this CPU's decode attention reads a bf16 cache faster (rule 1), else why not."""
    if not cpu_features().has("avx2"):
        return "this CPU has no AVX2 to widen bf16 values in vectors"
    kernel = model_decode_kernel(runner.model_config, runner.device, runner.dtype, torch.bfloat16)
    if kernel is None:
        return (
            "no compiled paged decode kernel here (no C++ toolchain, PDSERVE_CPU_KERNELS=0, or "
            "head_dim not a multiple of 16, or an MLA model): the torch path converts a bf16 "
            "cache on every read"
        )
    return None


def choose_kv_dtype(
    runner, ids: list[int], base, mode: str | None, chat: list[list[int]] = ()
) -> str:
    """Applies the rule to `runner` (whose weights already run in `mode`) and returns the words
    for its mode note. `ids`: the probe text; `base`: float32's quality.ProbeScore on rank 0, or
    None when the probe could not judge quality (no probe text, or a model that does not predict
    it); `chat`: the chat prompts' ids ([]: no chat check). Every rank runs the same probe steps
    (their collectives pair up); rank 0 judges."""
    from pdserve.engine.quality import QUALITY_BOUNDS, judge

    why_not = why_bf16_is_not_faster(runner)
    if why_not is not None:
        return f"kv_cache_dtype=auto kept float32: {why_not}"
    if not agree(base is not None and bool(ids)):
        return "kv_cache_dtype=auto kept float32: no probe to judge a bf16 cache by"
    bound = QUALITY_BOUNDS[mode or "bfloat16"]
    score = probe_with_bf16_cache(runner, ids, chat)
    ok, words = False, ""
    if is_first_rank():
        eos = tuple(runner.model_config.eos_token_ids or ())
        ok, verdict = judge(score, base, bound, eos)
        words = (
            f"{mode or 'float32'} with a bf16 KV cache: {verdict} (prefilled "
            f"{KV_PROBE_CHUNK} tokens a step)"
        )
    if agree(ok):
        runner.set_kv_dtype(torch.bfloat16)
        # (not the number of blocks: a kept verdict applies to any cache size, and the start
        # table shows each worker's own)
        return (
            f"kv_cache_dtype=auto chose bfloat16 ({words}; decode attention reads half the bytes)"
        )
    return f"kv_cache_dtype=auto kept float32 ({words})"


def probe_with_bf16_cache(runner, ids: list[int], chat: list[list[int]] = ()):
    """The probe's quality.ProbeScore on rank 0 (None on the others): `ids` prefilled
    KV_PROBE_CHUNK tokens a step, then the greedy answers to `chat`, through a bf16 cache of its
    own, just large enough; the runner's cache is put back."""
    from pdserve.engine.model_runner import ModelInput, SeqInput
    from pdserve.engine.precision import chat_blocks, greedy_chat
    from pdserve.engine.quality import ProbeScore, perplexity, top1

    full, full_dtype = runner.kv_cache, runner.kv_dtype
    num_blocks = max(-(-len(ids) // runner.block_size), chat_blocks(runner, list(chat)))
    shape = (full.shape[0], full.shape[1], num_blocks, *full.shape[3:])
    runner.kv_cache = torch.zeros(shape, dtype=torch.bfloat16, device=full.device)
    runner.kv_dtype = torch.bfloat16
    rows: list[dict[int, float]] = []
    try:
        for a in range(0, len(ids), KV_PROBE_CHUNK):
            b = min(len(ids), a + KV_PROBE_CHUNK)
            seq = SeqInput(
                token_ids=ids[a:b],
                start=a,
                block_ids=list(range(num_blocks)),
                samples=False,
                prompt_targets=ids[a + 1 : b + 1],
                prompt_topk=1,
                state_slot=0,
            )
            out = runner.execute(ModelInput([seq], []), rows=[] if is_first_rank() else None)
            rows += out.prompt_logprobs.get(0, [])
        answers = greedy_chat(runner, list(chat))
    finally:
        runner.kv_cache, runner.kv_dtype = full, full_dtype
    if not is_first_rank():
        return None
    return ProbeScore(perplexity(rows, ids), top1(rows), answers)
