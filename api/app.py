"""The FastAPI application: routes, gates (auth, size limit), error handlers; nothing else.

``create_app(settings)`` builds the real ``etrain.service.manager.JobManager`` in the lifespan (it starts or
joins Ray, so it must not happen at import) and closes it on shutdown. Tests and embedders pass their
own ``manager`` instead; the app then never closes it: whoever built it owns it.

Auth is always on: with no token in the settings, ``create_app`` generates (or reuses) the admin
token in ``<data-dir>/api-token`` (``etrain.api.auth.Authenticator.from_settings``); ``app.state.authenticator``
resolves tokens, and every /v1 router is included behind ``etrain.api.routes.get_principal``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import metadata
from typing import Any

from fastapi import Depends, FastAPI

from etrain.api.auth import Authenticator, BearerAuthGate, ChaosGate, PlanGate, RequestSizeLimitMiddleware
from etrain.api.errors import install_error_handlers
from etrain.api.routes import cluster, get_principal, health, jobs, plan
from etrain.api.schemas import ErrorOut
from etrain.service.access.quotas import FairUse
from etrain.service.ports import JobManagerPort
from etrain.service.settings import Settings


def _version() -> str:
    try:
        return metadata.version("etrain")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def create_app(
    settings: Settings | None = None,
    manager: JobManagerPort | None = None,
    *,
    on_ready: Callable[[JobManagerPort], None] | None = None,
) -> FastAPI:
    """``on_ready(manager)`` runs once the manager is up (``etrain serve`` prints its URLs there)."""
    settings = settings if settings is not None else Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned: JobManagerPort | None = None
        if app.state.manager is None:
            from etrain.service.manager import JobManager  # Ray lives behind this import

            # Built on the main thread, before any request is served: ray.init installs its signal
            # handlers only there. It may block for seconds (starting Ray, reattaching supervisors).
            owned = JobManager(settings)
            warm = getattr(owned, "warm_planner", None)  # tests stand a stub in for the class
            if warm is not None:
                warm()  # the first plan does not wait for the planner's process to start
            app.state.manager = owned
        if on_ready is not None:
            on_ready(app.state.manager)
        try:
            yield
        finally:
            if owned is not None:
                app.state.manager = None
                owned.close()

    app = FastAPI(
        title="etrain",
        version=_version(),
        description="Elastic training service: submit, follow, resize and cancel distributed training jobs.",
        lifespan=lifespan,
    )
    authenticator = Authenticator.from_settings(settings)
    app.state.settings = settings
    app.state.manager = manager
    app.state.authenticator = authenticator
    #: Per-tenant concurrency caps (event streams, plans) the routes take slots of; /healthz's cached probe.
    app.state.fair_use = FairUse.of(settings)
    app.state.health = health.HealthCache(lambda: health.probe(app), ttl_s=settings.health_cache_s)
    install_error_handlers(app)
    # Added last = outermost: anonymous health probes are answered first, at the least cost; then the token
    # is checked before anything else, so strangers learn nothing; then whether the caller may fire drills
    # at all, and whether it has a plan slot free; then the size.
    app.add_middleware(RequestSizeLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(PlanGate, authenticator=authenticator, fair_use=app.state.fair_use)
    app.add_middleware(ChaosGate, authenticator=authenticator, settings=settings)
    app.add_middleware(BearerAuthGate, authenticator=authenticator)
    app.add_middleware(health.AnonymousHealth, fastapi=app)
    # Every /v1 router goes here: behind the caller (401 without a known token, declared in OpenAPI).
    for router in (jobs.router, plan.router, cluster.router):
        app.include_router(router, **_V1)
    app.include_router(health.router)
    return app


_V1: dict[str, Any] = {
    "dependencies": [Depends(get_principal)],
    "responses": {401: {"model": ErrorOut, "description": "no API token, or one this server does not know"}},
}
