"""/v1/jobs: submit, list, inspect, follow, cancel, resize, export and (when enabled) break jobs.

Handlers are plain ``def``: the manager blocks (SQLite, Ray calls), so FastAPI runs them in its
thread pool. The one exception is GET /events, ``async`` so that a following (streaming) client holds
no thread while it waits. Errors are raised as ``etrain.service.errors`` and turned into HTTP by ``api/errors.py``.
No handler waits on Ray: cancel and scale are handed to the supervisor off the request thread (202).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import nullcontext
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from etrain.api import sse
from etrain.api.routes import get_fair_use, get_manager, get_principal, require_chaos
from etrain.api.schemas import (
    TOO_MANY,
    V1_RESPONSES,
    ChaosRequest,
    ErrorOut,
    EventOut,
    EventsOut,
    ExportOut,
    ExportRequest,
    JobListOut,
    JobOut,
    LogsOut,
    ScaleRequest,
    StepOut,
    StepsOut,
)
from etrain.service.access.quotas import FairUse
from etrain.service.access.tenancy import Principal
from etrain.service.planning.bounds import MAX_CURSOR
from etrain.service.planning.spec import JobSpec
from etrain.service.ports import JobManagerPort
from etrain.service.store import idempotency
from etrain.service.store.records import JobStatus

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=V1_RESPONSES)

Manager = Annotated[JobManagerPort, Depends(get_manager)]
Caller = Annotated[Principal, Depends(get_principal)]
Fair = Annotated[FairUse, Depends(get_fair_use)]
#: Largest event/step sequence number a query may name (SQLite integers are 64-bit).
MAX_SEQ = MAX_CURSOR
#: Bounds of GET /logs: a rank index no layout reaches, and the most lines one answer carries.
MAX_RANK = 1 << 20
MAX_LOG_TAIL = 10_000
_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorOut, "description": "no such job"}}
_CONFLICT: dict[int | str, dict[str, Any]] = {**_NOT_FOUND, 409: {"model": ErrorOut, "description": "job is terminal"}}


@router.post(
    "",
    status_code=201,
    response_model=JobOut,
    responses={
        422: {"model": ErrorOut, "description": "the spec is invalid or infeasible"},
        429: TOO_MANY["submit"],
        403: {
            "model": ErrorOut,
            "description": "a tenant asked for a priority outside its range "
            "(ETRAIN_TENANT_MIN_PRIORITY..ETRAIN_TENANT_MAX_PRIORITY, or its "
            "ETRAIN_TENANT_PRIORITIES entry)",
        },
        200: {
            "model": JobOut,
            "description": "an earlier submission with this Idempotency-Key and the same "
            "spec created this job; nothing new was created",
        },
        409: {
            "model": ErrorOut,
            "description": "this Idempotency-Key was used for a different spec, or "
            "checkpoint.path overlaps the directory of an unfinished job",
        },
    },
)
def submit_job(
    spec: JobSpec,
    response: Response,
    manager: Manager,
    caller: Caller,
    fair_use: Fair,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias=idempotency.HEADER,
            description="makes retries safe: the same key and spec return the job the first request created "
            "(200); the same key with another spec is 409. Per tenant. A UUID per logical submission.",
            # Checked by etrain.service.store.idempotency.check_key (a 422 naming the header and the fix); declared here.
            json_schema_extra={
                "minLength": 1,
                "maxLength": idempotency.MAX_KEY_LENGTH,
                "pattern": idempotency.KEY_PATTERN,
            },
        ),
    ] = None,
) -> JobOut:
    """Validate the spec (fields, cross-field rules, planner), record the job and start it.

    ``parallelism: auto`` makes the planner search layouts: such a submit takes one of the tenant's plan
    slots (ETRAIN_TENANT_MAX_PLANS) while it runs."""
    with fair_use.plans.slot(caller) if spec.is_auto else nullcontext():
        job = manager.submit(spec, principal=caller, idempotency_key=idempotency_key)
    if isinstance(job, idempotency.ReplayedJob):
        response.status_code = 200
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobOut.of(job)


@router.get("", response_model=JobListOut)
def list_jobs(
    manager: Manager,
    caller: Caller,
    # Typed without None (default None): the document offers "absent or a status", never null.
    status: Annotated[JobStatus, Query(description="only jobs in this status")] = None,  # type: ignore[assignment]
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=MAX_CURSOR)] = 0,
) -> JobListOut:
    jobs = manager.list(status=status, limit=limit, offset=offset, principal=caller)
    return JobListOut(jobs=[JobOut.of(job) for job in jobs], limit=limit, offset=offset)


@router.get("/{job_id}", response_model=JobOut, responses=_NOT_FOUND)
def get_job(job_id: str, manager: Manager, caller: Caller) -> JobOut:
    return JobOut.of(manager.get(job_id, principal=caller))


@router.get(
    "/{job_id}/events",
    response_model=EventsOut,
    responses={
        **_NOT_FOUND,
        429: TOO_MANY["max_streams"],
        200: {
            "description": "the events (JSON); with follow=true a server-sent event stream (api/sse.py): each "
            "event as `id: <seq>` + `data: <event JSON>`, `event: status` on status changes, "
            "`event: step` per step with steps=true, `: keepalive` comments, `event: end` last",
            # One event of the stream (OpenAPI 3.1: the schema of an event-stream describes each event).
            "content": {
                sse.MEDIA_TYPE: {
                    "schema": {
                        "type": "object",
                        "required": ["event", "data"],
                        "properties": {
                            "event": {"enum": ["message", "status", "step", "end"]},
                            "data": {"type": "string", "description": "JSON: an event, the job or a step row"},
                            "id": {"type": "string"},
                            "retry": {"type": "integer"},
                        },
                    }
                }
            },
        },
    },
)
async def job_events(
    job_id: str,
    manager: Manager,
    caller: Caller,
    fair_use: Fair,
    since: Annotated[int, Query(ge=0, le=MAX_SEQ, description="only events with seq > since")] = 0,
    follow: Annotated[bool, Query(description="stream (text/event-stream) until the job ends")] = False,
    steps: Annotated[bool, Query(description="follow only: also stream each per-step metrics row")] = False,
    steps_since: Annotated[int, Query(ge=-1, le=MAX_SEQ, description="follow only: steps > this")] = -1,
    timeout_s: Annotated[
        float, Query(gt=0, le=sse.MAX_STREAM_S, description="follow only: close the stream after this long")
    ] = sse.MAX_STREAM_S,
    last_event_id: Annotated[
        int,
        Header(
            alias="Last-Event-ID", ge=0, le=MAX_SEQ, description="follow only: resume after this seq (overrides since)"
        ),
    ] = None,  # type: ignore[assignment]
) -> Any:
    """The job's events, oldest first; ``follow=true`` streams them as they happen.

    ``async``: a stream sleeps on the event loop between reads of the store (through the thread pool),
    so a following client holds no thread while it waits. A tenant has at most ETRAIN_TENANT_MAX_STREAMS
    streams open at once (429 with Retry-After beyond); a stream's slot is free again when it ends or its
    client goes away."""
    if not follow:
        events = await run_in_threadpool(manager.events, job_id, since_seq=since, principal=caller)
        next_since = events[-1].seq if events else since
        return EventsOut(job_id=job_id, events=[EventOut.of(e) for e in events], next_since=next_since)
    await run_in_threadpool(manager.get, job_id, principal=caller)  # 404 now, not inside a 200 stream
    release = fair_use.streams.acquire(caller)  # 429 when the tenant's streams are all open
    stream = sse.job_event_stream(
        manager,
        job_id,
        caller,
        since=since if last_event_id is None else last_event_id,
        steps=steps,
        steps_since=steps_since,
        max_s=timeout_s,
    )
    return _HeldStream(
        stream, release, media_type=sse.MEDIA_TYPE, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


class _HeldStream(StreamingResponse):
    """A streaming response that gives its tenant's stream slot back when it is over: when the stream ends
    (before its last chunk goes out, so a client that reconnects at once finds the slot free), when the
    client goes away (Starlette cancels the stream then) or when sending fails."""

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None], **kwargs: Any):
        super().__init__(_released_at_end(content, release), **kwargs)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()  # idempotent: a stream that ended released already


async def _released_at_end(content: AsyncIterator[str], release: Callable[[], None]) -> AsyncIterator[str]:
    try:
        async for chunk in content:
            yield chunk
    finally:
        release()


@router.get("/{job_id}/metrics", response_model=StepsOut, responses=_NOT_FOUND)
def job_metrics(
    job_id: str,
    manager: Manager,
    caller: Caller,
    since: Annotated[int, Query(ge=-1, le=MAX_SEQ, description="only steps > since")] = -1,
) -> StepsOut:
    """Per-step history: loss, throughput and the compute / communication-wait split."""
    steps = manager.steps(job_id, since_step=since, principal=caller)
    next_since = steps[-1].step if steps else since
    return StepsOut(job_id=job_id, steps=[StepOut.of(s) for s in steps], next_since=next_since)


@router.post("/{job_id}/cancel", status_code=202, response_model=JobOut, responses=_CONFLICT)
def cancel_job(job_id: str, manager: Manager, caller: Caller) -> JobOut:
    """Ask the job to stop; answers at once (202) with the job as it is now. The request is recorded
    (``cancel_requested``) and handed to the job's supervisor off this thread; follow the job (GET, or
    the event stream) to CANCELLED."""
    return JobOut.of(manager.cancel(job_id, principal=caller))


@router.post(
    "/{job_id}/scale",
    status_code=202,
    response_model=JobOut,
    responses={
        **_CONFLICT,
        422: {"model": ErrorOut, "description": "dp outside min_dp..max_dp or not legal"},
        429: TOO_MANY["max_workers"],
    },
)
def scale_job(job_id: str, request: ScaleRequest, manager: Manager, caller: Caller) -> JobOut:
    """Change the data-parallel degree; tp and pp never change and the global batch is kept. A tenant's
    larger job counts against ETRAIN_TENANT_MAX_WORKERS as a submit does (429 beyond it).

    Answers at once (202): the request is recorded (``scale_requested``) and handed to the supervisor,
    which checkpoints, stops the group and relaunches at the new size (RESIZING, then ``resized``)."""
    return JobOut.of(manager.scale(job_id, request.dp, principal=caller))


@router.get(
    "/{job_id}/logs",
    response_model=LogsOut,
    responses={
        404: {"model": ErrorOut, "description": "no such job, or the job never had this rank"},
        409: {"model": ErrorOut, "description": "the job has not started: no rank has written a log"},
    },
)
def job_logs(
    job_id: str,
    manager: Manager,
    caller: Caller,
    rank: Annotated[int, Query(ge=0, le=MAX_RANK, description="the rank (0 .. world_size - 1)")] = 0,
    tail: Annotated[int, Query(ge=1, le=MAX_LOG_TAIL, description="at most this many lines")] = 200,
    offset: Annotated[
        int, Query(ge=0, le=MAX_SEQ, description="next_offset of the previous answer: only lines written after it")
    ] = None,  # type: ignore[assignment]
) -> LogsOut:
    """The rank's recent log lines (what it printed, one line per step, errors with tracebacks), read
    from its log file in the job's checkpoint folder; ``offset`` follows the file (``etrain logs -f``)."""
    return LogsOut.model_validate(manager.logs(job_id, rank, tail, offset, principal=caller))


@router.post(
    "/{job_id}/export",
    response_model=ExportOut,
    responses={
        **_NOT_FOUND,
        400: {"model": ErrorOut, "description": "the job's model has no Hugging Face format"},
        409: {"model": ErrorOut, "description": "no such committed checkpoint, or out is not empty"},
        422: {"model": ErrorOut, "description": "the body is invalid, or out is outside the storage roots"},
    },
)
def export_job(job_id: str, request: ExportRequest, manager: Manager, caller: Caller) -> ExportOut:
    """Write a committed checkpoint (``step``, default the newest) as a Hugging Face folder at ``out``.

    Blocks until the export task is done (it streams one output shard at a time); the folder loads
    with ``transformers.AutoModelForCausalLM.from_pretrained``.
    """
    return ExportOut.model_validate(
        manager.export(job_id, request.step, request.out, dtype=request.dtype, principal=caller)
    )


@router.post(
    "/{job_id}/chaos",
    dependencies=[Depends(require_chaos)],
    responses={
        **_CONFLICT,
        403: {"model": ErrorOut, "description": "chaos is disabled on this server, or the caller is not the admin"},
    },
)
def inject_fault(job_id: str, request: ChaosRequest, manager: Manager, caller: Caller) -> dict[str, Any]:
    """Inject a fault into a running job (servers started with ETRAIN_ENABLE_CHAOS=1 only).

    The manager gets the validated request as a plain dict (it travels to the supervisor actor).
    """
    return manager.chaos(job_id, request.model_dump(exclude_none=True), principal=caller)
