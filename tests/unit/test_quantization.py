"""Serving precisions: int8 and int4 linears stay close to float32, the engine serves in each mode,
and quantization="auto" (what dtype="auto" means on a CPU) keeps float32 for a model whose
quality it cannot judge. TP=2 in int8, and auto's pick for the real SmolLM2:
tests/integration/test_quantization_tp_and_smollm2.py."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.engine import needs_x86_int8, prompt_logprob_diff
from helpers.marks import BF16_MODE, needs_onednn_bf16
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels import cpu_fused
from pdserve.engine.layers import quant
from pdserve.engine.layers.linear import ReplicatedLinear
from pdserve.engine.layers.quant import (
    INT4_GROUP,
    Bf16Weight,
    Int4Weight,
    Int8Weight,
    ScreenedHead,
    head_quantization,
    quantize_weight,
)
from pdserve.engine.quality import informative, perplexity

pytestmark = pytest.mark.usefixtures("one_thread")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def weight_and_input(rows: int, n: int = 96, k: int = 128, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g)
    return w, x


@needs_x86_int8
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int8_close_to_float32(rows):
    w, x = weight_and_input(rows)
    assert rel_err(Int8Weight(w).matmul(x), x @ w.T) < 0.02


@needs_x86_int8
def test_int8_rows_with_outliers_keep_their_own_range():
    """One row 1000x larger than the rest (the first token and delimiters do this in real models)
    must not flatten the small rows: each row is evened out before the per-tensor kernel."""
    w, x = weight_and_input(16)
    x[3] *= 1000.0
    got, want = Int8Weight(w).matmul(x), x @ w.T
    for r in range(16):
        assert rel_err(got[r], want[r]) < 0.03, r


@needs_x86_int8
def test_int8_is_batch_invariant():
    """A row's result is the same alone or beside any other rows (outliers included): what a
    request gets does not depend on who shares its step, as in float32."""
    w, x = weight_and_input(12)
    x[4] *= 50.0
    x[7] = x[7].abs()  # all positive: a different min/max than the rest
    q = Int8Weight(w, act_absmax=x.abs().amax(dim=0))
    together = q.matmul(x)
    for r in range(12):
        assert torch.equal(q.matmul(x[r : r + 1])[0], together[r]), r
    assert torch.equal(q.matmul(x[3:9]), together[3:9])


@needs_x86_int8
def test_int8_smoothing_keeps_the_product_and_tames_an_outlier_channel():
    w, x = weight_and_input(32)
    x[:, 5] *= 200.0  # one input channel far larger than the rest, in every row
    want = x @ w.T
    plain = rel_err(Int8Weight(w).matmul(x), want)
    smoothed = Int8Weight(w, act_absmax=x.abs().amax(dim=0)).matmul(x)
    assert rel_err(smoothed, want) < 0.02
    assert rel_err(smoothed, want) < plain


@pytest.mark.parametrize("rows", [1, 9])
def test_int4_close_to_float32(rows):
    w, x = weight_and_input(rows)
    assert rel_err(Int4Weight(w).matmul(x), x @ w.T) < 0.12


def test_int4_recovers_q4_1_blocks_exactly():
    """A weight that is already 4-bit per block of 32 (a dequantized GGUF Q4_1) comes back as it
    was, up to bf16 rounding of the activations and scales."""
    n, k = 64, 4 * INT4_GROUP
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (n, k), generator=g).float()
    q[:, ::INT4_GROUP] = 0.0
    q[:, 1::INT4_GROUP] = 15.0  # every block spans its full range
    scale = torch.rand(n, k // INT4_GROUP, 1, generator=g) * 0.01 + 0.001
    low = -8 * scale + torch.randn(n, k // INT4_GROUP, 1, generator=g) * 0.001
    w = (q.view(n, -1, INT4_GROUP) * scale + low).view(n, k)
    x = torch.randn(3, k, generator=g)
    want = x.bfloat16().float() @ w.T
    assert rel_err(Int4Weight(w).matmul(x), want) < 0.01


def test_int4_refuses_a_width_it_cannot_group():
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Weight(torch.randn(8, 48))


@needs_x86_int8
@pytest.mark.parametrize("mode", ["int8", "int4", BF16_MODE])
def test_linear_layer_modes_and_bias(mode):
    layer = ReplicatedLinear(128, 96, bias=True)
    w, x = weight_and_input(5)
    layer.weight.data.copy_(w)
    layer.bias.data.normal_()
    want = x @ w.T + layer.bias
    layer.finalize(mode, release_dense=False)
    assert rel_err(layer(x), want) < 0.12
    layer.finalize(None)  # back to float32 from the kept dense weight, then released
    assert torch.allclose(layer(x), want, atol=1e-4) and layer.weight.numel() == 0
    with pytest.raises(RuntimeError, match="released"):
        layer.finalize(mode)


@needs_onednn_bf16
def test_head_stays_int8_under_int4_and_is_screened_under_bf16():
    assert head_quantization("int4") == "int8"
    assert head_quantization("int8") == "int8" and head_quantization(None) is None
    assert head_quantization("bf16") == "screened"
    w = torch.randn(64, 32)
    assert type(quantize_weight("bf16", w)) is Bf16Weight
    assert type(quantize_weight("screened", w)) is ScreenedHead
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_weight("int3", w)


def test_bf16_is_offered_only_with_bf16_units_and_onednns_bf16(monkeypatch):
    """auto offers bf16 only on bf16 units where oneDNN's bf16 linear runs, and int8 only on
    int8 units (without them fbgemm's int8 trails float32); where bf16 does not run (a CPU with
    AVX2 only), asking for the mode is refused with a message, not torch's error."""
    from pdserve.engine import cpu

    for units in (False, True):
        for onednn in (False, True):
            for int8 in (False, True):
                monkeypatch.setattr(cpu.CPUFeatures, "bf16_units", property(lambda s, u=units: u))
                monkeypatch.setattr(cpu.CPUFeatures, "int8_units", property(lambda s, i=int8: i))
                monkeypatch.setattr(quant, "onednn_bf16_available", lambda o=onednn: o)
                modes = quant.auto_candidates()
                assert ("bf16" in modes) == (units and onednn)
                assert ("int8" in modes) == int8 and ("int4" in modes) == units
    monkeypatch.setattr(quant, "onednn_bf16_available", lambda: False)
    with pytest.raises(ValueError, match="quantization='bf16' needs oneDNN's bf16 linear"):
        quantize_weight("bf16", torch.randn(32, 64))


def test_config_checks_quantization():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int3")
    assert EngineConfig(model="m", quantization="int8").quantization == "int8"


def test_quantization_refused_on_cuda(tiny_models):
    from transformers import AutoConfig

    from pdserve.engine.config import ModelConfig

    model_dir, _ = tiny_models("llama-gqa")
    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    with pytest.raises(ValueError, match="runs on CPU only"):
        EngineConfig(
            model=model_dir, device="cuda", quantization="int8", kv_cache_memory=1 << 20
        ).resolve(mc)
    # dtype auto on a GPU means bf16 and no quantization
    cfg = EngineConfig(model=model_dir, device="cuda", kv_cache_memory=1 << 20).resolve(mc)
    assert cfg.dtype == "bfloat16" and cfg.quantization is None


def test_dtype_auto_on_cpu_means_quantization_auto(tiny_models):
    from transformers import AutoConfig

    from pdserve.engine.config import ModelConfig

    model_dir, _ = tiny_models("llama-gqa")
    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    cfg = EngineConfig(model=model_dir, device="cpu").resolve(mc)
    assert (cfg.dtype, cfg.quantization) == ("float32", "auto")
    cfg = EngineConfig(model=model_dir, device="cpu", dtype="float32").resolve(mc)
    assert (cfg.dtype, cfg.quantization) == ("float32", None)


def assert_greedy_runs_without_leaks(llm, prompts) -> None:
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert_no_leaks(llm.engine)


@needs_x86_int8
@pytest.mark.parametrize("mode", ["int8", "int4", BF16_MODE])
def test_engine_serves_in_each_mode(refs, mode):
    """Greedy decoding runs, and prompt logprobs stay near float32's (a random tiny model's
    tokens are near-ties, so tokens are compared through logprobs, not text)."""
    model_dir, _, prompts, _ = refs("llama-gqa")
    ref = LLM(model_dir, dtype="float32", kv_cache_memory=1 << 22)
    llm = LLM(model_dir, quantization=mode, kv_cache_memory=1 << 22)
    assert llm.engine.config.quantization == mode and mode in llm.engine.mode_note
    try:
        for p in prompts[3:6]:
            diff = prompt_logprob_diff(ref, llm, p)
            assert diff < (0.05 if mode == "int8" else 0.25), diff
        # the calibration searches a smoothing strength where the mode serves int8 products as
        # they are: every linear under int8, int4's int8 head, none of bf16's (rescored) screen
        from pdserve.engine.layers.linear import LinearBase

        linears = {
            n: m.smooth_alpha
            for n, m in llm.engine.runner.model.named_modules()
            if isinstance(m, LinearBase)
        }
        searched = {n for n, a in linears.items() if a is not None}
        want = {"int8": set(linears), "int4": {"lm_head"}, "bf16": set()}[mode]
        assert searched == want, (mode, searched)
        assert_greedy_runs_without_leaks(llm, prompts)
    finally:
        ref.shutdown()
        llm.shutdown()


@needs_x86_int8
@pytest.mark.skipif(cpu_fused() is None, reason="no C++ toolchain: layers run one by one")
def test_int8_smooths_every_linear_by_the_calibration(refs):
    """The calibration pass records every linear's inputs, the layers' included: float32 on a CPU
    runs the probe's steps through the compiled decode stack, which no forward hook sees, and
    under it only the head was calibrated (SmolLM2 in int8: +3.95% perplexity, 90.8% top-1,
    against +2.29%, 94.15% smoothed)."""
    from pdserve.engine.layers.linear import LinearBase

    model_dir, _, _, _ = refs("llama-gqa")
    llm = LLM(model_dir, quantization="int8", kv_cache_memory=1 << 22)
    try:
        model = llm.engine.runner.model
        assert model.model._stack is not None, "the decode stack is in place after the start"
        linears = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
        assert any(n.startswith("model.layers.") for n in linears)
        for name, m in linears.items():
            assert m.act_absmax is not None, name
            in_features = m._quant.packed.unpack()[0].shape[1] // (2 if m._quant.spread else 1)
            assert m.act_absmax.shape == (in_features,), name
            assert m._quant.inv_smooth is not None, name
            assert m.smooth_alpha in quant.SMOOTH_ALPHAS, name
    finally:
        llm.shutdown()


@needs_x86_int8
def test_the_smoothing_search_measures_what_the_int8_kernel_computes():
    """quant.smoothing_errors redoes Int8Weight's rounding in float32 for each strength; its
    errors are the kernel's (up to the dequantization's last bits), outlier channels included."""
    w, x = weight_and_input(40, n=80, k=96, seed=3)
    x[:, 5] *= 30.0  # an outlier channel, as real models' activations have
    x[0] *= 20.0  # and an outlier row (the first token's)
    absmax = x.abs().amax(dim=0)
    fake = quant.smoothing_errors(w, absmax, x)
    real = [
        (Int8Weight(w, absmax, a).matmul(x) - x @ w.T).double().square().sum().item()
        for a in quant.SMOOTH_ALPHAS
    ]
    assert fake.tolist() == pytest.approx(real, rel=1e-4)
    assert len(set(real)) == len(real)  # the strengths do differ here
    # past SMOOTH_SEARCH_OUTPUTS outputs it measures an evenly spaced subset of them
    wide = torch.cat([w] * 15)  # 1,200 outputs
    assert quant.smoothing_errors(wide, absmax, x).shape == (len(quant.SMOOTH_ALPHAS),)


@pytest.mark.parametrize("units", [True, False], ids=["int8-units", "no-int8-units"])
def test_the_search_s_int8_sums_are_exact_on_either_path(monkeypatch, units):
    """Where the CPU has no int8 dot-product units the search sums in float64 (torch's int8
    product is a slow loop there): the same integers as torch's int32 product, extremes and a
    wide row included."""
    monkeypatch.setattr(quant, "cpu_features", lambda: type("F", (), {"int8_units": units})())
    g = torch.Generator().manual_seed(7)
    for rows, k, out in ((5, 96, 80), (3, 4096, 7)):
        xq = torch.randint(-128, 128, (rows, k), generator=g, dtype=torch.int8)
        wq = torch.randint(-128, 128, (out, k), generator=g, dtype=torch.int8)
        xq[0], wq[0] = -128, -128  # the largest sum: k * 2^14
        want = (xq.long() @ wq.long().t()).float()
        assert torch.equal(quant._int8_sums(xq, wq), want)


@needs_x86_int8
@pytest.mark.skipif(cpu_fused() is None, reason="no C++ toolchain: layers run one by one")
def test_the_calibration_keeps_the_strength_the_int8_kernel_errs_least_with(refs, monkeypatch):
    """Each linear's smooth_alpha is the strength whose int8 product (the kernel's, recomputed
    here on the rows the calibration measured) errs least, not one strength for all layers."""
    from pdserve.engine.layers.linear import LinearBase

    seen: dict[int, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = {}
    measure = quant.smoothing_errors

    def recording(weight, act_absmax, x2d, alphas=quant.SMOOTH_ALPHAS):
        kept = seen.setdefault(id(weight), (weight.detach().clone(), act_absmax.clone(), []))
        kept[2].append(x2d.detach().clone())
        return measure(weight, act_absmax, x2d, alphas)

    monkeypatch.setattr(quant, "smoothing_errors", recording)
    model_dir, _, _, _ = refs("llama-gqa")
    llm = LLM(model_dir, quantization="int8", kv_cache_memory=1 << 22)
    try:
        chosen = []
        for name, m in llm.engine.runner.model.named_modules():
            if not isinstance(m, LinearBase):
                continue
            w, absmax, xs = seen[id(m.weight)]
            x = torch.cat(xs).float()
            errors = {
                a: (Int8Weight(w, absmax, a).matmul(x) - x @ w.float().T).double().square().sum()
                for a in quant.SMOOTH_ALPHAS
            }
            assert errors[m.smooth_alpha] <= min(errors.values()) * (1 + 1e-4), name
            chosen.append(m.smooth_alpha)
        assert len(set(chosen)) > 1, chosen
    finally:
        llm.shutdown()


def test_auto_keeps_float32_for_a_model_it_cannot_judge(tiny_models):
    """A random model predicts no text: its perplexity says nothing about a mode's quality."""
    model_dir, _ = tiny_models("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=1 << 22)
    try:
        assert llm.engine.config.quantization is None
        assert "auto chose none" in llm.engine.mode_note
    finally:
        llm.shutdown()


def test_informative_and_perplexity():
    assert informative(14.0, 49152) and not informative(300.0, 49152)
    rows = [{5: math.log(0.5)}, {6: math.log(0.25)}]
    assert math.isclose(perplexity(rows, [4, 5, 6]), math.sqrt(8))


@needs_x86_int8
def test_bf16_kv_cache_under_float32_activations(refs):
    """kv_cache_dtype="bfloat16": the cache (and the transfer layout) is bf16, prompt chunks that
    read cached context and decode steps work from it, and the logprobs stay near float32's."""
    model_dir, _, prompts, _ = refs("llama-gqa")
    kw = dict(quantization="int8", kv_cache_memory=1 << 22, max_num_batched_tokens=32)
    ref = LLM(model_dir, **kw)
    llm = LLM(model_dir, kv_cache_dtype="bfloat16", **kw)
    try:
        assert llm.engine.kv_cache.dtype == torch.bfloat16
        assert llm.engine.kv_layout_spec()["dtype"] == "bfloat16"
        assert ref.engine.kv_layout_spec()["dtype"] == "float32"
        # 200 tokens in chunks of 32: every chunk after the first reads the cache
        assert prompt_logprob_diff(ref, llm, prompts[6]) < 0.05
        assert_greedy_runs_without_leaks(llm, prompts)
    finally:
        ref.shutdown()
        llm.shutdown()


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(model="m", kv_cache_dtype="int8")
    assert EngineConfig(model="m", dtype="float32").kv_torch_dtype == torch.float32
    assert (
        EngineConfig(model="m", dtype="float32", kv_cache_dtype="bf16").kv_torch_dtype
        == torch.bfloat16
    )


@needs_x86_int8
@pytest.mark.skipif(cpu_fused() is None, reason="no C++ toolchain: layers run one by one")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize("mode", [None, "int8", "int4", BF16_MODE])
def test_decode_stack_gives_the_layer_by_layer_bits(refs, mode, kv_cache_dtype):
    """Decode-only steps run every layer in one compiled call; it must compute exactly what the
    layers do one by one (same tokens, same logprobs, bit for bit), batched with sequences of
    different lengths, in float32 and each quantization mode."""
    model_dir, _, prompts, _ = refs("llama-gqa")
    llm = LLM(  # no prefix cache: the second run must prefill exactly as the first did
        model_dir,
        dtype="float32",
        quantization=mode,
        kv_cache_memory=1 << 22,
        kv_cache_dtype=kv_cache_dtype,
        enable_prefix_caching=False,
    )
    model = llm.engine.runner.model.model
    try:
        stack = model._stack
        assert stack is not None, "the decode stack was not prepared"
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)

        def run():
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

        fused = run()
        model._stack = None
        layer_by_layer = run()
        assert fused == layer_by_layer
        assert_no_leaks(llm.engine)
    finally:
        model._stack = stack
        llm.shutdown()
