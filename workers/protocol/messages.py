"""The messages between a job's supervisor and its ranks, and the calls that carry them (pure: no torch, no Ray).

Why a module of its own: the supervisor (``service/runtime/``) and the ranks (``workers/rank/worker.py``) are
two programs talking over Ray actor calls. What they say to each other is the contract between them, so
it lives here, where both sides import it, instead of inside the rank actor module, which the service
would otherwise have to import (and with it the engine) just to name a message.

Supervisor -> ranks (methods of :class:`RankActor`):

* :class:`LaunchPlan`, the argument of ``run``: one attempt's layout, where to resume, drills;
* :class:`ChaosOrder`, the argument of ``chaos``: a fault drill (only when the plan enables drills);
* ``request_checkpoint`` / ``request_stop``, acted on at a step boundary (``workers/rank/step_control.py``).

Ranks -> supervisor (methods of :class:`SupervisorReports`, fire-and-forget unless said otherwise):

* ``report_ready``: a rank is set up and restored (:class:`ReadyInfo`);
* ``report_steps``: rank 0's batch of :data:`StepReport` (``workers/rank/report_batch.py``), the job's heartbeat;
* ``report_checkpoint``: one rank's shards of a save (``etrain.workers.protocol.manifest.ShardReport``),
  awaited for up to :data:`REPORT_TIMEOUT_S`;
* ``report_chaos``: a drill fired, awaited for up to :data:`REPORT_TIMEOUT_S` (the process may die next).

The rank actor classes are *named* (:data:`RANK_ACTOR_CLASS`, :data:`SPARE_ACTOR_CLASS`), not imported,
by the service: it loads them only where it creates the actors (:func:`load_actor_class`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypedDict, get_args

from etrain.workers.protocol.compile_sharing import CompileArtifacts
from etrain.workers.protocol.run_config import RunConfig

__all__ = [
    "RANK_ACTOR_CLASS",
    "RANK_CHAOS_ACTIONS",
    "REPORT_TIMEOUT_S",
    "SPARE_ACTOR_CLASS",
    "ChaosMoment",
    "ChaosOrder",
    "LaunchPlan",
    "NodeInfo",
    "RankActor",
    "RankChaosAction",
    "RankTimings",
    "ReadyInfo",
    "RunResult",
    "SpareActor",
    "StepMetrics",
    "StepReport",
    "SupervisorReports",
    "load_actor_class",
]

#: How long a rank waits for the supervisor to accept a report it must not lose (checkpoint shards, chaos
#: firings) before giving up on it. Both sides rely on it: the supervisor's calls must answer well within.
REPORT_TIMEOUT_S = 30.0

#: The drills a rank carries out on itself (``corrupt_checkpoint`` is the supervisor's own drill).
RankChaosAction = Literal["kill_rank", "kill_actor", "slow_rank", "hang_rank", "fail_health_check", "hold_host_memory"]
RANK_CHAOS_ACTIONS: frozenset[str] = frozenset(get_args(RankChaosAction))
#: When a kill lands: at the start of a step (the default), or inside a checkpoint save.
ChaosMoment = Literal["step", "checkpoint_write", "checkpoint_commit"]


@dataclass(frozen=True, kw_only=True)
class ChaosOrder:
    """A fault drill for one rank. ``at_step`` None fires at once; otherwise when the rank starts that step.

    ``during`` (kills): ``step``, or inside the first checkpoint save after at least ``at_step`` steps,
    ``checkpoint_write`` once the rank's shards are written and before it reports them,
    ``checkpoint_commit`` right after the supervisor accepted its report. An order is only a message:
    the code that fires it is the rank's drill plugin (``workers/rank/chaos.py``).
    """

    id: int
    action: RankChaosAction
    rank: int
    factor: float = 1.0
    #: ``hold_host_memory``: GiB the rank allocates (and writes, so they are its own pages) and holds; 0 lets go
    gib: float = 0.0
    at_step: int | None = None
    #: ``health_check``: only ``fail_health_check``, set by the supervisor (not a ``during`` users give).
    during: ChaosMoment | Literal["health_check"] = "step"


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """What one attempt of the group runs: the layout, where to resume, when to stop."""

    attempt: int
    config: RunConfig
    start_step: int  # first step to run (0 on a fresh start)
    resume_dir: str | None  # committed checkpoint directory to load before start_step
    chaos: tuple[ChaosOrder, ...] = ()
    #: Whether the rank loads its drill plugin (``workers/rank/chaos.py``): the server setting ``enable_chaos``
    #: (``ETRAIN_ENABLE_CHAOS``). Off, nothing of it is imported and ``chaos`` calls are refused.
    chaos_enabled: bool = False
    #: The digest of resume_dir's manifest as the supervisor verified it with the service's key (ranks
    #: have no key): the rank loads only that very manifest (``verify(expect_digest=)``).
    resume_digest: str | None = None
    #: An in-place repair: restore start_step from the ranks' in-memory snapshots where every rank can
    #: get one (its own, or a data-parallel replica's), else from resume_dir (workers/checkpoints/snapshot.py).
    #: A later step the ranks hold in memory may serve instead (``workers/protocol/memory_resume.py``).
    state_from_memory: bool = False
    #: The newest step the ranks may resume at from memory: the last step whose record the supervisor holds
    #: (a step run but never reported, rank 0 having died with it, is run again so that it is). None: any.
    memory_resume_limit: int | None = None
    #: Keep in-memory snapshots at each save: only an in-place repair or resize reads them
    #: (``memory_resume.snapshots_are_read``).
    keep_snapshots: bool = True
    #: The host memory this rank's bundle reserves (``resources.host_memory_gb``, bytes; 0: none), which the rank
    #: log sets beside what the rank held (``workers/rank/host_memory.py``).
    host_memory_bytes: int = 0
    #: The job may grow past this attempt's dp (its elastic ceiling is higher): at dp=1, where no replica
    #: would read a snapshot for a repair, rank 0 keeps them anyway for the ranks a grow adds.
    may_grow: bool = False
    #: The compiled code each pipeline stage's first rank wrote next to the checkpoints, as it reported it
    #: (``workers/protocol/compile_sharing.py``): a rank started on a node without it loads its stage's set
    #: before its first step instead of compiling (``training.compile``), if the file still has that digest.
    compile_artifacts: tuple[CompileArtifacts, ...] = ()


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """What one optimizer step reports; ``loss`` is the global-batch mean, equal on every rank."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    step_s: float
    compute_s: float
    comm_wait_s: float
    tokens: int  # tokens of the global batch
    tokens_per_s: float
    flops_per_s: float
    mfu: float | None
    peak_mem_bytes: int
    #: True on timing-sync steps (and always in one process): compute_s excludes waiting on peers.
    timing_synced: bool


class RankTimings(TypedDict):
    """Every rank's timings of one step, one list per field in rank order (``step_control.RANK_TIMINGS``)."""

    compute_s: list[float]
    comm_wait_s: list[float]
    step_s: list[float]
    timing_synced: list[bool]
    peak_mem_bytes: list[int]
    host_mem_bytes: list[int]  # each rank's anonymous host memory, sampled every 10 s (0: unknown)


#: One completed step as rank 0 reports it: ``dataclasses.asdict(StepMetrics)`` plus ``"ranks"``
#: (:class:`RankTimings`). A plain dict on the wire: the supervisor reads it by key, and a batch of
#: them is the only per-step call a job makes.
StepReport = dict[str, Any]


class NodeInfo(TypedDict):
    """Where a rank runs (``RankActor.node_info``): the group learns rank 0's address from it."""

    rank: int
    node_id: str
    ip: str
    pid: int


class ReadyInfo(NodeInfo):
    """``report_ready``'s payload: where the rank runs, where its restored state came from (None on
    a fresh start; else ``storage``, ``memory``, or a replica's memory) and the step it resumes from (an
    in-place repair may resume after the plan's committed step, from state the ranks held in memory)."""

    state_source: str | None
    start_step: int


class RunResult(TypedDict):
    """What ``RankActor.run`` returns when the attempt ends without an error."""

    rank: int
    final_step: int
    final_loss: float | None
    stopped: bool  # True: a graceful stop (request_stop) ended it before the last step
    #: SHA-256 of the rank's local parameters: data-parallel replicas must agree (workers/rank/worker.py).
    param_digest: str


class RankActor(Protocol):
    """The calls the service makes on a rank actor (``workers/rank/worker.py`` ``TrainWorker``)."""

    def node_info(self) -> NodeInfo: ...

    def free_port(self) -> int: ...

    def ping(self) -> int: ...

    def request_checkpoint(self, completed_steps: int | None = None) -> None: ...

    def request_stop(self) -> None: ...

    def chaos(self, order: ChaosOrder) -> None: ...

    def run(self, plan: LaunchPlan, master_addr: str, master_port: int) -> RunResult: ...


class SpareActor(RankActor, Protocol):
    """A warm spare (``workers/rank/spare.py`` ``SpareRank``): a rank actor whose job comes later."""

    def ready(self) -> dict[str, Any]: ...

    def assign(
        self,
        *,
        job_id: str,
        rank: int,
        world_size: int,
        supervisor: Any,
        gpu_ids: list[str] | None = None,
        bundle: str = "",
    ) -> int: ...


class SupervisorReports(Protocol):
    """The calls a rank makes on its job's supervisor actor (``service/runtime/supervisor_actor.py``)."""

    def report_ready(self, attempt: int, rank: int, node_info: ReadyInfo) -> None: ...

    def report_steps(self, attempt: int, records: list[StepReport]) -> None: ...

    def report_checkpoint(self, attempt: int, rank: int, completed_steps: int, report: Any) -> None: ...

    def report_chaos(self, attempt: int, rank: int, order_id: int, step: int | None) -> None: ...


#: The rank actor class, by dotted name: the service creates rank actors from it without importing the
#: worker module into its own modules (it is loaded only in the process that creates the actors).
RANK_ACTOR_CLASS = "etrain.workers.rank.worker.TrainWorker"
#: The warm spare actor class (``service/runtime/spares.py`` starts them).
SPARE_ACTOR_CLASS = "etrain.workers.rank.spare.SpareRank"


def load_actor_class(dotted: str) -> type:
    """The class named ``package.module.Class`` (imported now: call it where the actors are created)."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)
