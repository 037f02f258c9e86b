"""The architectures beyond the fast lane's one of each mechanism (tests/unit/test_architectures.py),
through the same checks against HF transformers (tests/helpers/arch_checks.py): a batch with
chunked prefill and the prefix cache, the hand-off for the KV layouts the fast lane's kinds do not
cover, and int8 and int4 weights near float32."""

from __future__ import annotations

import pytest

from helpers.arch import ARCH_KINDS, arch_refs
from helpers.arch_checks import (
    HANDOFF_KINDS,
    QUANT_KINDS,
    check_batch,
    check_handoff,
    check_quantized,
    rest,
)
from helpers.engine import needs_x86_int8

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    cache: dict = {}
    return lambda kind, **kw: arch_refs(tmp_path_factory, cache, kind, **kw)


@pytest.mark.parametrize("kind", rest(ARCH_KINDS))
def test_batch_matches_hf_with_chunks_and_prefix_cache(refs, kind):
    check_batch(refs, kind)


@pytest.mark.parametrize("kind", rest(HANDOFF_KINDS))
def test_handoff_matches_hf(refs, kind):
    check_handoff(refs, kind)


@needs_x86_int8
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kind", rest(QUANT_KINDS))
def test_quantized_modes_stay_near_float32(refs, kind, mode):
    check_quantized(refs, kind, mode)
