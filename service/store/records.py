"""The records the job store hands out: a job, one of its events, one of its steps.

Frozen dataclasses, never row dicts, so the API's schemas (api/schemas.py), the manager and the fakes in
tests build and compare them without SQLite. They live apart from the store (service/store/job_store.py)
because far more code reads records than talks to the database.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from etrain.service.decisions.job_status import Status

# One status enum for the whole service: the state machine's (service/decisions/job_status.py).
JobStatus = Status


@dataclass(frozen=True, kw_only=True)
class JobRecord:
    id: str
    name: str
    status: JobStatus
    spec: dict[str, Any]
    step: int
    loss: float | None
    tokens_per_s: float | None
    world_size: int
    restarts: int
    created_at: float  # unix seconds
    updated_at: float
    error: str | None
    layout: str | None  # compact layout string, e.g. "pp1·dp2·tp1 zero=0"
    last_checkpoint_step: int | None
    stragglers: list[Any] = field(default_factory=list)
    goodput: float | None = None  # fraction of wall time spent on steps that were kept
    attempt: int = 0
    #: What a succeeded job wrote besides checkpoints, by format: ``{"hf": "/abs/path/hf-export"}``.
    artifacts: dict[str, str] = field(default_factory=dict)
    tenant: str = "default"  # who submitted it (etrain.service.access.tenancy); other tenants never see it
    priority: int = 0  # the queue starts higher first, then oldest first
    mfu: float | None = None  # model FLOPs utilisation of the latest step (None where the peak is unknown)
    #: Seconds of wall time since submit by cause (service/decisions/goodput_breakdown.py); None before.
    goodput_breakdown: dict[str, float] | None = None
    #: The ranks the job was granted (its size at submit, then each accepted ``scale``): what the tenant's
    #: worker quota counts it at while it runs smaller, and the most it grows back to by itself.
    granted_workers: int | None = None
    #: The most host memory (anonymous pages, GiB) a rank held at the latest sample, beside the
    #: ``resources.host_memory_gb`` it reserved; None before the first sample.
    host_memory_gib: float | None = None

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal


@dataclass(frozen=True, kw_only=True)
class EventRecord:
    seq: int  # per job, 1, 2, 3, ...: "give me what happened after seq N"
    job_id: str
    ts: float
    kind: str
    detail: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    job_id: str
    step: int
    loss: float | None
    tokens_per_s: float | None
    step_s: float | None
    compute_s: float | None
    comm_wait_s: float | None
    ts: float
    attempt: int = 0  # the run attempt that reported it; a later attempt's report replaces an earlier one
    mfu: float | None = None  # model FLOPs utilisation of the step (None where the device's peak is unknown)
