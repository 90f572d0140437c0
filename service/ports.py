"""What the REST API needs from the job service: the manager's interface and its request types.

``api/`` depends on this Protocol, never on the Ray-backed ``etrain.service.manager.JobManager``, so the API
is tested with a named fake (``tests/fakes.py``) and the manager can change inside freely. Types
that cross the boundary live here (``ChaosRequest``) or in ``service/store/records.py`` (the records).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from etrain.service.access.tenancy import ADMIN, Principal
from etrain.service.planning.bounds import MAX_STEPS, MAX_WORKERS
from etrain.service.planning.spec import JobSpec, json_int
from etrain.service.store.records import EventRecord, JobRecord, StepRecord
from etrain.workers.protocol.messages import RANK_CHAOS_ACTIONS, ChaosMoment, RankChaosAction

#: The rank drills (and when a kill lands) are the protocol's; ``corrupt_checkpoint`` is the supervisor's own.
ChaosAction = Literal[RankChaosAction, "corrupt_checkpoint"]
KILL_ACTIONS: frozenset[str] = frozenset({"kill_rank", "kill_actor"})
#: The most a ``hold_host_memory`` drill holds: more than any node's RAM is a typo, not a drill.
MAX_DRILL_GIB = 4096.0


class ChaosRequest(BaseModel):
    """One injected fault.

    * ``kill_rank``: the rank's process exits abruptly (as on a segfault or OOM kill);
    * ``kill_actor``: the rank's Ray actor is killed from outside (``ray.kill``), as on node loss;
    * ``slow_rank``: the rank's steps take ``factor`` times longer (a straggler); ``factor: 1`` ends an
      earlier slowdown (the straggler recovers);
    * ``hang_rank``: the rank stops making progress without exiting (heartbeats stop);
    * ``hold_host_memory``: the rank allocates ``gib`` GiB of host memory and holds it until the job ends
      (``gib: 0`` lets go of it): a rank beyond its ``resources.host_memory_gb``, to see the ``host_memory``
      event and the ``EtrainHostMemoryOverReservation`` alert fire where they are deployed;
    * ``fail_health_check``: the rank's health check at the start of an attempt reports it broken (the
      first attempt starting at or after ``at_step``; omitted: the next attempt), so its node is excluded;
    * ``corrupt_checkpoint``: the committed checkpoint of ``step`` is damaged on disk.

    ``at_step``: inject when the job reaches this step; omitted: as soon as possible.

    ``during`` (kills only): ``step`` (omitted) kills at the start of step ``at_step``; a kill
    ``checkpoint_write`` lands in the first save at or after ``at_step``, once the rank's shards are
    written but before it reports them (that step is never committed); ``checkpoint_commit`` right
    after the supervisor accepted the rank's report (the step commits, with the rank dead, when the
    other ranks' reports reach the supervisor before it handles the loss).
    """

    # The document states the per-action rules the validators below enforce (one shape per action), so
    # a client (or a fuzzer) reading it knows which fields each action takes; strict and finite as the spec.
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        allow_inf_nan=False,
        json_schema_extra=lambda schema: schema.update(oneOf=_CHAOS_SHAPES),
    )

    action: ChaosAction
    rank: json_int(0, MAX_WORKERS - 1) | None = Field(default=None, validate_default=True)
    factor: float | None = Field(
        default=None, le=1000.0, validate_default=True, description="slow_rank only; >= 1 (1 ends an earlier slow_rank)"
    )
    gib: float | None = Field(
        default=None,
        ge=0.0,
        le=MAX_DRILL_GIB,
        validate_default=True,
        description="hold_host_memory only: GiB the rank holds (0 lets go of it)",
    )
    step: json_int(0, MAX_STEPS) | None = Field(
        default=None, validate_default=True, description="corrupt_checkpoint only"
    )
    at_step: json_int(0, MAX_STEPS) | None = None
    during: ChaosMoment | None = Field(default=None, description="kill_rank and kill_actor only; omitted: step")

    @field_validator("rank")
    @classmethod
    def _rank_for_rank_actions(cls, rank: int | None, info: ValidationInfo) -> int | None:
        action = info.data.get("action")
        if action in RANK_CHAOS_ACTIONS and rank is None:
            raise ValueError(f"action {action!r} needs a rank (0 .. world_size - 1)")
        if action == "corrupt_checkpoint" and rank is not None:
            raise ValueError("corrupt_checkpoint takes no rank; give the checkpoint step instead")
        return rank

    @field_validator("factor")
    @classmethod
    def _factor_for_slow_rank(cls, factor: float | None, info: ValidationInfo) -> float | None:
        action = info.data.get("action")
        if action == "slow_rank":
            if factor is None or not factor >= 1:
                raise ValueError(
                    f"slow_rank needs a factor >= 1 (how many times slower; 1 ends an earlier slow_rank), got {factor}"
                )
        elif factor is not None and action is not None:
            raise ValueError(f"factor applies only to slow_rank, not {action!r}")
        return factor

    @field_validator("gib")
    @classmethod
    def _gib_for_hold_host_memory(cls, gib: float | None, info: ValidationInfo) -> float | None:
        action = info.data.get("action")
        if action == "hold_host_memory" and gib is None:
            raise ValueError("hold_host_memory needs gib: how many GiB the rank holds (0 lets go of what it held)")
        if action is not None and action != "hold_host_memory" and gib is not None:
            raise ValueError(f"gib applies only to hold_host_memory, not {action!r}")
        return gib

    @field_validator("step")
    @classmethod
    def _step_for_corrupt_checkpoint(cls, step: int | None, info: ValidationInfo) -> int | None:
        action = info.data.get("action")
        if action == "corrupt_checkpoint" and step is None:
            raise ValueError("corrupt_checkpoint needs the step of the checkpoint to damage")
        if action is not None and action != "corrupt_checkpoint" and step is not None:
            raise ValueError(f"step applies only to corrupt_checkpoint; to delay {action!r} use at_step")
        return step

    @field_validator("during")
    @classmethod
    def _during_for_kills(cls, during: str | None, info: ValidationInfo) -> str | None:
        action = info.data.get("action")
        if during is not None and action is not None and action not in KILL_ACTIONS:
            raise ValueError(f"during applies only to kill_rank and kill_actor, not {action!r}")
        return during


def _chaos_shape(
    actions: list[str], *, rank: bool, factor: bool = False, step: bool = False, during: bool = False, gib: bool = False
) -> dict[str, Any]:
    """One action's fields: each given one required (and not null), each other one absent or null;
    ``during`` is optional where it applies (absent or null: ``step``)."""
    none = {"type": "null"}
    properties: dict[str, Any] = {
        "action": {"enum": actions},
        "rank": {"type": "integer"} if rank else none,
        "factor": {"type": "number", "minimum": 1} if factor else none,
        "gib": {"type": "number", "minimum": 0, "maximum": MAX_DRILL_GIB} if gib else none,
        "step": {"type": "integer"} if step else none,
        "during": {"enum": [*ChaosMoment.__args__, None]} if during else none,
    }
    given = (("rank", rank), ("factor", factor), ("gib", gib), ("step", step))
    required = ["action", *(name for name, present in given if present)]
    return {"properties": properties, "required": required}


_CHAOS_SHAPES = [
    _chaos_shape(sorted(KILL_ACTIONS), rank=True, factor=False, step=False, during=True),
    _chaos_shape(["hang_rank"], rank=True, factor=False, step=False),
    _chaos_shape(["fail_health_check"], rank=True, factor=False, step=False),
    _chaos_shape(["slow_rank"], rank=True, factor=True, step=False),
    _chaos_shape(["hold_host_memory"], rank=True, gib=True),
    _chaos_shape(["corrupt_checkpoint"], rank=False, factor=False, step=True),
]


@runtime_checkable
class JobManagerPort(Protocol):
    """The job service as the API sees it. Every method is synchronous and may block briefly
    (the API calls it from a worker thread); each raises the ``etrain.service.errors`` named below."""

    # Every job-scoped call takes the caller (``principal``, default the admin): another tenant's job
    # is JobNotFound, exactly like a missing one, and lists hold only the caller's jobs.

    def submit(self, spec: JobSpec, *, principal: Principal = ADMIN, idempotency_key: str | None = None) -> JobRecord:
        """Validate (spec + planner), record and start a job. Raises SpecRejected.

        ``idempotency_key`` (the ``Idempotency-Key`` header, checked with
        ``etrain.service.store.idempotency.check_key``): the caller's earlier job with this key and the same spec
        (``etrain.service.store.idempotency.request_hash``) is returned as a ``ReplayedJob`` and nothing new is
        created; the same key with another spec is JobConflict. Keys are per tenant, and two concurrent
        submissions with one key create exactly one job."""

    def get(self, job_id: str, *, principal: Principal = ADMIN) -> JobRecord:
        """Raises JobNotFound."""

    def list(
        self, status: str | None = None, limit: int = 100, offset: int = 0, *, principal: Principal = ADMIN
    ) -> list[JobRecord]:
        """Newest first."""

    def events(self, job_id: str, since_seq: int = 0, *, principal: Principal = ADMIN) -> list[EventRecord]:
        """Events with seq > since_seq, oldest first. Raises JobNotFound."""

    def steps(self, job_id: str, since_step: int = -1, *, principal: Principal = ADMIN) -> list[StepRecord]:
        """Per-step metrics with step > since_step. Raises JobNotFound."""

    def cancel(self, job_id: str, *, principal: Principal = ADMIN) -> JobRecord:
        """Ask the job to stop and return at once (never waiting on Ray): records ``cancel_requested``;
        the job reaches CANCELLED shortly after. Raises JobNotFound, or JobConflict when already terminal."""

    def scale(self, job_id: str, dp: int, *, principal: Principal = ADMIN) -> JobRecord:
        """Ask for data parallelism ``dp`` and return at once: records ``scale_requested``; the job moves
        through RESIZING to the new size. JobConflict when terminal, SpecRejected (field ``dp``) when out
        of range."""

    def logs(
        self, job_id: str, rank: int, tail: int = 200, offset: int | None = None, *, principal: Principal = ADMIN
    ) -> dict[str, Any]:
        """``{"job_id", "rank", "lines": [str], "next_offset": int}``: the last ``tail`` lines of the rank's
        log, or (``offset`` = a previous ``next_offset``) up to ``tail`` lines written after it. Raises
        JobNotFound, RankNotFound (a rank the job never had), JobConflict (the job has not started)."""

    def chaos(self, job_id: str, request: dict[str, Any], *, principal: Principal = ADMIN) -> dict[str, Any]:
        """Inject a fault. ``request`` is a validated :class:`ChaosRequest` as a dict without unset
        fields (``request.model_dump(exclude_none=True)``): plain data for the supervisor actor.
        The API checks settings.enable_chaos first. Returns the order as recorded; for a job whose
        supervisor has not started (QUEUED, STARTING) the order is kept and the answer says ``pending``
        (it is armed before the first launch): never a 503 before the start. JobConflict once terminal."""

    def export(
        self, job_id: str, step: int | None, out: str, *, dtype: str | None = None, principal: Principal = ADMIN
    ) -> dict[str, Any]:
        """Write committed checkpoint ``step`` (None: the newest) as a Hugging Face folder at ``out``, its weights
        in ``dtype`` (None: the job's ``checkpoint.export_dtype``); returns ``{"hf": absolute path, "step": step,
        "dtype": dtype}``. Raises JobNotFound, JobConflict (no such
        committed step, ``out`` not empty), ConfigError (a model with no Hugging Face format), or
        ServiceUnavailable / EtrainError when the export itself fails or times out."""

    def plan(self, spec: JobSpec, *, principal: Principal = ADMIN) -> dict[str, Any]:
        """The planner's report without starting anything; at least ``feasible: bool`` and
        ``problems: [{field, message, fix}]`` (infeasible is an answer here, not an error). SpecRejected,
        like a submit, for a path outside the storage roots or out of the caller's reach."""

    def cluster(self, *, principal: Principal = ADMIN) -> dict[str, Any]:
        """The cluster as the scheduler sees it, in the shape of ``etrain.api.schemas.ClusterOut``: ``nodes``
        (node_id, alive, cpus, gpus, memory_gib, free_cpus, free_gpus, free_memory_gib), ``totals``, ``jobs`` (what each started job
        holds), ``queue`` (job_id, priority, position, reason, submitted_at) and ``observed_at``. Only the
        caller's jobs are listed; the totals count every tenant's. ServiceUnavailable when the cluster
        cannot be read."""

    def health(self) -> dict[str, Any]:
        """``db`` and ``ray`` ("ok" or what is wrong) and other details; optionally ``ok: bool``.
        /healthz answers 503 unless ``ok`` (or, without it, every ``db``/``ray`` entry is "ok")."""

    def metrics_text(self, *, principal: Principal | None = None) -> str:
        """Prometheus text exposition of job gauges (``etrain.service.prometheus.render_job_metrics``): aggregates
        only for ``principal`` None (an anonymous scraper), plus the per-job gauges this caller may see."""

    def close(self) -> None:
        """Stop background work; leaves detached supervisors running."""
