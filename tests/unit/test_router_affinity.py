"""Prefix-cache affinity (router/affinity.py): whole leading chunks match, and old entries and
forgotten workers drop out. Prefill picking by queued tokens and affinity in a WorkerPool (whose
gRPC channels a fast-lane test may not open): tests/integration/test_router_affinity_pool.py."""

from __future__ import annotations

from pdserve.router.affinity import CHUNK, PrefixAffinity, prefix_hashes


def test_affinity_matches_whole_leading_chunks_only_and_forgets():
    aff = PrefixAffinity(max_entries=3)
    a = list(range(3 * CHUNK))
    aff.record(prefix_hashes(a), "w1")
    assert aff.matched_tokens(prefix_hashes(a + [7])) == {"w1": 3 * CHUNK}
    changed = a[:CHUNK] + [99999] + a[CHUNK + 1 :]  # differs in the second chunk
    assert aff.matched_tokens(prefix_hashes(changed)) == {"w1": CHUNK}
    assert aff.matched_tokens(prefix_hashes(a[: CHUNK - 1])) == {}  # shorter than one chunk
    aff.record(prefix_hashes(list(range(500, 500 + CHUNK))), "w2")  # 4 hashes > max_entries=3
    assert aff.matched_tokens(prefix_hashes(a)) == {}  # the oldest (first chunk) was evicted
    aff.forget("w2")
    assert aff.matched_tokens(prefix_hashes(list(range(500, 500 + CHUNK)))) == {}
