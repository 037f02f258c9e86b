"""What the HTTP front's unit tests share (router/openai/app.py with no router behind it): a
word-level fake tokenizer, the front's ASGI app built from a few settings and a stub, and one
request sent straight to that app (no socket).

Not a test module: imported as `from helpers.http_front import ...`. The integration tests, which
run the front in front of real workers, use helpers/http.py.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

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
