"""OpenAI's Files API on the HTTP front, for the Batch API (router/openai/batches_api.py): a
batch's input file is uploaded here, and its output and error files are read back from here.

    POST   /v1/files                 multipart/form-data: file (JSONL), purpose "batch"
    GET    /v1/files                 ?purpose, ?after, ?limit (1-10,000), ?order (asc | desc)
    GET    /v1/files/{id}            the File object
    GET    /v1/files/{id}/content    the file's bytes
    DELETE /v1/files/{id}

FileStore keeps the files on the router's disk: in router.files_dir when it is set, each file
beside a small JSON record of its File object (written by an atomic rename once the file is
whole), so that a router started again on the folder finds them (and the batches there resume:
router/openai/batches_api.py); unset, in a private (0700) temporary folder made on the first
write and removed, with everything in it, when the front stops, as stored responses live as long
as the router process. Its bound is router.files_store_mb over all files, inputs
and outputs alike: an upload that would pass it is a 413, while a batch's output files are kept
whatever the bound (a result is never dropped), so uploads wait for deletions then. One upload
holds at most MAX_FILE_BYTES (OpenAI's 200 MB for a batch input); the multipart body is parsed
by Starlette's parser (python-multipart) from a stream counted against that bound. With API
keys a file belongs to the key that uploaded it (its hash, as a stored response: another key
gets 404). Every call runs on the front's event loop; disk copies run on threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.responses_api import page_of
from pdserve.router.openai.state import ClientGone, state_of

log = logging.getLogger(__name__)
router = APIRouter()

MAX_FILE_BYTES = 200 << 20  # one upload at most: OpenAI's bound on a batch's input file
MAX_FILES = 10_000  # files kept at once, at most (OpenAI's list limit)
# multipart's own bytes around the file (boundaries, part headers, the purpose field)
_FORM_OVERHEAD = 64 << 10
PURPOSES = ("batch",)  # what an upload may be for; outputs are "batch_output"
_MAX_NAME = 255  # a file name's characters kept


@dataclass
class StoredFile:
    """One file on the router's disk: its File object's fields and where its bytes are."""

    id: str
    owner: str | None
    filename: str
    purpose: str
    bytes: int
    created_at: int
    path: str

    def object(self) -> dict:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": None,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


class FileStore:
    """The front's files (the module's docstring); `max_bytes` 0: no Files or Batch API;
    `folder`: router.files_dir (None: a temporary folder)."""

    def __init__(self, max_bytes: int, folder: str | None = None):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._files: dict[str, StoredFile] = {}  # id -> file, in upload order
        self._dir = folder
        self.kept = folder is not None and max_bytes > 0  # files outlive the router
        if self.kept:
            try:
                os.makedirs(folder, mode=0o700, exist_ok=True)
                self._load()
            except OSError as e:
                raise OSError(
                    f"router.files_dir {folder!r} cannot hold the files: {e.strerror or e} "
                    "(set a folder the router may write, or leave it unset)"
                ) from None

    @property
    def folder(self) -> str | None:
        return self._dir

    def _load(self) -> None:
        """The files a router before this one kept in the folder, in upload order; a record
        whose file is gone is removed, one that cannot be read is logged and left alone."""
        found = []
        for name in os.listdir(self._dir):
            if not (name.startswith("file-") and name.endswith(".json")):
                continue
            record = os.path.join(self._dir, name)
            try:
                with open(record) as f:
                    fields = json.load(f)
                stored = StoredFile(**fields, bytes=0, path=record[: -len(".json")])
                stored.bytes = os.path.getsize(stored.path)
            except FileNotFoundError:
                os.unlink(record)  # its file was deleted: the record goes too
                continue
            except (OSError, ValueError, TypeError) as e:
                log.warning("files_dir: %s is not a file's record (%s): skipped", record, e)
                continue
            found.append(stored)
        for stored in sorted(found, key=lambda f: (f.created_at, f.id)):
            self._files[stored.id] = stored
            self.bytes += stored.bytes

    def unrecorded(self) -> set[str]:
        """The ids of the folder's files without a record: results of a batch that was running
        when the router before this one stopped, or an upload it did not finish."""
        if not self.kept:
            return set()
        names = set(os.listdir(self._dir))
        return {n for n in names if n.startswith("file-") and "." not in n and n not in self._files}

    def path_of(self, file_id: str) -> str:
        return os.path.join(self._dir, file_id)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._files)

    def check_enabled(self) -> None:
        if not self.enabled:
            raise ApiError(
                404,
                "the Files and Batch APIs are off on this deployment (router.files_store_mb is 0)",
                code="not_found",
            )

    def new_path(self) -> tuple[str, str]:
        """A fresh file id and the path its bytes go to (the folder made on first use)."""
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="pdserve-files-")  # 0700
        file_id = "file-" + secrets.token_hex(12)
        return file_id, os.path.join(self._dir, file_id)

    def room(self) -> int:
        """The bytes an upload may have now."""
        return max(0, min(MAX_FILE_BYTES, self.max_bytes - self.bytes))

    def add(
        self, file_id: str, path: str, owner, filename: str, purpose: str, result: bool = False
    ) -> StoredFile:
        """Keeps the file written at `path`: an upload checked against `room`, or a batch's
        output or error file (`result`), kept past every bound (a result is never dropped)."""
        if len(self._files) >= MAX_FILES and not result:
            os.unlink(path)
            raise ApiError(
                413,
                f"the router keeps {MAX_FILES} files, the most at once: delete some "
                "(DELETE /v1/files/{id})",
                code="too_many_files",
            )
        size = os.path.getsize(path)
        stored = StoredFile(
            file_id, owner, filename[:_MAX_NAME], purpose, size, int(time.time()), path
        )
        self._files[file_id] = stored
        self.bytes += size
        if self.kept:  # the record last: a file without one is not whole (`unrecorded`)
            fields = {k: v for k, v in vars(stored).items() if k not in ("path", "bytes")}
            write_atomically(path + ".json", json.dumps(fields).encode())
        return stored

    def get(self, file_id: str, owner) -> StoredFile:
        found = self._files.get(file_id)
        if found is None or found.owner != owner:
            raise ApiError(
                404,
                f"No such File object: {file_id[:200]!r} (never uploaded, or deleted)",
                param="file_id",
                code="not_found",
            )
        return found

    def find(self, file_id: str) -> StoredFile | None:
        """The file, whoever's it is (the batch runner's own lookup)."""
        return self._files.get(file_id)

    def delete(self, file_id: str, owner) -> None:
        """Removes the file; a batch reading it keeps its open descriptor until it ends."""
        found = self.get(file_id, owner)
        del self._files[file_id]
        self.bytes -= found.bytes
        for path in (found.path + ".json", found.path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def listed(self, owner, purpose: str | None) -> list[StoredFile]:
        return [
            f
            for f in self._files.values()
            if f.owner == owner and (purpose is None or f.purpose == purpose)
        ]

    def close(self) -> None:
        """The front stops: a temporary folder is removed with every file; router.files_dir is
        left as it is, for the next router."""
        self._files.clear()
        self.bytes = 0
        if self._dir is not None and not self.kept:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def write_atomically(path: str, data: bytes) -> None:
    """`data` at `path` whole or not at all (a temporary file renamed over it)."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _too_large(size, room: int) -> ApiError:
    has = f"has {size} bytes" if size is not None else "is too large"
    return ApiError(
        413,
        f"the upload {has}; this router's file store takes at most {room} now "
        "(router.files_store_mb, and at most 200 MB a file): split it, or delete files first",
        code="file_too_large",
    )


async def _bounded(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The body's pieces, refused past `limit` bytes (the room left, and multipart's own)."""
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(None, limit - _FORM_OVERHEAD)
            yield chunk
    except ClientDisconnect:  # one INFO line (the app's handler), not a server error
        raise ClientGone(f"the client disconnected after {size} bytes of an upload") from None


@router.post("/v1/files")
async def upload(request: Request):
    front = state_of(request)
    front.authorize(request)
    files = front.files
    files.check_enabled()
    kind = request.headers.get("content-type", "")
    if not kind.lower().startswith("multipart/form-data"):
        raise ApiError(
            400,
            "an upload is a multipart/form-data body with the fields 'file' and 'purpose' "
            f"(got Content-Type {kind[:100]!r})",
            code="invalid_body",
        )
    limit = files.room() + _FORM_OVERHEAD
    length = request.headers.get("content-length")
    if length is not None and length.isascii() and length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit - _FORM_OVERHEAD)
    parser = MultiPartParser(
        request.headers, _bounded(request, limit), max_files=1, max_fields=2, max_part_size=1024
    )
    try:
        form = await parser.parse()
    except MultiPartException as e:
        message = f"the multipart body is not valid: {e.message}"
        raise ApiError(400, message, code="invalid_body") from None
    try:
        purpose, upload_file = form.get("purpose"), form.get("file")
        if not isinstance(upload_file, UploadFile):
            raise ApiError(400, "the upload has no 'file' part with a file name", param="file")
        if purpose not in PURPOSES:
            raise ApiError(
                400,
                f"purpose must be one of {list(PURPOSES)} (got {str(purpose)[:50]!r}): this "
                "server keeps files for the Batch API only",
                param="purpose",
            )
        if upload_file.size is None or upload_file.size > files.room():
            raise _too_large(upload_file.size, files.room())
        file_id, path = files.new_path()
        await asyncio.to_thread(_copy, upload_file.file, path)
    finally:
        await form.close()
    stored = files.add(file_id, path, front.owner(request), upload_file.filename or "", purpose)
    return stored.object()


def _copy(source, path: str) -> None:
    source.seek(0)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        shutil.copyfileobj(source, out, 1 << 20)


@router.get("/v1/files")
async def list_files(request: Request):
    """The key's files, newest first unless `order` is asc; `purpose` picks one kind; `limit`
    (1-10,000, all unset) and `after` a file id page through them (OpenAI's list)."""
    front = state_of(request)
    front.authorize(request)
    front.files.check_enabled()
    found = front.files.listed(front.owner(request), request.query_params.get("purpose"))
    return page_of([f.id for f in found], lambda i: found[i].object(), request.query_params,
                   most=MAX_FILES, default=MAX_FILES)  # fmt: skip


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str):
    front = state_of(request)
    front.authorize(request)
    front.files.check_enabled()
    return front.files.get(file_id, front.owner(request)).object()


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str):
    front = state_of(request)
    front.authorize(request)
    front.files.check_enabled()
    found = front.files.get(file_id, front.owner(request))
    return FileResponse(found.path, media_type="application/jsonl", filename=found.filename)


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str):
    front = state_of(request)
    front.authorize(request)
    front.files.check_enabled()
    front.files.delete(file_id, front.owner(request))
    return {"id": file_id, "object": "file", "deleted": True}
