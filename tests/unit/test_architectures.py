"""Every mechanism the engine has, token for token against HF transformers on tiny random models
(tests/helpers/arch_checks.py: FAST_KINDS, one kind of each): a batch of mixed lengths with
chunked prefill and the prefix cache on, then served again from the prefix cache; a prefill/decode
hand-off from a prefill-only engine into another engine's reserved blocks; int8 and int4 weights
near float32; prompt logprobs where a family transforms its logits. Every other architecture runs
the same checks in the full suite (tests/integration/test_architectures_rest.py), tensor
parallelism in tests/integration/test_architectures_tp.py."""

from __future__ import annotations

import pytest

from helpers.arch import ARCH_KINDS, arch_refs
from helpers.arch_checks import (
    HANDOFF_KINDS,
    LOGPROB_KINDS,
    QUANT_KINDS,
    check_batch,
    check_handoff,
    check_prompt_logprobs,
    check_quantized,
    fast,
)
from helpers.engine import needs_x86_int8

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    cache: dict = {}
    return lambda kind, **kw: arch_refs(tmp_path_factory, cache, kind, **kw)


@pytest.mark.parametrize("kind", fast(ARCH_KINDS))
def test_batch_matches_hf_with_chunks_and_prefix_cache(refs, kind):
    check_batch(refs, kind)


@pytest.mark.parametrize("kind", fast(HANDOFF_KINDS))
def test_handoff_matches_hf(refs, kind):
    check_handoff(refs, kind)


@needs_x86_int8
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kind", fast(QUANT_KINDS))
def test_quantized_modes_stay_near_float32(refs, kind, mode):
    check_quantized(refs, kind, mode)


@pytest.mark.parametrize("kind", LOGPROB_KINDS)
def test_prompt_logprobs_match_hf(refs, kind):
    check_prompt_logprobs(refs, kind)
