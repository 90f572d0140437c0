"""/v1/jobs: submit, list, inspect, follow, cancel, resize, export and (when enabled) break jobs.

Handlers are plain ``def``: the manager blocks (SQLite, Ray calls), so FastAPI runs them in its
thread pool. Errors are raised as ``service.errors`` and turned into HTTP by ``api/errors.py``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response

from api.routes import get_manager, get_principal, require_chaos
from api.schemas import (
    ChaosRequest,
    ErrorOut,
    EventOut,
    EventsOut,
    ExportOut,
    ExportRequest,
    JobListOut,
    JobOut,
    ScaleRequest,
    StepOut,
    StepsOut,
)
from service.ports import JobManagerPort
from service.spec import JobSpec
from service.store import JobStatus
from service.tenancy import Principal

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

Manager = Annotated[JobManagerPort, Depends(get_manager)]
Caller = Annotated[Principal, Depends(get_principal)]
_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorOut, "description": "no such job"}}
_CONFLICT: dict[int | str, dict[str, Any]] = {**_NOT_FOUND, 409: {"model": ErrorOut, "description": "job is terminal"}}


@router.post(
    "",
    status_code=201,
    response_model=JobOut,
    responses={422: {"model": ErrorOut, "description": "the spec is invalid or infeasible"}},
)
def submit_job(spec: JobSpec, response: Response, manager: Manager, caller: Caller) -> JobOut:
    """Validate the spec (fields, cross-field rules, planner), record the job and start it."""
    job = manager.submit(spec, principal=caller)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobOut.of(job)


@router.get("", response_model=JobListOut)
def list_jobs(
    manager: Manager,
    caller: Caller,
    status: Annotated[JobStatus | None, Query(description="only jobs in this status")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> JobListOut:
    jobs = manager.list(status=status, limit=limit, offset=offset, principal=caller)
    return JobListOut(jobs=[JobOut.of(job) for job in jobs], limit=limit, offset=offset)


@router.get("/{job_id}", response_model=JobOut, responses=_NOT_FOUND)
def get_job(job_id: str, manager: Manager, caller: Caller) -> JobOut:
    return JobOut.of(manager.get(job_id, principal=caller))


@router.get("/{job_id}/events", response_model=EventsOut, responses=_NOT_FOUND)
def job_events(
    job_id: str,
    manager: Manager,
    caller: Caller,
    since: Annotated[int, Query(ge=0, description="only events with seq > since")] = 0,
) -> EventsOut:
    events = manager.events(job_id, since_seq=since, principal=caller)
    next_since = events[-1].seq if events else since
    return EventsOut(job_id=job_id, events=[EventOut.of(e) for e in events], next_since=next_since)


@router.get("/{job_id}/metrics", response_model=StepsOut, responses=_NOT_FOUND)
def job_metrics(
    job_id: str,
    manager: Manager,
    caller: Caller,
    since: Annotated[int, Query(ge=-1, description="only steps > since")] = -1,
) -> StepsOut:
    """Per-step history: loss, throughput and the compute / communication-wait split."""
    steps = manager.steps(job_id, since_step=since, principal=caller)
    next_since = steps[-1].step if steps else since
    return StepsOut(job_id=job_id, steps=[StepOut.of(s) for s in steps], next_since=next_since)


@router.post("/{job_id}/cancel", response_model=JobOut, responses=_CONFLICT)
def cancel_job(job_id: str, manager: Manager, caller: Caller) -> JobOut:
    return JobOut.of(manager.cancel(job_id, principal=caller))


@router.post("/{job_id}/scale", response_model=JobOut, responses=_CONFLICT)
def scale_job(job_id: str, request: ScaleRequest, manager: Manager, caller: Caller) -> JobOut:
    """Change the data-parallel degree; tp and pp never change and the global batch is kept."""
    return JobOut.of(manager.scale(job_id, request.dp, principal=caller))


@router.post(
    "/{job_id}/export",
    response_model=ExportOut,
    responses={
        **_NOT_FOUND,
        400: {"model": ErrorOut, "description": "the job's model has no Hugging Face format"},
        409: {"model": ErrorOut, "description": "no such committed checkpoint, or out is not empty"},
    },
)
def export_job(job_id: str, request: ExportRequest, manager: Manager, caller: Caller) -> ExportOut:
    """Write a committed checkpoint (``step``, default the newest) as a Hugging Face folder at ``out``.

    Blocks until the export task is done (it streams one output shard at a time); the folder loads
    with ``transformers.AutoModelForCausalLM.from_pretrained``.
    """
    return ExportOut.model_validate(manager.export(job_id, request.step, request.out, principal=caller))


@router.post(
    "/{job_id}/chaos",
    dependencies=[Depends(require_chaos)],
    responses={**_NOT_FOUND, 403: {"model": ErrorOut, "description": "chaos is disabled on this server"}},
)
def inject_fault(job_id: str, request: ChaosRequest, manager: Manager, caller: Caller) -> dict[str, Any]:
    """Inject a fault into a running job (servers started with ETRAIN_ENABLE_CHAOS=1 only).

    The manager gets the validated request as a plain dict (it travels to the supervisor actor).
    """
    return manager.chaos(job_id, request.model_dump(exclude_none=True), principal=caller)
