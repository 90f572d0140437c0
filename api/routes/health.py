"""Operational endpoints, open without a token: /healthz (liveness + dependencies) and /metrics."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse

from api.routes import get_manager
from service.ports import JobManagerPort

router = APIRouter(tags=["operations"])

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Manager = Annotated[JobManagerPort, Depends(get_manager)]


@router.get("/healthz")
def healthz(manager: Manager) -> JSONResponse:
    """200 when the manager reports ok (database and Ray reachable), else 503 with the same body.

    The manager may say ``ok`` itself; otherwise every ``db`` / ``ray`` entry it reports must be "ok".
    """
    report = dict(manager.health())
    if "ok" not in report:
        report["ok"] = all(report[key] in ("ok", True) for key in ("db", "ray") if key in report)
    return JSONResponse(report, status_code=200 if report["ok"] else 503)


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(manager: Manager) -> PlainTextResponse:
    """Prometheus text exposition of job gauges."""
    return PlainTextResponse(manager.metrics_text(), media_type=PROMETHEUS_CONTENT_TYPE)
