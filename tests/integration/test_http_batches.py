"""OpenAI's Files and Batch APIs on the HTTP front (router/openai/files_api.py, batches_api.py)
through the official `openai` client, on a prefill and a decode worker: a batch's answers equal
engine.LLM's, a bad line's answer goes to the error file, a bad file fails the batch naming its
lines, a cancelled batch accounts for every line, files and batches belong to their key, and bad
uploads are refused while the front keeps serving. The cluster is tests/integration/conftest.py's.
"""

from __future__ import annotations

import io
import json
import time

import pytest

from helpers.http import KEY, KEY2, MODEL, assert_error, openai_client, post, request, serves
from pdserve.engine import SamplingParams

openai = pytest.importorskip("openai")


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def chat_line(custom_id: str, content: str, max_tokens: int = 6, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **body,
        },
    }


def submit(client, data: bytes, endpoint: str = "/v1/chat/completions", window="24h", **kw):
    """`data` uploaded as a batch's file and a batch started on it: (the file, the batch)."""
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint=endpoint, completion_window=window, **kw
    )
    return uploaded, batch


def wait_completed(client, batch_id: str, n: int, timeout_s: float = 30) -> None:
    """Until `n` of the batch's requests completed."""
    deadline = time.monotonic() + timeout_s
    while client.batches.retrieve(batch_id).request_counts.completed < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def wait_ended(client, batch_id: str, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)


def records(client, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    lines = client.files.content(file_id).text.splitlines()
    out = {}
    for line in lines:
        record = json.loads(line)
        assert record["custom_id"] not in out, record  # each request once
        out[record["custom_id"]] = record
    return out


def test_a_batch_of_chats_answers_as_the_engine_and_a_bad_line_goes_to_the_error_file(
    router, idle, llm
):
    c = openai_client(router)
    words = ["t5 t9", "t11 t12 t13", "t20", "t21 t22", "t30 t31 t32 t33"]
    lines = [chat_line(f"req-{i}", w) for i, w in enumerate(words)]
    lines.append(chat_line("bad", "t5", max_tokens=-1))  # the endpoint's own 400
    uploaded, batch = submit(c, jsonl(lines), metadata={"job": "nightly"})
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_ended(c, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 6
    assert (done.request_counts.completed, done.request_counts.failed) == (5, 1)
    outputs, errors = records(c, done.output_file_id), records(c, done.error_file_id)
    assert set(outputs) == {f"req-{i}" for i in range(5)} and set(errors) == {"bad"}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, w in enumerate(words):
        want = llm.chat([{"role": "user", "content": w}], params, use_tqdm=False)[0]
        response = outputs[f"req-{i}"]["response"]
        assert response["status_code"] == 200 and response["request_id"]
        assert response["body"]["choices"][0]["message"]["content"] == want.outputs[0].text
    bad = errors["bad"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "max_tokens", bad
    assert done.usage.output_tokens == 5 * 6
    assert done.usage.input_tokens == sum(
        o["response"]["body"]["usage"]["prompt_tokens"] for o in outputs.values()
    )
    assert done.completed_at >= done.in_progress_at >= done.created_at
    assert [b.id for b in c.batches.list()][0] == batch.id
    output_file = c.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output"
    c.files.delete(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(uploaded.id)


def test_a_bad_file_fails_the_batch_naming_its_lines(router):
    c = openai_client(router)
    good = chat_line("a", "t5")
    lines = [
        good,
        {**good, "url": "/v1/completions"},
        b"{not json",
        good,  # custom_id "a" again
        {**chat_line("s", "t5", stream=True)},
        {**good, "custom_id": "m", "method": "GET"},
    ]
    raw = b"\n".join(x if isinstance(x, bytes) else json.dumps(x).encode() for x in lines)
    _, batch = submit(c, raw)
    done = wait_ended(c, batch.id)
    assert done.status == "failed" and done.failed_at is not None
    assert done.output_file_id is None and done.error_file_id is None
    by_line = {e.line: e.code for e in done.errors.data}
    assert by_line == {
        2: "invalid_url",
        3: "invalid_json_line",
        4: "duplicate_custom_id",
        5: "invalid_body",
        6: "invalid_method",
    }, done.errors
    serves(router)


def test_batch_requests_are_refused_with_what_to_fix(router):
    c = openai_client(router)
    uploaded = c.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line("a", "t5")]))),
                              purpose="batch")  # fmt: skip
    for body, param in (
        ({"endpoint": "/v1/chat/completions", "completion_window": "24h"}, "input_file_id"),
        ({"input_file_id": uploaded.id, "endpoint": "/v1/moderations",
          "completion_window": "24h"}, "endpoint"),
        ({"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions",
          "completion_window": "2d"}, "completion_window"),
        ({"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions",
          "completion_window": "24h", "metadata": {"k": 5}}, "metadata"),
    ):  # fmt: skip
        status, _, answer = post(router, "/v1/batches", body)
        assert_error(status, answer, 400, param)
    status, _, answer = post(
        router,
        "/v1/batches",
        {"input_file_id": "file-nope", "endpoint": "/v1/chat/completions",
         "completion_window": "24h"},
    )  # fmt: skip
    assert_error(status, answer, 404, "file_id")
    status, _, answer = request(router.http_address, "GET", "/v1/batches/batch_nope")
    assert_error(status, answer, 404, "batch_id")
    # an upload that is not multipart, or for another purpose
    status, _, answer = post(router, "/v1/files", {"purpose": "batch"})
    assert_error(status, answer, 400)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        c.files.create(file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    serves(router)


def test_a_cancelled_batch_accounts_for_every_line(workers, idle):
    r = workers.router(http_batch_max_inflight=1)
    try:
        c = openai_client(r)
        lines = [chat_line(f"r{i}", "t5 t6", max_tokens=40) for i in range(12)]
        _, batch = submit(c, jsonl(lines), window="1h")
        wait_completed(c, batch.id, 1)
        c.batches.cancel(batch.id)
        done = wait_ended(c, batch.id)
        assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
        outputs, errors = records(c, done.output_file_id), records(c, done.error_file_id)
        assert set(outputs) | set(errors) == {f"r{i}" for i in range(12)}
        assert not set(outputs) & set(errors)
        assert 1 <= len(outputs) < 12
        assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (12, len(outputs), len(errors))
    finally:
        r.stop()


def test_files_and_batches_belong_to_their_key(workers):
    r = workers.router(api_keys=(KEY, KEY2))
    try:
        _only_the_owner_sees_them(openai_client(r, KEY), openai_client(r, KEY2))
        with pytest.raises(openai.AuthenticationError):
            openai_client(r, "sk-nobody").files.list()
    finally:
        r.stop()


def _only_the_owner_sees_them(owner, other):
    uploaded, batch = submit(owner, jsonl([chat_line("a", "t5")]))
    assert wait_ended(owner, batch.id).status == "completed"
    for call in (
        lambda: other.files.retrieve(uploaded.id),
        lambda: other.files.content(uploaded.id),
        lambda: other.files.delete(uploaded.id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [f.id for f in other.files.list()] == [] and list(other.batches.list()) == []
    assert uploaded.id in [f.id for f in owner.files.list()]


def test_uploads_past_the_store_s_bound_are_refused_until_files_are_deleted(workers):
    r = workers.router(http_files_store_bytes=4096)
    off = workers.router(http_files_store_bytes=0)
    try:
        c = openai_client(r)
        data = jsonl([chat_line(f"r{i}", "t5 " * 20) for i in range(12)])[:3000]
        first = c.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch")
        with pytest.raises(openai.APIStatusError, match="delete files first") as refused:
            c.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")
        assert refused.value.status_code == 413
        with pytest.raises(openai.APIStatusError) as too_big:
            c.files.create(file=("c.jsonl", io.BytesIO(data + data)), purpose="batch")
        assert too_big.value.status_code == 413
        assert [f.id for f in c.files.list()] == [first.id]
        c.files.delete(first.id)
        second = c.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")
        assert c.files.content(second.id).content == data
        assert [f.filename for f in c.files.list(purpose="batch")] == ["b.jsonl"]
        serves(r)
        with pytest.raises(openai.NotFoundError, match="files_store_mb is 0"):
            openai_client(off).files.list()
    finally:
        r.stop()
        off.stop()


def test_pdserve_batch_writes_the_answers_and_the_errors(router, idle, llm, tmp_path, capsys):
    from pdserve.cli import main

    words = ["t5 t9", "t11 t12"]
    lines = [chat_line(f"q{i}", w) for i, w in enumerate(words)]
    lines.append(chat_line("bad", "t5", temperature=-1))
    (tmp_path / "in.jsonl").write_bytes(jsonl(lines))
    out = tmp_path / "out.jsonl"
    url = f"http://{router.http_address}"
    argv = ["batch", str(tmp_path / "in.jsonl"), "-o", str(out), "--url", url, "--interval", "0.1"]
    before = {f.id for f in openai_client(router).files.list()}
    assert main(argv) == 1  # one request failed
    answers = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, w in enumerate(words):
        want = llm.chat([{"role": "user", "content": w}], params, use_tqdm=False)[0]
        got = answers[f"q{i}"]["response"]["body"]["choices"][0]["message"]["content"]
        assert got == want.outputs[0].text
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert errors[0]["response"]["status_code"] == 400
    assert "2 completed, 1 failed of 3" in capsys.readouterr().err
    # the router keeps none of the three files
    assert {f.id for f in openai_client(router).files.list()} == before
    (tmp_path / "in.jsonl").write_bytes(jsonl(lines[:2]))
    assert main(argv) == 0
    assert main([*argv[:-4], "--url", "http://127.0.0.1:9"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_responses_and_embeddings_run_as_batches_and_leave_the_store_alone(router, idle):
    c = openai_client(router)

    def run(endpoint: str, body: dict) -> dict:
        line = {"custom_id": "x", "method": "POST", "url": endpoint, "body": body}
        _, batch = submit(c, jsonl([line]), endpoint)
        done = wait_ended(c, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 1, done
        return records(c, done.output_file_id)["x"]["response"]["body"]

    answer = run("/v1/responses", {"model": MODEL, "input": "t5 t6", "max_output_tokens": 4})
    assert answer["object"] == "response" and answer["status"] in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):  # not kept: the output file has it
        c.responses.retrieve(answer["id"])
    vectors = run("/v1/embeddings", {"model": MODEL, "input": ["t5 t6", "t7"]})
    assert [len(d["embedding"]) > 0 for d in vectors["data"]] == [True, True]
    assert vectors["usage"]["prompt_tokens"] > 0


def test_a_router_started_again_on_its_files_dir_finishes_the_batch(workers, idle, llm, tmp_path):
    folder = str(tmp_path / "files")
    words = [f"t{5 + i} t{9 + i}" for i in range(8)]
    lines = [chat_line(f"r{i}", w, max_tokens=20) for i, w in enumerate(words)]
    first = workers.router(http_files_dir=folder, http_batch_max_inflight=1)
    try:
        c = openai_client(first)
        uploaded, batch = submit(c, jsonl(lines), window="1h")
        wait_completed(c, batch.id, 2)
    finally:
        first.stop()  # mid-batch: the next router on the folder goes on with it
    second = workers.router(http_files_dir=folder)
    try:
        c = openai_client(second)
        assert c.files.retrieve(uploaded.id).filename == "in.jsonl"
        done = wait_ended(c, batch.id)
        assert done.status == "completed", done
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (8, 8, 0)
        outputs = records(c, done.output_file_id)  # each request once
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        for i, w in enumerate(words):
            want = llm.chat([{"role": "user", "content": w}], params, use_tqdm=False)[0]
            got = outputs[f"r{i}"]["response"]["body"]["choices"][0]["message"]["content"]
            assert got == want.outputs[0].text
    finally:
        second.stop()
