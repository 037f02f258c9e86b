"""What the HTTP front's unit tests share (router/openai/app.py with no router behind it): a
word-level fake tokenizer, the front's ASGI app built from a few settings and a stub, a stub
router whose Generate answers what a test says, and one request sent straight to that app (no
socket).

Not a test module: imported as `from helpers.http_front import ...`. The integration tests, which
run the front in front of real workers, use helpers/http.py.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import grpc

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.app import build_app
from pdserve.router.openai.server import HttpSettings


class Words:
    """A tokenizer of ten tokens whose token i reads "t{i}" (joined by spaces), with no special
    tokens and no chat template."""

    all_special_tokens = []
    chat_template = None

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)

    def __len__(self):
        return 10


def front_app(stub=None, **settings):
    """The front's app for model "org/tiny" on `stub` (the router's gRPC stub, faked; None: no
    call may reach it), with the Words tokenizer and no prompt encoder unless `settings` say
    otherwise (HttpSettings' fields)."""
    fields = dict(
        host="127.0.0.1", port=0, model_id="org/tiny", tokenizer=Words(), encoder=object()
    )
    fields.update(settings)
    return build_app(SimpleNamespace(settings=HttpSettings(**fields), stub=stub))


async def asgi_call(
    app, method: str, path: str, body: bytes = b"", query: str = "", midway=None, length=None
):
    """(status, headers, decoded JSON body or None) of one request sent straight to the ASGI
    `app`; `midway()`, when given, runs after the body's first 10 bytes were read and before the
    rest is given (a body that arrives in two parts); `length`: the Content-Length header's raw
    bytes (default: the body's length)."""
    parts = [body[:10], body[10:]] if midway is not None else [body]
    sent, out = [], {}

    async def receive():
        if parts:
            part = parts.pop(0)
            if midway is not None and not parts:
                midway()
            return {"type": "http.request", "body": part, "more_body": bool(parts)}
        await asyncio.Event().wait()

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.decode().lower(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            sent.append(message.get("body", b""))

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query.encode(),
        "server": ("test", 80),
        "client": ("test", 1),
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", length if length is not None else str(len(body)).encode()),
        ],
    }
    await app(scope, receive, send)
    return out["status"], out["headers"], json.loads(b"".join(sent) or b"null")


class FakeCall:
    """A router's Generate call that answers `responses` (GenerateResponse messages), then ends."""

    def __init__(self, responses):
        self._left = list(responses)

    async def read(self):
        return self._left.pop(0) if self._left else grpc.aio.EOF

    async def initial_metadata(self):
        return ()

    def cancel(self):
        pass


class FakeRouter:
    """The router's gRPC stub as the front calls it: each Generate request is kept in `gens` and
    answered by `answer(gen)` (a list of GenerateResponse)."""

    def __init__(self, answer):
        self.answer, self.gens = answer, []

    def Generate(self, gen, metadata=(), timeout=None):
        self.gens.append(gen)
        return FakeCall(self.answer(gen))


def one_token(prompt_tokens: int) -> list:
    """A sequence's answer: token 8 ("t8"), then a stop Finish counting `prompt_tokens`."""
    finish = pdserve_pb2.Finish(index=0, finish_reason="stop")
    finish.usage.prompt_tokens, finish.usage.completion_tokens = prompt_tokens, 1
    delta = pdserve_pb2.TokenDelta(index=0, token_ids=[8], text="t8")
    return [pdserve_pb2.GenerateResponse(delta=delta), pdserve_pb2.GenerateResponse(finish=finish)]


class HangingRouter:
    """A router whose Generate calls never answer; it keeps each call, to see it cancelled."""

    def __init__(self):
        self.calls = []

    def Generate(self, gen, metadata=(), timeout=None):
        call = HangingCall()
        self.calls.append(call)
        return call


class HangingCall:
    cancelled = False

    async def read(self):
        await asyncio.sleep(3600)

    def cancel(self):
        self.cancelled = True


class UnaryReply:
    """A grpc.aio unary call's stand-in: awaiting it gives `reply`."""

    def __init__(self, reply):
        self.reply = reply

    def __await__(self):
        async def answer():
            return self.reply

        return answer().__await__()

    def cancel(self):
        pass


class EmbedRouter:
    """A router whose Embed answers the vector (0, 1) for each input (logits (0, 1) to /classify),
    counting a text's words as its tokens; `calls` keeps each EmbedRequest."""

    def __init__(self):
        self.calls = []

    def Embed(self, request, metadata=()):
        self.calls.append(request)
        reply = pdserve_pb2.EmbedResponse()
        for i, one in enumerate(request.inputs):
            n = len(one.text.split()) if one.HasField("text") else len(one.token_ids.ids)
            reply.embeddings.add(index=i, values=[0.0, 1.0], prompt_tokens=n)
            reply.prompt_tokens += n
        return UnaryReply(reply)
