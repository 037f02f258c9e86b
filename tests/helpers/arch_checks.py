"""The checks of every architecture the engine serves against HF transformers on a tiny random
model of that architecture (tests/helpers/arch.py ARCH_KINDS), shared by the fast lane's
representative kinds (tests/unit/test_architectures.py: FAST_KINDS, one of each mechanism) and
the full suite's others (tests/integration/test_architectures_rest.py): a batch's greedy tokens
with chunked prefill and the prefix cache on, the same prompts again from the prefix cache; a
prefill/decode hand-off (one kind of each KV layout: HANDOFF_KINDS); int8 and int4 weights near
float32 (QUANT_KINDS); prompt logprobs where a family transforms its logits (LOGPROB_KINDS).
Tensor parallelism: tests/integration/test_architectures_tp.py.

Not a test module: imported as `from helpers.arch_checks import ...`.
"""

from __future__ import annotations

from helpers.arch import ARCH_NEW, QUANT_SCALE
from helpers.engine import KV, CopySink, greedy, prompt_logprob_diff, run_until_done
from helpers.models import SHARED_PREFIX
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams

AGAIN_NEW = 8  # tokens of the second, cached pass: every one attends over the cached blocks
# the fast lane's kinds: one of each mechanism the engine has (dense GQA, partial rotary, every
# layer sliding, sliding beside full with soft-capping, chunked beside full, experts, MLA with
# experts, sinks, and each recurrent kind: Gated DeltaNet, Mamba2, short convolutions, Mamba);
# the full suite runs every other kind too
FAST_KINDS = (
    "llama",
    "phi3-partial",
    "mistral-sw",
    "gemma2",
    "llama4",
    "qwen3-moe",
    "deepseek-v3",
    "gpt-oss",
    "qwen3.5",
    "granite-4.0-h",
    "lfm2",
    "falcon-mamba",
)
# the families that transform their logits (check_prompt_logprobs)
LOGPROB_KINDS = (
    "granite",
    "gemma2",
    "cohere2",
    "olmo-hybrid",
    "granite-4.0-h",
    "falcon-h1",
    "mamba",
    "falcon-mamba",
    "jamba",
)


def fast(kinds) -> list[str]:
    """The fast lane's share of `kinds`."""
    return [k for k in kinds if k in FAST_KINDS]


def rest(kinds) -> list[str]:
    """The full suite's share of `kinds` beyond the fast lane's."""
    return [k for k in kinds if k not in FAST_KINDS]


def check_batch(refs, kind: str) -> None:
    """ARCH_NEW greedy tokens of a batch of mixed lengths with chunked prefill and the prefix
    cache on, then each prompt again from the prefix cache."""
    model_dir, _, prompts, want = refs(kind)
    llm = LLM(
        model_dir,
        kv_cache_memory=KV,
        block_size=4,
        enable_prefix_caching=True,
        max_num_batched_tokens=32,
    )
    try:
        outs = llm.generate(prompts, greedy(ARCH_NEW), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        # again, one at a time: every prompt's full blocks come from the cache (AGAIN_NEW tokens
        # read them all; the batch above compared the long continuations); a hybrid's recurrent
        # layers from the state the cache kept after the last of them (engine/scheduler.py)
        for prompt, expected in zip(prompts, want):
            again = llm.generate(prompt, greedy(AGAIN_NEW), use_tqdm=False)[0]
            got = again.outputs[0].token_ids
            assert got == expected[:AGAIN_NEW], f"prompt of {len(prompt)} tokens"
            assert again.num_cached_tokens == (len(prompt) - 1) // 4 * 4
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


# A hand-off moves what the prefill wrote, layer by layer: what can differ between kinds is the
# KV cache's layout and which positions a decode reads (windows), not the MLPs, norms or scalars
# that shape the values. One kind of each: plain heads, every layer sliding, a mix of sliding and
# full layers (with a rope of their own, without one, soft-capped, with sinks), chunked layers
# beside a full one (Llama 4), and the MLA latent
# (deepseek-v2's and glm4-moe-lite's are laid out as deepseek-v3's).
HANDOFF_KINDS = [
    "llama",
    "mistral-sw",
    "qwen2-sw",
    "exaone4",
    "olmo3",
    "gemma2",
    "gemma3",
    "deepseek-v3",
    "gpt-oss",
    "llama4",
    "qwen3.5",  # (KV for its full-attention layers, then each linear layer's state)
    "lfm2",  # (a state of conv taps alone: no matrix)
    "nemotron-h",  # (Mamba2's state; layers of an MLP alone between the KV layers)
    "falcon-h1",  # (every layer's KV and its Mamba2 state both)
    "mamba2",  # (no KV at all: the state frames alone)
    "falcon-mamba",  # (Mamba's state: a vector per channel)
]


def check_handoff(refs, kind: str) -> None:
    """The prompt runs on a prefill-only engine (chunked, 4-token blocks); its KV, layer by layer,
    lands in a decode engine's reservation (16-token blocks), which decodes the rest."""
    model_dir, _, prompts, want = refs(kind)
    a = LLM(model_dir, kv_cache_memory=KV, block_size=4, max_num_batched_tokens=32).engine
    b = LLM(model_dir, kv_cache_memory=KV, block_size=16).engine
    num_layers = a.model_config.num_layers
    for i in (0, 3, 4, 5, 7):  # 1, 100 and 150 tokens, then two sharing a prefix
        prompt, rid = prompts[i], f"h{i}"
        res = b.reserve(rid, prompt, greedy(ARCH_NEW))
        if i == 7:  # (a hybrid's too: the state comes whole from the prefill)
            assert res.num_cached_tokens == SHARED_PREFIX
        sink = CopySink(b, res, num_layers)
        a.add_request(rid, prompt, greedy(ARCH_NEW), prefill_only=True, kv_sink=sink)
        outs = run_until_done(a)
        first = outs[-1].outputs[0].token_ids
        assert outs[-1].finished and len(first) == 1
        b.commit(rid, first[:1])
        final = [o for o in run_until_done(b) if o.finished]
        assert final[0].outputs[0].token_ids == want[i], f"prompt of {len(prompt)} tokens"
        assert_no_leaks(a)
        assert_no_leaks(b)


# quantization acts on each linear alike whatever the family: the kinds whose linears differ
# (fused checkpoint tensors, norms after branches, scalars, experts, MLA's kept kv_b_proj)
QUANT_KINDS = [
    "llama",
    "gemma2",
    "granite",
    "olmo2",
    "phi3",
    "mixtral",
    "qwen2-moe",
    "deepseek-v3",
    "glm4-moe",
    "qwen3.5",  # (the linear layers' merged projection, and the state in float32 whatever the mode)
]


def check_quantized(refs, kind: str, mode: str) -> None:
    """int8 and int4 weights: each prompt token's logprob within the bound the llama tests hold
    (a random tiny model's tokens are near-ties, so quality is read from logprobs, not text)."""
    model_dir, _, prompts, _ = refs(kind, scale=QUANT_SCALE)
    ref = LLM(model_dir, dtype="float32", kv_cache_memory=KV)
    llm = LLM(model_dir, quantization=mode, kv_cache_memory=KV)
    try:
        assert llm.engine.config.quantization == mode
        for p in prompts[2:5]:
            diff = prompt_logprob_diff(ref, llm, p)
            assert diff < (0.05 if mode == "int8" else 0.25), (p, diff)
    finally:
        ref.shutdown()
        llm.shutdown()


def check_prompt_logprobs(refs, kind: str) -> None:
    """The families that transform their logits (Granite's logits_scaling, Gemma 2's final
    soft-capping, Cohere's logit_scale, Falcon-H1's muP multipliers folded into the weights; and Mamba's, whose tiny
    random models repeat one token),
    which greedy tokens alone do not show: each prompt token's logprob equals HF's log-softmax
    of its logits."""
    import torch

    model_dir, hf, prompts, _ = refs(kind)
    prompt = prompts[2]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory=KV)
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        got = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    finally:
        llm.shutdown()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)
    for i in range(1, len(prompt)):
        assert abs(got[i][prompt[i]] - float(want[i - 1, prompt[i]])) < 1e-4, i
