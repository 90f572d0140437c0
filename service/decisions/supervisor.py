"""The job supervisor as a pure state machine: ``decide(state, event, now, config) -> Decision``.

One supervisor per training job. The Ray adapter (service/runtime/supervisor_actor.py) turns what happens to the
job into events, calls :func:`decide` with the wall clock, stores the new state and carries out
the returned actions in order. Nothing here reads the clock, sleeps, or talks to Ray: every rule
is a line of the table below and a test in tests/unit/test_supervisor.py.

Two axes of state: the job ``status`` (what users see) and the worker ``group`` phase (what the
adapter's group of rank actors is doing: NONE -> LAUNCHING -> UP -> STOPPING -> NONE).

Transition table. "group" is the phase; STARTING+ = STARTING, RECOVERING or RESIZING; "live" =
any non-terminal status; "fault" and [n] are explained under the table::

  status     group      event                                 -> status    actions
  ---------  ---------  ------------------------------------  ----------  ----------------------------
  QUEUED     NONE       Start                                 STARTING    LaunchGroup(attempt 1)   [1]
  STARTING   LAUNCHING  GroupReady(world_size = pp*dp*tp)     RUNNING     RecordEvent(started)     [2]
  RECOVERING LAUNCHING  GroupReady                            RUNNING     RecordEvent(restored)    [2]
  RESIZING   LAUNCHING  GroupReady                            RUNNING     RecordEvent(resized)     [2]
  STARTING+  LAUNCHING  GroupReady(wrong world_size)          FAILED      StopGroup, MarkTerminal
  RUNNING    UP         StepReported (higher step)            RUNNING    (progress clock reset)
  RUNNING    UP         StepReported(loss nan/inf)            FAILED      StopGroup, MarkTerminal
  live       any        CheckpointReported (last rank)        same        CommitCheckpoint         [3]
  live       any        CommitSucceeded(step being committed) same        checkpoint_committed     [3]
  live       any        CommitFailed(step being committed)    same        checkpoint_commit_failed [3]
  RUNNING    UP         Finished(final_step >= total_steps)   SUCCEEDED   StopGroup, MarkTerminal
                          with export, final step committed   EXPORTING   StopGroup                [6]
                          with export, final step uncommitted FAILED      StopGroup, MarkTerminal
  EXPORTING  STOPPING   GroupStopped, or Tick > stop_timeout  EXPORTING   ExportCheckpoint(final)  [6]
  EXPORTING  any        Exported(path)                        SUCCEEDED   exported, MarkTerminal
  EXPORTING  any        ExportFailed / Tick > export_timeout  FAILED      MarkTerminal: error names the
                                                                           checkpoint and `etrain export`
  EXPORTING  any        CapacityChanged / ScaleRequested      same        (noted / scale_rejected)
  RUNNING    UP         Finished(final_step < total_steps)    FAILED      StopGroup, MarkTerminal
  live       LAUNCH/UP  JobError                              FAILED      StopGroup, MarkTerminal
  live       UP         WorkerLost(process | actor), one rank RECOVERING  RepairGroup (in place)  [9]
  live       LAUNCH/UP  WorkerLost(process | actor)           RECOVERING  fault
  RECOVERING LAUNCHING  RepairFailed                          RECOVERING  StopGroup, then relaunch [9]
  live       LAUNCH/UP  GroupStopped (not asked for)          RECOVERING  fault
  RUNNING    UP         Tick, no progress > heartbeat_timeout RECOVERING  hang_detected, fault
  STARTING+  LAUNCHING  Tick, not ready > start_timeout_s     RECOVERING  start_timeout, fault
  live       LAUNCH/UP  WorkerLost(node)                      RECOVERING  StopGroup; await capacity
  live       any        NodeLossConfirmed                     same        restart_refunded         [8]
                          group LAUNCHING, fit dp != dp       RECOVERING  StopGroup; await capacity
                          group NONE (backing off)            same        launch now, no backoff
  live       STOPPING   WorkerLost / JobError                 same        (ignored: teardown noise)
  RUNNING    UP         CapacityChanged / ScaleRequested,     RUNNING     RequestCheckpoint        [4]
                          fit dp != dp                        (RESIZING   StopGroup, at once when
                                                               at once)   nothing is new to save)
  RUNNING    UP         StragglerFlagged(evict=True)          RUNNING     RequestCheckpoint        [4]
  RUNNING    UP         CommitSucceeded of the pending step   RESIZING    StopGroup (resize)
                                                              RECOVERING  ExcludeNode, StopGroup (evict)
  RUNNING    UP         CommitFailed of the pending step      RUNNING     RequestCheckpoint (retry) [7]
  RUNNING    UP         Tick, pending > checkpoint_timeout_s  RUNNING     resize_abandoned, or
                                                              RECOVERING  evict from the last commit
  live       any        StragglerFlagged(evict=False)         same        RecordEvent(straggler_detected)
  STARTING+  STOPPING   GroupStopped                          same        launch when ready        [5]
  STARTING+  NONE       Tick / CapacityChanged / Scale...     same        launch when ready        [5]
  live       STOPPING   Tick, not stopped > stop_timeout_s    FAILED      MarkTerminal
  STARTING+  NONE       Tick, no capacity > capacity_wait...  FAILED      MarkTerminal
  live       any        ScaleRequested(illegal or too big)    same        RecordEvent(scale_rejected)
  live       any        Cancel                                CANCELLED   StopGroup (if a group), MarkTerminal
  live       any        Abort (adapter cannot go on)          FAILED      StopGroup (if a group), MarkTerminal
  terminal   any        anything                              same        (ignored)
  any        any        event.attempt != state.attempt        same        (ignored: stale old group)

  fault  A failure of the worker group the job may survive (lost process/actor, hang, start timeout,
         group gone). When restarts_used == max_restarts -> FAILED ("restarted N times,
         max_restarts=N"). Otherwise StopGroup, restarts_used += 1, backoff_until = now +
         min(backoff_base_s * 2**restarts_used, backoff_max_s), ScheduleWake(backoff_until).
         Node loss, eviction and resizes are not the job's fault: no budget, no backoff; node loss
         and eviction wait for the adapter's next CapacityChanged before launching.
  [1] Start launches at once unless capacity is known to be below min_dp (then it waits, [5]).
  [2] The fit is re-checked on GroupReady: capacity or a ScaleRequested that arrived during the
      launch starts a resize right away.
  [3] A step is committed only when every rank of the current world (pp*dp*tp) reported it, it is
      newer than the last committed step, and the adapter then wrote its manifest: the last report
      asks for the manifest (CommitCheckpoint, the step is "committing"), and only the adapter's
      answer CommitSucceeded moves ``last_committed_step`` and records checkpoint_committed. So a
      restart, a resize or an eviction never resumes from, nor waits on, a commit that did not
      happen. CommitFailed records checkpoint_commit_failed and leaves ``last_committed_step`` where
      it was (restore keeps the previous checkpoint). The adapter answers before it handles any other
      event; a launch forgets steps still committing (it resumes from what was committed before it).
  [4] "fit dp" = largest legal dp <= min(reported capacity, ScaleRequested target, max_dp), see
      service/decisions/elastic.py. A planned stop (resize, eviction) first saves a checkpoint; the stop
      happens when a step >= the step at the request commits.
  [5] Launch when the old group is confirmed stopped, the backoff is over, capacity was reported
      since a node loss/eviction and a legal dp fits: LaunchGroup(dp=fit, attempt+1,
      resume_step=last_committed_step). Status becomes RESIZING when dp changes, else RECOVERING.
      While blocked on capacity it records waiting_for_capacity (again whenever what it waits for
      changes) and fails once capacity_wait_timeout_s passed without a group becoming ready (so
      launches that keep failing to place cannot loop for free).
  [6] Export (``config.export``): a job that trained every step stops its group first (the ranks'
      memory and devices are freed before the export reads the checkpoint), then writes the final
      committed checkpoint as a Hugging Face folder. It is SUCCEEDED only once that folder exists
      (``state.hf_export``); a failed or timed-out export fails the job but leaves the checkpoint,
      and the error says how to retry the export by hand.
  [7] A resize or eviction waiting for a checkpoint whose commit failed asks the group for another
      checkpoint at once (the failure may be transient: a full disk freed, a slow shared filesystem).
      ``checkpoint_requested_at`` is kept, so all retries together are still bounded by
      checkpoint_timeout_s, after which the resize is abandoned or the eviction goes ahead from the
      last committed checkpoint (the Tick rows above). A failed commit of an older, unrequested step
      changes nothing: the requested one is still to come.

  [8] Classify at once, correct later: the adapter reports a lost rank as a process fault the moment
      its actor dies (Ray's death cause says "node" only once the cluster has declared the node
      dead), so the restart starts without waiting for the node's health verdict. When the node is
      declared dead afterwards, NodeLossConfirmed gives the restart back (restarts_used - 1) and
      re-fits the job to the capacity left; an attempt still launching at a size that no longer fits
      is stopped and the job waits for capacity like any node loss.

  [9] Keep the survivors: a single rank lost from a running group (process or actor, a budget left,
      a committed step, no resize or eviction pending, ``in_place``) is repaired in place: attempt
      + 1 on the same placement group, every surviving rank process kept (it rejoins a new
      rendezvous and restores the committed step from its own memory), and only the lost rank
      replaced (a warm spare where there is one), which gets its state from a data-parallel replica
      or else from storage. The restart is spent as for any fault, with no backoff (the budget
      bounds the loop). RepairFailed falls back to a full relaunch from the same step without
      spending again; a failure during the repair's launch is an ordinary fault.

Policies are plain values: the resize policy is :class:`etrain.service.decisions.elastic.ElasticPolicy` built from
the config; straggler statistics live in service/decisions/stragglers.py and arrive as StragglerFlagged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum, StrEnum

from etrain.service.decisions.elastic import ElasticPolicy, ResizeError
from etrain.service.decisions.supervisor_events import (
    Abort,
    Action,
    Cancel,
    CapacityChanged,
    CheckpointFallback,
    CheckpointReported,
    CommitCheckpoint,
    CommitFailed,
    CommitSucceeded,
    Event,
    ExcludeNode,
    ExportCheckpoint,
    Exported,
    ExportFailed,
    Finished,
    GroupReady,
    GroupStopped,
    JobError,
    LaunchGroup,
    MarkTerminal,
    NodeLossConfirmed,
    RecordEvent,
    RepairFailed,
    RepairGroup,
    RequestCheckpoint,
    ScaleRequested,
    ScheduleWake,
    Start,
    StepReported,
    StopGroup,
    StragglerFlagged,
    Tick,
    WorkerLost,
)
from etrain.workers.protocol.errors import EtrainError

__all__ = [
    "Abort", "Action", "Cancel", "CapacityChanged", "CheckpointFallback", "CheckpointReported", "CommitCheckpoint",
    "CommitFailed", "CommitSucceeded",
    "Decision", "Event", "ExcludeNode", "ExportCheckpoint", "ExportFailed", "Exported", "Finished",
    "GroupPhase", "GroupReady", "GroupStopped", "NodeLossConfirmed", "RepairFailed", "RepairGroup",
    "JobError", "LaunchGroup", "MarkTerminal", "RecordEvent", "RequestCheckpoint",
    "ScaleRequested", "ScheduleWake", "Start", "Status", "StepReported", "StopGroup",
    "StragglerFlagged", "SupervisorConfig", "SupervisorConfigError", "SupervisorState", "Tick",
    "WorkerLost", "backoff_delay", "decide", "initial_state",
]


class SupervisorConfigError(EtrainError, ValueError):
    """A supervisor setting out of range; the message names the setting, the value and the fix."""


class Status(StrEnum):
    """A job's status: what users see, what the store keeps, what the state machine decides."""

    QUEUED = "QUEUED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESIZING = "RESIZING"
    EXPORTING = "EXPORTING"  # every step trained; writing the final weights as a Hugging Face folder
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)

    is_terminal = terminal

    @classmethod
    def _missing_(cls, value: object) -> "Status | None":
        """Accept any case ("running"): statuses arrive from query strings and command lines."""
        return cls.__members__.get(value.upper()) if isinstance(value, str) else None


class GroupPhase(str, Enum):
    """What the adapter's worker group is doing, as far as the supervisor knows."""

    NONE = "none"  # no group: not launched yet, or GroupStopped confirmed
    LAUNCHING = "launching"  # LaunchGroup sent, GroupReady not yet seen
    UP = "up"  # GroupReady seen; training
    STOPPING = "stopping"  # StopGroup sent, GroupStopped not yet seen


# ---------------------------------------------------------------------------------------------
# Config and state


@dataclass(frozen=True, kw_only=True)
class SupervisorConfig:
    total_steps: int
    global_batch: int
    micro_batch: int
    min_dp: int
    max_dp: int
    tp: int = 1
    pp: int = 1
    dp_multiple: int = 1  # HSDP: every dp the job runs at stays a multiple of dp_replicate
    max_restarts: int = 3  # faults survived before FAILED (node loss/resize/evict are free)
    heartbeat_timeout_s: float = 300.0  # RUNNING with no step progress this long = hang
    start_timeout_s: float = 600.0  # LaunchGroup -> GroupReady
    stop_timeout_s: float = 120.0  # StopGroup -> GroupStopped
    checkpoint_timeout_s: float = 300.0  # RequestCheckpoint -> committed
    capacity_wait_timeout_s: float = 1800.0  # waiting for min_dp replicas / a capacity report
    backoff_base_s: float = 5.0
    backoff_max_s: float = 300.0
    in_place: bool = True  # repair a single lost rank in place [9] instead of relaunching every rank
    fail_on_nonfinite_loss: bool = True
    export: bool = False  # write the final checkpoint as a Hugging Face folder before SUCCEEDED
    export_timeout_s: float = 3600.0  # ExportCheckpoint -> Exported
    job_id: str = "JOB_ID"  # only for messages (the `etrain export` retry command)

    def __post_init__(self) -> None:
        # ``field`` names the setting (this config's name) so that spec validation, which builds this
        # config at submit to run these same rules, can name the spec field (service/planning/spec.py).
        def need(ok: bool, message: str, field: str) -> None:
            if not ok:
                raise SupervisorConfigError(message, field=field)

        need(self.total_steps >= 1, f"total_steps={self.total_steps} must be >= 1", "total_steps")
        need(self.tp >= 1 and self.pp >= 1, f"tp={self.tp} and pp={self.pp} must be >= 1", "tp")
        need(self.max_restarts >= 0, f"max_restarts={self.max_restarts} must be >= 0", "max_restarts")
        for name in ("heartbeat_timeout_s", "start_timeout_s", "stop_timeout_s",
                     "checkpoint_timeout_s", "capacity_wait_timeout_s", "export_timeout_s"):
            value = getattr(self, name)
            need(value > 0, f"{name}={value} must be > 0 seconds (every wait has a timeout)", name)
        need(self.backoff_base_s >= 0, f"backoff_base_s={self.backoff_base_s} must be >= 0", "backoff_base_s")
        need(
            self.backoff_max_s >= self.backoff_base_s,
            f"backoff_max_s={self.backoff_max_s} must be >= backoff_base_s={self.backoff_base_s}",
            "backoff_max_s",
        )
        try:
            self.elastic  # noqa: B018 - validates the batch sizes and dp range
        except ResizeError as err:
            raise SupervisorConfigError(str(err), field=err.field) from err

    @property
    def elastic(self) -> ElasticPolicy:
        return ElasticPolicy(
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            min_dp=self.min_dp,
            max_dp=self.max_dp,
            dp_multiple=self.dp_multiple,
        )

    def world_size(self, dp: int) -> int:
        return self.pp * dp * self.tp


@dataclass(frozen=True, kw_only=True)
class SupervisorState:
    status: Status
    dp: int  # dp of the current (or last) group
    attempt: int = 0  # bumped by every LaunchGroup; events from other attempts are stale
    group: GroupPhase = GroupPhase.NONE
    group_since: float | None = None  # when `group` last changed (start/stop timeouts)
    restarts_used: int = 0
    last_committed_step: int | None = None
    step: int = 0  # highest step seen from the current attempt
    last_progress_at: float | None = None
    backoff_until: float | None = None
    # Capacity and elasticity.
    available_dp: int | None = None  # last CapacityChanged; None = never reported
    target_dp: int | None = None  # ScaleRequested ceiling; None = as much as capacity allows
    awaiting_capacity: bool = False  # a node was lost/evicted: wait for a fresh CapacityChanged
    # When the job began waiting for capacity; cleared only by GroupReady, so launches that keep
    # failing to place (WorkerLost(node) while LAUNCHING) run into capacity_wait_timeout_s too.
    capacity_wait_since: float | None = None
    waiting_for: str | None = None  # what a blocked launch waits for (recorded when it changes)
    excluded_nodes: frozenset[str] = frozenset()
    # A change waiting for a checkpoint while RUNNING (one at a time).
    pending_resize_dp: int | None = None
    pending_evict_node: str | None = None
    pending_evict_rank: int | None = None
    checkpoint_requested_at: float | None = None
    checkpoint_requested_step: int | None = None
    # (step, rank) pairs of checkpoint saves reported by the current attempt, not yet committed.
    checkpoint_reports: frozenset[tuple[int, int]] = frozenset()
    # Steps every rank reported whose manifest the adapter is writing (CommitCheckpoint sent, no
    # CommitSucceeded / CommitFailed yet). Not committed: last_committed_step does not include them.
    committing: frozenset[int] = frozenset()
    # The end-of-job export (status EXPORTING): which committed step, since when, and where it went.
    exporting_step: int | None = None
    export_started_at: float | None = None  # None while the group is still stopping
    hf_export: str | None = None
    error: str | None = None

    @property
    def pending(self) -> bool:
        return self.checkpoint_requested_at is not None


def initial_state(
    config: SupervisorConfig,
    *,
    dp: int,
    last_committed_step: int | None = None,
    restarts_used: int = 0,
) -> SupervisorState:
    """A QUEUED job that will launch at ``dp`` (the planner's choice; capacity may change it)."""
    try:
        config.elastic.check(dp)
    except ResizeError as err:
        raise SupervisorConfigError(str(err), field=err.field) from err
    return SupervisorState(
        status=Status.QUEUED,
        dp=dp,
        last_committed_step=last_committed_step,
        step=last_committed_step or 0,
        restarts_used=restarts_used,
    )


def backoff_delay(restarts_used: int, config: SupervisorConfig) -> float:
    """Seconds before the next restart: ``backoff_base_s * 2**restarts_used``, capped."""
    return min(config.backoff_max_s, config.backoff_base_s * 2.0 ** min(restarts_used, 64))


# ---------------------------------------------------------------------------------------------
# Decision. The events (in) and actions (out) it speaks of live in service/decisions/supervisor_events.py.


@dataclass(frozen=True, kw_only=True)
class Decision:
    state: SupervisorState
    actions: tuple[Action, ...] = ()
    reason: str = ""
    ignored: bool = False  # the event changed nothing (late, stale or not legal in this state)


# ---------------------------------------------------------------------------------------------
# decide


def decide(state: SupervisorState, event: Event, now: float, config: SupervisorConfig) -> Decision:
    """The one entry point: the next state, the actions to carry out, and why."""
    if state.status.terminal:
        return _ignore(state, f"job is {state.status.value}; {type(event).__name__} ignored")
    attempt = getattr(event, "attempt", None)
    if attempt is not None and attempt != state.attempt:
        return _ignore(
            state,
            f"stale {type(event).__name__} from attempt {attempt} (current attempt {state.attempt})",
        )
    handler = _HANDLERS.get(type(event))
    if handler is None:
        return _ignore(state, f"unknown event {type(event).__name__}")
    return handler(state, event, now, config)


def _ignore(state: SupervisorState, reason: str) -> Decision:
    return Decision(state=state, actions=(), reason=f"ignored: {reason}", ignored=True)


def _decision(state: SupervisorState, actions: list[Action] | tuple[Action, ...], reason: str) -> Decision:
    return Decision(state=state, actions=tuple(actions), reason=reason)


def _on_start(state: SupervisorState, event: Start, now: float, config: SupervisorConfig) -> Decision:
    if state.status is not Status.QUEUED:
        return _ignore(state, f"Start in {state.status.value}")
    return _try_launch(replace(state, status=Status.STARTING), now, config, [], "start")


def _on_group_ready(
    state: SupervisorState,
    event: GroupReady,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    if state.group is not GroupPhase.LAUNCHING:
        return _ignore(state, f"GroupReady while group is {state.group.value}")
    expected = config.world_size(state.dp)
    if event.world_size != expected:
        return _terminal(
            state, now, Status.FAILED,
            f"worker group reported world_size={event.world_size}, expected "
            f"pp*dp*tp = {config.pp}*{state.dp}*{config.tp} = {expected}",
            [],
        )
    kind = _READY_KIND[state.status]
    resumed = "fresh start" if state.last_committed_step is None else f"from step {state.last_committed_step}"
    detail = f"attempt {state.attempt}: dp={state.dp} world_size={expected}, {resumed}"
    up = replace(
        state, status=Status.RUNNING, group=GroupPhase.UP, group_since=now, last_progress_at=now,
        capacity_wait_since=None, waiting_for=None,
    )
    return _maybe_resize(up, now, config, [RecordEvent(kind=kind, detail=detail)], f"group ready ({kind})")


def _on_step(state: SupervisorState, event: StepReported, now: float, config: SupervisorConfig) -> Decision:
    if state.status is not Status.RUNNING:
        return _ignore(state, f"StepReported in {state.status.value}")
    if config.fail_on_nonfinite_loss and not math.isfinite(event.loss):
        return _terminal(
            state, now, Status.FAILED, f"loss is {event.loss} at step {event.step} (rank {event.rank})", []
        )
    return _progress(state, event.step, now, "step")


def _on_checkpoint_fallback(
    state: SupervisorState, event: CheckpointFallback, now: float, config: SupervisorConfig
) -> Decision:
    if state.group is not GroupPhase.LAUNCHING:
        return _ignore(state, f"CheckpointFallback while the group is {state.group.value}")
    if event.step is not None and state.last_committed_step is not None and event.step >= state.last_committed_step:
        return _ignore(state, f"fallback to step {event.step} is not older than step {state.last_committed_step}")
    moved = replace(state, last_committed_step=event.step, step=event.step or 0)
    to = f"step {event.step}" if event.step is not None else "a fresh start"
    detail = f"step {state.last_committed_step} failed verification; restoring {to}" + (
        f" ({event.reason})" if event.reason else ""
    )
    return _decision(moved, [RecordEvent(kind="checkpoint_fallback", detail=detail)], detail)


def _progress(state: SupervisorState, step: int, now: float, what: str) -> Decision:
    """Only a higher step is progress: a report of a step already seen does not reset the hang clock."""
    if step <= state.step:
        return _decision(state, [], f"{what} at step {step}: no progress past step {state.step}")
    return _decision(replace(state, step=step, last_progress_at=now), [], f"{what}: progress to step {step}")


def _on_checkpoint(
    state: SupervisorState,
    event: CheckpointReported,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    world = config.world_size(state.dp)
    if state.attempt == 0:
        return _ignore(state, "CheckpointReported before any launch")
    if not 0 <= event.rank < world:
        return _ignore(state, f"checkpoint report from rank {event.rank}, outside world of {world}")
    if state.last_committed_step is not None and event.step <= state.last_committed_step:
        return _ignore(state, f"checkpoint step {event.step} <= committed step {state.last_committed_step}")
    if event.step in state.committing:
        return _ignore(state, f"checkpoint step {event.step} is already being committed")
    reports = state.checkpoint_reports | {(event.step, event.rank)}
    reported = sum(1 for step, _ in reports if step == event.step)
    if reported < world:
        return _decision(
            replace(state, checkpoint_reports=reports), [],
            f"checkpoint step {event.step}: {reported}/{world} ranks reported",
        )
    # Every rank saved its shards; the step counts only once the adapter wrote its manifest ([3]).
    committing = replace(
        state,
        committing=state.committing | {event.step},
        checkpoint_reports=frozenset(r for r in reports if r[0] != event.step),
    )
    return _decision(
        committing, [CommitCheckpoint(step=event.step)],
        f"checkpoint step {event.step}: {world}/{world} ranks reported; writing its manifest",
    )


def _on_commit_succeeded(
    state: SupervisorState, event: CommitSucceeded, now: float, config: SupervisorConfig
) -> Decision:
    if event.step not in state.committing:
        return _ignore(state, f"CommitSucceeded(step {event.step}) for a step not being committed")
    done = replace(state, committing=state.committing - {event.step})
    if state.last_committed_step is not None and event.step <= state.last_committed_step:
        why = f"checkpoint step {event.step} committed, but step {state.last_committed_step} is newer"
        return _decision(done, [], why)
    world = config.world_size(state.dp)
    committed = replace(
        done,
        last_committed_step=event.step,
        checkpoint_reports=frozenset(r for r in state.checkpoint_reports if r[0] > event.step),
    )
    actions: list[Action] = [
        RecordEvent(kind="checkpoint_committed", detail=f"step {event.step}, {world} ranks"),
    ]
    reason = f"checkpoint step {event.step} committed ({world}/{world} ranks, manifest written)"
    if (
        committed.status is Status.RUNNING
        and committed.pending
        and event.step >= (committed.checkpoint_requested_step or 0)
    ):
        return _carry_out_pending(committed, now, config, actions, reason)
    return _decision(committed, actions, reason)


def _on_commit_failed(state: SupervisorState, event: CommitFailed, now: float, config: SupervisorConfig) -> Decision:
    if event.step not in state.committing:
        return _ignore(state, f"CommitFailed(step {event.step}) for a step not being committed")
    failed = replace(state, committing=state.committing - {event.step})
    kept = "nothing" if state.last_committed_step is None else f"step {state.last_committed_step}"
    detail = f"step {event.step}: {event.error}; the last committed checkpoint stays {kept}"
    actions: list[Action] = [RecordEvent(kind="checkpoint_commit_failed", detail=detail)]
    if (
        failed.status is Status.RUNNING
        and failed.group is GroupPhase.UP
        and failed.pending
        and event.step >= (failed.checkpoint_requested_step or 0)
    ):
        # The change waits for a commit that did not happen: ask again, within the same deadline [7].
        what = "resize" if failed.pending_resize_dp is not None else "eviction"
        retry = RequestCheckpoint(attempt=state.attempt, reason=f"retry before the {what}: commit of step "
                                                               f"{event.step} failed")
        actions += [retry, RecordEvent(kind="checkpoint_requested",
                                       detail=f"again before the {what}: the commit of step {event.step} failed")]
        return _decision(failed, actions, f"{detail}; checkpoint requested again for the pending {what}")
    return _decision(failed, actions, detail)


def _on_finished(state: SupervisorState, event: Finished, now: float, config: SupervisorConfig) -> Decision:
    if state.status is not Status.RUNNING:
        return _ignore(state, f"Finished in {state.status.value}")
    done = replace(state, step=max(state.step, event.final_step))
    if event.final_step >= config.total_steps and config.export:
        return _begin_export(done, now, config, event.final_step)
    if event.final_step >= config.total_steps:
        detail = f"finished {event.final_step}/{config.total_steps} steps"
        return _terminal(done, now, Status.SUCCEEDED, None, [], detail=detail)
    return _terminal(
        done, now, Status.FAILED,
        f"workers exited at step {event.final_step} before total_steps={config.total_steps}", [],
    )


def _on_job_error(state: SupervisorState, event: JobError, now: float, config: SupervisorConfig) -> Decision:
    if state.group not in (GroupPhase.LAUNCHING, GroupPhase.UP):
        return _ignore(state, f"JobError while group is {state.group.value} (teardown noise)")
    error = f"rank {event.rank}: {event.message}"
    detail = f"{error}\n{event.traceback}".rstrip()
    return _terminal(state, now, Status.FAILED, error, [], detail=detail)


def _on_worker_lost(
    state: SupervisorState,
    event: WorkerLost,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    if state.group not in (GroupPhase.LAUNCHING, GroupPhase.UP):
        return _ignore(state, f"WorkerLost while group is {state.group.value} (expected during teardown)")
    what = f"rank {event.rank} on node {event.node} lost ({event.cause})"
    if event.detail:
        what += f": {event.detail}"
    if event.cause == "node":
        return _node_lost(state, now, config, what)
    if _can_repair(state, event, config):
        return _repair(state, now, config, event.rank, what)
    return _fault(state, now, config, "worker_failed", what)


def _can_repair(state: SupervisorState, event: WorkerLost, config: SupervisorConfig) -> bool:
    """[9] One known rank of a running group, a committed step to resume, nothing planned to stop for."""
    return (config.in_place and state.group is GroupPhase.UP and 0 <= event.rank < config.world_size(state.dp)
            and state.last_committed_step is not None and state.restarts_used < config.max_restarts
            and state.pending_evict_node is None and state.pending_resize_dp is None)


def _repair(state: SupervisorState, now: float, config: SupervisorConfig, rank: int, what: str) -> Decision:
    """Spend a restart, keep every other rank's process, replace ``rank``, resume the last commit."""
    step = state.last_committed_step
    repaired = replace(
        _clear_pending(state),
        status=Status.RECOVERING,
        restarts_used=state.restarts_used + 1,
        attempt=state.attempt + 1,
        group=GroupPhase.LAUNCHING,
        group_since=now,
        step=step,
        last_progress_at=None,
        backoff_until=None,
        checkpoint_reports=frozenset(),
        committing=frozenset(),  # a late answer about the old attempt's commit is ignored [3]
    )
    detail = (f"restart {repaired.restarts_used}/{config.max_restarts} in place: rank {rank} replaced, the other "
              f"ranks kept, resuming step {step}")
    actions: list[Action] = [
        RecordEvent(kind="worker_failed", detail=what),
        RecordEvent(kind="restarting", detail=detail),
        RepairGroup(attempt=repaired.attempt, lost_rank=rank, world_size=config.world_size(state.dp),
                    resume_step=step),
    ]
    return _decision(repaired, actions, f"{what}: {detail}")


def _on_repair_failed(state: SupervisorState, event: RepairFailed, now: float, config: SupervisorConfig) -> Decision:
    """[9] Fall back to a full relaunch from the same committed step; the restart was already spent."""
    if state.group is not GroupPhase.LAUNCHING:
        return _ignore(state, f"RepairFailed while group is {state.group.value}")
    what = f"in-place repair of attempt {state.attempt} failed: {event.reason}; relaunching every rank"
    stopped, stop_actions = _stop(state, now, what)
    return _decision(stopped, [RecordEvent(kind="repair_failed", detail=what), *stop_actions], what)


def _on_node_loss_confirmed(
    state: SupervisorState,
    event: NodeLossConfirmed,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    """A process fault turned out to be a node loss [8]: refund its restart, re-fit to the capacity left."""
    refunded = replace(state, restarts_used=max(0, state.restarts_used - 1), available_dp=event.available_dp)
    detail = (f"node {event.node} of the rank lost in attempt {event.failed_attempt} was declared dead: a node "
              f"loss, not the job's fault; restarts used {refunded.restarts_used}/{config.max_restarts}")
    actions: list[Action] = [RecordEvent(kind="restart_refunded", detail=detail)]
    fit = _fit_dp(refunded, config)
    if state.group is GroupPhase.LAUNCHING and fit != state.dp:
        # The relaunch asked for a size the cluster no longer holds: stop it and re-fit.
        lost = _node_lost(refunded, now, config, f"attempt {state.attempt} cannot be placed at dp={state.dp} "
                                                 f"without node {event.node}")
        return _decision(lost.state, [*actions, *lost.actions], f"{detail}; {lost.reason}")
    if state.group is GroupPhase.NONE and state.status in (Status.RECOVERING, Status.RESIZING):
        return _try_launch(replace(refunded, backoff_until=None), now, config, actions, detail)  # no backoff for a node
    return _decision(refunded, actions, detail)


def _on_group_stopped(
    state: SupervisorState,
    event: GroupStopped,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    if state.group is GroupPhase.STOPPING and state.status is Status.EXPORTING:
        stopped = replace(state, group=GroupPhase.NONE, group_since=now)
        if stopped.export_started_at is not None:
            return _decision(stopped, [], "group stopped; the export already runs")
        return _start_export(stopped, now, config, f"group of attempt {state.attempt} stopped")
    if state.group is GroupPhase.STOPPING:
        stopped = replace(state, group=GroupPhase.NONE, group_since=now)
        return _try_launch(stopped, now, config, [], f"group of attempt {state.attempt} stopped")
    if state.group in (GroupPhase.LAUNCHING, GroupPhase.UP):
        gone = replace(state, group=GroupPhase.NONE, group_since=now)
        what = f"worker group of attempt {state.attempt} stopped unexpectedly"
        return _fault(gone, now, config, "worker_failed", what)
    return _ignore(state, "GroupStopped with no group")


def _on_tick(state: SupervisorState, event: Tick, now: float, config: SupervisorConfig) -> Decision:
    if state.status is Status.EXPORTING:
        return _export_tick(state, now, config)
    since = state.group_since if state.group_since is not None else now
    if state.group is GroupPhase.UP:
        idle = now - (state.last_progress_at if state.last_progress_at is not None else now)
        if idle > config.heartbeat_timeout_s:
            return _fault(
                state, now, config, "hang_detected",
                f"no step progress for {idle:.0f}s (heartbeat_timeout_s={config.heartbeat_timeout_s:g}), "
                f"stuck at step {state.step}",
            )
        if state.pending and now - state.checkpoint_requested_at > config.checkpoint_timeout_s:
            return _pending_checkpoint_timed_out(state, now, config)
        return _decision(state, [], "tick: running")
    if state.group is GroupPhase.LAUNCHING:
        if now - since > config.start_timeout_s:
            return _fault(
                state, now, config, "start_timeout",
                f"worker group of attempt {state.attempt} not ready after {now - since:.0f}s "
                f"(start_timeout_s={config.start_timeout_s:g})",
            )
        return _decision(state, [], "tick: group launching")
    if state.group is GroupPhase.STOPPING:
        if now - since > config.stop_timeout_s:
            return _terminal(
                state, now, Status.FAILED,
                f"worker group of attempt {state.attempt} did not stop within "
                f"stop_timeout_s={config.stop_timeout_s:g}", [],
            )
        return _decision(state, [], "tick: waiting for the group to stop")
    if state.status is Status.QUEUED:
        return _decision(state, [], "tick: queued")
    return _try_launch(state, now, config, [], "tick")


def _on_capacity(
    state: SupervisorState,
    event: CapacityChanged,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    if event.available_dp < 0:
        return _ignore(state, f"negative capacity {event.available_dp}")
    updated = replace(state, available_dp=event.available_dp, awaiting_capacity=False)
    reason = f"capacity {event.available_dp} replica(s)"
    if state.status is Status.EXPORTING:
        return _decision(updated, [], f"{reason}; training is done, nothing to launch")
    if state.group is GroupPhase.UP:
        return _maybe_resize(updated, now, config, [], reason)
    if state.group is GroupPhase.NONE and state.status is not Status.QUEUED:
        return _try_launch(updated, now, config, [], reason)
    return _decision(updated, [], f"{reason}; applies at the next launch")


def _on_scale(
    state: SupervisorState,
    event: ScaleRequested,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    policy = config.elastic
    if state.status is Status.EXPORTING:
        why = f"dp={event.dp} rejected: every step is trained; the job is exporting its final checkpoint"
        return _decision(state, [RecordEvent(kind="scale_rejected", detail=why)], why)
    if not policy.is_legal(event.dp):
        why = (
            f"dp={event.dp} rejected: legal sizes for global_batch={config.global_batch}, "
            f"micro_batch={config.micro_batch} in [min_dp={config.min_dp}, max_dp={config.max_dp}] "
            f"are {policy.legal_sizes()}"
        )
        return _decision(state, [RecordEvent(kind="scale_rejected", detail=why)], why)
    if state.available_dp is not None and event.dp > state.available_dp:
        why = f"dp={event.dp} rejected: the cluster can place only {state.available_dp} replica(s) now"
        return _decision(state, [RecordEvent(kind="scale_rejected", detail=why)], why)
    updated = replace(state, target_dp=event.dp)
    actions: list[Action] = [RecordEvent(kind="scale_requested", detail=f"dp {state.dp} -> {event.dp}")]
    reason = f"scale to dp={event.dp} accepted"
    if state.group is GroupPhase.UP:
        return _maybe_resize(updated, now, config, actions, reason)
    if state.group is GroupPhase.NONE and state.status is not Status.QUEUED:
        return _try_launch(updated, now, config, actions, reason)
    return _decision(updated, actions, f"{reason}; applies at the next launch")


def _on_straggler(
    state: SupervisorState,
    event: StragglerFlagged,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    detail = f"rank {event.rank} on node {event.node} is {event.factor:.2f}x slower than its peers"
    if event.evidence:
        detail += f" ({event.evidence})"
    actions: list[Action] = [RecordEvent(kind="straggler_detected", detail=detail)]
    if not event.evict:
        return _decision(state, actions, "straggler reported (no eviction)")
    if state.status is not Status.RUNNING:
        return _decision(state, actions, f"straggler not evicted: job is {state.status.value}")
    if state.pending:
        return _decision(state, actions, "straggler not evicted: another change is waiting for a checkpoint")
    if state.step >= config.total_steps:
        return _decision(state, actions, "straggler not evicted: every step is done, the job is finishing")
    if event.node in state.excluded_nodes:
        return _decision(state, actions, f"node {event.node} is already excluded")
    pending = replace(state, pending_evict_node=event.node, pending_evict_rank=event.rank)
    return _begin_pending(pending, now, actions, f"evict node {event.node} (rank {event.rank})", config)


def _on_cancel(state: SupervisorState, event: Cancel, now: float, config: SupervisorConfig) -> Decision:
    return _terminal(state, now, Status.CANCELLED, None, [], detail=event.reason)


def _on_abort(state: SupervisorState, event: Abort, now: float, config: SupervisorConfig) -> Decision:
    return _terminal(state, now, Status.FAILED, event.error, [])


def _begin_export(state: SupervisorState, now: float, config: SupervisorConfig, final_step: int) -> Decision:
    """Every step is trained: stop the group, then export the final checkpoint (on GroupStopped)."""
    if state.last_committed_step != final_step:
        committed = "nothing" if state.last_committed_step is None else f"step {state.last_committed_step}"
        return _terminal(
            state, now, Status.FAILED,
            f"finished {final_step}/{config.total_steps} steps but the final checkpoint (step {final_step}) was "
            f"not committed (last committed: {committed}), so there is no checkpoint to export",
            [],
        )
    stopped, stop_actions = _stop(state, now, "training finished; exporting")
    exporting = replace(_clear_pending(stopped), status=Status.EXPORTING, exporting_step=final_step,
                        export_started_at=None)
    detail = f"finished {final_step}/{config.total_steps} steps; exporting checkpoint step {final_step}"
    actions: list[Action] = [RecordEvent(kind="training_finished", detail=detail), *stop_actions]
    if exporting.group is GroupPhase.NONE:
        return _start_export(exporting, now, config, detail, tuple(actions))
    return _decision(exporting, actions, f"{detail} once the group has stopped")


def _start_export(state: SupervisorState, now: float, config: SupervisorConfig, reason: str,
                  actions: tuple[Action, ...] = ()) -> Decision:
    step = state.exporting_step
    started = replace(state, export_started_at=now)
    return _decision(
        started,
        [*actions, RecordEvent(kind="exporting", detail=f"checkpoint step {step} to Hugging Face format"),
         ExportCheckpoint(step=step)],
        f"{reason}; export of step {step} started (export_timeout_s={config.export_timeout_s:g})",
    )


def _export_tick(state: SupervisorState, now: float, config: SupervisorConfig) -> Decision:
    if state.export_started_at is None:  # still waiting for the group to stop
        since = state.group_since if state.group_since is not None else now
        if now - since > config.stop_timeout_s:
            # The checkpoint is committed: exporting it does not need the group, so do not wait on it.
            what = (f"worker group of attempt {state.attempt} did not stop within "
                    f"stop_timeout_s={config.stop_timeout_s:g}; exporting anyway")
            return _start_export(state, now, config, what, (RecordEvent(kind="stop_timeout", detail=what),))
        return _decision(state, [], "tick: waiting for the group to stop before the export")
    if now - state.export_started_at > config.export_timeout_s:
        why = (f"did not finish within export_timeout_s={config.export_timeout_s:g} "
               f"({now - state.export_started_at:.0f}s)")
        return _terminal(state, now, Status.FAILED, _export_error(state.exporting_step, None, why, config), [])
    return _decision(state, [], "tick: exporting")


def _export_error(step: int | None, checkpoint_dir: str | None, why: str, config: SupervisorConfig) -> str:
    where = f"checkpoint step {step}" + (f" ({checkpoint_dir})" if checkpoint_dir else "")
    return (f"training finished but exporting {where} to Hugging Face format failed: {why}. The checkpoint is "
            f"intact; retry with `etrain export {config.job_id} --step {step} --out DIR`")


def _on_exported(state: SupervisorState, event: Exported, now: float, config: SupervisorConfig) -> Decision:
    if state.status is not Status.EXPORTING or event.step != state.exporting_step:
        return _ignore(state, f"Exported(step {event.step}) while {state.status.value}, "
                              f"exporting step {state.exporting_step}")
    done = replace(state, hf_export=event.path)
    record = RecordEvent(kind="exported", detail=f"step {event.step} -> {event.path}")
    detail = f"finished {config.total_steps}/{config.total_steps} steps; Hugging Face folder {event.path}"
    return _terminal(done, now, Status.SUCCEEDED, None, [record], detail=detail)


def _on_export_failed(state: SupervisorState, event: ExportFailed, now: float, config: SupervisorConfig) -> Decision:
    if state.status is not Status.EXPORTING or event.step != state.exporting_step:
        return _ignore(state, f"ExportFailed(step {event.step}) while {state.status.value}, "
                              f"exporting step {state.exporting_step}")
    error = _export_error(event.step, event.checkpoint_dir, event.error, config)
    return _terminal(state, now, Status.FAILED, error, [])


_READY_KIND = {Status.STARTING: "started", Status.RECOVERING: "restored", Status.RESIZING: "resized"}

_HANDLERS = {
    Start: _on_start,
    GroupReady: _on_group_ready,
    StepReported: _on_step,
    CheckpointReported: _on_checkpoint,
    CommitSucceeded: _on_commit_succeeded,
    CommitFailed: _on_commit_failed,
    WorkerLost: _on_worker_lost,
    NodeLossConfirmed: _on_node_loss_confirmed,
    RepairFailed: _on_repair_failed,
    JobError: _on_job_error,
    Tick: _on_tick,
    CapacityChanged: _on_capacity,
    ScaleRequested: _on_scale,
    StragglerFlagged: _on_straggler,
    Cancel: _on_cancel,
    Abort: _on_abort,
    Finished: _on_finished,
    GroupStopped: _on_group_stopped,
    CheckpointFallback: _on_checkpoint_fallback,
    Exported: _on_exported,
    ExportFailed: _on_export_failed,
}

# ---------------------------------------------------------------------------------------------
# Shared moves


def _fit_dp(state: SupervisorState, config: SupervisorConfig) -> int | None:
    """Largest legal dp under every ceiling we know of (capacity, user target, max_dp)."""
    if state.target_dp is None and state.available_dp is None:
        ceiling = state.dp  # nothing says more (or less) fits: keep the size we have
    else:
        ceiling = min(x for x in (state.target_dp, state.available_dp) if x is not None)
    return config.elastic.choose(ceiling, state.dp)


def _stop(state: SupervisorState, now: float, reason: str) -> tuple[SupervisorState, list[Action]]:
    """Stop the group if one exists or is starting; NONE/STOPPING need nothing new."""
    if state.group in (GroupPhase.LAUNCHING, GroupPhase.UP):
        stopped = replace(state, group=GroupPhase.STOPPING, group_since=now)
        return stopped, [StopGroup(attempt=state.attempt, reason=reason)]
    return state, []


def _clear_pending(state: SupervisorState) -> SupervisorState:
    return replace(
        state, pending_resize_dp=None, pending_evict_node=None, pending_evict_rank=None,
        checkpoint_requested_at=None, checkpoint_requested_step=None,
    )


def _terminal(
    state: SupervisorState,
    now: float,
    status: Status,
    error: str | None,
    actions: list[Action],
    *,
    detail: str | None = None,
) -> Decision:
    stopped, stop_actions = _stop(state, now, f"job {status.value.lower()}")
    final = replace(_clear_pending(stopped), status=status, error=error)
    record = RecordEvent(kind=status.value.lower(), detail=detail or error or status.value.lower())
    return _decision(
        final,
        [*actions, *stop_actions, record, MarkTerminal(status=status, error=error)],
        f"{state.status.value} -> {status.value}: {detail or error or status.value.lower()}",
    )


def _fault(state: SupervisorState, now: float, config: SupervisorConfig, kind: str, what: str) -> Decision:
    """A group failure the job may survive: restart after backoff, spending one restart."""
    actions: list[Action] = [RecordEvent(kind=kind, detail=what)]
    if state.restarts_used >= config.max_restarts:
        error = f"{what}; restarted {state.restarts_used} times, max_restarts={config.max_restarts}"
        return _terminal(state, now, Status.FAILED, error, actions)
    delay = backoff_delay(state.restarts_used, config)
    stopped, stop_actions = _stop(state, now, what)
    recovering = replace(
        _carry_evict(stopped),
        status=Status.RECOVERING,
        restarts_used=state.restarts_used + 1,
        backoff_until=now + delay,
    )
    resume = "scratch" if state.last_committed_step is None else f"step {state.last_committed_step}"
    actions += stop_actions
    actions += _evict_actions(state)
    actions += [
        RecordEvent(
            kind="restarting",
            detail=f"restart {state.restarts_used + 1}/{config.max_restarts} from {resume} in {delay:g}s",
        ),
        ScheduleWake(at=now + delay),
    ]
    reason = f"{what}: restart {state.restarts_used + 1}/{config.max_restarts} after {delay:g}s backoff"
    if recovering.group is GroupPhase.NONE:
        return _try_launch(recovering, now, config, actions, reason)
    return _decision(recovering, actions, reason)


def _node_lost(state: SupervisorState, now: float, config: SupervisorConfig, what: str) -> Decision:
    """Capacity went away (not the job's fault): stop, wait for the new capacity, no budget spent."""
    stopped, stop_actions = _stop(state, now, what)
    recovering = replace(
        _carry_evict(stopped), status=Status.RECOVERING, awaiting_capacity=True, backoff_until=None
    )
    actions: list[Action] = [
        RecordEvent(kind="node_lost", detail=what), *stop_actions, *_evict_actions(state),
    ]
    return _decision(recovering, actions, f"{what}: stopping the group, waiting for a capacity report")


def _carry_evict(state: SupervisorState) -> SupervisorState:
    """A restart for another reason still honours a pending eviction (the node stays slow)."""
    node = state.pending_evict_node
    cleared = _clear_pending(state)
    if node is None:
        return cleared
    return replace(cleared, excluded_nodes=state.excluded_nodes | {node}, awaiting_capacity=True)


def _evict_actions(state: SupervisorState) -> list[Action]:
    if state.pending_evict_node is None:
        return []
    node, rank = state.pending_evict_node, state.pending_evict_rank
    return [ExcludeNode(node=node, reason=f"straggler rank {rank}")]


def _maybe_resize(
    state: SupervisorState,
    now: float,
    config: SupervisorConfig,
    actions: list[Action],
    reason: str,
) -> Decision:
    """RUNNING: start a resize when the best legal dp differs from the one we run at."""
    if state.pending_evict_node is not None:
        return _decision(state, actions, f"{reason}; eviction pending, size re-checked at relaunch")
    fit = _fit_dp(state, config)
    if fit is None:
        detail = (
            f"capacity {state.available_dp} replica(s) is below min_dp={config.min_dp}; "
            f"keeping dp={state.dp} while the group runs"
        )
        low = RecordEvent(kind="capacity_low", detail=detail)
        return _decision(_clear_pending(state), [*actions, low], f"{reason}; {detail}")
    if fit == state.dp:
        if state.pending_resize_dp is not None:
            why = f"{reason}; dp={fit} already fits, resize dropped"
            return _decision(_clear_pending(state), actions, why)
        return _decision(state, actions, f"{reason}; dp={state.dp} still fits")
    if state.pending_resize_dp is not None:
        why = f"{reason}; pending resize now to dp={fit}"
        return _decision(replace(state, pending_resize_dp=fit), actions, why)
    what = f"resize dp {state.dp} -> {fit}"
    return _begin_pending(replace(state, pending_resize_dp=fit), now, actions, what, config)


def _begin_pending(
    state: SupervisorState,
    now: float,
    actions: list[Action],
    what: str,
    config: SupervisorConfig,
) -> Decision:
    """Save progress before a planned stop; stop at once when nothing new would be saved."""
    if state.step <= (state.last_committed_step or 0):
        why = f"{what}: nothing new since the last checkpoint"
        return _carry_out_pending(state, now, config, actions, why)
    asked = replace(state, checkpoint_requested_at=now, checkpoint_requested_step=state.step)
    return _decision(
        asked,
        [*actions, RequestCheckpoint(attempt=state.attempt, reason=what),
         RecordEvent(kind="checkpoint_requested", detail=f"before {what}, at step {state.step}")],
        f"{what}: checkpoint requested at step {state.step}",
    )


def _carry_out_pending(
    state: SupervisorState,
    now: float,
    config: SupervisorConfig,
    actions: list[Action],
    reason: str,
) -> Decision:
    if state.pending_evict_node is not None:
        node, rank = state.pending_evict_node, state.pending_evict_rank
        what = f"evict straggler rank {rank} on node {node}"
        stopped, stop_actions = _stop(state, now, what)
        evicting = replace(_carry_evict(stopped), status=Status.RECOVERING)
        return _decision(
            evicting,
            [
                *actions,
                RecordEvent(kind="straggler_evicted", detail=what),
                *_evict_actions(state),
                *stop_actions,
            ],
            f"{reason}; {what}, relaunching without it",
        )
    target = state.pending_resize_dp
    what = f"resize dp {state.dp} -> {target}"
    stopped, stop_actions = _stop(state, now, what)
    return _decision(
        replace(_clear_pending(stopped), status=Status.RESIZING),
        [*actions, RecordEvent(kind="resizing", detail=what), *stop_actions],
        f"{reason}; {what}",
    )


def _pending_checkpoint_timed_out(state: SupervisorState, now: float, config: SupervisorConfig) -> Decision:
    waited = f"no checkpoint committed {now - state.checkpoint_requested_at:.0f}s after the request " \
             f"(checkpoint_timeout_s={config.checkpoint_timeout_s:g})"
    if state.pending_evict_node is not None:
        # A straggler slows every step from now on: losing the steps since the last commit is cheaper.
        timeout = RecordEvent(kind="checkpoint_timeout", detail=waited)
        return _carry_out_pending(state, now, config, [timeout], waited)
    what = f"resize dp {state.dp} -> {state.pending_resize_dp} abandoned: {waited}"
    return _decision(_clear_pending(state), [RecordEvent(kind="resize_abandoned", detail=what)], what)


def _try_launch(
    state: SupervisorState,
    now: float,
    config: SupervisorConfig,
    actions: list[Action],
    reason: str,
) -> Decision:
    """Group gone: launch the next attempt if nothing blocks it, otherwise say what we wait for."""
    if state.backoff_until is not None and now < state.backoff_until:
        return _decision(state, actions, f"{reason}; backing off until t={state.backoff_until:g}")
    fit = None if state.awaiting_capacity else _fit_dp(state, config)
    if fit is None:
        return _wait_for_capacity(state, now, config, actions, reason)
    status = state.status
    if state.attempt > 0:
        status = Status.RESIZING if fit != state.dp else Status.RECOVERING
    launched = replace(
        _clear_pending(state),
        status=status,
        dp=fit,
        attempt=state.attempt + 1,
        group=GroupPhase.LAUNCHING,
        group_since=now,
        step=state.last_committed_step or 0,
        last_progress_at=None,
        backoff_until=None,
        checkpoint_reports=frozenset(),
        committing=frozenset(),  # a late answer about the old group's commit is ignored [3]
    )
    launch = LaunchGroup(
        attempt=launched.attempt,
        dp=fit,
        world_size=config.world_size(fit),
        resume_step=state.last_committed_step,
        excluded_nodes=state.excluded_nodes,
    )
    resume = "fresh" if state.last_committed_step is None else f"resuming step {state.last_committed_step}"
    why = f"{reason}; launch attempt {launched.attempt} at dp={fit} ({resume})"
    return _decision(launched, [*actions, launch], why)


def _wait_for_capacity(
    state: SupervisorState,
    now: float,
    config: SupervisorConfig,
    actions: list[Action],
    reason: str,
) -> Decision:
    """Never wait silently: record what we wait for whenever it changes, fail at the deadline."""
    if state.awaiting_capacity:
        waiting_for = "a capacity report after losing or excluding a node"
    else:
        waiting_for = (
            f"capacity for min_dp={config.min_dp} legal replica(s) "
            f"(the cluster can place {state.available_dp})"
        )
    since = state.capacity_wait_since if state.capacity_wait_since is not None else now
    if now - since > config.capacity_wait_timeout_s:
        return _terminal(
            state, now, Status.FAILED,
            f"gave up after {now - since:.0f}s waiting for {waiting_for} "
            f"(capacity_wait_timeout_s={config.capacity_wait_timeout_s:g})",
            actions,
        )
    waiting = replace(state, capacity_wait_since=since, waiting_for=waiting_for)
    if waiting_for != state.waiting_for:
        detail = f"waiting for {waiting_for}; failing after {config.capacity_wait_timeout_s:g}s"
        actions = [*actions, RecordEvent(kind="waiting_for_capacity", detail=detail)]
    return _decision(waiting, actions, f"{reason}; waiting for {waiting_for} ({now - since:.0f}s so far)")
