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
  live       any        CheckpointFailed (storage fault)      same        checkpoint_failed        [3]
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
                          (after a node loss)                 RECOVERING  StopGroup; await capacity
  RESIZING   LAUNCHING  ResizeFailed                          RESIZING    StopGroup, then relaunch [11]
  live       LAUNCH/UP  RankUnhealthy(rank, node)             RECOVERING  health_check_failed,     [12]
                                                                          ExcludeNode, StopGroup
  live       LAUNCH/UP  GroupStopped (not asked for)          RECOVERING  fault
  RUNNING    UP         Tick, no progress > heartbeat_timeout RUNNING     DiagnoseHang             [10]
                          diagnosis asked > HANG_DIAGNOSIS_S  RECOVERING  hang_detected, fault
  RUNNING    UP         HangDiagnosed(culprit, repairable)    RUNNING     hang_detected, KillRank  [10]
                          no culprit, or no repair possible   RECOVERING  hang_detected, fault
  STARTING+  LAUNCHING  Tick, not ready > start_timeout_s     RECOVERING  start_timeout, fault
                          (+ the survivors' leave allowance
                          for an in-place attempt [9] [11])
  live       UP         WorkerLost(node), one rank            RECOVERING  node_lost, RepairGroup    [9]
                                                                          (in place, no restart spent)
  live       LAUNCH/UP  WorkerLost(node)                      RECOVERING  StopGroup; await capacity
  live       any        NodeLossConfirmed                     same        restart_refunded         [8]
                          group LAUNCHING, fit dp != dp       RECOVERING  StopGroup; await capacity
                          group NONE (backing off)            same        launch now, no backoff
  live       STOPPING   WorkerLost / JobError                 same        (ignored: teardown noise)
  RUNNING    UP         CapacityChanged / ScaleRequested,     RUNNING     RequestCheckpoint        [4]
                          fit dp != dp                        (RESIZING   StopGroup, at once when
                                                               at once)   nothing is new to save)
  RUNNING    UP         StragglerFlagged(evict=True)          RUNNING     RequestCheckpoint        [4]
  RUNNING    UP         CommitSucceeded of the pending step   RESIZING    ResizeGroup (in place)  [11]
                          (resize; in_place off: relaunch)    RESIZING    StopGroup (resize)
                                                              RECOVERING  ExcludeNode, StopGroup (evict)
  RUNNING    UP         CommitFailed of the pending step      RUNNING     RequestCheckpoint (retry) [7]
  RUNNING    UP         CheckpointFailed of the pending step  RUNNING     RequestCheckpoint (retry) [7]
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
         max_restarts=N"). Otherwise StopGroup, restarts_used += 1. Restart 1 launches as soon as
         the group has stopped; restart k >= 2 sets backoff_until = now +
         min(backoff_base_s * 2**(k - 2), backoff_max_s), ScheduleWake(backoff_until).
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
  [6] Export (``config.policy.export``): a job that trained every step stops its group first (the ranks'
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

  [9] Keep the survivors: a single rank lost from a running group of several ranks (process or actor, a budget left,
      a committed step, no resize or eviction pending, ``in_place``) is repaired in place: attempt
      + 1 on the same placement group, every surviving rank process kept (it rejoins a new
      rendezvous and restores the committed step from its own memory), and only the lost rank
      replaced (a warm spare where there is one), which gets its state from a data-parallel replica
      or else from storage. The adapter (``WorkerGroup.repair``) replaces with it every other rank
      whose process died in the same fault, and every survivor still stuck in the failed attempt after
      the others left it (a ``worker_failed`` event each, the same restart). Where a lost rank's node died,
      the placement group is reserved again (the kept ranks' bundles on their own nodes) and the lost
      ranks start on the nodes left (once more if the node is declared dead only during the repair, as
      a crashed node is); with no room there the repair fails (RepairFailed). The restart is spent as for any fault, with no
      backoff (the budget bounds the loop). RepairFailed falls back to a full relaunch from the same step
      without spending again; a failure during the repair's launch is an ordinary fault.
      A rank reported lost with its node (Ray had declared the node dead) is repaired the same way under
      the same conditions but a budget: no restart is spent, and a failed repair waits for a capacity
      report and fits the job to it (a shrink where the node's ranks have nowhere to go), as any node
      loss does.
      All of this needs the survivors' collectives with the lost rank to fail, so that they leave the
      failed attempt: gloo's do. NCCL's wait for the dead peer until the process group's timeout
      (``JobPolicy.collectives_fail_on_peer_loss`` is false for ``device: cuda``), so there a lost rank,
      or a hung one [10], relaunches every rank at once (a node loss waits for the capacity left), and
      its event says why.

  [10] A hang is diagnosed before anything is stopped: DiagnoseHang asks every rank where its training
      thread is (step and Python frames, answered from another thread of the rank's process), and
      HangDiagnosed names the rank the others wait for (service/decisions/hangs.py: the one not
      inside a collective, or silent). With a culprit that [9] could repair, the event names it (rank,
      node, its innermost frames) and KillRank kills that rank only: its loss arrives as WorkerLost and
      is repaired in place, the survivors kept. Without one (every rank waits: a network or device
      fault), or without a committed step or budget, every rank is relaunched as before. A step
      reported meanwhile clears the hang; HANG_DIAGNOSIS_S bounds the diagnosis and the kill.

  [11] Resize without a relaunch: with ``in_place``, the planned stop of a resize [4] becomes
      ResizeGroup once its checkpoint commits: attempt + 1 at the new dp, from the step just
      committed, no restart spent. The adapter stops the ranks' runs at a step boundary, keeps
      every rank whose data-parallel index stays below the new dp (its process, renumbered),
      releases the others, places the new size (the kept ranks' bundles on their own nodes) and adds
      ranks from the warm pool; state comes from the kept ranks' memory where DDP replicates it,
      else from the checkpoint (DCP reshards it). The `resized` event ends with "in place", or with
      "relaunched: why". ResizeFailed relaunches every rank at the new size, still without budget.

  [12] Health checks before trust: every attempt's ranks first check their device (allocate, a
      matmul against their peers' rate on GPUs) and the new group (an all-reduce with a deadline)
      (workers/protocol/health.py). A rank that fails is reported as RankUnhealthy: its node is
      excluded from the job and every rank relaunched without it, like a straggler's eviction, with
      no restart spent (excluded nodes only accumulate: the capacity wait bounds it).

Policies are plain values: the resize policy is :class:`etrain.service.decisions.elastic.ElasticPolicy` built from
the config; straggler statistics live in service/decisions/stragglers.py and arrive as StragglerFlagged.

Where each piece lives (this module holds the table and the one entry point; nothing else calls a handler):

  supervisor_events.py       the events (in) and actions (out)
  supervisor_state.py        SupervisorConfig, SupervisorState, Decision, initial_state, backoff_delay
  job_status.py              Status
  supervisor_lifecycle.py    Start, GroupReady, StepReported, Finished, JobError, GroupStopped, Tick, Cancel, Abort
  supervisor_checkpoints.py  CheckpointReported, CheckpointFailed, CommitSucceeded, CommitFailed,
                             CheckpointFallback                                                   [3] [7]
  supervisor_failures.py     WorkerLost, RepairFailed, NodeLossConfirmed, HangDiagnosed,
                             RankUnhealthy                                          [8] [9] [10] [12]
  supervisor_resize.py       CapacityChanged, ScaleRequested, StragglerFlagged, ResizeFailed  [4] [11]
  supervisor_export.py       Exported, ExportFailed and the EXPORTING phase                       [6]
  supervisor_moves.py        what the handlers share: stop, fault, launch, wait for capacity, planned stops
"""

from __future__ import annotations

from etrain.service.decisions import (
    supervisor_checkpoints as checkpoints,
)
from etrain.service.decisions import (
    supervisor_export as export,
)
from etrain.service.decisions import (
    supervisor_failures as failures,
)
from etrain.service.decisions import (
    supervisor_lifecycle as lifecycle,
)
from etrain.service.decisions import (
    supervisor_resize as resize,
)
from etrain.service.decisions.supervisor_events import (
    Abort,
    Cancel,
    CapacityChanged,
    CheckpointFailed,
    CheckpointFallback,
    CheckpointReported,
    CommitFailed,
    CommitSucceeded,
    Event,
    Exported,
    ExportFailed,
    Finished,
    GroupReady,
    GroupStopped,
    HangDiagnosed,
    JobError,
    NodeLossConfirmed,
    RankUnhealthy,
    RepairFailed,
    ResizeFailed,
    ScaleRequested,
    Start,
    StepReported,
    StragglerFlagged,
    Tick,
    WorkerLost,
)
from etrain.service.decisions.supervisor_moves import ignore
from etrain.service.decisions.supervisor_state import Decision, SupervisorConfig, SupervisorState

__all__ = ["decide"]


def decide(state: SupervisorState, event: Event, now: float, config: SupervisorConfig) -> Decision:
    """The one entry point: the next state, the actions to carry out, and why."""
    if state.status.terminal:
        return ignore(state, f"job is {state.status.value}; {type(event).__name__} ignored")
    attempt = getattr(event, "attempt", None)
    if attempt is not None and attempt != state.attempt:
        return ignore(
            state,
            f"stale {type(event).__name__} from attempt {attempt} (current attempt {state.attempt})",
        )
    handler = _HANDLERS.get(type(event))
    if handler is None:
        return ignore(state, f"unknown event {type(event).__name__}")
    return handler(state, event, now, config)


#: Every event and the handler that decides it (each is ``(state, event, now, config) -> Decision``).
_HANDLERS = {
    Start: lifecycle.on_start,
    GroupReady: lifecycle.on_group_ready,
    StepReported: lifecycle.on_step,
    Finished: lifecycle.on_finished,
    JobError: lifecycle.on_job_error,
    GroupStopped: lifecycle.on_group_stopped,
    Tick: lifecycle.on_tick,
    Cancel: lifecycle.on_cancel,
    Abort: lifecycle.on_abort,
    CheckpointReported: checkpoints.on_checkpoint,
    CommitSucceeded: checkpoints.on_commit_succeeded,
    CommitFailed: checkpoints.on_commit_failed,
    CheckpointFailed: checkpoints.on_checkpoint_failed,
    CheckpointFallback: checkpoints.on_checkpoint_fallback,
    WorkerLost: failures.on_worker_lost,
    RepairFailed: failures.on_repair_failed,
    NodeLossConfirmed: failures.on_node_loss_confirmed,
    HangDiagnosed: failures.on_hang_diagnosed,
    RankUnhealthy: failures.on_rank_unhealthy,
    CapacityChanged: resize.on_capacity,
    ScaleRequested: resize.on_scale,
    ResizeFailed: resize.on_resize_failed,
    StragglerFlagged: resize.on_straggler,
    Exported: export.on_exported,
    ExportFailed: export.on_export_failed,
}
