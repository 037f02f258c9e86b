"""The precision a runner serves in: its linears' quantization, chosen once as it starts.

This module owns the "auto" choice of the weights' mode, as kv_dtype.py owns the KV cache's and
EngineConfig.resolve the device's and dtype's: the model runner executes steps and holds the
model and the cache, and this module decides, through the runner's own forward passes, what
they run in. `start_runner` builds a runner, calls `choose_precision` (every tensor-parallel
rank does, so their collectives pair up) and only then captures the runner's decode graphs,
since a graph records the kernels of the final mode. `choose_precision`: quantization None
keeps the dense weights; a named mode is calibrated (int8 smooths its activations by each
channel's largest input on a calibration text) and kept; "auto" scores a probe text in float32,
then with each mode in order of speed on this CPU, and keeps the first whose perplexity stays
within its bound (engine/quality.py), then lets kv_dtype.py choose the cache's dtype by the same
probe. Rank 0 judges and tells the rest (parallel.agree). The calibration and probe texts are
disjoint stretches of the same corpus. Nothing here runs after the runner has started.
"""

from __future__ import annotations

import torch

from pdserve.engine.kv_dtype import auto_kv_dtype_applies, choose_kv_dtype
from pdserve.engine.model_runner import ModelInput, ModelRunner, SeqInput
from pdserve.engine.parallel import agree, tp_rank


def start_runner(config, model_config, model_dir: str, kv_cache_path: str | None = None):
    """A ModelRunner ready to step: weights loaded, precision chosen, decode graphs captured."""
    runner = ModelRunner(config, model_config, model_dir, kv_cache_path)
    runner.quantization, runner.mode_note = choose_precision(runner, model_dir)
    runner.capture_graphs()
    return runner


def choose_precision(runner: ModelRunner, model_dir: str) -> tuple[str | None, str]:
    """(the quantization the linears run in, None: config.dtype; the mode note saying why)."""
    config = runner.config
    wanted = config.quantization
    if wanted is None:
        runner.model.prepare_linears(None)
        return None, f"quantization=none ({config.dtype}), as configured"
    from pdserve.engine.quality import PROBE_TOKENS, probe_ids
    from pdserve.engine.tokenizer import load_tokenizer

    length = min(PROBE_TOKENS, config.max_model_len, runner.num_blocks * runner.block_size)
    ids = probe_ids(load_tokenizer(model_dir), length, skip=length) if length >= 64 else []
    calibration, probe = ids[:length], ids[length:]
    runner.model.prepare_linears(None, release_dense=False)
    if calibration:
        calibrate(runner, calibration)
    if wanted != "auto":
        runner.model.prepare_linears(wanted)
        return wanted, f"quantization={wanted} ({config.dtype}), as configured"
    return _choose_quantization(runner, probe, length)


def calibrate(runner: ModelRunner, ids: list[int]) -> None:
    """Records, for every linear, the largest |input| per channel over `ids` (int8 smooths
    its activations by it; see engine/layers/quant.py)."""
    from pdserve.engine.layers.linear import LinearBase

    def record(module, args, _out):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
        seen = module.act_absmax
        module.act_absmax = x if seen is None else torch.maximum(seen, x)

    hooks = [
        m.register_forward_hook(record) for m in runner.model.modules() if isinstance(m, LinearBase)
    ]
    try:
        probe_perplexity(runner, ids)
    finally:
        for h in hooks:
            h.remove()


def _choose_quantization(runner: ModelRunner, ids: list[int], length: int):
    """quantization="auto": the first mode, in order of speed, within its bound of float32's
    probe perplexity; then the KV cache's dtype (kv_dtype.py)."""
    chosen: str | None = None
    judged: float | None = None  # float32's probe perplexity where it can judge a mode
    if not ids:
        note = (
            f"float32: no probe text (the probe needs 64 tokens of English; max_model_len "
            f"and the KV cache allow {length}, or the tokenizer cannot spell it)"
        )
    else:
        chosen, judged, note = _probe_modes(runner, ids)
    runner.model.prepare_linears(chosen)  # the final mode, and the dense weights released
    note = f"quantization=auto chose {chosen or 'none'} ({runner.config.dtype}): {note}"
    if auto_kv_dtype_applies(runner.config):  # the KV cache's dtype by the same probe
        note += "; " + choose_kv_dtype(runner, ids, judged, chosen)
    return chosen, note


def _probe_modes(runner: ModelRunner, ids: list[int]):
    """(the chosen mode or None, float32's perplexity if it can judge, the words on rank 0)."""
    from pdserve.engine.layers.quant import auto_candidates
    from pdserve.engine.quality import QUALITY_BOUNDS, informative

    note = ""
    chosen = None
    base = probe_perplexity(runner, ids)
    if not agree(base is not None and informative(base, runner.model_config.vocab_size)):
        note = (
            f"float32: the model does not predict the probe text (perplexity "
            f"{base if base is not None else float('nan'):.1f}), so no mode's quality "
            "can be judged"
        )
    judged = None if note else base
    for mode in auto_candidates() if not note else ():
        runner.model.prepare_linears(mode, release_dense=False)
        ppl = probe_perplexity(runner, ids)
        ok = ppl is not None and ppl <= base * (1 + QUALITY_BOUNDS[mode])
        if tp_rank() == 0:
            note += (
                f"{mode}: probe perplexity {ppl:.3f} vs float32 {base:.3f} "
                f"({ppl / base - 1:+.2%}, bound +{QUALITY_BOUNDS[mode]:.0%}); "
            )
        if agree(ok):
            chosen = mode
            break
    # (only rank 0 words the probes; the others know the verdict)
    note = note.rstrip("; ") or ("float32: no quantization mode passed" if chosen is None else "")
    return chosen, judged, note


def probe_perplexity(runner: ModelRunner, ids: list[int]) -> float | None:
    """The perplexity of `ids` on rank 0 (None on the others), through the KV cache's first
    blocks (no request holds any yet)."""
    from pdserve.engine.quality import perplexity

    seq = SeqInput(
        token_ids=ids,
        start=0,
        block_ids=list(range(-(-len(ids) // runner.block_size))),
        samples=False,
        prompt_targets=ids[1:],
    )
    out = runner.execute(ModelInput([seq], []), rows=[] if tp_rank() == 0 else None)
    return perplexity(out.prompt_logprobs[0], ids) if tp_rank() == 0 else None
