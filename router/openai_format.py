"""OpenAI's response and error shapes for the HTTP front (router/http_api.py), as pure functions of
the router's gRPC messages: the error object and the gRPC status each maps to, request validation
errors, the sampling fields passed through, choices, usage, the `pdserve` extension (stage timings
from router/stage_timings.py), logprobs and server-sent event framing. No server state lives here.
"""

from __future__ import annotations

import json
import math
import time
import typing
from dataclasses import dataclass, field

import grpc
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pdserve.protos.convert import OPTIONAL_FIELDS
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai_schema import ChatCompletionRequest, CompletionRequest
from pdserve.router.stage_timings import stage_durations

# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code)
GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "invalid_request_error", "not_implemented"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
    # CANCELLED, ABORTED, INTERNAL, UNKNOWN, DATA_LOSS: the server's failure
}
_SERVER_ERROR = (500, "server_error", None)
_RETRY_AFTER = {429, 503}  # statuses a client may retry: they get a Retry-After header
LOGPROB_FLOOR = -9999.0  # what -inf is sent as (JSON has no infinities; vLLM does the same)


class ApiError(Exception):
    """An OpenAI error object with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in _RETRY_AFTER else {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    @classmethod
    def from_grpc(cls, error: grpc.RpcError) -> ApiError:
        code = error.code()
        status, type_, err_code = GRPC_TO_HTTP.get(code, _SERVER_ERROR)
        details = error.details() or code.name
        if code == grpc.StatusCode.OUT_OF_RANGE and "max_model_len" in details:
            err_code = "context_length_exceeded"  # OpenAI's code for it
        if status == 500:
            details = f"{code.name}: {details}"
        return cls(status, details, type_, None, err_code)


# ---- request validation ----------------------------------------------------------------------
def _field_names(*annotations) -> set[str]:
    """Every field name of the models in `annotations`, nested ones included (through lists,
    unions and Annotated)."""
    names: set[str] = set()
    for a in annotations:
        fields = getattr(a, "model_fields", None)
        if isinstance(a, type) and fields:
            names |= set(fields)
            names |= _field_names(*(f.annotation for f in fields.values()))
        else:
            names |= _field_names(*typing.get_args(a))
    return names


def _param(loc: tuple, known: set[str], extra: bool = False) -> str | None:
    """The field a pydantic error location names, as `messages[0].role`; union members and
    validator names in the location are left out. `extra`: the last part is an unknown field."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in known or (extra and i == len(loc) - 1):
            out += f".{str(part)[:64]}" if out else str(part)[:64]
    return out or None


def validation_error(e: ValidationError, known: set[str]) -> ApiError:
    """One 400 from pydantic's errors: the first field at fault and what is wrong with it (a
    union field lists what each form expects). The input is never echoed."""
    errors = e.errors(include_input=False, include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] in ("model_type", "model_attributes_type") and not first["loc"]:
        return ApiError(400, "the body must be a JSON object", code="invalid_body")
    param = _param(first["loc"], known, first["type"] == "extra_forbidden")
    msgs = []
    for err in errors:
        if _param(err["loc"], known, err["type"] == "extra_forbidden") != param:
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (not an OpenAI or vLLM sampling field pdserve accepts)"
        if msg not in msgs:
            msgs.append(msg)
    where = f"{param}: " if param else ""
    return ApiError(400, where + "; or ".join(msgs[:3]), param=param, code="invalid_value")


KNOWN_FIELDS = _field_names(CompletionRequest, ChatCompletionRequest)


# ---- building the gRPC request ---------------------------------------------------------------
# SamplingParams' optional scalars an OpenAI body carries as they are (n, max_tokens and logprobs
# are translated in sampling_params)
_PASSED_THROUGH = tuple(f for f in OPTIONAL_FIELDS if f not in ("n", "max_tokens", "logprobs"))


def sampling_params(body, max_tokens: int | None, logprobs: bool) -> pdserve_pb2.SamplingParams:
    """The gRPC SamplingParams of an OpenAI body: only what the client set (the engine's defaults
    are OpenAI's: temperature 1, top_p 1, max_tokens 16 for completions)."""
    s = pdserve_pb2.SamplingParams()
    if body.n != 1:
        s.n = body.n
    for name in _PASSED_THROUGH:
        value = getattr(body, name)
        if value is not None:
            setattr(s, name, value)
    if max_tokens is not None:
        s.max_tokens = max_tokens
    s.stop.extend(body.stops())
    if body.stop_token_ids:
        s.stop_token_ids.extend(body.stop_token_ids)
    if logprobs:
        s.logprobs = True
    return s


# ---- reading the gRPC stream -----------------------------------------------------------------
@dataclass
class Choice:
    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: pdserve_pb2.Finish | None = None


def finish_reason(finish: pdserve_pb2.Finish) -> str:
    """OpenAI's finish_reason; a Finish that is a failure raises it as an ApiError."""
    reason = finish.finish_reason
    if reason in ("stop", "length"):
        return reason
    why = finish.message or "no reason given"
    if reason == "abort":
        raise ApiError(503, f"the request was aborted: {why}", "server_error", code="aborted")
    raise ApiError(500, f"the request failed ({reason}): {why}", "server_error")


def usage(finishes: list[pdserve_pb2.Finish], n: int = 1) -> dict:
    """The request's usage from its sequences' Finishes (index i * n + j: prompt i's sequence j):
    each prompt's tokens once (every Finish of a prompt repeats them), every sequence's output."""
    per_prompt: dict[int, pdserve_pb2.Usage] = {}
    for f in finishes:
        per_prompt.setdefault(f.index // n, f.usage)
    prompt = sum(u.prompt_tokens for u in per_prompt.values())
    completion = sum(f.usage.completion_tokens for f in finishes)
    cached = sum(u.cached_prompt_tokens for u in per_prompt.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def extension(finishes: list[pdserve_pb2.Finish], request_id: str) -> dict:
    """The `pdserve` field: where the request's time went (the last sequence to finish)."""
    last = finishes[-1] if finishes else pdserve_pb2.Finish()
    t = last.timings
    return {
        "request_id": request_id,
        "timings": stage_durations(t),
        "prefill_worker": t.prefill_worker or None,
        "decode_worker": t.decode_worker or None,
    }


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


class TokenText:
    """Each token's own text, for logprobs (decoded alone, as vLLM reports them)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def check_logprobs(tokens, lps) -> None:
    """One logprob per token, or the request fails: a response never pairs a token with another
    token's logprob, nor leaves one out silently."""
    if len(lps) != len(tokens):
        raise ApiError(
            500,
            f"logprobs: the workers returned {len(lps)} logprobs for {len(tokens)} tokens; "
            f"send the request without logprobs, and report this",
            "server_error",
            code="logprobs_unavailable",
        )


def completion_logprobs(tokens: list[int], lps: list[float], text_of, offset: int = 0) -> dict:
    strs = [text_of(t) for t in tokens]
    offsets, at = [], offset
    for s in strs:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": strs,
        "token_logprobs": [_logprob(x) for x in lps],
        "top_logprobs": [{s: _logprob(x)} for s, x in zip(strs, lps)],
        "text_offset": offsets,
    }


def chat_logprobs(tokens: list[int], lps: list[float], text_of) -> dict:
    content = []
    for t, x in zip(tokens, lps):
        s = text_of(t)
        content.append(
            {
                "token": s,
                "logprob": _logprob(x),
                "bytes": list(s.encode("utf-8", "surrogatepass")),
                "top_logprobs": [],
            }
        )
    return {"content": content}


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def collect_choices(responses) -> dict[int, Choice]:
    choices: dict[int, Choice] = {}
    for r in responses:
        if r.HasField("delta"):
            d = r.delta
            c = choices.setdefault(d.index, Choice(d.index))
            c.text.append(d.text)
            c.token_ids.extend(d.token_ids)
            c.logprobs.extend(d.logprobs)
        elif r.HasField("finish"):
            c = choices.setdefault(r.finish.index, Choice(r.finish.index))
            c.finish = r.finish
    return choices


def whole_response(responses, body, chat: bool, model_id: str, request_id: str, text_of) -> dict:
    """The non-streaming response body."""
    choices = collect_choices(responses)
    finishes = [c.finish for c in choices.values() if c.finish is not None]
    missing = [i for i, c in choices.items() if c.finish is None]
    if missing or not finishes:
        raise ApiError(500, f"sequences {missing} ended without a Finish", "server_error")
    want_logprobs = body.logprobs if chat else body.logprobs is not None
    out = []
    for i in sorted(choices):
        c = choices[i]
        reason = finish_reason(c.finish)
        text = "".join(c.text)
        lp = None
        if want_logprobs:
            check_logprobs(c.token_ids, c.logprobs)
            lp = (
                chat_logprobs(c.token_ids, c.logprobs, text_of)
                if chat
                else completion_logprobs(c.token_ids, c.logprobs, text_of)
            )
        if chat:
            out.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": lp,
                    "finish_reason": reason,
                }
            )
        else:
            out.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason})
    suffix = request_id.removeprefix("http-")
    return {
        "id": f"chatcmpl-{suffix}" if chat else f"cmpl-{suffix}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_id,
        "choices": out,
        "usage": usage(finishes, body.n),
        "system_fingerprint": None,
        "pdserve": extension(finishes, request_id),
    }
