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
        # the router's API answers NOT_FOUND only for a model it does not serve (router/service.py):
        # the field to fix is `model`, as the front's own 404s (state.py, models.py) and vLLM's say
        param = "model" if code == grpc.StatusCode.NOT_FOUND else None
        return cls(status, details, type_, param, err_code)


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
    union field lists what each form expects; a list sent to a field of text or a list is read
    as the list: `_narrowed`). The input is never echoed."""
    errors = _narrowed(e.errors(include_input=False, include_url=False), known)
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


def _narrowed(errors: list[dict], known: set[str]) -> list[dict]:
    """pydantic's errors less those of union members the input plainly is not, the deepest
    first. A list sent to a field that takes text or a list of blocks (a message's content)
    fails the text member too ("Input should be a valid string"), and each block fails every
    block type it is not: what is left says what is wrong with the list itself, down to the
    block's field (messages[1].content[0].foo: unknown field)."""
    lists = {e["loc"][:-1] for e in errors if _text_of_a_list(e, errors)}
    if not lists:
        return errors
    out = [e for e in errors if e["loc"][:-1] not in lists or e["type"] != "string_type"]
    for site in lists:  # of several list members (list[int], list[list[int]]), the closest
        out = _closest_list(out, site)
    done: set[tuple] = set()
    for err in list(out):
        site = _member_site(err["loc"], out, lists, known) if err in out else None
        if site is None or site in done:
            continue
        done.add(site)
        n = len(site)
        members: dict[str, list[dict]] = {}
        for e in out:
            if e["loc"][:n] == site:
                members.setdefault(e["loc"][n], []).append(e)
        # the block type it is: the member whose `type` matched, with the fewest errors
        best = min(members, key=lambda m: (_wrong_kind(members[m], n), len(members[m])))
        out = [e for e in out if e["loc"][:n] != site or e["loc"][n] == best]
    deepest = max(out, key=lambda e: len(e["loc"]))
    return [deepest] + [e for e in out if e is not deepest]


def _closest_list(errors: list[dict], site: tuple) -> list[dict]:
    """`errors` less those of the list members at `site` other than the closest: the one with
    the fewest errors (a prompt of 65 token lists fails list[int] and list[str] at every element
    and list[list[int]] once, for its length, and that is what is wrong with it), of equals the
    one with the fewest elements of a wrong type."""
    n = len(site)
    branches: dict[str, list[int]] = {}  # member -> [its errors, those of a wrong type]
    for e in errors:
        loc = e["loc"]
        if len(loc) > n and loc[:n] == site and str(loc[n]).startswith("list["):
            counts = branches.setdefault(loc[n], [0, 0])
            counts[0] += 1
            counts[1] += e["type"].endswith("_type")
    if len(branches) < 2:
        return errors
    # the fewest errors; of equals, the one whose elements had its type ([[]]: a token list that
    # is empty, not a text that is not one)
    keep = min(branches, key=lambda m: tuple(branches[m]))
    return [
        e
        for e in errors
        if not (
            len(e["loc"]) > n
            and e["loc"][:n] == site
            and str(e["loc"][n]).startswith("list[")
            and e["loc"][n] != keep
        )
    ]


def _text_of_a_list(err: dict, errors: list[dict]) -> bool:
    """Whether `err` is the text member's refusal of a list: a member `list[...]` of the same
    field got into the list (its errors are not "Input should be a valid list")."""
    loc = err["loc"]
    if err["type"] != "string_type" or not loc or loc[-1] not in ("str", "constrained-str"):
        return False
    site, n = loc[:-1], len(loc) - 1
    branch = [
        e
        for e in errors
        if len(e["loc"]) > n and e["loc"][:n] == site and str(e["loc"][n]).startswith("list[")
    ]
    return bool(branch) and not any(
        e["type"] == "list_type" and len(e["loc"]) == n + 1 for e in branch
    )


def _member_site(
    loc: tuple, errors: list[dict], lists: set[tuple], known: set[str]
) -> tuple | None:
    """The location, inside one of `lists` (fields read as a list), of a union of block types
    that `loc` goes through: the place where errors part into one branch per member, each
    going deeper (a model's fields), none of them a field's name."""
    for k in range(1, len(loc) - 1):
        site = loc[:k]
        if not any(site[: len(f)] == f and len(site) > len(f) for f in lists):
            continue
        parts = {e["loc"][k] for e in errors if len(e["loc"]) > k + 1 and e["loc"][:k] == site}
        shallow = any(len(e["loc"]) == k + 1 and e["loc"][:k] == site for e in errors)
        named = all(isinstance(p, str) and p not in known for p in parts)
        if len(parts) > 1 and not shallow and named:
            return site
    return None


def _wrong_kind(errors: list[dict], n: int) -> bool:
    """Whether a member's errors say the block's `type` is not this member's."""
    return any(e["type"] == "literal_error" and e["loc"][n + 1 :] == ("type",) for e in errors)
