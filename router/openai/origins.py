"""The HTTP front's refusal of POSTs that a web page of a foreign origin sends without asking
(ForeignOrigins, a middleware build_app adds inside RequestIdHeaders). A browser sends a POST
with no body, or a form's, to any address without the CORS preflight that would have stopped it;
CORS only keeps the page from reading the answer. The JSON paths refuse such bodies already
(state.py check_json_body, a 415); the paths that take no body (/pause, /resume,
/v1/responses/{id}/cancel, ...) would act on them. So a POST whose Origin header names an
origin that is neither in router.cors_allowed_origins (or "*" there) nor the front's own (the
/docs page it serves) is a 403 before any handler runs, whatever its path. Clients that are not
browsers (the SDKs, curl, the router's own) send no Origin and never meet it; the middleware
keeps no state and lives as long as the app.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers

from pdserve.router.openai.errors import ApiError


class ForeignOrigins:
    def __init__(self, app, front, origins: tuple[str, ...]):
        self._app, self._front = app, front
        self._any = "*" in origins
        self._listed = frozenset(origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or self._any:
            return await self._app(scope, receive, send)
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None or origin in self._listed or _same_origin(origin, headers.get("host")):
            return await self._app(scope, receive, send)
        error = ApiError(
            403,
            f"this front takes no POST from web pages of origin {origin[:200]!r}: a browser "
            "sent it; list the origin in router.cors_allowed_origins (--allowed-origins) to "
            "let that page call the API",
            code="forbidden_origin",
        )
        await self._front.answer(error, scope.get("path", ""))(scope, receive, send)


def _same_origin(origin: str, host: str | None) -> bool:
    """Whether `origin` (scheme://host[:port]) names the address the request was sent to (its
    Host header): a page the front itself served, /docs."""
    try:
        netloc = urlsplit(origin).netloc
    except ValueError:
        return False
    return bool(host) and netloc.lower() == host.lower()
