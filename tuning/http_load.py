"""`pdserve bench --backend openai --base-url URL`: the load generator's HTTP side, for any server
with OpenAI's completions API (pdserve's HTTP front, vLLM, SGLang), so one tool measures them all
on the same requests.

    target = Target.of("http://127.0.0.1:8000")
    card = model_card(target)                   # GET /v1/models: the first card's id, max_model_len
    records, duration_s = run_load(target, requests, build_prompts(requests, card.vocab_size))

Owns the target (base URL, endpoint, the client key as `Authorization: Bearer`, TLS for https),
the model card from GET {base}/v1/models (its first card, or the one --model names; max_model_len
where the card gives it; no standard field gives the vocabulary, so the prompts' ids stay below
--vocab-size, else below FALLBACK_VOCAB, which every real vocabulary holds), the request body
(token-id prompt, greedy, max_tokens, vLLM's ignore_eos, streamed with the usage chunk), and the
reading of its server-sent events into a metrics.RequestRecord: TTFT at the first chunk that
carries text or token ids, ITL one gap per such chunk (vLLM's), output tokens from the usage
chunk (else the chunks' count), cached tokens from usage.prompt_tokens_details, the finish_reason.
An HTTP error status or an error event is recorded as the gRPC path records a status (its name
and message) and the run goes on. Arrivals, --max-concurrency slots and threads are
loadgen.drive_load's; each request's thread opens its own connection (http.client) with the
request timeout. The gRPC path's Finish.timings and KV bytes have no HTTP counterpart: empty.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus

from pdserve.client import API_KEY_ENV
from pdserve.tuning.metrics import RequestRecord, attribute_itl
from pdserve.tuning.workload import RequestSpec

DEFAULT_BASE_URL = "http://127.0.0.1:8000"  # `pdserve up`'s HTTP front, and vLLM's default
DEFAULT_ENDPOINT = "/v1/completions"
# without --vocab-size the prompts' ids are drawn below this (workload.build_prompts: from 1000,
# above common vocabularies' special tokens): every real vocabulary holds them (Llama 2's and
# Mistral's 32000 are the smallest of the families pdserve and vLLM load)
FALLBACK_VOCAB = 16000


@dataclass(frozen=True)
class Target:
    """Where the requests go: {base_url}{endpoint}, with `headers` (the key) and for https an
    SSL context (`tls`: the --tls-* options, or the system's CAs)."""

    base_url: str
    endpoint: str = DEFAULT_ENDPOINT
    headers: dict = field(default_factory=dict)
    context: ssl.SSLContext | None = None

    @classmethod
    def of(cls, base_url: str, endpoint: str = DEFAULT_ENDPOINT, tls=None) -> Target:
        """The target of --base-url/--endpoint, the key from PDSERVE_API_KEY (--api-key sets it);
        ValueError for a URL or TLS option that cannot work."""
        from pdserve.tuning import loadgen  # grpc: not when bench's options are only declared

        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname or url.query or url.fragment:
            raise ValueError(f"--base-url {base_url!r}: expected http[s]://HOST[:PORT][/PATH]")
        try:
            url.port  # noqa: B018 (parses it: a bad port raises here)
        except ValueError:
            raise ValueError(f"--base-url {base_url!r}: the port is not a number") from None
        if not endpoint.startswith("/"):
            raise ValueError(f"--endpoint {endpoint!r}: a path, e.g. {DEFAULT_ENDPOINT}")
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        key = os.environ.get(API_KEY_ENV)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        context = _ssl_context(tls) if url.scheme == "https" else None
        if url.scheme == "http" and loadgen.uses_tls(tls):
            raise ValueError("--tls-ca, --tls-cert and --tls-key need an https:// --base-url")
        return cls(base_url.rstrip("/"), endpoint, headers, context)

    def connection(self, timeout_s: float | None) -> http.client.HTTPConnection:
        url = urllib.parse.urlsplit(self.base_url)
        if url.scheme == "https":
            return http.client.HTTPSConnection(
                url.hostname, url.port, timeout=timeout_s, context=self.context
            )
        return http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)

    def path(self, endpoint: str) -> str:
        return urllib.parse.urlsplit(self.base_url).path + endpoint


def _ssl_context(tls) -> ssl.SSLContext:
    """https: the system's CAs, or --tls-ca's; --tls-cert/--tls-key as the client certificate."""
    ca = getattr(tls, "tls_ca", None)
    cert, key = getattr(tls, "tls_cert", None), getattr(tls, "tls_key", None)
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together")
    try:
        context = ssl.create_default_context(cafile=ca)
        if cert:
            context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cannot read the --tls-* files: {e}") from None
    return context


@dataclass(frozen=True)
class HttpCard:
    """The model card bench needs, as GET /v1/models gives it."""

    id: str
    max_model_len: int | None  # None: the card gives none (nothing is refused up front)
    vocab_size: int  # the prompts' ids are drawn below it: --vocab-size, else FALLBACK_VOCAB
    vocab_size_given: bool = False
    dtype: str = ""  # no standard field

    def prompt_ids(self) -> str:
        """How the prompts' token ids were drawn, for the result file and stderr."""
        if self.vocab_size_given:
            return f"random token ids below --vocab-size {self.vocab_size}"
        return (
            f"random token ids below {self.vocab_size}, which every real vocabulary holds: the "
            f"server's vocabulary size is unknown over HTTP (give it with --vocab-size)"
        )


def status_name(status: int) -> str:
    """An HTTP status as a record's error code: its name (429 -> TOO_MANY_REQUESTS)."""
    try:
        return HTTPStatus(status).name
    except ValueError:
        return f"HTTP_{status}"


def error_message(body: bytes, limit: int = 300) -> str:
    """One line of an error response's body: OpenAI's error.message, FastAPI's detail, or the
    text itself, cut to `limit` characters."""
    text = body.decode("utf-8", "replace")
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
        elif isinstance(err, str):
            text = err
        elif doc.get("detail") is not None:
            text = str(doc["detail"])
        elif doc.get("message"):
            text = str(doc["message"])
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _get(target: Target, endpoint: str, timeout_s: float) -> tuple[int, str, bytes]:
    conn = target.connection(timeout_s)
    try:
        headers = {k: v for k, v in target.headers.items() if k != "Content-Type"}
        conn.request("GET", target.path(endpoint), headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.reason, resp.read()
    finally:
        conn.close()


def model_card(
    target: Target, model: str = "", vocab_size: int | None = None, timeout_s: float = 10.0
) -> HttpCard:
    """The card of `model` ("" = the first one) from GET {base}/v1/models; LoadgenError, one line
    naming what to change, when the server cannot be reached, refuses, or serves no such model."""
    from pdserve.tuning.loadgen import LoadgenError

    where = f"server {target.base_url}"
    try:
        status, reason, body = _get(target, "/v1/models", timeout_s)
    except (OSError, http.client.HTTPException) as e:
        raise LoadgenError(
            f"{where} unreachable: {type(e).__name__}: {e} (is it running? pass its address "
            f"with --base-url)"
        ) from None
    if status != 200:
        said = f"{where} answered GET /v1/models with {status} {reason}: {error_message(body)}"
        if status in (401, 403):
            given = (
                "the key given was refused"
                if "Authorization" in target.headers
                else "no key was given"
            )
            said += f" ({given}: pass the server's API key with --api-key or set {API_KEY_ENV})"
        elif status == 404:
            said += (
                " (is it an OpenAI-compatible server? --base-url is its root, e.g. "
                f"{DEFAULT_BASE_URL}, without /v1)"
            )
        raise LoadgenError(said)
    try:
        cards = [c for c in json.loads(body)["data"] if isinstance(c, dict) and c.get("id")]
    except (ValueError, KeyError, TypeError):
        raise LoadgenError(f"{where}: GET /v1/models did not answer OpenAI's model list") from None
    if not cards:
        raise LoadgenError(f"{where} serves no model")
    card = cards[0] if not model else next((c for c in cards if c["id"] == model), None)
    if card is None:
        raise LoadgenError(
            f"{where} does not serve model {model!r}; it serves {', '.join(c['id'] for c in cards)}"
        )
    length = card.get("max_model_len")
    return HttpCard(
        str(card["id"]),
        length if isinstance(length, int) and length > 0 else None,
        vocab_size or FALLBACK_VOCAB,
        vocab_size is not None,
    )


def request_body(spec: RequestSpec, prompt: list[int], model: str = "") -> bytes:
    """POST {endpoint}'s body: the token ids, greedy, exactly output_len tokens (ignore_eos:
    vLLM's and SGLang's extension, which pdserve serves too), streamed with the usage chunk."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def _error_name(err: dict) -> str:
    """An error event's code name: its HTTP status (vLLM's int `code`), else its code or type."""
    code = err.get("code")
    if isinstance(code, int):
        return status_name(code)
    for name in (code, err.get("type")):
        if isinstance(name, str) and name:
            return name.upper()
    return "STREAM_ERROR"


class _Reading:
    """What one stream's events have said so far."""

    def __init__(self):
        self.times: list[float] = []  # the chunks that carried text or token ids
        self.counts: list[int | None] = []  # their token ids' count (None: no ids sent)
        self.usage: dict | None = None
        self.finish_reason = ""
        self.error: tuple[str, str] | None = None

    def event(self, event, now: float) -> None:
        if not isinstance(event, dict):
            return
        err = event.get("error")
        if err and self.error is None:
            err = err if isinstance(err, dict) else {"message": str(err)}
            self.error = (_error_name(err), error_message(json.dumps(err).encode()))
        choices = event.get("choices") or []
        if choices and isinstance(choices[0], dict):  # one prompt, n=1: choice 0
            choice = choices[0]
            ids = choice.get("token_ids")
            if choice.get("text") or ids:
                self.times.append(now)
                self.counts.append(len(ids) if isinstance(ids, list) else None)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]

    def fill(self, rec: RequestRecord, start: float) -> None:
        """The record's tokens, latencies, cached tokens and finish from what was read."""
        ids_known = bool(self.counts) and all(self.counts)  # each chunk's ids, none empty
        chunks = sum(self.counts) if ids_known else len(self.times)
        tokens = (self.usage or {}).get("completion_tokens")
        rec.output_tokens = tokens if isinstance(tokens, int) else chunks
        if self.times:
            rec.ttft_s = self.times[0] - start
            rec.itl_s = [now - prev for prev, now in zip(self.times, self.times[1:])]
            # pdserve's per-token split needs each chunk's token count: its ids, or one token a
            # chunk when the chunks are as many as the tokens; else it stays empty
            if ids_known:
                rec.itl_per_token_s = attribute_itl(self.times, self.counts)
            elif rec.output_tokens == len(self.times):
                rec.itl_per_token_s = attribute_itl(self.times, [1] * len(self.times))
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            rec.cached_prompt_tokens = details["cached_tokens"]
        rec.finish_reason = self.finish_reason
        if rec.error:
            return
        if self.error is not None:
            rec.error, rec.error_message = self.error
        elif self.finish_reason in ("error", "abort"):
            rec.error = self.finish_reason
            rec.error_message = f"the server ended the sequence with finish_reason {rec.error}"
        elif not self.finish_reason:
            rec.error, rec.error_message = "NO_FINISH", "the stream ended without a finish_reason"


def read_stream(
    rec: RequestRecord,
    lines: Iterable[bytes],
    start: float,
    clock: Callable[[], float] = time.perf_counter,
    deadline: float | None = None,
) -> None:
    """Reads one completion's server-sent events (`lines`, as a response yields them) into `rec`,
    each event timed by `clock` as it arrives; `start` is the send's time on that clock. The
    stream's end (or `data: [DONE]`) is the record's e2e, unless an error event came. Past
    `deadline` it stops with TimeoutError (the record keeps what came)."""
    reading = _Reading()
    try:
        for raw in lines:
            line = raw.strip()
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = clock()
                try:
                    event = json.loads(data)
                except ValueError:
                    raise ValueError(f"an event that is not JSON: {error_message(data)}") from None
                reading.event(event, now)
            if deadline is not None and clock() > deadline:
                raise TimeoutError("no end of the stream within the request timeout")
        if reading.error is None:
            rec.e2e_s = clock() - start
    finally:
        reading.fill(rec, start)


def send(
    target: Target, body: bytes, rec: RequestRecord, t0: float, timeout_s: float | None, done
) -> None:
    """Streams one request into `rec` (loadgen._send's HTTP counterpart, for drive_load): its
    own connection, `timeout_s` for each read and for the whole stream."""
    conn = None
    start = time.perf_counter()
    rec.send_s, rec.send_unix_ns = start - t0, time.time_ns()
    try:
        conn = target.connection(timeout_s)
        conn.request("POST", target.path(target.endpoint), body=body, headers=target.headers)
        resp = conn.getresponse()
        if resp.status != 200:
            rec.error = status_name(resp.status)
            rec.error_message = f"HTTP {resp.status}: {error_message(resp.read())}"
        else:
            deadline = None if timeout_s is None else start + timeout_s
            read_stream(rec, resp, start, deadline=deadline)
    except TimeoutError as e:  # a read's or the whole stream's
        rec.error, rec.error_message = "TIMEOUT", str(e) or f"no answer within {timeout_s:g} s"
    except Exception as e:  # recorded, so one odd stream cannot end the whole run
        rec.error, rec.error_message = type(e).__name__, str(e)
    finally:
        if conn is not None:
            conn.close()
    done()


def run_load(
    target: Target, requests: list[RequestSpec], prompts: list[list[int]], **kwargs
) -> tuple[list[RequestRecord], float]:
    """loadgen.drive_load's run with HTTP requests to `target` (kwargs: drive_load's; `model` the
    served id the body names)."""
    from pdserve.tuning import loadgen

    return loadgen.drive_load(target, requests, prompts, make=request_body, send=send, **kwargs)
