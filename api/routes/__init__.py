"""Route modules and the dependencies they share (the manager, the settings, the caller).

Routes get the manager through :func:`get_manager`, so tests may hand ``create_app`` a fake or
override the dependency (``app.dependency_overrides[get_manager] = ...``). Every /v1 route acts for
:func:`get_principal`'s caller (``create_app`` adds it to every /v1 router, so the OpenAPI document
declares the bearer scheme on each operation even where the handler does not take the caller).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from etrain.service.access.quotas import FairUse
from etrain.service.access.tenancy import Principal
from etrain.service.errors import AdminOnly, ChaosDisabled, NotAuthenticated, ServiceUnavailable
from etrain.service.ports import JobManagerPort
from etrain.service.settings import Settings

#: The OpenAPI security scheme. ``auto_error=False``: a missing token is answered by
#: :func:`get_principal` in the one error shape (and by ``etrain.api.auth.BearerAuthGate`` before that).
bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="ETRAIN_API_TOKEN (the admin), a tenant's token (ETRAIN_API_TOKENS), or the token the server "
    "generated into <data-dir>/api-token when none is configured.",
)


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_fair_use(request: Request) -> FairUse:
    """The per-tenant concurrency caps (event streams, plans): ``create_app`` keeps one per app. ``async``: no
    thread-pool hop for a lookup."""
    return request.app.state.fair_use


def get_manager(request: Request) -> JobManagerPort:
    manager = getattr(request.app.state, "manager", None)
    if manager is None:
        raise ServiceUnavailable(
            "the job manager is not running.", fix="the server is starting or stopping; retry in a few seconds"
        )
    return manager


def get_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)],
) -> Principal:
    """The caller the route acts for (a tenant, or the admin); NotAuthenticated (401) without a known token."""
    token = credentials.credentials if credentials is not None else None
    principal = request.app.state.authenticator.principal_for(token)
    if principal is None:
        raise NotAuthenticated(token_given="authorization" in request.headers)
    return principal


def get_optional_principal(request: Request) -> Principal | None:
    """For open routes (/metrics) that show more to a caller with a token: None without an
    ``Authorization`` header, the caller with a known token, NotAuthenticated (401) with a wrong one.
    Read by hand, not through ``bearer_scheme``, so the document keeps the route open."""
    header = request.headers.get("authorization")
    return None if header is None else request.app.state.authenticator.authenticate(header)


def require_chaos(
    request: Request,
    job_id: str,
    manager: Annotated[JobManagerPort, Depends(get_manager)],
    caller: Annotated[Principal, Depends(get_principal)],
) -> None:
    """Fault injection: only on servers started with ETRAIN_ENABLE_CHAOS=1, only with the admin token.

    Checked before the body: here for the route, and by ``etrain.api.auth.ChaosGate`` before FastAPI even
    parses it (a tenant's malformed body is a 403 too, never a 422 that teaches the drill API).
    """
    check_chaos_allowed(get_settings(request), manager, job_id, caller)


def check_chaos_allowed(settings: Settings, manager: JobManagerPort | None, job_id: str, caller: Principal) -> None:
    """ChaosDisabled unless the server allows drills; for a tenant, JobNotFound (404) for a job it cannot
    see, like on every other route (ids do not leak), and AdminOnly (403) on its own job. ``manager`` None
    (not running): the tenant's refusal waits for the route, which answers 503."""
    if not settings.enable_chaos:
        raise ChaosDisabled()
    if not caller.admin and manager is not None:
        manager.get(job_id, principal=caller)  # JobNotFound for another tenant's job
        raise AdminOnly("fault injection (chaos)", tenant=caller.tenant)
