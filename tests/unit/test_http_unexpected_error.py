"""An exception that no handler of the HTTP front takes (a bug) is a 500 with OpenAI's error
object, and the app returns normally after answering it (router/openai/app.py _Unexpected).
Before, Starlette's handler for Exception answered and then raised the exception again, so
uvicorn closed the client's keep-alive connection and the client's next request on it failed."""

from __future__ import annotations

import asyncio

import pytest

from helpers.http_front import asgi_call, front_app


def test_an_unexpected_exception_is_a_500_and_the_app_returns_normally():
    app = front_app()

    @app.get("/boom")
    async def boom():
        raise TypeError("a bug")

    status, _, body = asyncio.run(asgi_call(app, "GET", "/boom"))
    assert status == 500
    assert body["error"]["message"] == "internal error: TypeError"
    assert body["error"]["type"] == "server_error"


def test_an_exception_after_the_response_started_still_ends_the_call():
    app = front_app()

    class StartedThenFails:  # a raw ASGI endpoint (Starlette calls an instance as one)
        async def __call__(self, scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            raise TypeError("mid-stream")

    app.add_route("/half", StartedThenFails())
    with pytest.raises(TypeError):
        asyncio.run(asgi_call(app, "GET", "/half"))
