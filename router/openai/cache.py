"""The HTTP front's prefix-cache reset, on router/cache_reset.py:

    POST /reset_prefix_cache   vLLM's (its dev-mode endpoint): ?reset_external=true also clears
                               the host and disk tiers (vLLM's connector cache);
                               ?reset_running_requests=true (vLLM preempts them) is a 400: wait for
                               them to end, or /pause first
    GET|POST /flush_cache      SGLang's: the same, tiers included

Both answer {"status": "reset", "workers": n, "blocks": m} once every live worker of both pools
forgot its cached prefixes, or 409 naming the workers where a request still holds blocks (they
keep theirs; the others reset), 503 with no live worker. A client key where the router has keys.
The worker calls block, so the reset runs on a thread.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from pdserve.router.cache_reset import CacheResetError
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.pause import query_flag
from pdserve.router.openai.state import state_of

router = APIRouter()


async def _reset(request: Request, external: bool) -> dict:
    front = state_of(request)
    front.authorize(request)
    control = front.settings.cache_reset
    if control is None:
        raise ApiError(404, "no prefix cache to reset here", code="not_found")
    try:
        workers, blocks = await asyncio.to_thread(control.reset, external)
    except CacheResetError as e:
        raise ApiError.of_status(e.status, e.message) from None
    return {"status": "reset", "workers": workers, "blocks": blocks}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request):
    if query_flag(request, "reset_running_requests"):
        raise ApiError(
            400,
            "reset_running_requests=true preempts running requests in vLLM; pdserve does not "
            "preempt to reset: reset once they end, or POST /pause first",
            param="reset_running_requests",
        )
    return await _reset(request, bool(query_flag(request, "reset_external")))


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    return await _reset(request, True)
