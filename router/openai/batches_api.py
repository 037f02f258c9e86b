"""OpenAI's Batch API on the HTTP front: a JSONL file of requests (uploaded through
router/openai/files_api.py) run on the live cluster beside its interactive traffic, each result
written to an output or error file read back through the Files API.

    POST /v1/batches               {input_file_id, endpoint, completion_window, metadata?}
    GET  /v1/batches               ?after, ?limit (1-100): newest first
    GET  /v1/batches/{id}          the Batch object: status, request_counts, usage, file ids
    POST /v1/batches/{id}/cancel

A batch is validated first (status validating: every line a JSON object with a unique custom_id,
method POST, the batch's url and a body that asks for no stream; a bad line fails the whole batch
with its line number, as OpenAI does), then runs (in_progress): each line goes through the app
itself, in-process, as the same POST a client would send with the creator's key, so admission,
routing, validation and errors are the endpoint's own. A line answered 200 goes to the output
file, any other status to the error file with its error body. A 429 or 503 (the router's queue
full, no worker ready) is not the line's fault: it is tried again, with backoff, until the
completion window ends. At the end every input line is in one of the two files: lines not run
when the batch is cancelled or expires are written to the error file as batch_cancelled or
batch_expired, and request_counts add up to the total.

Interactive traffic comes first: at most router.batch_max_inflight lines of all batches run at
once (shared in the order they asked), and each line's gRPC call is marked as a batch's, which
the router's admission queues behind every interactive call (router/admission.py): a batch never
takes an admission slot a waiting interactive request could have; past the admission its calls
travel after every interactive one's (router/service.py batch_priority).

`stop` cancels the batches when the front stops, ending none. With router.files_dir each batch's
record is written there at every change of status (its result files are flushed a line at a
time), and `resume`, as the next router's front starts, goes on with those that had not ended:
the requests with a result in their files are skipped, a line cut short is dropped. The creator's
key is never written down: under API keys a resumed batch runs once its owner calls again
(`rearm`). Without router.files_dir batches live as long as the router process, as stored
responses do. Every call runs on the front's event loop; reading lines and validating the file
run on threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import time
from collections import OrderedDict, deque

from fastapi import APIRouter, Request

from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.files_api import FileStore, write_atomically
from pdserve.router.openai.responses_api import page_of
from pdserve.router.openai.state import BATCH_SCOPE_KEY, check_json_body, key_header, state_of

log = logging.getLogger(__name__)
router = APIRouter()

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
)
MAX_REQUESTS = 50_000  # lines of one batch at most (OpenAI's bound)
MAX_CUSTOM_ID = 512  # characters of a custom_id at most
MAX_KEPT = 1_000  # Batch objects kept; past it the oldest ended one is forgotten (files stay)
MAX_ACTIVE = 100  # batches validating, running or finalizing at once
MAX_ERRORS = 100  # validation errors listed in a failed batch
MAX_METADATA = 16  # metadata pairs (OpenAI's bounds: keys of 64 characters, values of 512)
RETRIED = (429, 503)  # the cluster busy, not the request wrong: tried again within the window
MAX_BACKOFF_S = 30.0
_WINDOW = re.compile(r"^([1-9][0-9]{0,3})([mh])$")
MAX_WINDOW_S = 7 * 24 * 3600
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
_USAGE = (  # (the batch's usage field, the names a line's usage gives it under)
    ("input_tokens", ("input_tokens", "prompt_tokens")),
    ("output_tokens", ("output_tokens", "completion_tokens")),
)


class Batch:
    """One batch: its Batch object's fields, the lines' places in the input file, and what ran."""

    def __init__(self, owner, auth, endpoint: str, input_file_id: str, window: str, expires_at,
                 meta, batch_id: str | None = None, created_at: int | None = None):  # fmt: skip
        self.id = batch_id or "batch_" + secrets.token_hex(12)
        self.owner, self.auth, self.endpoint = owner, auth, endpoint
        self.input_file_id, self.window, self.metadata = input_file_id, window, meta
        self.created_at = created_at or int(time.time())
        self.expires_at = expires_at
        self.deadline = time.monotonic() + (expires_at - time.time())
        self.status = "validating"
        self.at: dict[str, int] = {}  # status -> when it was reached (in_progress_at, ...)
        self.errors: list[dict] = []
        self.total = self.completed = self.failed = 0
        self.usage = {"input_tokens": 0, "output_tokens": 0, "cached": 0, "reasoning": 0}
        self.output_file_id: str | None = None
        self.error_file_id: str | None = None
        self.fd: int | None = None  # the input, open while it runs: a DELETE of it is safe
        self.lines: list[tuple[int, int]] = []  # (offset, length) of each request line
        self.done = bytearray()  # 1 where the line's result is written
        self.task: asyncio.Task | None = None
        self.cancel_asked = False
        self.outputs = None  # (output, errors): _Out files while it runs
        self.out_ids: list[str] | None = None  # their file ids (in its record: a resume's)
        self.waits_for_key = False  # resumed under API keys: runs once its owner calls again

    # what router.files_dir keeps of it: the Batch object's fields and the result files' ids
    _RECORD = ("id", "owner", "endpoint", "input_file_id", "window", "expires_at", "metadata",
               "created_at", "status", "at", "errors", "total", "completed", "failed", "usage",
               "output_file_id", "error_file_id", "out_ids")  # fmt: skip

    def record(self) -> bytes:
        return json.dumps({k: getattr(self, k) for k in self._RECORD}).encode()

    @classmethod
    def restore(cls, fields: dict) -> Batch:
        """The batch a router before this one recorded (its key not kept: none)."""
        batch = cls(fields["owner"], None, fields["endpoint"], fields["input_file_id"],
                    fields["window"], fields["expires_at"], fields["metadata"], fields["id"],
                    fields["created_at"])  # fmt: skip
        for k in cls._RECORD[8:]:
            setattr(batch, k, fields[k])
        return batch

    def deadline_left(self) -> float:
        """Seconds left of its completion window (0: ended)."""
        return max(0.0, self.deadline - time.monotonic())

    def set_status(self, status: str) -> None:
        self.status = status
        self.at[status] = int(time.time())

    def object(self) -> dict:
        usage = self.usage
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.at.get("in_progress"),
            "expires_at": self.expires_at,
            "finalizing_at": self.at.get("finalizing"),
            "completed_at": self.at.get("completed"),
            "failed_at": self.at.get("failed"),
            "expired_at": self.at.get("expired"),
            "cancelling_at": self.at.get("cancelling"),
            "cancelled_at": self.at.get("cancelled"),
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "usage": {
                "input_tokens": usage["input_tokens"],
                "input_tokens_details": {"cached_tokens": usage["cached"]},
                "output_tokens": usage["output_tokens"],
                "output_tokens_details": {"reasoning_tokens": usage["reasoning"]},
                "total_tokens": usage["input_tokens"] + usage["output_tokens"],
            },
            "metadata": self.metadata,
        }

    def add_usage(self, usage) -> None:
        if not isinstance(usage, dict):
            return
        for field, names in _USAGE:
            value = next((usage[n] for n in names if isinstance(usage.get(n), int)), 0)
            self.usage[field] += value
        for field, details, name in (
            ("cached", ("input_tokens_details", "prompt_tokens_details"), "cached_tokens"),
            (
                "reasoning",
                ("output_tokens_details", "completion_tokens_details"),
                "reasoning_tokens",
            ),
        ):
            for d in details:
                if isinstance(usage.get(d), dict) and isinstance(usage[d].get(name), int):
                    self.usage[field] += usage[d][name]
                    break

    def close(self) -> None:
        """Lets go of what only a running batch needs: the input file and the creator's key."""
        self.auth = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.outputs is not None:  # the front stops mid-batch: the files go with the store
            for out in self.outputs:
                out.file.close()
            self.outputs = None


class _Out:
    """An output or error file while its batch runs: JSON lines appended as results come."""

    def __init__(self, files: FileStore, purpose: str, name: str, file_id: str | None = None):
        """A new file, or (`file_id`) the one a router before this one was writing: its whole
        lines are kept (`records`), a last line cut short is dropped, and lines go on after
        them."""
        self.purpose, self.name = purpose, name
        self.records: list[dict] = []
        if file_id is None:
            self.id, self.path = files.new_path()
            self.file = open(self.path, "xb")  # noqa: SIM115 - closed by keep()
        else:
            self.id, self.path = file_id, files.path_of(file_id)
            self.file = open(self.path, "a+b")  # noqa: SIM115 - closed by keep()
            self.file.seek(0)
            whole = self.file.read()
            end = whole.rfind(b"\n") + 1
            self.file.truncate(end)
            self.file.seek(end)
            self.records = [json.loads(line) for line in whole[:end].splitlines()]
        self.count = len(self.records)

    def write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
        self.file.write(line + b"\n")
        self.file.flush()  # a router that dies loses at most this line (a resume runs it again)
        self.count += 1

    def keep(self, files: FileStore, owner) -> str | None:
        """The file's id once kept in the store; None (and removed) when nothing was written."""
        self.file.close()
        if not self.count:
            os.unlink(self.path)
            return None
        return files.add(self.id, self.path, owner, self.name, self.purpose, result=True).id


class Batches:
    """The front's batches and the lines they run (the module's docstring)."""

    def __init__(self, files: FileStore, max_inflight: int):
        self.files = files
        self.max_inflight = max_inflight
        self.app = None  # the app the lines go through (build_app sets it)
        self._batches: OrderedDict[str, Batch] = OrderedDict()
        self._free = max_inflight
        self._waiting: deque[asyncio.Future] = deque()  # line slots asked for, in order
        self.lines_run = {"completed": 0, "failed": 0}  # since the front started (metrics)
        self.running_lines = 0

    def _set(self, batch: Batch, status: str) -> None:
        """The batch's new status, recorded in router.files_dir (when set)."""
        batch.set_status(status)
        self._save(batch)

    def _save(self, batch: Batch) -> None:
        if self.files.kept:
            write_atomically(os.path.join(self.files.folder, f"{batch.id}.json"), batch.record())

    async def resume(self, keys: bool) -> None:
        """The batches a router before this one recorded in router.files_dir: those that ended
        listed again, those that had not going on where they stopped (each request with a result
        in their files is not run again; one running as that router stopped is). Under API keys
        (`keys`) a batch goes on once its owner calls the Batch API again (its key is never
        written down); without, at once. Result files of no batch are removed."""
        if not self.files.kept:
            return
        folder, found = self.files.folder, []
        for name in os.listdir(folder):
            if name.startswith("batch_") and name.endswith(".json"):
                try:
                    with open(os.path.join(folder, name)) as f:
                        found.append(Batch.restore(json.load(f)))
                except (OSError, ValueError, KeyError, TypeError) as e:
                    log.warning("files_dir: %s is not a batch's record (%s): skipped", name, e)
        claimed = set()
        for batch in sorted(found, key=lambda b: (b.created_at, b.id)):
            self._batches[batch.id] = batch
            claimed.update(batch.out_ids or ())
            if batch.status in ACTIVE:
                if keys and batch.owner is not None and batch.expires_at > time.time():
                    batch.waits_for_key = True
                    # an owner who never calls again: the batch still ends with its window
                    # (a second after it, so that no request starts without a key)
                    wait_s = batch.expires_at - time.time() + 1.0
                    asyncio.get_running_loop().call_later(wait_s, self.rearm, batch.owner, None)
                else:
                    batch.task = asyncio.create_task(self._run(batch))
        for file_id in self.files.unrecorded() - claimed:
            os.unlink(self.files.path_of(file_id))
        log.info("files_dir %s: %d batches, %d files", folder, len(found), len(self.files))

    def rearm(self, owner: str | None, auth: str | None) -> None:
        """The owner called: its resumed batches go on, with its key (None: their windows have
        ended, so they only expire)."""
        for batch in self._batches.values():
            if batch.waits_for_key and batch.owner == owner and (auth or not batch.deadline_left()):
                batch.waits_for_key, batch.auth = False, auth
                batch.task = asyncio.create_task(self._run(batch))

    def active(self) -> int:
        return sum(b.status in ACTIVE for b in self._batches.values())

    def create(self, body: dict, owner: str | None, auth: str | None) -> Batch:
        """The batch a POST /v1/batches body asks for, started (validating), for the key whose
        hash is `owner` and whose Authorization header is `auth` (its lines are sent with it)."""
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise ApiError(
                400,
                f"endpoint must be one of {list(ENDPOINTS)} (got {str(endpoint)[:100]!r})",
                param="endpoint",
            )
        window = body.get("completion_window")
        match = _WINDOW.match(window) if isinstance(window, str) else None
        window_s = int(match[1]) * (3600 if match[2] == "h" else 60) if match else 0
        if not 0 < window_s <= MAX_WINDOW_S:
            raise ApiError(
                400,
                "completion_window must be a duration such as '24h' (OpenAI's) or '30m': whole "
                f"hours or minutes, at most 168h (got {str(window)[:50]!r})",
                param="completion_window",
            )
        meta = _metadata(body.get("metadata"))
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise ApiError(400, "input_file_id must be a file's id", param="input_file_id")
        stored = self.files.get(file_id, owner)
        if stored.purpose != "batch":
            raise ApiError(
                400,
                f"the file {file_id!r} has purpose {stored.purpose!r}: a batch reads one "
                "uploaded with purpose 'batch'",
                param="input_file_id",
            )
        if self.active() >= MAX_ACTIVE:
            raise ApiError(
                429,
                f"{MAX_ACTIVE} batches are in progress, the most at once: retry later",
                "rate_limit_error",
                code="rate_limit_exceeded",
            )
        batch = Batch(owner, auth, endpoint, stored.id, window, int(time.time()) + window_s, meta)
        batch.fd = os.open(stored.path, os.O_RDONLY)
        self._batches[batch.id] = batch
        self._save(batch)
        while len(self._batches) > MAX_KEPT:  # the oldest ended batch gives way
            oldest = next(b for b in self._batches.values() if b.status not in ACTIVE)
            del self._batches[oldest.id]
            if self.files.kept:
                os.unlink(os.path.join(self.files.folder, f"{oldest.id}.json"))
        batch.task = asyncio.create_task(self._run(batch))
        return batch

    def get(self, batch_id: str, owner) -> Batch:
        found = self._batches.get(batch_id)
        if found is None or found.owner != owner:
            raise ApiError(
                404,
                f"No batch found with id {batch_id[:200]!r} (never created, or forgotten: the "
                f"router keeps the last {MAX_KEPT})",
                param="batch_id",
                code="not_found",
            )
        return found

    def listed(self, owner) -> list[Batch]:
        return [b for b in self._batches.values() if b.owner == owner]

    def cancel(self, batch: Batch) -> None:
        if batch.status not in ("validating", "in_progress"):
            return  # ended, or ending: answered as it stands
        batch.cancel_asked = True
        self._set(batch, "cancelling")
        if batch.task is not None:
            batch.task.cancel()
        else:  # resumed, waiting for its owner's key: nothing runs
            batch.waits_for_key = False
            batch.task = asyncio.create_task(self._run(batch))

    async def stop(self) -> None:
        """Cancels every batch (the front stops): nothing is finalized."""
        tasks = [b.task for b in self._batches.values() if b.task is not None and not b.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for b in self._batches.values():
            b.close()

    async def _run(self, batch: Batch) -> None:
        try:
            if batch.fd is None:  # resumed: its input, if it is still there
                stored = self.files.find(batch.input_file_id)
                if stored is None:
                    batch.errors = [{"code": "input_file_deleted", "message": "the input file "
                                     "was deleted while the router was stopped"}]  # fmt: skip
                    self._reopen(batch)
                    await self._finish(batch, "failed")
                    return
                batch.fd = os.open(stored.path, os.O_RDONLY)
            try:
                batch.lines, ids, batch.errors = await asyncio.to_thread(_validate, batch)
            finally:
                batch.total = len(batch.lines)
            if batch.errors:
                self._set(batch, "failed")
                return
            batch.done = bytearray(len(batch.lines))
            self._reopen(batch, ids)
            if batch.cancel_asked or batch.status == "cancelling":
                await self._finish(batch, "cancelled")
                return
            self._set(batch, "in_progress")
            await asyncio.wait_for(self._lines(batch), timeout=batch.deadline_left())
            await self._finish(batch, "completed")
        except TimeoutError:
            await self._finish(batch, "expired")
        except asyncio.CancelledError:
            if not batch.cancel_asked:
                raise  # the front stops
            await self._finish(batch, "cancelled")
        except Exception as e:  # noqa: BLE001 - a fault of the runner: the batch fails, said so
            log.exception("batch %s failed", batch.id)
            batch.errors.append({"code": "server_error", "message": type(e).__name__})
            await self._finish(batch, "failed")
        finally:
            batch.close()

    def _reopen(self, batch: Batch, ids: list[str] | None = None) -> None:
        """The batch's result files: new ones, or a resumed batch's with what they hold counted
        again and its requests (their custom_ids in `ids`) marked done."""
        names = (f"{batch.id}_output.jsonl", f"{batch.id}_error.jsonl")
        old = batch.out_ids or (None, None)
        batch.outputs = tuple(
            _Out(self.files, "batch_output", name, file_id) for name, file_id in zip(names, old)
        )
        batch.out_ids = [out.id for out in batch.outputs]
        output, errors = batch.outputs
        batch.completed, batch.failed = output.count, errors.count
        batch.usage = dict.fromkeys(batch.usage, 0)
        for record in output.records:
            batch.add_usage(((record.get("response") or {}).get("body") or {}).get("usage"))
        where = {custom_id: i for i, custom_id in enumerate(ids or ())}
        for record in output.records + errors.records:
            if record.get("custom_id") in where:
                batch.done[where[record["custom_id"]]] = 1
        self._save(batch)

    async def _finish(self, batch: Batch, status: str) -> None:
        """Writes every line without a result (not run: the batch was cancelled, expired or
        failed) to the error file, keeps the files, and ends the batch with `status`."""
        if batch.outputs is None:
            self._set(batch, status)
            return
        self._set(batch, "finalizing" if status != "cancelled" else "cancelling")
        output, errors = batch.outputs
        left = [i for i, done in enumerate(batch.done) if not done]
        if left:
            error = {
                "cancelled": {
                    "code": "batch_cancelled",
                    "message": "the batch was cancelled before this request ran",
                },
                "expired": {
                    "code": "batch_expired",
                    "message": "the batch's completion window ended before this request ran",
                },
            }.get(
                status,
                {
                    "code": "server_error",
                    "message": "the request did not run (a fault of the router's: see its log)",
                },
            )
            await asyncio.to_thread(_write_left, batch, left, errors, error)
            batch.failed += len(left)
            self.lines_run["failed"] += len(left)
        batch.output_file_id = output.keep(self.files, batch.owner)
        batch.error_file_id = errors.keep(self.files, batch.owner)
        batch.outputs, batch.out_ids = None, None
        self._set(batch, status)

    async def _lines(self, batch: Batch) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            for i in range(len(batch.lines)):
                if batch.done[i]:  # its result is in a file already (a resumed batch)
                    continue
                await self._slot()
                task = asyncio.create_task(self._line(batch, i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.wait(tasks)
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)

    async def _slot(self) -> None:
        """One of max_inflight line slots, in the order asked (all batches share them)."""
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # granted as it was cancelled: hand it on
            elif waiter in self._waiting:  # (a release may have passed over it already)
                self._waiting.remove(waiter)
            raise

    def _release(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1

    async def _line(self, batch: Batch, i: int) -> None:
        """Runs line i until it is answered other than 429 or 503, and records the answer."""
        self.running_lines += 1
        custom_id = None
        try:
            offset, length = batch.lines[i]
            raw = await asyncio.to_thread(os.pread, batch.fd, length, offset)
            item = json.loads(raw)
            custom_id = item["custom_id"]
            if batch.endpoint == "/v1/responses":  # its answer is in the output file: a batch's
                # responses are not kept in the store (and so evict no client's) unless it asks
                item["body"].setdefault("store", False)
            body = json.dumps(item["body"], separators=(",", ":")).encode()
            wait = 1.0
            while True:
                status, headers, content = await self._dispatch(batch, body)
                if status not in RETRIED:
                    break
                after = headers.get("retry-after", "")
                pause = float(after) if after.isascii() and after.isdigit() else wait
                await asyncio.sleep(min(pause, MAX_BACKOFF_S))
                wait = min(2 * wait, MAX_BACKOFF_S)
            self._record(batch, i, custom_id, status, headers, content)
        except Exception as e:  # noqa: BLE001 - the line fails, said so; the batch goes on
            log.exception("batch %s: request %s failed", batch.id, custom_id)
            if custom_id is not None:
                error = {
                    "code": "server_error",
                    "message": f"the request failed: {type(e).__name__}",
                }
                batch.outputs[1].write(_record(custom_id, None, error))
                batch.failed += 1
                self.lines_run["failed"] += 1
                batch.done[i] = 1
        finally:
            self.running_lines -= 1
            self._release()

    def _record(self, batch: Batch, i: int, custom_id: str, status, headers, content) -> None:
        try:
            answer = json.loads(content)
        except ValueError:
            answer = {"error": {"message": content[:1000].decode(errors="replace")}}
        response = {
            "status_code": status,
            "request_id": headers.get("x-request-id", ""),
            "body": answer,
        }
        output, errors = batch.outputs
        if status == 200:
            output.write(_record(custom_id, response, None))
            batch.completed += 1
            self.lines_run["completed"] += 1
            batch.add_usage(answer.get("usage") if isinstance(answer, dict) else None)
        else:
            errors.write(_record(custom_id, response, None))
            batch.failed += 1
            self.lines_run["failed"] += 1
        batch.done[i] = 1

    async def _dispatch(self, batch: Batch, body: bytes) -> tuple[int, dict, bytes]:
        """The line's POST through the app, in-process: its status, headers and body."""
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if batch.auth is not None:
            headers.append((b"authorization", batch.auth.encode("latin-1")))
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": batch.endpoint,
            "raw_path": batch.endpoint.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": None,
            "server": None,
            "state": {BATCH_SCOPE_KEY: batch.id},
        }
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.get_running_loop().create_future()  # never disconnects

        answer = {"status": 500, "headers": {}, "body": []}

        async def send(message):
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                answer["headers"] = {
                    k.decode("latin-1").lower(): v.decode("latin-1")
                    for k, v in message.get("headers", ())
                }
            elif message["type"] == "http.response.body":
                answer["body"].append(message.get("body", b""))

        await self.app(scope, receive, send)
        return answer["status"], answer["headers"], b"".join(answer["body"])


def _record(custom_id: str, response: dict | None, error: dict | None) -> dict:
    return {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def _write_left(batch: Batch, left: list[int], errors: _Out, error: dict) -> None:
    """The error file's lines of the requests `left` without a result (on a thread)."""
    for i in left:
        offset, length = batch.lines[i]
        custom_id = json.loads(os.pread(batch.fd, length, offset))["custom_id"]
        errors.write(_record(custom_id, None, error))


def _metadata(value) -> dict | None:
    if value is None:
        return None
    ok = isinstance(value, dict) and len(value) <= MAX_METADATA
    ok = ok and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
        for k, v in value.items()
    )
    if not ok:
        raise ApiError(
            400,
            f"metadata must be an object of at most {MAX_METADATA} string values, keys of at "
            "most 64 characters and values of at most 512",
            param="metadata",
        )
    return value


def _validate(batch: Batch) -> tuple[list[tuple[int, int]], list[str], list[dict]]:
    """Each request line's (offset, length) and custom_id, and the errors that fail the batch
    (at most MAX_ERRORS listed), read from its input file on a thread."""
    lines, ids, errors, seen = [], [], [], set()

    def error(code: str, message: str, line: int, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": line})

    offset = 0
    with os.fdopen(os.dup(batch.fd), "rb") as f:
        for number, raw in enumerate(f, start=1):
            at, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            if len(lines) >= MAX_REQUESTS:
                error("too_many_requests", f"a batch holds at most {MAX_REQUESTS} requests", number)
                break
            try:
                item = json.loads(raw)
            except (ValueError, RecursionError):
                error("invalid_json_line", "the line is not valid JSON", number)
                continue
            if not isinstance(item, dict):
                error("invalid_json_line", "the line is not a JSON object", number)
                continue
            custom_id = item.get("custom_id")
            if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
                error(
                    "invalid_custom_id",
                    f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters",
                    number,
                    "custom_id",
                )
            elif custom_id in seen:
                error("duplicate_custom_id", f"custom_id {custom_id[:100]!r} is repeated", number)
            seen.add(custom_id)
            if item.get("method") != "POST":
                error("invalid_method", "method must be 'POST'", number, "method")
            if item.get("url") != batch.endpoint:
                error(
                    "invalid_url",
                    f"url must be the batch's endpoint {batch.endpoint!r}",
                    number,
                    "url",
                )
            body = item.get("body")
            if not isinstance(body, dict):
                error("invalid_body", "body must be a JSON object (the request's body)", number)
            elif body.get("stream") or body.get("background"):
                field = "stream" if body.get("stream") else "background"
                error(
                    "invalid_body",
                    f"a batch's request answers whole: {field} must be false or unset",
                    number,
                    f"body.{field}",
                )
            lines.append((at, len(raw)))
            ids.append(custom_id)
    if not lines and not errors:
        error("empty_file", "the input file holds no request", 0)
    return lines, ids, errors


async def _json_body(request: Request) -> dict:
    front = state_of(request)
    check_json_body(request.headers.get("content-type"))
    raw = await front.read_body(request)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON", code="invalid_body") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_body")
    return body


def _batches(request: Request) -> Batches:
    front = state_of(request)
    front.authorize(request)
    front.files.check_enabled()
    front.batches.rearm(front.owner(request), key_header(request))
    return front.batches


@router.post("/v1/batches")
async def create_batch(request: Request):
    batches = _batches(request)
    body = await _json_body(request)
    return batches.create(body, state_of(request).owner(request), key_header(request)).object()


@router.get("/v1/batches")
async def list_batches(request: Request):
    """The key's batches, newest first (OpenAI's list: `after` a batch id, `limit` 1-100)."""
    batches = _batches(request)
    found = batches.listed(state_of(request).owner(request))
    query = dict(request.query_params)
    query.setdefault("order", "desc")
    if query["order"] != "desc":
        raise ApiError(400, "batches are listed newest first: leave order unset", param="order")
    return page_of([b.id for b in found], lambda i: found[i].object(), query)


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str):
    batches = _batches(request)
    return batches.get(batch_id, state_of(request).owner(request)).object()


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str):
    batches = _batches(request)
    batch = batches.get(batch_id, state_of(request).owner(request))
    batches.cancel(batch)
    return batch.object()
