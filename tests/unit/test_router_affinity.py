"""Prefix-cache affinity (router/affinity.py): whole leading chunks match, and old entries and
forgotten workers drop out. Prefill picking by queued tokens and affinity in a WorkerPool (whose
gRPC channels a fast-lane test may not open): tests/integration/test_router_affinity_pool.py."""

from __future__ import annotations

from pdserve.router.affinity import (
    CHUNK,
    MIN_ENTRIES,
    PrefixAffinity,
    prefix_hashes,
)


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


def test_affinity_keeps_at_most_its_bound_and_drops_what_no_worker_holds():
    """The view's memory (issue #26's soak: the router grew with every fresh prompt) stays at its
    bound however many requests pass, a tighter bound applies at once, and a worker that leaves
    takes the hashes only it held."""
    aff = PrefixAffinity(max_entries=500)
    prompts = [[i * 1000 + j for j in range(2 * CHUNK)] for i in range(2000)]  # 2 hashes each
    for i, prompt in enumerate(prompts):
        aff.record(prefix_hashes(prompt), "w1" if i % 2 else "w2")
    assert len(aff) == 500
    newest = prompts[-1]
    assert aff.matched_tokens(prefix_hashes(newest)) == {"w1": 2 * CHUNK}
    aff.set_max_entries(100)
    assert len(aff) == 100
    assert aff.matched_tokens(prefix_hashes(newest)) == {"w1": 2 * CHUNK}  # the newest stay
    aff.record(prefix_hashes(newest), "w2")  # now held by both
    aff.forget("w1")
    assert len(aff) == 50 + 2  # w2's prompts, and the one both held
    assert aff.matched_tokens(prefix_hashes(newest)) == {"w2": 2 * CHUNK}
    aff.forget("w2")
    assert len(aff) == 0


def test_affinity_fits_its_bound_to_what_the_prefill_caches_hold():
    aff = PrefixAffinity()
    aff.fit_to_tokens(0)  # no worker's Stats yet: the default stays
    assert aff.max_entries == PrefixAffinity().max_entries
    aff.fit_to_tokens(4 * 546 * 16)  # four workers of 546 16-token blocks: a hash per CHUNK
    assert aff.max_entries == 4 * 546 * 16 // CHUNK
    aff.fit_to_tokens(200 * 16)  # a small cache: the floor
    assert aff.max_entries == MIN_ENTRIES
    # the bound holds: the least recently sent prefixes go first, and no longer match
    aff = PrefixAffinity()
    aff.fit_to_tokens(300 * CHUNK)
    old, new = list(range(2 * CHUNK)), list(range(10**6, 10**6 + 299 * CHUNK))
    aff.record(prefix_hashes(old), "w1")
    aff.record(prefix_hashes(new), "w1")
    assert len(aff) == 300
    assert aff.matched_tokens(prefix_hashes(old)) == {}
