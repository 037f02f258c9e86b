"""Every architecture the engine serves (tests/helpers/arch.py: dense, sliding windows, Gemma's
soft-caps, three mixtures of experts), on CUDA with decode graphs, against HF transformers on the
same GPU: float32 greedy token for token (a divergence fails unless HF's own logits put the two
tokens within TIE of each other), with chunked prefill, then the same prompts again one at a time
served from the prefix cache. The CPU suite checks the same on CPU (tests/unit/test_architectures.py);
this is where MoE routing, windows and soft-caps meet graph capture and the CUDA kernels."""

from __future__ import annotations

import pytest

from helpers.arch import ARCH_KINDS, CPU_ONLY_KINDS, arch_refs
from helpers.engine import greedy
from helpers.gpu import DEVICE, ON_CUDA, assert_greedy_matches, hf_on
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM

pytestmark = pytest.mark.gpu

NEW = 24
TIE = 1e-3  # float32: only a true near tie may part the two
BLOCK = 16


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    cache: dict = {}
    return lambda kind: arch_refs(tmp_path_factory, cache, kind)


# (MLA, sinks, chunked attention: CPU only)
CUDA_KINDS = [k for k in ARCH_KINDS if k not in CPU_ONLY_KINDS]


@pytest.mark.parametrize("kind", CUDA_KINDS)
def test_architecture_on_cuda_with_graphs_chunks_and_prefix_cache(refs, kind):
    model_dir, hf, prompts, _ = refs(kind)
    hf = hf_on(hf)
    llm = LLM(
        model_dir,
        device=DEVICE,
        dtype="float32",
        kv_cache_memory=1 << 24,
        max_model_len=512,
        block_size=BLOCK,
        enable_prefix_caching=True,
        max_num_batched_tokens=32,  # the 100- and 150-token prompts run in chunks
        speculative_config=None,
    )
    try:
        outs = llm.generate(prompts, greedy(NEW), use_tqdm=False)
        assert_greedy_matches(hf, prompts, outs, TIE)
        if ON_CUDA:
            assert llm.engine.runner.graphs.recorded, "no decode step was replayed from a graph"
        first = [o.outputs[0].token_ids for o in outs]
        for prompt, want in zip(prompts, first):
            again = llm.generate(prompt, greedy(NEW), use_tqdm=False)[0]
            assert again.outputs[0].token_ids == want, f"prompt of {len(prompt)} tokens"
            assert again.num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
