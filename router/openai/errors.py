"""The HTTP front's errors: OpenAI's error object with its HTTP status (ApiError; Anthropic's
shape of it for /v1/messages), the HTTP status each gRPC status maps to, and the 400 a request
body's validation errors become.

Every failure a handler meets ends as an ApiError: the app's exception handlers
(router/openai/app.py) answer it as {"error": {"message", "type", "param", "code"}} with its
status and headers (Retry-After on 429 and 503, WWW-Authenticate on 401), and a stream that
already started sends its body as one event (router/openai/responses/stream.py). A gRPC error
of the router's own API becomes one through `ApiError.from_grpc`, so both fronts refuse a
request for the same reason. No state lives here: pure functions and one exception class.
"""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse
from pydantic import ValidationError

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

# HTTP status -> the error type of Anthropic's Messages API (/v1/messages answers in its shape:
# {"type": "error", "error": {"type", "message"}}); another 4xx is invalid_request_error, another
# 5xx api_error
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# an OpenAI error object's code -> the HTTP status it came with (a stream's error event carries
# the object alone): ApiError.from_grpc's codes and the front's own
_STATUS_OF_CODE = {
    "invalid_api_key": 401,
    "model_not_found": 404,
    "body_too_large": 413,
    "request_too_large": 413,
    "rate_limit_exceeded": 429,
    "service_unavailable": 503,
    "aborted": 503,
    "timeout": 504,
}


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

    def anthropic_body(self) -> dict:
        """The error in the shape of Anthropic's Messages API."""
        return {
            "type": "error",
            "error": {"type": anthropic_type(self.status), "message": self.message},
        }

    def response(self, anthropic: bool = False) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in _RETRY_AFTER else {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers=headers)

    @classmethod
    def of_status(cls, status: int, message: str, param: str | None = None) -> ApiError:
        """The error a router-side refusal with an HTTP `status` is (the run-time control
        endpoints': LoRA adapters, pause): a client's fault below 500, the server's from 500;
        404 is `not_found`."""
        return cls(
            status,
            message,
            "invalid_request_error" if status < 500 else "server_error",
            param=param,
            code="not_found" if status == 404 else None,
        )

    @classmethod
    def from_grpc(cls, error: grpc.RpcError) -> ApiError:
        code = error.code()
        status, type_, err_code = GRPC_TO_HTTP.get(code, _SERVER_ERROR)
        details = error.details() or code.name
        if code == grpc.StatusCode.OUT_OF_RANGE and "max_model_len" in details:
            err_code = "context_length_exceeded"  # OpenAI's code for it
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
            # gRPC's own refusal of a message past the router's size limit: no retry can pass
            return request_too_large(f"the router refused it ({details})")
        if status == 500:
            details = f"{code.name}: {details}"
        return cls(status, details, type_, None, err_code)


def request_too_large(
    why: str,
    param: str | None = None,
    fix: str = "send fewer or shorter texts (prompt, messages, inputs, documents, tools)",
) -> ApiError:
    """The 413 of a request larger than one gRPC message to the router may be (its limit:
    router/server.py max_request_bytes), `why` saying by how much and `fix` what to shrink."""
    return ApiError(
        413,
        f"the request is too large for the router: {why}; {fix}",
        param=param,
        code="request_too_large",
    )


def anthropic_type(status: int) -> str:
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def status_of(error: dict) -> int:
    """The HTTP status of an OpenAI error object (ApiError.body()'s "error")."""
    if error.get("code") in _STATUS_OF_CODE:
        return _STATUS_OF_CODE[error["code"]]
    kind = error.get("type")
    return {"authentication_error": 401, "permission_error": 403, "rate_limit_error": 429}.get(
        kind, 500 if kind == "server_error" else 400
    )


# ---- request validation -------------------------------------------------------------------
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
            msg = "unknown field (not one of the fields pdserve accepts on this path)"
        if msg not in msgs:
            msgs.append(msg)
    where = f"{param}: " if param else ""
    return ApiError(400, where + "; or ".join(msgs[:3]), param=param, code="invalid_value")
