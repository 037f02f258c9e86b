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

    def __init__(self, hang: bool = True):
        self.hang = hang  # False: "hang" answers as "ok" does (a router started again)
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
            elif do == "hang" and self.hang:
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


def upload(files: FileStore, dos: list[str], owner=None) -> str:
    file_id, path = files.new_path()
    with open(path, "w") as f:
        for n, do in enumerate(dos):
            line = {"custom_id": f"c{n}", "method": "POST", "url": "/v1/completions",
                    "body": {"do": do, "n": str(n)}}  # fmt: skip
            f.write(json.dumps(line) + "\n")
    return files.add(file_id, path, owner, "in.jsonl", "batch").id


def body(file_id: str, window: str = "24h") -> dict:
    return {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": window}


async def ended(batch) -> None:
    deadline = time.monotonic() + WALL_S
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch.object()
        await asyncio.sleep(0.01)


def lines_of(files: FileStore, file_id: str | None, owner=None) -> dict[str, dict]:
    if file_id is None:
        return {}
    with open(files.get(file_id, owner).path) as f:
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


def run_until_stopped(folder, dos: list[str], owner=None) -> tuple[str, str]:
    """A router's batch on `dos` in router.files_dir `folder`, one line at a time, stopped while
    its "hang" line runs: (the batch's id, its input's id)."""

    async def run():
        files = FileStore(1 << 20, str(folder))
        app = FakeApp()
        batches = Batches(files, max_inflight=1)
        batches.app = app
        file_id = upload(files, dos, owner)
        batch = batches.create(body(file_id), owner, "Bearer sk-1")
        while batch.completed < dos.index("hang") or not app.running:
            await asyncio.sleep(0.01)
        await batches.stop()
        files.close()
        assert batch.status == "in_progress"
        return batch.id, file_id

    return asyncio.run(run())


async def started_again(folder, keys: bool = False):
    files = FileStore(1 << 20, str(folder))
    app = FakeApp(hang=False)
    batches = Batches(files, max_inflight=1)
    batches.app = app
    await batches.resume(keys)
    return files, app, batches


def test_a_batch_resumes_where_a_stopped_router_left_it(tmp_path):
    folder = tmp_path / "files"
    batch_id, file_id = run_until_stopped(folder, ["ok", "ok", "hang", "ok", "ok"])

    async def run():
        files, app, batches = await started_again(folder)
        assert files.get(file_id, None).purpose == "batch"  # the input, listed again
        batch = batches.get(batch_id, None)
        await ended(batch)
        return files, app, batch

    files, app, batch = asyncio.run(run())
    assert batch.status == "completed"
    assert batch.object()["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert batch.object()["usage"]["total_tokens"] == 25
    assert sorted(lines_of(files, batch.output_file_id)) == ["c0", "c1", "c2", "c3", "c4"]
    # what had a result is not run again; the request running as the router stopped is
    assert sorted(app.tries) == ["2", "3", "4"]
    # and a third router lists it as it ended
    files3, _, batches3 = asyncio.run(started_again(folder))
    assert batches3.get(batch_id, None).object() == batch.object()
    assert len(lines_of(files3, batch.output_file_id)) == 5


def test_a_resumed_batch_under_api_keys_waits_for_its_owner_and_drops_a_cut_line(tmp_path):
    folder = tmp_path / "files"
    batch_id, _ = run_until_stopped(folder, ["ok", "hang", "ok"], owner="o")
    record = json.loads((folder / f"{batch_id}.json").read_text())
    with open(folder / record["out_ids"][0], "ab") as f:  # a line the router was writing
        f.write(b'{"id":"batch_req_1","custom_id":"c1","resp')

    async def run():
        files, app, batches = await started_again(folder, keys=True)
        batch = batches.get(batch_id, "o")
        await asyncio.sleep(0.2)
        assert not app.calls and batch.status == "in_progress"  # no key to send its lines with
        batches.rearm("someone else", "Bearer sk-2")
        batches.rearm("o", None)  # no key, and its window open: nothing to send lines with
        await asyncio.sleep(0.2)
        assert not app.calls
        batches.rearm("o", "Bearer sk-1")
        await ended(batch)
        return files, app, batch

    files, app, batch = asyncio.run(run())
    assert batch.status == "completed" and sorted(app.tries) == ["1", "2"]
    assert sorted(lines_of(files, batch.output_file_id, "o")) == ["c0", "c1", "c2"]
    assert {dict(s["headers"])[b"authorization"] for s in app.calls} == {b"Bearer sk-1"}


def test_a_batch_whose_input_was_deleted_while_stopped_fails_keeping_its_results(tmp_path):
    folder = tmp_path / "files"
    batch_id, file_id = run_until_stopped(folder, ["ok", "hang", "ok"])
    FileStore(1 << 20, str(folder)).delete(file_id, None)
    (folder / "file-0123456789abcdef01234567").write_bytes(b'{"custom')  # an upload cut short

    async def run():
        files, app, batches = await started_again(folder)
        batch = batches.get(batch_id, None)
        await ended(batch)
        return files, app, batch

    files, app, batch = asyncio.run(run())
    assert batch.status == "failed" and batch.errors[0]["code"] == "input_file_deleted"
    assert sorted(lines_of(files, batch.output_file_id)) == ["c0"] and not app.calls
    # no file of no batch is left in the folder (the upload cut short is removed)
    assert sorted(p.name for p in folder.iterdir() if "." not in p.name) == [batch.output_file_id]


def test_a_resumed_batch_whose_owner_never_calls_again_expires_with_its_window(tmp_path):
    folder = tmp_path / "files"
    batch_id, _ = run_until_stopped(folder, ["ok", "hang", "ok"], owner="o")
    path = folder / f"{batch_id}.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "expires_at": time.time() + 0.5}))

    async def run():
        files, app, batches = await started_again(folder, keys=True)
        batch = batches.get(batch_id, "o")
        await ended(batch)
        return files, app, batch

    files, app, batch = asyncio.run(run())
    assert batch.status == "expired" and not app.calls
    errors = lines_of(files, batch.error_file_id, "o")
    assert sorted(errors) == ["c1", "c2"]
    assert {e["error"]["code"] for e in errors.values()} == {"batch_expired"}
    assert sorted(lines_of(files, batch.output_file_id, "o")) == ["c0"]


def test_the_batch_keys_reach_the_router(tmp_path, monkeypatch):
    from helpers.deploy_config import router_config_of, write
    from pdserve.deploy.config.load import load_config

    def passed(yaml: str):
        rc = router_config_of(load_config(write(tmp_path, yaml)), monkeypatch)
        return rc.http_files_store_bytes, rc.http_files_dir, rc.http_batch_max_inflight

    assert passed("model: smollm2\n") == (1 << 30, None, 16)
    keys = "router:\n  files_store_mb: 5\n  files_dir: /srv/batches\n  batch_max_inflight: 3\n"
    assert passed("model: smollm2\n" + keys) == (5 << 20, "/srv/batches", 3)


def test_an_upload_cut_short_is_a_client_gone_and_one_too_long_a_413():
    from starlette.requests import ClientDisconnect

    from pdserve.router.openai import files_api
    from pdserve.router.openai.errors import ApiError
    from pdserve.router.openai.state import ClientGone

    class Body:
        def __init__(self, cut: bool):
            self.cut = cut

        async def stream(self):
            yield b"x" * 64
            if self.cut:
                raise ClientDisconnect()
            yield b"y" * 64

    async def read(body, limit):
        return [chunk async for chunk in files_api._bounded(body, limit)]

    with pytest.raises(ClientGone, match="after 64 bytes"):
        asyncio.run(read(Body(cut=True), 1 << 20))
    with pytest.raises(ApiError) as refused:
        asyncio.run(read(Body(cut=False), 100))
    assert refused.value.status == 413
