"""The ingress's gate, an ASGI middleware that runs before routing and before any body is read:
the API key (every route but /health) and the request body size limit.

A body is refused from its Content-Length before a byte of it is read; a chunked body is counted while
it is read and refused as soon as it passes the limit, so one client cannot make the replica hold, parse
or tokenize a body of any size (a 60 MB body used to stall the replica for minutes). The limits come from
the replica's RouterConfig, which Router.__init__ puts on the app's state (`install_limits`).
"""
from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.config import RouterSettings
from router.errors import APIError

OPEN_PATHS = ("/health",)  # load balancers probe it without credentials


class BodyTooLarge(HTTPException):
    """Raised from `receive` while a chunked body passes the limit; FastAPI hands HTTPExceptions raised
    while reading the body to the app's handler (router/errors.py), which answers in the OpenAI shape."""

    def __init__(self, limit: int):
        super().__init__(413, too_large(limit).message)
        self.error_code = "request_too_large"


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                         f"(--max-body-bytes)", "invalid_request_error", None, "request_too_large")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key")


def install_limits(app, settings: RouterSettings) -> None:
    app.state.router_settings = settings


class AccessGate:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings: RouterSettings | None = getattr(scope["app"].state, "router_settings", None) \
            if scope["type"] == "http" and "app" in scope else None
        if settings is None:
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        refusal = _check_key(settings.api_key, scope, headers)
        if refusal is None:
            refusal = _check_length(settings.max_body_bytes, headers)
        if refusal is not None:
            return await refusal.response()(scope, receive, send)
        await self.app(scope, _counting(receive, settings.max_body_bytes), send)


def _check_key(key: str | None, scope: Scope, headers: Headers) -> APIError | None:
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if key is None or path in OPEN_PATHS or (root and path.startswith(root) and path[len(root):] in OPEN_PATHS):
        return None
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return unauthorized("this server needs an API key: send `Authorization: Bearer <key>`")
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        return unauthorized("the API key is not valid for this server")
    return None


def _check_length(limit: int, headers: Headers) -> APIError | None:
    length = headers.get("content-length")
    if length is None:
        return None
    try:
        size = int(length)
    except ValueError:
        return APIError(400, f"Content-Length {length!r} is not a number", "invalid_request_error")
    return too_large(limit) if size > limit else None


def _counting(receive: Receive, limit: int) -> Receive:
    seen = 0

    async def receive_within_limit() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
        return message

    return receive_within_limit
