"""The prefix-cache reset across both pools: vLLM's POST /reset_prefix_cache and SGLang's
/flush_cache (router/openai/cache.py), which benchmark scripts call between runs so that each run
starts from cold caches. A disaggregated deployment caches prompts on its prefill workers and
conversations on its decode workers (and in their host tiers), so a reset that reached one engine
would leave the others warm: every live worker of both pools is told ResetPrefixCache
(worker_common/prefix_cache.py) at once. A worker where a request holds blocks refuses and keeps
its cache (vLLM's engine refuses then too); the others reset, and the answer names those that
did not. The router's own block index (router/kv_index.py) follows from the workers' "cleared"
events. No state: one RouterCacheReset per router; `reset` blocks its caller (the HTTP front runs
it on a thread).
"""

from __future__ import annotations

import logging

from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router.sleep import call_all, http_status, live_workers

log = logging.getLogger(__name__)
RESET_CALL_TIMEOUT_S = 90.0  # a worker's own bound (60 s), and its answer's way back


class CacheResetError(Exception):
    """`status`: the HTTP status (409 a worker still runs requests, 503 none live)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class RouterCacheReset:
    def __init__(self, pool):
        self.pool = pool

    def reset(self, external: bool) -> tuple[int, int]:
        """Every live worker forgets its cached prefix blocks (with `external`, its host and
        disk tiers' too): (workers reset, device blocks forgotten). Raises CacheResetError
        naming the workers that refused, after the others reset."""
        workers = live_workers(self.pool)
        if not workers:
            raise CacheResetError(503, "no live worker to reset")
        request = worker_pb2.ResetPrefixCacheRequest(external=external)
        answered, failed = call_all(workers, "ResetPrefixCache", request, RESET_CALL_TIMEOUT_S)
        blocks = sum(reply.blocks for _, reply in answered)
        log.info(
            "prefix cache reset on %d of %d worker(s): %d block(s) forgotten%s",
            len(answered),
            len(workers),
            blocks,
            " (and the host tiers)" if external else "",
        )
        if failed:
            why = "; ".join(
                f"{self.pool.name(w)}: {e.code().name}: {(e.details() or '')[:300]}"
                for w, e in failed[:8]
            )
            raise CacheResetError(
                max(http_status(e) for _, e in failed),
                f"{len(failed)} of {len(workers)} worker(s) kept their prefix cache ({why}); "
                f"{len(answered)} reset",
            )
        return len(answered), blocks
