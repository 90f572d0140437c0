"""Operational endpoints, open without a token: /healthz (liveness + dependencies) and /metrics."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse

from etrain.api.routes import get_manager, get_optional_principal
from etrain.api.schemas import COMMON_RESPONSES, ErrorOut
from etrain.service import prometheus
from etrain.service.ports import JobManagerPort
from etrain.service.access.tenancy import Principal

router = APIRouter(tags=["operations"], responses=COMMON_RESPONSES)


Manager = Annotated[JobManagerPort, Depends(get_manager)]


@router.get(
    "/healthz",
    responses={503: {"description": "a dependency (database, Ray) is not ok: the same report as 200 with "
                                    "ok=false, or the error body when the job service is not running",
                     "content": {"application/json": {"schema": {"type": "object"}}}}},
)
def healthz(manager: Manager) -> JSONResponse:
    """200 when the manager reports ok (database and Ray reachable), else 503 with the same body.

    The manager may say ``ok`` itself; otherwise every ``db`` / ``ray`` entry it reports must be "ok".
    """
    report = dict(manager.health())
    if "ok" not in report:
        report["ok"] = all(report[key] in ("ok", True) for key in ("db", "ray") if key in report)
    return JSONResponse(report, status_code=200 if report["ok"] else 503)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={401: {"model": ErrorOut, "description": "an Authorization header with a token this server does not know"}},
)
def metrics(
    manager: Manager, viewer: Annotated[Principal | None, Depends(get_optional_principal)]
) -> PlainTextResponse:
    """Prometheus text exposition of job gauges: aggregates for anyone; with a bearer token (optional)
    also the per-job gauges of the jobs that token may see (the admin: all)."""
    return PlainTextResponse(manager.metrics_text(principal=viewer), media_type=prometheus.CONTENT_TYPE)
