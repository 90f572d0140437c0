"""Route modules and the dependencies they share (the manager, the settings).

Routes get the manager through :func:`get_manager`, so tests may hand ``create_app`` a fake or
override the dependency (``app.dependency_overrides[get_manager] = ...``).
"""

from __future__ import annotations

from fastapi import Request

from service.errors import ChaosDisabled, ServiceUnavailable
from service.ports import JobManagerPort
from service.settings import Settings
from service.tenancy import ADMIN, Principal


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_manager(request: Request) -> JobManagerPort:
    manager = getattr(request.app.state, "manager", None)
    if manager is None:
        raise ServiceUnavailable(
            "the job manager is not running.", fix="the server is starting or stopping; retry in a few seconds"
        )
    return manager


def require_chaos(request: Request) -> None:
    """Fault injection only on servers started with ETRAIN_ENABLE_CHAOS=1 (checked before the body)."""
    if not get_settings(request).enable_chaos:
        raise ChaosDisabled()


def get_principal(request: Request) -> Principal:
    """The caller the route acts for (the tenant its jobs belong to, or the admin)."""
    return getattr(request.state, "principal", ADMIN)
