"""The HTTP front's server-sent events (router/openai/generate.py starts them): one gRPC Generate
call's responses as OpenAI's chunks, for chat and completions. One chunk per TokenDelta (its
logprobs, with their alternatives, in logprobs.py's shapes), one with the finish_reason per
sequence, with include_usage a last chunk with empty choices and the usage, then `data: [DONE]`.
Completions' echo sends each choice's prompt first (max_tokens 0: the prompt alone; the prompt's
logprobs are not streamed: router/openai/protocol.py refuses them with stream=true). A failure
after the stream started is one error event, then [DONE]. A chat with tools has its text read by
tool_calls.py: content deltas, and each call as a `tool_calls` delta when it is complete. The
generator cancels the call however it ends, so a client gone mid-stream aborts the request on
both pools.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.responses.logprobs import (
    chat_logprobs,
    check_logprobs,
    completion_logprobs,
)
from pdserve.router.openai.responses.parts import extension, finish_reason, sse
from pdserve.router.openai.responses.tool_calls import ToolCallParser, delta_of
from pdserve.router.openai.responses.whole import echo_text, request_usage


def _with(choice: dict, delta: dict) -> dict:
    choice["delta"].update(delta)
    return choice


async def rest(call) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """The call's responses until it ends."""
    while True:
        msg = await call.read()
        if msg is grpc.aio.EOF:
            return
        yield msg


async def _prepend(first, call):
    yield first
    async for r in rest(call):
        yield r


async def stream(call, first, body, chat: bool, model_id: str, request_id: str, text_of):
    """The SSE bytes of `call`, whose first response is `first`. The `pdserve` extension rides on
    the last chunk before [DONE]."""
    suffix = request_id.removeprefix("http-")
    base = {
        "id": f"chatcmpl-{suffix}" if chat else f"cmpl-{suffix}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_id,
    }
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    want_logprobs, num_top = body.wants_logprobs, body.num_top()
    echo = not chat and body.echo
    echo_only = echo and body.max_tokens == 0
    mode = body.tool_mode() if chat else "none"
    parsers: dict[int, ToolCallParser] = {}  # tools: each sequence's
    finishes: list[pdserve_pb2.Finish] = []
    offsets: dict[int, int] = {}
    held: dict | None = None  # the latest finish chunk: the extension goes on the last one

    def chunk(choices: list[dict]) -> dict:
        out = {**base, "choices": choices}
        if include_usage:
            out["usage"] = None
        return out

    def choice(index: int, text: str | None, lp, reason: str | None, role: bool = False) -> dict:
        if chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}

    try:
        if chat:  # the assistant role first, one chunk per sequence
            for i in range(body.n):
                yield sse(chunk([choice(i, "", None, None, role=True)]))
        if echo:  # each choice's prompt first (its logprobs are not streamed: the schema's check)
            for i in range(len(body.prompts()) * body.n):
                head = echo_text(body, i, text_of)
                offsets[i] = len(head)
                yield sse(chunk([choice(i, head, None, None)]))
        async for r in _prepend(first, call):
            if r.HasField("delta"):
                d = r.delta
                if echo_only or not d.text and not (want_logprobs and d.token_ids):
                    continue
                lp = None
                if want_logprobs:
                    ids, lps, tops = list(d.token_ids), list(d.logprobs), list(d.top_logprobs)
                    check_logprobs(ids, lps, tops, num_top)
                    if chat:
                        lp = chat_logprobs(ids, lps, text_of, tops, num_top)
                    else:
                        at = offsets.get(d.index, 0)
                        lp = completion_logprobs(ids, lps, text_of, at, tops, num_top)
                        offsets[d.index] = at + sum(len(t) for t in lp["tokens"])
                if held is not None:
                    yield sse(held)
                    held = None
                if mode == "none":
                    yield sse(chunk([choice(d.index, d.text, lp, None)]))
                    continue
                p = parsers.setdefault(d.index, ToolCallParser(forced=mode == "forced"))
                deltas = [delta_of(e) for e in p.feed(d.text)] or ([{}] if lp else [])
                for k, delta in enumerate(deltas):
                    yield sse(
                        chunk([_with(choice(d.index, None, lp if k == 0 else None, None), delta)])
                    )
            elif r.HasField("finish"):
                f = r.finish
                reason = finish_reason(f)
                finishes.append(f)
                if held is not None:
                    yield sse(held)
                if mode != "none":
                    p = parsers.setdefault(f.index, ToolCallParser(forced=mode == "forced"))
                    for e in p.finish():
                        yield sse(chunk([_with(choice(f.index, None, None, None), delta_of(e))]))
                    if p.num_calls and reason == "stop":
                        reason = "tool_calls"
                held = chunk([choice(f.index, None if chat else "", None, reason)])
        if include_usage:
            if held is not None:
                yield sse(held)
            held = {**base, "choices": [], "usage": request_usage(finishes, body)}
        if held is not None:
            held["pdserve"] = extension(finishes, request_id)
            yield sse(held)
    except grpc.RpcError as e:
        if held is not None:
            yield sse(held)
        yield sse(ApiError.from_grpc(e).body())
    except ApiError as e:
        if held is not None:
            yield sse(held)
        yield sse(e.body())
    finally:
        call.cancel()  # a client gone mid-stream cancels here: the router aborts both legs
    yield sse("[DONE]")
