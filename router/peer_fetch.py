"""Which reuse path a conversation's turn takes when it goes through the prefill pool: the prefill
worker pulls the cached prefix its decode worker holds (peer fetch: prefill_worker/peer_fetch.py)
or it recomputes what its own prefix cache misses. Chosen per Prefill call by estimated cost, from
what the deployment measured (docs/architecture.md section 11).

The decode worker's reservation says how many leading prompt tokens it holds
(ReserveResponse.num_cached_tokens); the prefill worker probably holds what the router's
affinity view says (router/affinity.py, the charge of pick_prefill). The gain is the blocks the
decode worker holds beyond that (whole blocks before the prompt's last token). A fetch is asked
for when the decode worker holds at least `min_tokens` and (the gain taken as at least that)

    gain x bytes per token / fetch bandwidth + overhead_s  <  gain / prefill tokens per second

where, from the Prefill replies this router saw (exponential moving averages, PeerFetchCost):
bytes per token is the KV pushed per token pushed; the fetch bandwidth is the fetches' own bytes
per second once one was measured, before that the prefill workers' hand-off bandwidth (their
WorkerStats push bytes over push seconds); prefill speed is the tokens a prefill worker computed
per second of its compute. Until both sides are measured a fetch is asked for (it is bounded, and
its reply measures it). The affinity view is a guess; the prefill worker looks at its own cache
and pulls only the blocks it lacks (none: no call to the decode worker at all). The same estimate prices the prefill path in the local-prefill rule
(router/legs.py): with a fetch, the prefill pool computes only the new tokens plus the fetch's
time in prefill tokens, so a turn stays on the prefill pool, off the decode worker's running
batch, whenever that is about as fast.

PeerFetch (the settings: YAML router.peer_fetch) is immutable; PeerFetchCost is shared by every
call's thread (under its lock) and lives as long as the router's Legs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pdserve.protos.pdserve.v1 import worker_pb2

EWMA = 0.2  # a new measurement's weight
MIN_MEASURED_TOKENS = 16  # a prefill of fewer computed tokens says little about the speed


@dataclass(frozen=True)
class PeerFetch:
    enabled: bool = True
    max_blocks: int = 4096  # one fetch's blocks at most
    max_bytes: int = 1 << 30  # and bytes
    timeout_s: float = 5.0  # and time: what arrived by then is used, the rest computed
    min_tokens: int = 32  # a smaller gain is recomputed
    overhead_s: float = 0.002  # a fetch's fixed cost (one more RPC), in the estimate

    def __post_init__(self):
        if self.max_blocks < 1 or self.max_bytes < 1 or self.min_tokens < 0:
            raise ValueError(
                f"peer fetch: max_blocks and max_bytes must be >= 1 and min_tokens >= 0, got "
                f"{self.max_blocks}, {self.max_bytes}, {self.min_tokens}"
            )
        if not 0 < self.timeout_s <= 600 or self.overhead_s < 0:
            raise ValueError(
                f"peer fetch: timeout_s must be in (0, 600] and overhead_s >= 0, got "
                f"{self.timeout_s}, {self.overhead_s}"
            )


def _ewma(old: float, new: float) -> float:
    return new if old <= 0 else (1 - EWMA) * old + EWMA * new


class PeerFetchCost:
    """The measurements the estimate uses, and the choice (module docstring)."""

    def __init__(self, settings: PeerFetch | None = None):
        self.settings = settings or PeerFetch()
        self._lock = threading.Lock()
        self.bytes_per_token = 0.0
        self.fetch_bytes_per_s = 0.0
        self.prefill_tokens_per_s = 0.0

    def observe(self, prompt_tokens: int, reservation, reply) -> None:
        """A Prefill call answered: what it says about KV bytes per token, fetch bandwidth and
        prefill speed."""
        pushed = prompt_tokens - reservation.num_cached_tokens
        t = reply.timings
        computed = prompt_tokens - reply.num_cached_tokens
        compute_s = (t.prefill_end_unix_ns - t.prefill_start_unix_ns) / 1e9
        with self._lock:
            if pushed > 0 and reply.bytes_sent > 0:
                self.bytes_per_token = _ewma(self.bytes_per_token, reply.bytes_sent / pushed)
            if reply.peer_fetch_bytes > 0 and reply.peer_fetch_seconds > 0:
                rate = reply.peer_fetch_bytes / reply.peer_fetch_seconds
                self.fetch_bytes_per_s = _ewma(self.fetch_bytes_per_s, rate)
            if computed >= MIN_MEASURED_TOKENS and compute_s > 0:
                rate = computed / compute_s
                self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, rate)

    def estimate(self, gain: int, handoff_bytes_per_s: float = 0.0) -> tuple[float, float] | None:
        """(fetch seconds, recompute seconds) of `gain` tokens; None until measured.
        handoff_bytes_per_s: the prefill workers' push bandwidth, used until a fetch is
        measured."""
        with self._lock:
            bpt, speed = self.bytes_per_token, self.prefill_tokens_per_s
            bw = self.fetch_bytes_per_s or handoff_bytes_per_s
        if bpt <= 0 or speed <= 0 or bw <= 0:
            return None
        return gain * bpt / bw + self.settings.overhead_s, gain / speed

    def choose(
        self, prompt_tokens: int, reservation, prefill_held: int, handoff_bytes_per_s: float = 0.0
    ) -> tuple[bool, dict]:
        """Whether the prefill worker, probably holding `prefill_held` leading tokens, should
        pull what the reservation's decode worker holds beyond them; with the estimate's
        figures, for the trace."""
        s = self.settings
        bs = max(1, reservation.block_size)
        theirs = min(reservation.num_cached_tokens, max(0, prompt_tokens - 1))
        theirs -= theirs % bs
        gain = max(0, theirs - prefill_held)
        why = {"pdserve.peer_fetch_gain_tokens": gain, "pdserve.decode_held_tokens": theirs}
        if not s.enabled or theirs < max(s.min_tokens, bs):
            return False, why
        # the affinity view's `prefill_held` is a guess (the worker may have evicted it): the
        # prefill worker looks at its own cache and pulls only what it lacks, so a fetch is asked
        # for whenever it pays per token; the estimate prices at least min_tokens
        est = self.estimate(max(gain, s.min_tokens, bs), handoff_bytes_per_s)
        if est is None:  # not measured yet: a bounded fetch measures it
            return True, why
        fetch_s, recompute_s = est
        why.update(
            {"pdserve.peer_fetch_est_s": fetch_s, "pdserve.peer_fetch_recompute_est_s": recompute_s}
        )
        return fetch_s < recompute_s, why

    def fetch_cost_tokens(self, gain: int, handoff_bytes_per_s: float = 0.0) -> float | None:
        """A fetch of `gain` tokens' time in prefill tokens (the local-prefill rule's unit);
        None until measured."""
        est = self.estimate(gain, handoff_bytes_per_s)
        if est is None:
            return None
        with self._lock:
            return est[0] * self.prefill_tokens_per_s

    def request(self, address: str) -> worker_pb2.PeerFetch:
        s = self.settings
        return worker_pb2.PeerFetch(
            address=address,
            max_blocks=s.max_blocks,
            max_bytes=s.max_bytes,
            timeout_ms=max(1, int(s.timeout_s * 1000)),
        )
