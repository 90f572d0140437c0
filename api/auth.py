"""Who is calling: bearer tokens -> :class:`etrain.service.access.tenancy.Principal`, and the request gates.

Auth is always on. ``ETRAIN_API_TOKEN`` is the admin; ``ETRAIN_API_TOKENS`` / ``ETRAIN_API_TOKENS_FILE``
map tokens to tenants; with none of them set the server generates its admin token into
``<data-dir>/api-token`` (``etrain.service.access.api_token``). The routes get the caller from the security
dependency ``etrain.api.routes.get_principal`` (so the OpenAPI document declares the bearer scheme), and
:class:`BearerAuthGate`, plain ASGI, answers the same 401 *before* FastAPI reads the body: FastAPI
parses JSON before it runs dependencies, so without the gate a stranger's malformed body would get
a 422 that teaches the API's validation. The size limit is plain ASGI for the same reason (an
oversized body is never buffered). Responses come from ``etrain.api.errors``, the one error shape.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Mapping
from pathlib import Path

from fastapi.security.utils import get_authorization_scheme_param
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from etrain.api.errors import error_response, etrain_error_response
from etrain.api.routes import check_chaos_allowed
from etrain.service.access.quotas import FairUse
from etrain.service.access.tenancy import ADMIN, Principal
from etrain.service.errors import NotAuthenticated, QuotaExceeded
from etrain.service.settings import Settings
from etrain.workers.protocol.errors import EtrainError

log = logging.getLogger("etrain.api")

PROTECTED_PREFIX = "/v1/"


class Authenticator:
    """Bearer token -> Principal, comparing in constant time against *every* configured token.

    Tokens are compared as SHA-256 digests with ``hmac.compare_digest``, and the loop never stops
    early, so neither the time to answer nor a length difference tells a caller how close it came or
    which entry matched.
    """

    def __init__(self, tokens: Mapping[str, Principal], *, token_file: Path | None = None):
        assert tokens, "an Authenticator needs at least one token"
        self._entries = [(_digest(token), principal) for token, principal in tokens.items()]
        #: Where the generated admin token lives (None when the operator configured the tokens).
        self.token_file = token_file

    @classmethod
    def from_settings(cls, settings: Settings) -> Authenticator:
        """The admin token (ETRAIN_API_TOKEN, else the generated file when no token at all is set) and
        every tenant token."""
        tokens: dict[str, Principal] = {token: Principal(tenant) for token, tenant in settings.token_tenants.items()}
        token_file = None
        admin = settings.api_token
        if not settings.auth_configured:
            from etrain.service.access.api_token import ensure_api_token

            provisioned = ensure_api_token(settings.data_dir)
            admin, token_file = provisioned.token, provisioned.path
            log.warning(
                "no API token configured: the admin token is in %s (%s)",
                provisioned.path,
                "generated now" if provisioned.created else "kept from an earlier start",
            )
        if admin is not None:
            tokens[admin] = ADMIN
        return cls(tokens, token_file=token_file)

    def principal_for(self, token: str | None) -> Principal | None:
        """The caller this token belongs to, or None (no token, or an unknown one)."""
        if not token:
            return None
        given = _digest(token)
        found = None
        for digest, principal in self._entries:
            if hmac.compare_digest(given, digest):
                found = principal
        return found

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller of a request with this ``Authorization`` header, or NotAuthenticated (401)."""
        principal = self.principal_for(bearer_token(authorization))
        if principal is None:
            raise NotAuthenticated(token_given=bool(authorization))
        return principal


def bearer_token(authorization: str | None) -> str | None:
    """The token of ``Bearer <token>`` (parsed as FastAPI's ``HTTPBearer`` does), else None."""
    scheme, token = get_authorization_scheme_param(authorization)
    return token if scheme.lower() == "bearer" and token else None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class BearerAuthGate:
    """Answer 401 on /v1/* without a known bearer token, before the route reads or parses the body.

    /healthz and /metrics stay open: load balancers and Prometheus probe them without secrets, and
    anonymously they show only aggregates (no job ids, names or tenants). The routes still resolve
    the caller themselves (``etrain.api.routes.get_principal``); this gate only makes the refusal early.
    """

    def __init__(self, app: ASGIApp, *, authenticator: Authenticator):
        self.app = app
        self.authenticator = authenticator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"] + "/").startswith(PROTECTED_PREFIX):
            try:
                self.authenticator.authenticate(Headers(scope=scope).get("authorization"))
            except NotAuthenticated as refused:
                await etrain_error_response(refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ChaosGate:
    """Refuse ``POST /v1/jobs/{id}/chaos`` to a caller who may not fire drills before the body is read.

    FastAPI parses a JSON body before it runs a route's dependencies, so without this gate a tenant's
    malformed drill order got a 422 (which teaches the drill API) where a well-formed one got 403. Same
    rule as the route's own dependency (``etrain.api.routes.check_chaos_allowed``): chaos disabled -> 403,
    another tenant's job -> 404, a tenant's own job -> 403. The admin passes on to the route.
    """

    PATH = re.compile(r"^/v1/jobs/([^/]+)/chaos/?$")

    def __init__(self, app: ASGIApp, *, authenticator: Authenticator, settings: Settings):
        self.app = app
        self.authenticator = authenticator
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = self.PATH.match(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if match is not None:
            caller = self.authenticator.principal_for(bearer_token(Headers(scope=scope).get("authorization")))
            if caller is not None:  # None: BearerAuthGate answers 401
                manager = getattr(scope["app"].state, "manager", None) if "app" in scope else None
                try:
                    if caller.admin or not self.settings.enable_chaos:
                        check_chaos_allowed(self.settings, None, match.group(1), caller)
                    else:  # reads the job (SQLite): off the event loop
                        await run_in_threadpool(check_chaos_allowed, self.settings, manager, match.group(1), caller)
                except EtrainError as refused:
                    await etrain_error_response(refused)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class PlanGate:
    """Hold one of the caller's plan slots (``ETRAIN_TENANT_MAX_PLANS``) for the whole of ``POST /v1/plan``,
    taken before the body is read: a refusal (429 with Retry-After) costs no parsing of the spec (a large
    spec's validation costs milliseconds; a tenant retrying at once must not buy CPU with it). The admin is
    not capped. The slot is given back as the answer ends."""

    def __init__(self, app: ASGIApp, *, authenticator: Authenticator, fair_use: FairUse):
        self.app = app
        self.authenticator = authenticator
        self.fair_use = fair_use

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].rstrip("/") != "/v1/plan":
            await self.app(scope, receive, send)
            return
        caller = self.authenticator.principal_for(bearer_token(Headers(scope=scope).get("authorization")))
        if caller is None:  # BearerAuthGate answers 401
            await self.app(scope, receive, send)
            return
        try:
            release = self.fair_use.plans.acquire(caller)
        except QuotaExceeded as refused:
            await etrain_error_response(refused)(scope, receive, send)
            return

        async def send_then_release(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()  # before the answer's end goes out: a client that has it finds the slot free
            await send(message)

        try:
            await self.app(scope, receive, send_then_release)
        finally:
            release()  # idempotent; an app that failed before answering


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
