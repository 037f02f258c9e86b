"""What the HTTP front's unit tests share (router/openai/app.py with no router behind it): a
word-level fake tokenizer and the front's ASGI app built from a few settings and a stub.

Not a test module: imported as `from helpers.http_front import ...`. The integration tests, which
run the front in front of real workers, use helpers/http.py.
"""

from __future__ import annotations

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
