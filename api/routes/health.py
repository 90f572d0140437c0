"""Operational endpoints, open without a token: /healthz (liveness + dependencies) and /metrics.

/healthz answers from :class:`HealthCache`: the manager's report (the database and Ray) is probed by one
background thread at a time and kept ``ETRAIN_HEALTH_CACHE_S`` (default 2 s), so a flood of probes
(load balancers, a scanner) costs one Ray call per interval, never one per request, and a request never
waits on Ray once the first probe answered. Anonymously it says only whether the service is ok; with a
token (any tenant's, or the admin's) it shows the whole report (Ray's resources name the nodes' IPs).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from etrain.api.routes import get_manager, get_optional_principal
from etrain.api.schemas import COMMON_RESPONSES, ErrorOut
from etrain.service import prometheus
from etrain.service.access.tenancy import Principal
from etrain.service.errors import ServiceUnavailable
from etrain.service.ports import JobManagerPort

router = APIRouter(tags=["operations"], responses=COMMON_RESPONSES)


Manager = Annotated[JobManagerPort, Depends(get_manager)]

#: How long a request waits for the first probe (or, with ETRAIN_HEALTH_CACHE_S=0, for a fresh one).
FIRST_PROBE_WAIT_S = 10.0


def probe(app: FastAPI) -> dict[str, Any]:
    """The manager's health report with ``ok``: the manager may say it itself; otherwise every ``db`` / ``ray``
    entry it reports must be "ok". ServiceUnavailable when the manager is not running."""
    manager = getattr(app.state, "manager", None)
    if manager is None:
        raise ServiceUnavailable(
            "the job manager is not running.", fix="the server is starting or stopping; retry in a few seconds"
        )
    report = dict(manager.health())
    if "ok" not in report:
        report["ok"] = all(report[key] in ("ok", True) for key in ("db", "ray") if key in report)
    return report


class HealthCache:
    """The last health report, refreshed by one background probe at a time (single flight).

    A report younger than ``ttl_s`` is served as it is; an older one is served too while a background
    thread probes again (stale while revalidating), so only the first request (or every request with
    ``ttl_s`` 0) waits for a probe, and concurrent waiters share it. A report older than ``stuck_s``
    means the probe itself hangs (Ray does not answer): it is served as a failure (``ok`` false, 503).
    """

    def __init__(
        self,
        probe: Callable[[], dict[str, Any]],
        *,
        ttl_s: float,
        stuck_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._probe = probe
        self.ttl_s = ttl_s
        self.stuck_s = stuck_s if stuck_s is not None else max(30.0, 10 * ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._report: dict[str, Any] | None = None
        self._at = 0.0
        self._flight: Future | None = None
        #: Probes run so far (tests and the benchmark count them).
        self.probes = 0

    async def get(self) -> tuple[dict[str, Any], float]:
        """(the report, its age in seconds)."""
        with self._lock:
            now = self._clock()
            report, age = self._report, now - self._at
            if report is not None and age < self.ttl_s:
                return report, age
            flight = self._start()
            if report is not None and self.ttl_s > 0:
                if age > self.stuck_s:
                    report = {
                        **report,
                        "ok": False,
                        "health": f"no answer from the health probe for {age:.0f} s (the database or Ray hangs)",
                    }
                return report, age
        try:
            fresh = await asyncio.wait_for(asyncio.wrap_future(flight), FIRST_PROBE_WAIT_S)
        except TimeoutError:
            return {"ok": False, "health": f"the health probe did not answer within {FIRST_PROBE_WAIT_S:g} s"}, 0.0
        return fresh, 0.0

    def _start(self) -> Future:
        """The probe in flight, or a new one on its own thread (under the lock)."""
        if self._flight is None:
            flight: Future = Future()
            flight.set_running_or_notify_cancel()  # a waiter that times out cannot cancel it for the others
            self._flight = flight
            threading.Thread(target=self._run, args=(flight,), name="etrain-health", daemon=True).start()
        return self._flight

    def _run(self, flight: Future) -> None:
        try:
            report = self._probe()
        except Exception as err:  # noqa: BLE001 - a failed probe is an answer, cached like any other
            report = {"ok": False, "health": f"the health probe failed: {type(err).__name__}: {err}"}
        with self._lock:
            self._report, self._at = report, self._clock()
            self._flight = None
            self.probes += 1
        flight.set_result(report)


@router.get(
    "/healthz",
    responses={
        200: {
            "description": 'the service is ok. Anonymously `{"ok": true, "status": "ok"}`; with a token the '
            "whole report (db, ray, Ray's nodes and resources, age_s: how old the cached probe is)",
            "content": {"application/json": {"schema": {"type": "object"}}},
        },
        401: {"model": ErrorOut, "description": "an Authorization header with a token this server does not know"},
        503: {
            "description": "a dependency (database, Ray) is not ok: the same body as 200 with ok=false and "
            'status "unavailable", or the error body when the job service is not running',
            "content": {"application/json": {"schema": {"type": "object"}}},
        },
    },
)
async def healthz(request: Request) -> JSONResponse:
    """200 when the database and Ray are reachable (as last probed, at most ETRAIN_HEALTH_CACHE_S ago),
    else 503. Never waits on Ray once the first probe has answered. (An anonymous request is answered the
    same way by :class:`AnonymousHealth` before the app's routing: probers are many and must cost little.)"""
    viewer = get_optional_principal(request)  # 401 for a wrong token, as /metrics
    if getattr(request.app.state, "manager", None) is None:
        probe(request.app)  # ServiceUnavailable: 503
    return await answer(request.app, full=viewer is not None)


async def answer(app: FastAPI, *, full: bool) -> JSONResponse:
    """/healthz's answer from the cache: ``{"ok", "status"}``, and with ``full`` the whole report and its age."""
    report, age = await app.state.health.get()
    ok = bool(report.get("ok"))
    body: dict[str, Any] = {"ok": ok, "status": "ok" if ok else "unavailable"}
    if full:
        body = {**report, **body, "age_s": round(age, 3)}
    return JSONResponse(body, status_code=200 if ok else 503)


class AnonymousHealth:
    """``GET /healthz`` without an ``Authorization`` header, answered before the app's routing, dependencies
    and other middleware: the same answer as the route's (:func:`answer`), at a fraction of the cost, for the
    load balancers and scanners that probe it many times a second. Anything else passes on (a request with
    a token, or while the job manager is not running: the route answers those)."""

    def __init__(self, app: ASGIApp, *, fastapi: FastAPI):
        self.app = app
        self.fastapi = fastapi

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] == "/healthz"
            and scope["method"] == "GET"
            and getattr(self.fastapi.state, "manager", None) is not None
            and not any(name == b"authorization" for name, _ in scope["headers"])
        ):
            await (await answer(self.fastapi, full=False))(scope, receive, send)
            return
        await self.app(scope, receive, send)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        401: {"model": ErrorOut, "description": "an Authorization header with a token this server does not know"}
    },
)
def metrics(
    manager: Manager, viewer: Annotated[Principal | None, Depends(get_optional_principal)]
) -> PlainTextResponse:
    """Prometheus text exposition of job gauges: aggregates for anyone; with a bearer token (optional)
    also the per-job gauges of the jobs that token may see (the admin: all)."""
    return PlainTextResponse(manager.metrics_text(principal=viewer), media_type=prometheus.CONTENT_TYPE)
