"""previous_response_id naming a background response still running
(router/openai/responses_api.py `_history`): a 400 naming the field, with OpenAI's error object and
what to do (wait for it or cancel it), and the front keeps serving; once it has ended it can be
continued."""

from __future__ import annotations

import asyncio
import json

from helpers.http_front import HangingRouter, asgi_call, front_app


def _post(app, path: str, body: dict | None = None):
    raw = json.dumps(body).encode() if body is not None else b""
    return asgi_call(app, "POST", path, raw)


def test_continuing_a_response_still_in_progress_is_a_400_naming_the_field():
    router = HangingRouter()
    app = front_app(stub=router)

    async def run():
        status, _, queued = await _post(app, "/v1/responses", {"input": "hi", "background": True})
        assert status == 200 and queued["status"] == "queued"
        rid = queued["id"]
        body = {"input": "next", "previous_response_id": rid}
        status, _, reply = await _post(app, "/v1/responses", body)
        assert status == 400, reply
        error = reply["error"]
        assert error["param"] == "previous_response_id" and error["code"] == "response_in_progress"
        assert error["type"] == "invalid_request_error"
        assert "in progress" in error["message"] and "cancel" in error["message"]
        assert len(router.calls) == 1  # nothing was run for the refused one
        # the front keeps serving: the running one is cancelled, then continued (in the
        # background too, so that the router's call, which never answers, is not waited for)
        status, _, cancelled = await _post(app, f"/v1/responses/{rid}/cancel")
        assert status == 200 and cancelled["status"] == "cancelled"
        status, _, reply = await _post(app, "/v1/responses", {**body, "background": True})
        assert status == 200 and reply["status"] == "queued", reply
        for _ in range(1000):  # (the background task makes its call once it runs)
            if len(router.calls) == 2:
                break
            await asyncio.sleep(0)
        assert len(router.calls) == 2
        await app.state.front.responses.stop()

    asyncio.run(run())
