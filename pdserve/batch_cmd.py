"""`pdserve batch`: an OpenAI batch file run on a running deployment, as `vllm run-batch` runs one
on an engine of its own. The file (JSONL: one {"custom_id", "method": "POST", "url", "body"} a
line, all lines one url) is uploaded to the router's HTTP front (POST /v1/files), run as a batch
(POST /v1/batches: behind the deployment's interactive traffic, docs/api.md "Batch jobs"), and
its results are written to OUTPUT (the answers) and ERRORS (every other answer, and the requests
that did not run), one JSON line each as OpenAI's Batch API gives them.

    pdserve batch requests.jsonl -o results.jsonl
    pdserve batch requests.jsonl -o results.jsonl --errors errors.jsonl --url http://host:8000

It prints the batch's progress every --interval seconds on stderr. Ctrl-C cancels the batch (the
requests that did not run go to ERRORS as batch_cancelled) and still writes both files. Exit
codes: 0 every request answered 200, 1 some failed or the batch failed, expired or was cancelled
(the errors are in ERRORS, or on stderr when the file itself was refused), 2 the command could not
run (no such file, the router unreachable or refusing the upload). Only the standard library's
HTTP client is used; nothing is kept between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
import uuid

ENDED = ("completed", "failed", "expired", "cancelled")


class Refused(Exception):
    """The router answered an error, or could not be reached: the message says which."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="the batch file: JSONL, one request a line (OpenAI's format)")
    p.add_argument("-o", "--output", required=True, help="where the answers go (JSONL)")
    p.add_argument(
        "--errors",
        default=None,
        help="where the failed and not-run requests go (JSONL; default: OUTPUT with "
        "'.errors.jsonl' in place of its extension)",
    )
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the deployment's HTTP front (default: %(default)s, `pdserve up`'s)",
    )
    p.add_argument(
        "--completion-window",
        default="24h",
        help="how long the batch may run before it expires (default: %(default)s)",
    )
    p.add_argument("--interval", type=float, default=5.0, help="seconds between progress lines")


class Front:
    """The calls to one HTTP front, with the client API key when there is one."""

    def __init__(self, url: str, key: str | None):
        self.base = url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.key = key

    def call(self, method: str, path: str, body: bytes | None = None, kind: str | None = None):
        headers = {"Content-Type": kind} if kind else {}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        req = urllib.request.Request(self.base + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:2000]
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                detail = detail.decode(errors="replace")
            raise Refused(f"{method} {path}: HTTP {e.code}: {detail}") from None
        except OSError as e:
            raise Refused(f"cannot reach {self.base}: {getattr(e, 'reason', e)}") from None

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        return json.loads(self.call(method, path, data, "application/json" if data else None))

    def upload(self, path: str) -> str:
        """The file uploaded for a batch; its id."""
        with open(path, "rb") as f:
            data = f.read()
        boundary = uuid.uuid4().hex
        name = os.path.basename(path).replace('"', "_")
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        body = head + data + f"\r\n--{boundary}--\r\n".encode()
        kind = f"multipart/form-data; boundary={boundary}"
        return json.loads(self.call("POST", "/files", body, kind))["id"]


def endpoint_of(path: str) -> str:
    """The url of the file's first request (the batch's endpoint: every line must name it)."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    url = json.loads(line).get("url")
                except (ValueError, AttributeError):
                    url = None
                if not isinstance(url, str):
                    raise Refused(f"{path}: its first request has no url (OpenAI's batch format)")
                return url
    raise Refused(f"{path}: the file holds no request")


def progress(batch: dict) -> str:
    counts = batch["request_counts"]
    return (
        f"pdserve batch {batch['id']}: {batch['status']}, {counts['completed']} completed, "
        f"{counts['failed']} failed of {counts['total']}"
    )


def run(args: argparse.Namespace) -> int:
    """Exit code (the module's docstring)."""
    errors_path = args.errors or os.path.splitext(args.output)[0] + ".errors.jsonl"
    front = Front(args.url, os.environ.get("PDSERVE_API_KEY"))
    try:
        endpoint = endpoint_of(args.input)
        input_id = front.upload(args.input)
        batch = front.json(
            "POST",
            "/batches",
            {
                "input_file_id": input_id,
                "endpoint": endpoint,
                "completion_window": args.completion_window,
            },
        )
    except (Refused, OSError) as e:
        print(f"pdserve batch: {e}", file=sys.stderr)
        return 2
    print(progress(batch), file=sys.stderr, flush=True)
    try:
        batch = wait(front, batch, args.interval)
    except KeyboardInterrupt:
        print(f"pdserve batch: cancelling {batch['id']}", file=sys.stderr, flush=True)
        front.json("POST", f"/batches/{batch['id']}/cancel")
        batch = wait(front, batch, min(args.interval, 1.0))
    print(progress(batch), file=sys.stderr, flush=True)
    for data in (batch.get("errors") or {}).get("data", []):
        print(f"  line {data.get('line')}: {data.get('message')}", file=sys.stderr)
    results = ((batch["output_file_id"], args.output), (batch["error_file_id"], errors_path))
    for file_id, path in results:
        content = front.call("GET", f"/files/{file_id}/content") if file_id else b""
        if file_id or path == args.output:  # OUTPUT always; ERRORS only when there are errors
            with open(path, "wb") as f:
                f.write(content)
    # the router need keep none of the three any longer
    for file_id in (input_id, batch["output_file_id"], batch["error_file_id"]):
        if file_id:
            try:
                front.call("DELETE", f"/files/{file_id}")
            except Refused as e:
                print(f"pdserve batch: {e}", file=sys.stderr)
    counts = batch["request_counts"]
    ok = batch["status"] == "completed" and counts["failed"] == 0
    return 0 if ok else 1


def wait(front: Front, batch: dict, interval_s: float) -> dict:
    """Polls the batch until it ends, a progress line every interval_s."""
    last = time.monotonic()
    while batch["status"] not in ENDED:
        time.sleep(min(0.5, interval_s))
        batch = front.json("GET", f"/batches/{batch['id']}")
        if time.monotonic() - last >= interval_s:
            print(progress(batch), file=sys.stderr, flush=True)
            last = time.monotonic()
    return batch
