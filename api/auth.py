"""Request gates that run before any route: a bearer token on /v1/*, and a request-size limit.

Both are plain ASGI middleware, so they answer before the body is read or parsed (an unauthenticated
client learns nothing about the API's validation; an oversized body is never buffered). Their
responses are built by ``api.errors.error_response``, the one error shape.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response

PROTECTED_PREFIX = "/v1/"


class BearerTokenMiddleware:
    """Require ``Authorization: Bearer <token>`` on every /v1/* request (constant-time compare).

    /healthz and /metrics stay open: load balancers and Prometheus probe them without secrets, and
    they reveal no more than job counts and gauges.
    """

    def __init__(self, app: ASGIApp, *, token: str):
        assert token, "BearerTokenMiddleware needs a non-empty token"
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (scope["path"] + "/").startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("authorization")
        if given is None or not hmac.compare_digest(given.encode(), self._expected):
            response = error_response(
                401,
                "unauthorized",
                "missing or wrong API token." if given else "this server requires an API token.",
                fix="send 'Authorization: Bearer <token>' (the CLI reads ETRAIN_API_TOKEN)",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequestSizeLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413: up front when Content-Length says so, and
    while streaming for chunked bodies that do not declare a length."""

    def __init__(self, app: ASGIApp, *, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> tuple[str, str]:
        return (
            f"the request body is {size}; this server accepts at most {self.max_bytes} bytes.",
            "send a smaller body (ETRAIN_MAX_REQUEST_BYTES sets the limit)",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            try:
                length = int(declared)
                if length < 0:
                    raise ValueError
            except ValueError:
                response = error_response(400, "bad_request", f"invalid Content-Length header {declared!r}.")
                await response(scope, receive, send)
                return
            if length > self.max_bytes:
                message, fix = self._too_large(f"{length} bytes")
                await error_response(413, "request_too_large", message, fix=fix)(scope, receive, send)
                return

        received = 0
        limit = self.max_bytes
        too_large = self._too_large

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Raised inside the route's body read; FastAPI re-raises HTTPException as is and
                    # api/errors.py turns it into the 413 JSON.
                    text, _ = too_large(f"over {limit} bytes")
                    raise HTTPException(413, detail=text)
            return message

        await self.app(scope, counting_receive, send)
