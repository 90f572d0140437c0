"""The FastAPI application: routes, gates (auth, size limit), error handlers; nothing else.

``create_app(settings)`` builds the real ``service.manager.JobManager`` in the lifespan (it starts or
joins Ray, so it must not happen at import) and closes it on shutdown. Tests and embedders pass their
own ``manager`` instead; the app then never closes it: whoever built it owns it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import metadata

from fastapi import FastAPI

from api.auth import BearerTokenMiddleware, RequestSizeLimitMiddleware
from api.errors import install_error_handlers
from api.routes import health, jobs, plan
from service.ports import JobManagerPort
from service.settings import Settings


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
            from service.manager import JobManager  # Ray lives behind this import

            # Built on the main thread, before any request is served: ray.init installs its signal
            # handlers only there. It may block for seconds (starting Ray, reattaching supervisors).
            owned = JobManager(settings)
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
    app.state.settings = settings
    app.state.manager = manager
    install_error_handlers(app)
    # Added last = outermost: the token is checked before the size, so strangers learn nothing.
    app.add_middleware(RequestSizeLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_token:
        app.add_middleware(BearerTokenMiddleware, token=settings.api_token)
    app.include_router(jobs.router)
    app.include_router(plan.router)
    app.include_router(health.router)
    return app
