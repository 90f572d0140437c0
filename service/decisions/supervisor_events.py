"""The vocabulary the Ray adapter and the supervisor's state machine share: events in, actions out.

Events are what happens to a job (service/runtime/supervisor_actor.py builds them from Ray and the clock); actions
are what :func:`etrain.service.decisions.supervisor.decide` asks the adapter to do, in order. Both are frozen,
keyword-only dataclasses with plain fields, so they pickle across Ray actors and compare in tests.
The transition table that maps one to the other is the docstring of service/decisions/supervisor.py.
This module imports nothing of the state machine (``Status`` comes from service/decisions/job_status.py),
so the state machine's modules import it and never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from etrain.service.decisions.job_status import Status

__all__ = [
    "Abort",
    "Action",
    "Cancel",
    "CapacityChanged",
    "CheckpointFailed",
    "CheckpointFallback",
    "CheckpointReported",
    "CommitCheckpoint",
    "CommitFailed",
    "CommitSucceeded",
    "DiagnoseHang",
    "Event",
    "ExcludeNode",
    "ExportCheckpoint",
    "ExportFailed",
    "Exported",
    "Finished",
    "GroupReady",
    "GroupStopped",
    "HangDiagnosed",
    "JobError",
    "KillRank",
    "LaunchGroup",
    "MarkTerminal",
    "NodeLossConfirmed",
    "RecordEvent",
    "RepairFailed",
    "RepairGroup",
    "RequestCheckpoint",
    "ScaleRequested",
    "ScheduleWake",
    "Start",
    "StepReported",
    "StopGroup",
    "StragglerFlagged",
    "Tick",
    "WorkerLost",
]


# ---------------------------------------------------------------------------------------------
# Events (in). Events from a worker group carry the attempt that group was launched for.


@dataclass(frozen=True, kw_only=True)
class Start:
    pass


@dataclass(frozen=True, kw_only=True)
class GroupReady:
    attempt: int
    world_size: int
    #: The step the ranks resume from: the plan's (the last committed step, 0 fresh) or, after an in-place
    #: repair, a later one they held in memory (``workers/protocol/memory_resume.py``); None: the plan's.
    start_step: int | None = None


@dataclass(frozen=True, kw_only=True)
class StepReported:
    attempt: int
    step: int  # optimizer steps completed
    loss: float
    rank: int = 0


@dataclass(frozen=True, kw_only=True)
class CheckpointReported:
    """One rank finished writing its shard of the checkpoint at ``step``."""

    attempt: int
    step: int
    rank: int


@dataclass(frozen=True, kw_only=True)
class CheckpointFailed:
    """The ranks abandoned the save of ``step`` (the storage failed it: full, over quota, an I/O
    error); ``reason`` says so in words. Nothing of it was committed; training goes on."""

    attempt: int
    step: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class CommitSucceeded:
    """The adapter wrote (atomically) the manifest of checkpoint ``step`` after a CommitCheckpoint:
    only now is the step a checkpoint a restart, a resize or an eviction may resume from.

    No ``attempt``: a manifest on disk is a fact whatever group wrote the shards, so it is never stale.
    """

    step: int


@dataclass(frozen=True, kw_only=True)
class CommitFailed:
    """Writing the manifest of checkpoint ``step`` failed (a missing or short shard, a full disk): the
    step is not a checkpoint, and restore keeps using the previous committed one."""

    step: int
    error: str


@dataclass(frozen=True, kw_only=True)
class WorkerLost:
    attempt: int
    rank: int
    node: str
    cause: Literal["process", "actor", "node"]
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class HangDiagnosed:
    """The answer to DiagnoseHang: ``rank`` is the rank the others wait for (None: no single one), on
    ``node``; ``detail`` says why in words, with the culprit's innermost frames
    (service/decisions/hangs.py)."""

    attempt: int
    rank: int | None
    node: str
    detail: str


@dataclass(frozen=True, kw_only=True)
class NodeLossConfirmed:
    """The node of a rank lost as a process fault (classified at once, budget spent) was afterwards
    declared dead by the cluster: the loss was the node's, not the job's, so the restart is refunded.

    No ``attempt``: it corrects an earlier attempt's verdict (``failed_attempt``) whatever runs now.
    ``available_dp`` is the capacity measured when the death was confirmed.
    """

    node: str
    failed_attempt: int
    available_dp: int


@dataclass(frozen=True, kw_only=True)
class RepairFailed:
    """The in-place repair of attempt ``attempt`` (RepairGroup) could not be carried out: a survivor
    did not come back, no replacement could be started, or the ranks could not rendezvous."""

    attempt: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class RankUnhealthy:
    """Rank ``rank`` of attempt ``attempt`` failed the health check every attempt starts with (device not
    allocatable, a matmul far below its peers', a drill): ``reason`` says which (workers/protocol/health.py)."""

    attempt: int
    rank: int
    node: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class ResizeFailed:
    """The in-place resize to attempt ``attempt`` (ResizeGroup) could not be carried out: a rank did not
    leave the old attempt, the new placement could not be reserved on the kept ranks' nodes (or their
    GPUs), or the ranks could not rendezvous. The job relaunches every rank at the new size instead."""

    attempt: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class JobError:
    """The job itself is broken (bad data, NaN loss, model exception): retrying cannot help."""

    attempt: int
    rank: int
    message: str
    traceback: str = ""


@dataclass(frozen=True, kw_only=True)
class Tick:
    """Time passes. ``step_s``: the job's recent median step time (None before any step), which bounds how
    long an in-place attempt may take to leave the old one (``in_place_waits``)."""

    step_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class CapacityChanged:
    """Replicas (tp*pp ranks each) the cluster can give this job in total, its own included,
    excluded nodes left out."""

    available_dp: int


@dataclass(frozen=True, kw_only=True)
class ScaleRequested:
    dp: int


@dataclass(frozen=True, kw_only=True)
class StragglerFlagged:
    attempt: int
    rank: int
    node: str
    factor: float
    evict: bool = False
    evidence: str = ""


@dataclass(frozen=True, kw_only=True)
class Cancel:
    reason: str = "cancelled by user"


@dataclass(frozen=True, kw_only=True)
class Abort:
    """The adapter cannot go on (an internal error of its own): fail now, whatever the state."""

    error: str


@dataclass(frozen=True, kw_only=True)
class Finished:
    attempt: int
    final_step: int


@dataclass(frozen=True, kw_only=True)
class GroupStopped:
    """The adapter finished tearing down the group of ``attempt`` (asked for or not)."""

    attempt: int


@dataclass(frozen=True, kw_only=True)
class CheckpointFallback:
    """The launching group restores an older checkpoint than ``resume_step``: the newer one failed
    verification (rot, a crash, a corruption drill). Progress and the commit point move back to it."""

    attempt: int
    step: int | None  # None: nothing verifies, the group starts fresh
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class Exported:
    """The export of checkpoint ``step`` finished: ``path`` is the Hugging Face folder (absolute)."""

    step: int
    path: str


@dataclass(frozen=True, kw_only=True)
class ExportFailed:
    """The export of checkpoint ``step`` (in ``checkpoint_dir``) failed or timed out; the checkpoint
    itself is intact, so the error tells the user how to retry."""

    step: int
    checkpoint_dir: str
    error: str


Event = Union[  # noqa: UP007 - a runtime alias of many classes, read as one line per group
    NodeLossConfirmed,
    RepairFailed,
    ResizeFailed,
    RankUnhealthy,
    Start,
    GroupReady,
    StepReported,
    CheckpointReported,
    CheckpointFailed,
    CommitSucceeded,
    CommitFailed,
    WorkerLost,
    HangDiagnosed,
    JobError,
    Tick,
    CapacityChanged,
    ScaleRequested,
    StragglerFlagged,
    Cancel,
    Abort,
    Finished,
    GroupStopped,
    CheckpointFallback,
    Exported,
    ExportFailed,
]


# ---------------------------------------------------------------------------------------------
# Actions (out), carried out by the adapter in order.


@dataclass(frozen=True, kw_only=True)
class LaunchGroup:
    attempt: int
    dp: int
    world_size: int  # pp * dp * tp ranks
    resume_step: int | None  # restore this committed checkpoint; None = fresh start
    excluded_nodes: frozenset[str] = frozenset()


@dataclass(frozen=True, kw_only=True)
class RepairGroup:
    """Keep the surviving ranks' processes, replace ``lost_rank`` only, and run attempt ``attempt`` on
    the same placement from committed step ``resume_step`` (state from the ranks' memory where a
    replica holds it, else from the checkpoint on storage)."""

    attempt: int
    lost_rank: int
    world_size: int
    resume_step: int


@dataclass(frozen=True, kw_only=True)
class ResizeGroup:
    """Change the running group from ``from_dp`` to ``dp`` data-parallel replicas without a relaunch
    ([11]): every rank whose data-parallel index stays below ``dp`` keeps its process (renumbered for
    the new world), ranks past it are released, new ones join (warm spares where the pool has them),
    and attempt ``attempt`` resumes committed step ``resume_step`` (state from the kept ranks' memory
    where the layout replicates it, else from the checkpoint on storage, resharded)."""

    attempt: int
    dp: int
    from_dp: int
    world_size: int
    resume_step: int


@dataclass(frozen=True, kw_only=True)
class DiagnoseHang:
    """Ask every rank of attempt ``attempt`` where its training thread is (with a timeout) and answer
    with HangDiagnosed."""

    attempt: int


@dataclass(frozen=True, kw_only=True)
class KillRank:
    """Kill rank ``rank`` of attempt ``attempt`` (the culprit of a hang); its loss then arrives as
    WorkerLost and is repaired like any lost rank."""

    attempt: int
    rank: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class StopGroup:
    attempt: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class CommitCheckpoint:
    """Every rank saved its shards of ``step``: write the manifest, then answer with CommitSucceeded
    or CommitFailed (before any other event, so nothing acts on a commit that has not happened)."""

    step: int


@dataclass(frozen=True, kw_only=True)
class RequestCheckpoint:
    """Ask the running group to save a checkpoint at its next step boundary."""

    attempt: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class ExcludeNode:
    """Never place this job's ranks on ``node`` again; report the new CapacityChanged."""

    node: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class ScheduleWake:
    """Send a Tick at or after ``at`` (on top of the adapter's periodic ticks)."""

    at: float


@dataclass(frozen=True, kw_only=True)
class RecordEvent:
    kind: str
    detail: str


@dataclass(frozen=True, kw_only=True)
class ExportCheckpoint:
    """Write committed checkpoint ``step`` as a Hugging Face folder (off the control thread, with a
    timeout); answer with Exported or ExportFailed."""

    step: int


@dataclass(frozen=True, kw_only=True)
class MarkTerminal:
    status: Status
    error: str | None


Action = Union[  # noqa: UP007 - a runtime alias of many classes, read as one line per group
    LaunchGroup,
    RepairGroup,
    ResizeGroup,
    DiagnoseHang,
    KillRank,
    StopGroup,
    CommitCheckpoint,
    RequestCheckpoint,
    ExcludeNode,
    ScheduleWake,
    RecordEvent,
    ExportCheckpoint,
    MarkTerminal,
]
