"""Pure-ASGI gates in front of the routes: the API key, and the request-body size limit.

Both answer before any route code runs and before an oversize body is read: an
unauthenticated client cannot make the server buffer anything, and a body above the limit is
refused on its Content-Length, or, when it is chunked, as soon as the count passes the limit.
(Pure ASGI rather than BaseHTTPMiddleware, which would get between a stream and the client's
disconnect.)
"""
from __future__ import annotations

import hmac
from typing import Callable

from ridge.server.errors import APIError


class StatusCounter:
    """Counts every error status the app sends, whatever produced it."""

    def __init__(self, app, on_error: Callable[[int], None]):
        self.app, self.on_error = app, on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted_send(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.on_error(message["status"])
            await send(message)

        await self.app(scope, receive, counted_send)


class APIKeyGate:
    """With an API key set, /v1/* needs `Authorization: Bearer <key>`; /health and /metrics
    stay open for load balancers and scrapers."""

    def __init__(self, app, api_key: str | None, prefix: str = "/v1"):
        self.app, self.prefix = app, prefix
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.key is None or not scope["path"].startswith(self.prefix):
            return await self.app(scope, receive, send)
        auth = _header(scope, b"authorization")
        if auth is None:
            err = APIError(401, "authorization: missing API key; send 'Authorization: Bearer <key>'",
                           "authorization", "missing_api_key")
        else:
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
                return await self.app(scope, receive, send)
            err = APIError(401, "authorization: invalid API key", "authorization", "invalid_api_key")
        await err.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)


class BodyLimit:
    """Reads a request body up to `limit` bytes and hands it on whole; 413 past the limit."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._too_large(scope, receive, send)
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return                      # the client left before sending its body
            body = message.get("body", b"")
            total += len(body)
            if total > self.limit:
                return await self._too_large(scope, receive, send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            # the body once, then the real channel (the app listens on it for a disconnect)
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        err = APIError(413, f"body: the request body exceeds the limit of {self.limit} bytes", "body",
                       "request_too_large")
        await err.response({"Connection": "close"})(scope, receive, send)


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None
