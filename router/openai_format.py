"""OpenAI's error shapes and the pieces of its responses for the HTTP front (router/http_api.py),
as pure functions of the router's gRPC messages: the error object and the gRPC status each maps
to, request validation errors, the sampling fields passed through, finish reasons, usage, the
`pdserve` extension (stage timings from protos/timings.py) and server-sent event framing.
Whole responses are router/openai_response.py's, logprobs router/openai_logprobs.py's. No server
state lives here.
"""

from __future__ import annotations

import json
import typing

import grpc
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pdserve.protos.convert import OPTIONAL_FIELDS, structured_message
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.protos.timings import stage_durations
from pdserve.router.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

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
            names |= {f.alias or name for name, f in fields.items()}
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


KNOWN_FIELDS = _field_names(
    CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest
)


# ---- building the gRPC request ---------------------------------------------------------------
# SamplingParams' optional scalars an OpenAI body carries as they are (the others are translated
# in sampling_params)
_TRANSLATED = ("n", "max_tokens", "logprobs", "prompt_logprobs", "top_logprobs")
_PASSED_THROUGH = tuple(f for f in OPTIONAL_FIELDS if f not in _TRANSLATED)


def sampling_params(body, max_tokens: int | None) -> pdserve_pb2.SamplingParams:
    """The gRPC SamplingParams of an OpenAI body: only what the client set (the engine's defaults
    are OpenAI's: temperature 1, top_p 1, max_tokens 16 for completions). Logprobs: the sampled
    tokens' when the body wants them, with its number of alternatives (top_logprobs); the
    prompt's when echo or prompt_logprobs needs them."""
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
    if body.wants_logprobs:
        s.logprobs = True
        if body.num_top():
            s.top_logprobs = body.num_top()
    k = body.prompt_logprobs_k()
    if k is not None:
        s.prompt_logprobs = k
    found = body.structured_spec()
    if found is not None:
        structured_message(s.structured, found[0])
    return s


# ---- reading the gRPC stream -----------------------------------------------------------------
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


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
