"""Response (and small request) models of the REST API: the JSON contract, built from store records.

Request bodies for jobs and plans are ``etrain.service.planning.spec.JobSpec`` itself; ``ChaosRequest`` lives with the
manager interface (``etrain.service.ports``) because the manager consumes it. Non-finite floats (a NaN loss)
are sent as ``null``: JSON has no NaN and the job's ``error`` says what happened.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from etrain.service.planning.bounds import MAX_STEPS
from etrain.service.planning.spec import DataParallel, ExportDtype, PathText, json_int
from etrain.service.ports import ChaosRequest
from etrain.service.store.records import EventRecord, JobRecord, JobStatus, StepRecord

__all__ = [
    "ChaosRequest",
    "ClusterOut",
    "ErrorItem",
    "ErrorOut",
    "EventOut",
    "EventsOut",
    "ExportOut",
    "ExportRequest",
    "JobListOut",
    "JobOut",
    "LogsOut",
    "ScaleRequest",
    "StepOut",
    "StepsOut",
]


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


# Request bodies are strict (a JSON string is not a number) and bounded (service/planning/bounds.py), like the spec.
_REQUEST = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ScaleRequest(BaseModel):
    model_config = _REQUEST

    dp: DataParallel = Field(description="the new data-parallel degree (within resources.min_dp .. max_dp)")


class ExportRequest(BaseModel):
    model_config = _REQUEST

    step: json_int(0, MAX_STEPS) | None = Field(
        default=None, description="a committed checkpoint step; null: the newest"
    )
    out: PathText = Field(description="a new or empty folder (relative paths: the server's directory)")
    dtype: ExportDtype | None = Field(
        default=None,
        description="the weights' dtype: float32 (the fp32 master weights exactly), bfloat16 or float16 (rounded, "
        "half the bytes); null: the job's checkpoint.export_dtype",
    )


class ExportOut(BaseModel):
    hf: str = Field(description="absolute path of the folder transformers' from_pretrained loads")
    step: int
    dtype: ExportDtype = Field(description="the dtype the weights were written in")


class JobOut(BaseModel):
    id: str
    name: str
    status: JobStatus
    spec: dict[str, Any]
    step: int
    loss: float | None
    tokens_per_s: float | None
    world_size: int
    restarts: int
    created_at: float = Field(description="unix seconds")
    updated_at: float = Field(description="unix seconds")
    error: str | None
    layout: str | None
    last_checkpoint_step: int | None
    stragglers: list[Any]
    goodput: float | None = Field(
        ge=0.0,
        le=1.0,
        description="kept step time / wall time since submit, 0..1 (service/decisions/goodput.py: a recomputed step counts "
        "once, queued time counts against it); null before the first step",
    )
    attempt: int
    artifacts: dict[str, str] = Field(
        default_factory=dict, description='what a succeeded job wrote besides checkpoints: {"hf": "<folder>"}'
    )
    tenant: str = Field(default="default", description="the tenant that submitted the job")
    priority: int = Field(default=0, description="queue order: higher first, then oldest first")
    mfu: float | None = Field(
        default=None,
        description="model FLOPs utilisation of the latest step, 0..1 (docs/job-spec.md: the formula); null "
        "before the first step and where the device's peak FLOP/s is unknown (CPU)",
    )
    goodput_breakdown: dict[str, float] | None = Field(
        default=None,
        description="seconds of wall time since submit by cause, summing to it: queued, startup, productive, "
        "stragglers, checkpoint, between_steps, recomputed, recovery, resizing, since_last_step "
        "(docs/rest-api.md; service/decisions/goodput_breakdown.py); refreshed every 10 s while the job runs, "
        "final at its end; null before the first refresh",
    )
    host_memory_gib: float | None = Field(
        default=None,
        description="the most host memory a rank held at the latest sample (its anonymous pages, GiB; each rank "
        "samples every 10 s), beside the spec's resources.host_memory_gb that each rank reserves; null before the "
        "first sample and where the kernel does not say",
    )

    @classmethod
    def of(cls, job: JobRecord) -> JobOut:
        return cls(
            id=job.id,
            name=job.name,
            status=job.status,
            spec=_clean(job.spec),
            step=job.step,
            loss=_finite(job.loss),
            tokens_per_s=_finite(job.tokens_per_s),
            world_size=job.world_size,
            restarts=job.restarts,
            created_at=job.created_at,
            updated_at=job.updated_at,
            error=job.error,
            layout=job.layout,
            last_checkpoint_step=job.last_checkpoint_step,
            stragglers=_clean(list(job.stragglers)),
            goodput=_finite(job.goodput),
            attempt=job.attempt,
            artifacts=dict(job.artifacts),
            tenant=job.tenant,
            priority=job.priority,
            mfu=_finite(job.mfu),
            goodput_breakdown=None
            if job.goodput_breakdown is None
            else {cause: _finite(value) or 0.0 for cause, value in job.goodput_breakdown.items()},
            host_memory_gib=_finite(job.host_memory_gib),
        )


class JobListOut(BaseModel):
    jobs: list[JobOut]
    limit: int
    offset: int


class EventOut(BaseModel):
    seq: int
    ts: float
    kind: str
    detail: dict[str, Any]

    @classmethod
    def of(cls, event: EventRecord) -> EventOut:
        return cls(seq=event.seq, ts=event.ts, kind=event.kind, detail=_clean(event.detail))


class EventsOut(BaseModel):
    job_id: str
    events: list[EventOut]
    next_since: int = Field(description="pass as ?since= to get only newer events")


class StepOut(BaseModel):
    step: int
    loss: float | None
    tokens_per_s: float | None
    step_s: float | None
    compute_s: float | None
    comm_wait_s: float | None
    ts: float
    attempt: int
    mfu: float | None = Field(
        None, description="model FLOPs utilisation, 0..1; null where the device's peak FLOP/s is unknown (CPU)"
    )

    @classmethod
    def of(cls, record: StepRecord) -> StepOut:
        return cls(
            step=record.step,
            loss=_finite(record.loss),
            tokens_per_s=_finite(record.tokens_per_s),
            step_s=_finite(record.step_s),
            compute_s=_finite(record.compute_s),
            comm_wait_s=_finite(record.comm_wait_s),
            ts=record.ts,
            attempt=record.attempt,
            mfu=_finite(record.mfu),
        )


class StepsOut(BaseModel):
    job_id: str
    steps: list[StepOut]
    next_since: int = Field(description="pass as ?since= to get only newer steps")


class LogsOut(BaseModel):
    job_id: str
    rank: int
    lines: list[str] = Field(description="whole lines, oldest first, each at most 4000 characters")
    next_offset: int = Field(description="pass as ?offset= to get only the lines written after these")


class ClusterNodeOut(BaseModel):
    node_id: str
    alive: bool
    cpus: float = Field(description="total CPUs the node offers to Ray")
    gpus: float
    memory_gib: float = Field(description="host memory the node offers to Ray (its `memory` resource), GiB")
    free_cpus: float = Field(description="not held by any placement group, actor or task now")
    free_gpus: float
    free_memory_gib: float


class NodeHoldingOut(BaseModel):
    node_id: str
    cpus: float
    gpus: float
    memory_gib: float = Field(description="host memory its ranks' bundles reserve (resources.host_memory_gb each)")


class JobHoldingOut(BaseModel):
    """A started job and what its placement group holds now (nothing while it starts or recovers)."""

    job_id: str
    status: JobStatus
    priority: int
    tenant: str
    world_size: int = Field(description="ranks of its current layout")
    cpus: float
    gpus: float
    memory_gib: float
    nodes: list[NodeHoldingOut]


class QueueEntryOut(BaseModel):
    job_id: str
    priority: int
    position: int = Field(ge=1, description="1 starts next: higher priority first, then oldest first")
    reason: str = Field(description="what it waits for, with the numbers")
    submitted_at: float


class ClusterTotalsOut(BaseModel):
    nodes: int
    alive_nodes: int
    cpus: float
    gpus: float
    memory_gib: float
    free_cpus: float
    free_gpus: float
    free_memory_gib: float
    running_jobs: int = Field(description="started, unfinished jobs of every tenant")
    queued_jobs: int = Field(description="queued jobs of every tenant")


class ClusterOut(BaseModel):
    """GET /v1/cluster: nodes, totals, what each started job holds, and the queue in admission order.
    A tenant sees its own jobs only (``jobs``, ``queue``); nodes and totals cover the whole cluster."""

    nodes: list[ClusterNodeOut]
    totals: ClusterTotalsOut
    jobs: list[JobHoldingOut]
    queue: list[QueueEntryOut]
    observed_at: float = Field(description="when the cluster was read (unix seconds)")


class ErrorItem(BaseModel):
    field: str
    message: str
    fix: str | None = None


class ErrorOut(BaseModel):
    """Every error response (documented in OpenAPI; produced by api/errors.py)."""

    error: str
    message: str
    fix: str | None = None
    detail: list[ErrorItem] = []


#: Statuses any operation may answer besides its own, declared by each router (``responses=``) so the
#: document lists every status the server sends (FastAPI's own 422 schema is not our error body).
COMMON_RESPONSES: dict[int | str, dict[str, Any]] = {
    413: {"model": ErrorOut, "description": "the request body is larger than ETRAIN_MAX_REQUEST_BYTES"},
    503: {"model": ErrorOut, "description": "the job service is not running (the server is starting or stopping)"},
}
#: The 429 of each per-tenant cap a route can hit (the body's ``quota`` object has the numbers, the
#: ``Retry-After`` header when to try again).
TOO_MANY: dict[str, dict[str, Any]] = {
    name: {
        "model": ErrorOut,
        "description": f"{what} (the body's quota object has the numbers; retry after "
        "the Retry-After header's seconds)",
        "headers": {
            "Retry-After": {"description": "seconds to wait before trying again", "schema": {"type": "integer"}}
        },
    }
    for name, what in (
        ("max_plans", "the tenant has ETRAIN_TENANT_MAX_PLANS plans computing already"),
        ("max_streams", "the tenant has ETRAIN_TENANT_MAX_STREAMS event streams open already"),
        ("max_workers", "the larger job would take the tenant over ETRAIN_TENANT_MAX_WORKERS"),
        (
            "submit",
            "a per-tenant quota (ETRAIN_TENANT_MAX_JOBS / _MAX_WORKERS) is full, or, for parallelism auto, "
            "the tenant has ETRAIN_TENANT_MAX_PLANS plans computing already",
        ),
    )
}
#: ... and every operation that takes parameters or a body (all of /v1).
V1_RESPONSES: dict[int | str, dict[str, Any]] = {
    **COMMON_RESPONSES,
    422: {
        "model": ErrorOut,
        "description": "a parameter or the body is invalid or out of bounds; each problem names its field and the fix",
    },
}
