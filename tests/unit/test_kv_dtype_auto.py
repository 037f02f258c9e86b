"""kv_cache_dtype="auto" under dtype="auto" on a CPU (engine/kv_dtype.py): a bf16 KV cache where
the probe with it stays within the chosen mode's bound and the compiled decode kernel reads it,
else float32; an explicit kv_cache_dtype is kept. A tiny random model predicts no text, so the
tests that need a verdict declare its probe informative and widen or break the bounds."""

from __future__ import annotations

import pytest
import torch

from helpers.engine import needs_x86_int8
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams, kv_dtype
from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels import cpu_paged_decode
from pdserve.engine.precision import probe_perplexity
from pdserve.engine.quality import QUALITY_BOUNDS

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    needs_x86_int8,
    pytest.mark.skipif(cpu_paged_decode() is None, reason="no compiled paged decode kernel"),
]
KV_BYTES = 1 << 22


def first_mode() -> str | None:
    """The weights' mode auto takes when every mode passes: the fastest on this CPU (None:
    float32, where no quantized mode is faster)."""
    from pdserve.engine.layers.quant import auto_candidates

    return (auto_candidates() or [None])[0]


@pytest.fixture(autouse=True)
def probe_every_start(monkeypatch):
    """These tests change what the probe judges by (monkeypatched bounds and checks): a verdict
    kept from an earlier start of the same model must not stand in for their probe."""
    monkeypatch.setenv("PDSERVE_PRECISION_CACHE", "0")


@pytest.fixture
def judged(monkeypatch):
    """The tiny model's probe counts as informative, and every mode's bound is wide enough that
    the weights' modes pass (no agreement bound, no chat check: a random model's greedy answers
    sit on near ties): what the KV cache's probe then scores decides alone."""
    monkeypatch.setattr("pdserve.engine.quality.informative", lambda ppl, vocab: True)
    monkeypatch.setattr("pdserve.engine.quality.AGREEMENT_BOUND", 0.0)
    monkeypatch.setattr("pdserve.engine.precision.chat_ids", lambda runner, tokenizer: [])
    for mode in ("bfloat16", "int8", "int4", "bf16"):
        monkeypatch.setitem(QUALITY_BOUNDS, mode, 1.0)


def greedy_runs_without_leaks(llm) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([[5, 6, 7] * 30, [9] * 40], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert_no_leaks(llm.engine)


def test_auto_chooses_a_bf16_cache_within_the_bound(tiny_models, judged):
    model_dir, _ = tiny_models("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV_BYTES)  # dtype="auto": float32, quantization auto
    explicit = LLM(
        model_dir,
        dtype="float32",
        quantization="int8",
        kv_cache_dtype="float32",
        kv_cache_memory=KV_BYTES,
    )
    try:
        eng, note = llm.engine, llm.engine.mode_note
        assert eng.config.quantization == first_mode(), note
        assert "kv_cache_dtype=auto chose bfloat16" in note, note
        assert "with a bf16 KV cache: probe perplexity" in note and "bound +100%" in note
        assert eng.kv_cache.dtype == torch.bfloat16 and eng.runner.kv_dtype == torch.bfloat16
        assert eng.config.kv_cache_dtype == "bfloat16"
        assert eng.kv_layout_spec()["dtype"] == "bfloat16"
        # the same bytes hold twice the blocks, and the scheduler knows all of them
        assert eng.kv_cache.nbytes <= KV_BYTES
        fp32_blocks = explicit.engine.block_manager.num_blocks
        assert eng.block_manager.num_blocks in (2 * fp32_blocks, 2 * fp32_blocks + 1)
        greedy_runs_without_leaks(llm)
    finally:
        llm.shutdown()
        explicit.shutdown()


def test_auto_keeps_float32_when_the_bf16_probe_fails(tiny_models, judged, monkeypatch):
    real = kv_dtype.probe_with_bf16_cache

    def worse(score):
        score.perplexity *= 10.0
        return score

    monkeypatch.setattr(
        "pdserve.engine.kv_dtype.probe_with_bf16_cache",
        lambda r, ids, chat: worse(real(r, ids, chat)),
    )
    model_dir, _ = tiny_models("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV_BYTES)
    try:
        eng, note = llm.engine, llm.engine.mode_note
        assert eng.config.quantization == first_mode(), note
        mode = first_mode() or "float32"
        assert f"kv_cache_dtype=auto kept float32 ({mode} with a bf16 KV cache" in note, note
        assert eng.kv_cache.dtype == torch.float32 and eng.config.kv_cache_dtype == "float32"
        assert eng.kv_layout_spec()["dtype"] == "float32"
        greedy_runs_without_leaks(llm)
    finally:
        llm.shutdown()


def test_auto_keeps_float32_without_the_compiled_decode_kernel(tiny_models, judged, monkeypatch):
    """The torch path converts a bf16 cache on every read: nothing to gain, so no probe runs."""
    monkeypatch.setattr("pdserve.engine.kv_dtype.model_decode_kernel", lambda *a: None)
    model_dir, _ = tiny_models("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV_BYTES)
    try:
        note = llm.engine.mode_note
        assert "kv_cache_dtype=auto kept float32: no compiled paged decode kernel" in note, note
        assert llm.engine.kv_cache.dtype == torch.float32
    finally:
        llm.shutdown()


def test_auto_keeps_float32_for_a_model_it_cannot_judge(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV_BYTES)
    try:
        note = llm.engine.mode_note
        assert "kv_cache_dtype=auto kept float32: no probe to judge" in note, note
        assert llm.engine.kv_cache.dtype == torch.float32
    finally:
        llm.shutdown()


@pytest.mark.parametrize("given", ["float32", "bfloat16"])
def test_an_explicit_kv_cache_dtype_is_kept(tiny_models, judged, given):
    model_dir, _ = tiny_models("llama-gqa")
    llm = LLM(model_dir, kv_cache_dtype=given, kv_cache_memory=KV_BYTES)
    try:
        eng = llm.engine
        assert eng.config.quantization == first_mode()  # the weights' mode is still chosen
        assert "kv_cache_dtype=auto" not in eng.mode_note
        assert eng.kv_cache.dtype == getattr(torch, given) and eng.config.kv_cache_dtype == given
    finally:
        llm.shutdown()


def test_the_rule_applies_to_auto_weights_on_a_cpu_only():
    def cfg(**kw):
        return EngineConfig(model="m", device="cpu", dtype="float32", **kw)

    assert kv_dtype.auto_kv_dtype_applies(cfg(quantization="auto"))
    assert not kv_dtype.auto_kv_dtype_applies(cfg())  # float32 as configured: follows it
    assert not kv_dtype.auto_kv_dtype_applies(cfg(quantization="int8"))
    assert not kv_dtype.auto_kv_dtype_applies(cfg(quantization="auto", kv_cache_dtype="fp32"))
    bf16 = EngineConfig(model="m", device="cpu", dtype="bfloat16", quantization="auto")
    assert not kv_dtype.auto_kv_dtype_applies(bf16)
    cuda = EngineConfig(model="m", device="cuda", dtype="float32", quantization="auto")
    assert not kv_dtype.auto_kv_dtype_applies(cuda)


def test_the_bf16_probe_reads_its_context_from_a_bf16_cache(tiny_models):
    """Prefilled in chunks, the probe's later chunks read K/V back from the cache: the score
    moves off float32's (by little), and the engine's own cache is left as it was."""
    model_dir, _ = tiny_models("llama-gqa")
    llm = LLM(model_dir, dtype="float32", kv_cache_memory=KV_BYTES)
    try:
        runner = llm.engine.runner
        cache = runner.kv_cache
        ids = [(7 * i) % 200 + 3 for i in range(300)]
        want = probe_perplexity(runner, ids)
        got = kv_dtype.probe_with_bf16_cache(runner, ids).perplexity
        assert got != want and abs(got / want - 1) < 0.02, (got, want)
        assert runner.kv_cache is cache and runner.kv_dtype == torch.float32
        greedy_runs_without_leaks(llm)
    finally:
        llm.shutdown()


def test_the_fit_check_counts_float32_blocks_under_auto():
    """The launcher cannot run the probe: under dtype "auto" on a CPU it checks the fewer blocks
    of a float32 cache (a bf16 one holds twice as many)."""
    from pdserve.deploy.config.checks import fit_problems
    from pdserve.deploy.config.load import validate_config

    hf = {
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "head_dim": 64,
        "max_position_embeddings": 8192,
    }  # SmolLM2-135M: a float32 block of 16 tokens is 737,280 bytes
    pool = {"prefill": {"kv_cache_memory": 737_280 * 511, "max_model_len": 8192}}
    auto = fit_problems(validate_config({"pools": pool}), hf)
    assert len(auto) == 1 and "holds 511 KV blocks" in auto[0]
    bf16 = validate_config({"kv_cache_dtype": "bfloat16", "pools": pool})
    assert fit_problems(bf16, hf) == []
