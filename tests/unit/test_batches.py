"""The Batch API's runner (router/openai/batches_api.py Batches) on a fake app, without a server:
a 429 or 503 tried again until answered, a completion window that ends with lines left, the bound
on lines running at once shared by two batches, what each line's request carries (the creator's
key, the batch's mark), and a front that stops mid-batch. The fake app answers the ASGI calls the
runner makes; the files are a FileStore in a temporary folder."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from pdserve.router.openai.batches_api import Batches
from pdserve.router.openai.files_api import FileStore
from pdserve.router.openai.state import BATCH_SCOPE_KEY

WALL_S = 20.0  # a bound on a test's wait, never a speed claim


class FakeApp:
    """Answers each line by its body's "do": "ok" 200, "busy:N" 503 N times then 200, "hang"
    never; records the scopes and the most lines running at once."""

    def __init__(self):
        self.calls: list[dict] = []
        self.tries: dict[str, int] = {}
        self.running = self.most = 0

    async def __call__(self, scope, receive, send):
        body = json.loads((await receive())["body"])
        self.calls.append(scope)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            do = body["do"]
            self.tries[body["n"]] = self.tries.get(body["n"], 0) + 1
            status = 200
            if do.startswith("busy:") and self.tries[body["n"]] <= int(do[5:]):
                status = 503
            elif do == "hang":
                await asyncio.get_running_loop().create_future()
            await asyncio.sleep(0.01)
            answer = json.dumps(
                {"n": body["n"], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
            )
            headers = [(b"content-type", b"application/json"), (b"x-request-id", b"rid")]
            if status == 503:
                headers.append((b"retry-after", b"0"))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": answer.encode()})
        finally:
            self.running -= 1


def upload(files: FileStore, dos: list[str]) -> str:
    file_id, path = files.new_path()
    with open(path, "w") as f:
        for n, do in enumerate(dos):
            line = {"custom_id": f"c{n}", "method": "POST", "url": "/v1/completions",
                    "body": {"do": do, "n": str(n)}}  # fmt: skip
            f.write(json.dumps(line) + "\n")
    return files.add(file_id, path, None, "in.jsonl", "batch").id


def body(file_id: str, window: str = "24h") -> dict:
    return {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": window}


async def ended(batch) -> None:
    deadline = time.monotonic() + WALL_S
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch.object()
        await asyncio.sleep(0.01)


def lines_of(files: FileStore, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    with open(files.get(file_id, None).path) as f:
        return {r["custom_id"]: r for r in map(json.loads, f)}


@pytest.fixture
def runner():
    files = FileStore(1 << 20)
    app = FakeApp()
    batches = Batches(files, max_inflight=2)
    batches.app = app
    yield files, app, batches
    files.close()


def test_busy_answers_are_tried_again_and_each_line_is_answered_once(runner):
    files, app, batches = runner

    async def run():
        batch = batches.create(body(upload(files, ["ok", "busy:2", "ok"])), None, "Bearer sk-1")
        await ended(batch)
        return batch

    batch = asyncio.run(run())
    assert batch.status == "completed" and batch.error_file_id is None
    out = lines_of(files, batch.output_file_id)
    assert sorted(out) == ["c0", "c1", "c2"]
    assert all(r["response"]["status_code"] == 200 for r in out.values())
    assert app.tries == {"0": 1, "1": 3, "2": 1}
    assert batch.object()["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert batch.object()["usage"]["total_tokens"] == 15
    assert batches.lines_run == {"completed": 3, "failed": 0}
    # each line carries the creator's key and its batch's mark
    for scope in app.calls:
        assert dict(scope["headers"])[b"authorization"] == b"Bearer sk-1"
        assert scope["state"][BATCH_SCOPE_KEY] == batch.id and scope["path"] == "/v1/completions"


def test_a_window_that_ends_writes_the_lines_left_as_expired(runner):
    files, app, batches = runner

    async def run():
        batch = batches.create(body(upload(files, ["ok", "hang", "ok", "ok"]), "1m"), None, None)
        batch.deadline = time.monotonic() + 1.0  # the runner reads it once the file is valid
        await ended(batch)
        return batch

    batch = asyncio.run(run())
    assert batch.status == "expired" and batch.at["expired"]
    out, errors = lines_of(files, batch.output_file_id), lines_of(files, batch.error_file_id)
    assert sorted(out) == ["c0", "c2", "c3"] and sorted(errors) == ["c1"]
    assert errors["c1"]["error"]["code"] == "batch_expired" and errors["c1"]["response"] is None
    assert batch.object()["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert app.running == 0  # the hung line's call was cancelled


def test_lines_of_all_batches_share_max_inflight(runner):
    files, app, batches = runner

    async def run():
        first = batches.create(body(upload(files, ["ok"] * 6)), None, None)
        second = batches.create(body(upload(files, ["ok"] * 6)), None, None)
        await ended(first)
        await ended(second)
        return first, second

    first, second = asyncio.run(run())
    assert first.status == second.status == "completed"
    assert app.most == 2 and len(app.calls) == 12
    assert batches.running_lines == 0 and batches._free == 2


def test_a_front_that_stops_cancels_its_batches_without_finalizing(runner):
    files, app, batches = runner

    async def run():
        batch = batches.create(body(upload(files, ["hang"] * 3)), None, None)
        while app.running < 2:
            await asyncio.sleep(0.01)
        await batches.stop()
        return batch

    batch = asyncio.run(run())
    assert batch.status == "in_progress" and batch.fd is None and app.running == 0


def test_deleting_the_input_file_of_a_running_batch_is_safe(runner):
    files, app, batches = runner

    async def run():
        file_id = upload(files, ["ok"] * 4)
        batch = batches.create(body(file_id), None, None)
        path = files.get(file_id, None).path
        while not app.calls:
            await asyncio.sleep(0.01)
        files.delete(file_id, None)
        assert not os.path.exists(path)
        await ended(batch)
        return batch

    batch = asyncio.run(run())
    assert batch.status == "completed" and len(lines_of(files, batch.output_file_id)) == 4


def test_a_batch_lines_call_is_marked_for_the_admission_queue():
    """The mark in a line's scope reaches its gRPC metadata (FrontState.authorize), which the
    router's servicer reads as a batch's call (router/service.py _is_batch)."""
    from types import SimpleNamespace

    from starlette.requests import Request

    from pdserve.protos.security import NO_KEYS
    from pdserve.router.admission import BATCH_METADATA_KEY
    from pdserve.router.openai.state import FrontState
    from pdserve.router.service import _is_batch

    front = SimpleNamespace(settings=SimpleNamespace(keys=NO_KEYS))

    def metadata(state: dict):
        scope = {"type": "http", "method": "POST", "headers": [], "state": state}
        return FrontState.authorize(front, Request(scope))

    marked, plain = metadata({BATCH_SCOPE_KEY: "batch_1"}), metadata({})
    assert (BATCH_METADATA_KEY, "batch_1") in marked and not plain
    assert _is_batch(SimpleNamespace(invocation_metadata=lambda: marked))
    assert not _is_batch(SimpleNamespace(invocation_metadata=lambda: plain))
