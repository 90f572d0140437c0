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

from etrain.service.errors import AdminOnly, ChaosDisabled, NotAuthenticated, ServiceUnavailable
from etrain.service.ports import JobManagerPort
from etrain.service.settings import Settings
from etrain.service.access.tenancy import Principal

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

    Checked before the body. A tenant asking about a job it cannot see gets 404 like on every other
    route (ids do not leak); on its own job, 403 saying drills are the operator's.
    """
    if not get_settings(request).enable_chaos:
        raise ChaosDisabled()
    if not caller.admin:
        manager.get(job_id, principal=caller)  # JobNotFound for another tenant's job
        raise AdminOnly("fault injection (chaos)", tenant=caller.tenant)
