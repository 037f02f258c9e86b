"""The HTTP front's server-sent events (router/openai/generate.py starts them): one gRPC Generate
call's responses as OpenAI's chunks, for chat and completions. One chunk per TokenDelta (its
logprobs, with their alternatives, in logprobs.py's shapes), one with the finish_reason (and
vLLM's stop_reason) per sequence, with include_usage a last chunk with empty choices and the
usage, then `data: [DONE]`; with vLLM's continuous_usage_stats every chunk carries its choice's
usage so far too (the prompt's token count comes in the call's initial metadata,
PROMPT_TOKENS_KEY, before any token); with vLLM's return_token_ids each delta's chunk has its ids
and the prompt's ids ride on the first chunk (completions: each choice's first generated one).
Completions' echo sends each choice's prompt first (max_tokens 0: the prompt alone; the prompt's
logprobs are not streamed: router/openai/protocol.py refuses them with stream=true). A failure
after the stream started is one error event, then [DONE]: a gRPC status as its HTTP error, and
an unexpected exception (a bug) as a 500 server_error whose traceback is logged once here, as
vLLM frames both; /v1/responses and /v1/messages turn that event into their own. A chat with
tools has its text read by tool_calls.py: content deltas, and each call as a `tool_calls` delta
when it is complete. The generator cancels the call however it ends, so a client gone mid-stream
aborts the request on both pools.
"""

from __future__ import annotations

import logging
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
from pdserve.router.openai.responses.parts import extension, finish_reason, sse, stop_reason
from pdserve.router.openai.responses.reasoning import ChatText, Reading, reading_of
from pdserve.router.openai.responses.tool_calls import delta_of
from pdserve.router.openai.responses.whole import (
    chat_text,
    echo_text,
    request_usage,
    with_reasoning_tokens,
)
from pdserve.router.service import PROMPT_TOKENS_KEY  # the router's Generate sends it

log = logging.getLogger(__name__)


def _with(choice: dict, delta: dict) -> dict:
    choice["delta"].update(delta)
    return choice


def response_id(chat: bool, public_id: str) -> str:
    """A chat completion's or a completion's id, as vLLM forms it of the request's id."""
    return f"chatcmpl-{public_id}" if chat else f"cmpl-{public_id}"


def prompt_tokens_of(metadata) -> int:
    """The prompt's token count in a Generate call's initial metadata (0 when absent)."""
    for key, value in metadata or ():
        if key == PROMPT_TOKENS_KEY:
            return int(value) if str(value).isdigit() else 0
    return 0


async def prompt_token_counts(call) -> list[int]:
    """Each prompt's token count: the one call's, or each of a batch's calls' (prompt_counts)."""
    if hasattr(call, "prompt_counts"):
        return await call.prompt_counts()
    return [prompt_tokens_of(await call.initial_metadata())]


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


class _Chunks:
    """The chunks of one stream: their common fields, each choice's shape, and what a delta or a
    finish of the call becomes (a chat with tools reads its text through a ToolCallParser per
    sequence)."""

    def __init__(self, body, chat: bool, model_id: str, public_id: str, text_of):
        self.base = {
            "id": response_id(chat, public_id),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_id,
        }
        self.body, self.chat, self.text_of = body, chat, text_of
        opts = body.stream_options
        self.include_usage = bool(opts and opts.usage())
        self.continuous = bool(opts and opts.continuous())
        self.prompt_tokens: list[int] = []  # continuous: each prompt's, set by `stream`
        self.generated: dict[int, int] = {}  # continuous: each choice's tokens so far
        self.want_logprobs, self.num_top = body.wants_logprobs, body.num_top()
        self.echo = not chat and body.echo
        self.echo_only = self.echo and body.max_tokens == 0
        self.mode = body.tool_mode() if chat else "none"
        # how a chat's text is read (reasoning split, tool call format): `chunks` reads it from
        # the call
        self.reading = Reading()
        self.parsers: dict[int, ChatText] = {}  # tools or reasoning: each sequence's
        self.offsets: dict[int, int] = {}  # completions: each choice's text offset so far
        # vLLM's return_token_ids: each delta's ids on its chunk, each prompt's ids (known from
        # its call's first response) on the first chunk (chat) or each choice's first (completions)
        self.want_ids = bool(getattr(body, "return_token_ids", None))
        self.prompt_ids: dict[int, list[int]] = {}  # prompt index -> its ids
        self.ids_sent: set[int] = set()  # completions: choices whose prompt ids went out

    def chunk(self, choices: list[dict]) -> dict:
        out = {**self.base, "choices": choices}
        if self.continuous and choices:  # vLLM's: the choice's usage so far
            index = choices[0]["index"]
            counts = self.prompt_tokens
            prompt = counts[min(index // self.body.n, len(counts) - 1)] if counts else 0
            done = self.generated.get(index, 0)
            out["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": done,
                "total_tokens": prompt + done,
            }
        elif self.include_usage:
            out["usage"] = None
        return out

    def count(self, d: pdserve_pb2.TokenDelta) -> None:
        if not self.echo_only:
            self.generated[d.index] = self.generated.get(d.index, 0) + len(d.token_ids)

    def choice(self, index: int, text: str | None, lp, reason: str | None, role=False) -> dict:
        if self.chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}

    def learn_prompt_ids(self, r: pdserve_pb2.GenerateResponse) -> None:
        """return_token_ids: the prompt's ids if this response carries them."""
        event = r.delta if r.HasField("delta") else r.finish
        if self.want_ids and event.prompt_token_ids:
            self.prompt_ids.setdefault(event.index // self.body.n, list(event.prompt_token_ids))

    def opening(self) -> list[dict]:
        """A chat's assistant role, one chunk per sequence (the first with the prompt's ids when
        asked); completions' echo, each choice's prompt (its logprobs are not streamed: the
        schema's check)."""
        out = []
        if self.chat:
            out += [
                self.chunk([self.choice(i, "", None, None, role=True)]) for i in range(self.body.n)
            ]
            if self.want_ids and out:
                out[0]["prompt_token_ids"] = self.prompt_ids.get(0, [])
        if self.echo:
            for i in range(len(self.body.prompts()) * self.body.n):
                head = echo_text(self.body, i, self.text_of)
                self.offsets[i] = len(head)
                out.append(self.chunk([self.choice(i, head, None, None)]))
        return out

    def sent(self, d: pdserve_pb2.TokenDelta) -> bool:
        """Whether the delta is sent at all (echo alone sends the prompt only; a delta with no
        text yet goes out for its logprobs or its ids when they are asked for)."""
        carries = (self.want_logprobs or self.want_ids) and d.token_ids
        return not (self.echo_only or not d.text and not carries)

    def with_ids(self, chunk: dict, d: pdserve_pb2.TokenDelta) -> dict:
        """return_token_ids: the delta's ids on its choice (completions: the prompt's too, on
        the choice's first chunk)."""
        if not self.want_ids:
            return chunk
        choice = chunk["choices"][0]
        choice["token_ids"] = list(d.token_ids)
        if not self.chat and d.index not in self.ids_sent:
            self.ids_sent.add(d.index)
            choice["prompt_token_ids"] = self.prompt_ids.get(d.index // self.body.n, [])
        return chunk

    def logprobs(self, d: pdserve_pb2.TokenDelta) -> dict | None:
        if not self.want_logprobs:
            return None
        ids, lps, tops = list(d.token_ids), list(d.logprobs), list(d.top_logprobs)
        check_logprobs(ids, lps, tops, self.num_top)
        if self.chat:
            return chat_logprobs(ids, lps, self.text_of, tops, self.num_top)
        at = self.offsets.get(d.index, 0)
        lp = completion_logprobs(ids, lps, self.text_of, at, tops, self.num_top)
        self.offsets[d.index] = at + sum(len(t) for t in lp["tokens"])
        return lp

    def of_delta(self, d: pdserve_pb2.TokenDelta, lp) -> list[dict]:
        if self.mode == "none" and self.reading.reasoning is None:
            return [self.with_ids(self.chunk([self.choice(d.index, d.text, lp, None)]), d)]
        p = self._parser(d.index)
        events = p.feed(d.text, len(d.token_ids), self._texts(d))
        deltas = [delta_of(e) for e in events] or ([{}] if lp or self.want_ids else [])
        out = [
            self.chunk([_with(self.choice(d.index, None, lp if k == 0 else None, None), delta)])
            for k, delta in enumerate(deltas)
        ]
        if out:  # the delta's ids ride on its first chunk
            self.with_ids(out[0], d)
        return out

    def _texts(self, d: pdserve_pb2.TokenDelta):
        """Each of the delta's tokens' own text, when the reasoning split asks (reasoning.py)."""
        return lambda: [self.text_of.text([t]) for t in d.token_ids]

    def unsent(self, d: pdserve_pb2.TokenDelta) -> None:
        """A delta not sent (no text yet): its tokens still count where the text is split."""
        if self.reading.reasoning is not None and not self.echo_only:
            self._parser(d.index).feed("", len(d.token_ids), self._texts(d))

    def of_finish(self, f: pdserve_pb2.Finish, reason: str) -> tuple[list[dict], dict]:
        """A chat's last tool calls of the sequence, and its finish chunk (held by `stream`)."""
        calls = []
        if self.mode != "none" or self.reading.reasoning is not None:
            p = self._parser(f.index)
            for e in p.finish():
                calls.append(
                    self.chunk([_with(self.choice(f.index, None, None, None), delta_of(e))])
                )
            if p.num_calls and reason == "stop":
                reason = "tool_calls"
        last = self.choice(f.index, None if self.chat else "", None, reason)
        last["stop_reason"] = stop_reason(f)  # vLLM's: the stop string or token that matched
        return calls, self.chunk([last])

    def _parser(self, index: int) -> ChatText:
        if index not in self.parsers:
            self.parsers[index] = chat_text(self.body, self.reading)
        return self.parsers[index]


async def stream(
    call, first, body, chat: bool, model_id: str, request_id: str, text_of, public_id=None
):
    """The SSE bytes of `call`, whose first response is `first`: `chunks` as server-sent
    events, an aborted sequence ending with finish_reason "abort" (parts.finish_reason)."""
    args = (call, first, body, chat, model_id, request_id, text_of)
    async for out in chunks(*args, aborts=True, public_id=public_id):
        yield sse(out)


async def chunks(
    call,
    first,
    body,
    chat: bool,
    model_id: str,
    request_id: str,
    text_of,
    aborts: bool = False,
    public_id: str | None = None,
):
    """The chunks of `call` (dicts; an error as OpenAI's error object; "[DONE]" last), whose
    first response is `first`. `request_id` is the router's (the `pdserve` extension's and the
    log's), `public_id` the client's one that the chunks' id carries (None: the router's without
    its "http-"). The `pdserve` extension rides on the last chunk before [DONE]; each finish
    chunk is held until the next chunk goes out, so the last one can take it. /v1/responses
    (router/openai/responses_api.py) reads a chat's chunks as its own events."""
    public_id = public_id or request_id.removeprefix("http-")
    c = _Chunks(body, chat, model_id, public_id, text_of)
    finishes: list[pdserve_pb2.Finish] = []
    held: dict | None = None  # the latest finish chunk: the extension goes on the last one
    try:
        if c.continuous:
            c.prompt_tokens = await prompt_token_counts(call)
        if chat:
            c.reading = await reading_of(call)
        c.learn_prompt_ids(first)
        for out in c.opening():
            yield out
        async for r in _prepend(first, call):
            c.learn_prompt_ids(r)
            if r.HasField("delta"):
                c.count(r.delta)
                if not c.sent(r.delta):
                    c.unsent(r.delta)
                    continue
                lp = c.logprobs(r.delta)
                if held is not None:
                    yield held
                    held = None
                for out in c.of_delta(r.delta, lp):
                    yield out
            elif r.HasField("finish"):
                reason = finish_reason(r.finish, aborts)
                finishes.append(r.finish)
                if held is not None:
                    yield held
                calls, held = c.of_finish(r.finish, reason)
                for out in calls:
                    yield out
        if c.include_usage:
            if held is not None:
                yield held
            used = request_usage(finishes, body)
            if c.reading.reasoning is not None:
                tokens = sum(p.reasoning_tokens for p in c.parsers.values())
                with_reasoning_tokens(used, tokens)
            held = {**c.base, "choices": [], "usage": used}
        if held is not None:
            held["pdserve"] = extension(finishes, request_id)
            yield held
    except (grpc.RpcError, ApiError) as e:
        if held is not None:
            yield held
        yield (ApiError.from_grpc(e) if isinstance(e, grpc.RpcError) else e).body()
    except Exception as e:  # a bug, here or in the call: framed as any failure, logged once
        log.exception("HTTP stream of request %s failed", request_id)
        if held is not None:
            yield held
        yield ApiError(500, f"internal error: {type(e).__name__}", "server_error").body()
    finally:
        call.cancel()  # a client gone mid-stream cancels here: the router aborts both legs
    yield "[DONE]"
