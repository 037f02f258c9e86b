"""The pieces every OpenAI response of the HTTP front shares, as pure functions of the router's
gRPC messages: the finish_reason of a sequence's Finish (a failed one raises its ApiError) and
vLLM's stop_reason beside it (the stop string or token that matched), the usage of a request,
the `pdserve` extension (per-stage timings from protos/timings.py and the workers that served
it), server-sent event framing, and the loop that writes another API's stream of a chat's
chunks (shaped_events: /v1/responses, /v1/messages).

Whole responses (router/openai/responses/whole.py) and streams (stream.py beside it) build on
these; neither keeps state past the request it formats.
"""

from __future__ import annotations

import json
import logging

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.protos.timings import stage_durations
from pdserve.router.openai.errors import ApiError

log = logging.getLogger(__name__)


def finish_reason(finish: pdserve_pb2.Finish, aborts: bool = False) -> str:
    """OpenAI's finish_reason; a Finish that is a failure raises it as an ApiError. With
    `aborts` (the completion and chat APIs), an aborted sequence (the router's /pause with
    mode=abort: router/pause.py) ends with vLLM's finish_reason "abort" and what it generated, so
    a trainer can continue it; the Messages and Responses APIs have no such reason, and answer
    it as the failure it is there."""
    reason = finish.finish_reason
    if reason in ("stop", "length", "repetition"):  # (repetition: vLLM's repetition detection)
        return reason
    why = finish.message or "no reason given"
    if reason == "abort" and aborts:
        return reason
    if reason == "abort":
        raise ApiError(503, f"the request was aborted: {why}", "server_error", code="aborted")
    raise ApiError(500, f"the request failed ({reason}): {why}", "server_error")


def stop_reason(finish: pdserve_pb2.Finish) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the sequence; None when
    it ended otherwise (its end-of-sequence token, max_tokens, the context)."""
    kind = finish.WhichOneof("stop_reason")
    return getattr(finish, kind) if kind is not None else None


def usage(finishes: list[pdserve_pb2.Finish], n: int = 1) -> dict:
    """The request's usage from its sequences' Finishes (index i * n + j: prompt i's sequence j):
    each prompt's tokens once (every Finish of a prompt repeats them), every sequence's output."""
    per_prompt: dict[int, pdserve_pb2.Usage] = {}
    for f in finishes:
        per_prompt.setdefault(f.index // n, f.usage)
    prompt = sum(u.prompt_tokens for u in per_prompt.values())
    completion = sum(f.usage.completion_tokens for f in finishes)
    cached = sum(u.cached_prompt_tokens for u in per_prompt.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def extension(finishes: list[pdserve_pb2.Finish], request_id: str) -> dict:
    """The `pdserve` field: where the request's time went (the last sequence to finish)."""
    last = finishes[-1] if finishes else pdserve_pb2.Finish()
    t = last.timings
    return {
        "request_id": request_id,
        "timings": stage_durations(t),
        "prefill_worker": t.prefill_worker or None,
        "decode_worker": t.decode_worker or None,
        # the weights it ran on (router/weights.py; null before any update)
        "weight_version": last.weight_version or None,
    }


async def shaped_events(writer, chunks):
    """Another API's stream (/v1/responses', /v1/messages') of a chat's chunks: each chunk through
    `writer.feed` (its event bytes), until the chunks end or the writer met a failure. A bug in
    the writer (an unexpected exception) ends the stream as a failure of the chat's does: its
    traceback logged once, then the writer's error event of a 500 server_error, if it can still
    write one."""
    async for chunk in chunks:
        try:
            events = writer.feed(chunk)
        except Exception as e:
            log.exception("HTTP stream's %s events failed", type(writer).__name__)
            error = ApiError(500, f"internal error: {type(e).__name__}", "server_error")
            if not writer.failed:
                try:
                    for event in writer.feed(error.body()):
                        yield event
                except Exception:  # the writer cannot even write its error: the stream ends
                    pass
            return
        for event in events:
            yield event
        if writer.failed:
            return


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
