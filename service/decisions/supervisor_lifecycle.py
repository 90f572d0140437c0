"""The supervisor's handlers for a job's life as such: start, the group up, steps, the end, timeouts.

Start and GroupReady launch and confirm a group; StepReported is progress (and the hang clock);
Finished, JobError, Cancel and Abort end the job; GroupStopped and Tick move a job on between groups
(launch when ready, [5]) and catch every wait that ran past its timeout. The rows are in the transition
table of service/decisions/supervisor.py; the moves they share are in service/decisions/supervisor_moves.py.
"""

from __future__ import annotations

import math
from dataclasses import replace

from etrain.service.decisions.in_place_waits import in_place_leave_allowance_s
from etrain.service.decisions.job_status import Status
from etrain.service.decisions.supervisor_events import (
    Abort,
    Cancel,
    DiagnoseHang,
    Finished,
    GroupReady,
    GroupStopped,
    JobError,
    RecordEvent,
    Start,
    StepReported,
    Tick,
)
from etrain.service.decisions.supervisor_export import begin_export, export_tick, start_export
from etrain.service.decisions.supervisor_moves import (
    decision,
    fault,
    ignore,
    maybe_resize,
    pending_checkpoint_timed_out,
    terminal,
    try_launch,
)
from etrain.service.decisions.supervisor_state import Decision, GroupPhase, SupervisorConfig, SupervisorState

#: How long a hang's diagnosis (the ranks asked where they are, then the culprit's kill) may take before
#: the job is relaunched as for a hang with no culprit [10].
HANG_DIAGNOSIS_S = 10.0


def on_start(state: SupervisorState, event: Start, now: float, config: SupervisorConfig) -> Decision:
    if state.status is not Status.QUEUED:
        return ignore(state, f"Start in {state.status.value}")
    return try_launch(replace(state, status=Status.STARTING), now, config, [], "start")


_READY_KIND = {Status.STARTING: "started", Status.RECOVERING: "restored", Status.RESIZING: "resized"}


def on_group_ready(
    state: SupervisorState,
    event: GroupReady,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    if state.group is not GroupPhase.LAUNCHING:
        return ignore(state, f"GroupReady while group is {state.group.value}")
    expected = config.world_size(state.dp)
    if event.world_size != expected:
        return terminal(
            state,
            now,
            Status.FAILED,
            f"worker group reported world_size={event.world_size}, expected "
            f"pp*dp*tp = {config.pp}*{state.dp}*{config.tp} = {expected}",
            [],
        )
    kind = _READY_KIND[state.status]
    committed = state.last_committed_step
    start = event.start_step if event.start_step is not None else committed
    if start is None:
        resumed = "fresh start"
    elif committed is not None and start > committed:  # the survivors' memory held a later step: none recomputed
        resumed = f"from step {start} (in memory; step {committed} committed)"
    else:
        resumed = f"from step {start}"
    detail = f"attempt {state.attempt}: dp={state.dp} world_size={expected}, {resumed}"
    if state.status is Status.RESIZING:
        detail += f"; {state.resize_note or 'relaunched'}"
    up = replace(
        state,
        resize_note=None,
        status=Status.RUNNING,
        group=GroupPhase.UP,
        group_since=now,
        step=max(state.step, start or 0),
        last_progress_at=now,
        hang_asked_at=None,
        capacity_wait_since=None,
        waiting_for=None,
        node_loss_repair=False,
    )
    return maybe_resize(up, now, config, [RecordEvent(kind=kind, detail=detail)], f"group ready ({kind})")


def on_step(state: SupervisorState, event: StepReported, now: float, config: SupervisorConfig) -> Decision:
    if state.status is not Status.RUNNING:
        return ignore(state, f"StepReported in {state.status.value}")
    if config.fail_on_nonfinite_loss and not math.isfinite(event.loss):
        return terminal(state, now, Status.FAILED, f"loss is {event.loss} at step {event.step} (rank {event.rank})", [])
    return _progress(state, event.step, now, "step")


def _progress(state: SupervisorState, step: int, now: float, what: str) -> Decision:
    """Only a higher step is progress: a report of a step already seen does not reset the hang clock."""
    if step <= state.step:
        return decision(state, [], f"{what} at step {step}: no progress past step {state.step}")
    return decision(
        replace(state, step=step, last_progress_at=now, hang_asked_at=None), [], f"{what}: progress to step {step}"
    )


def on_finished(state: SupervisorState, event: Finished, now: float, config: SupervisorConfig) -> Decision:
    if state.status is not Status.RUNNING:
        return ignore(state, f"Finished in {state.status.value}")
    done = replace(state, step=max(state.step, event.final_step))
    if event.final_step >= config.total_steps and config.policy.export:
        return begin_export(done, now, config, event.final_step)
    if event.final_step >= config.total_steps:
        detail = f"finished {event.final_step}/{config.total_steps} steps"
        return terminal(done, now, Status.SUCCEEDED, None, [], detail=detail)
    return terminal(
        done,
        now,
        Status.FAILED,
        f"workers exited at step {event.final_step} before total_steps={config.total_steps}",
        [],
    )


def on_job_error(state: SupervisorState, event: JobError, now: float, config: SupervisorConfig) -> Decision:
    if state.group not in (GroupPhase.LAUNCHING, GroupPhase.UP):
        return ignore(state, f"JobError while group is {state.group.value} (teardown noise)")
    error = f"rank {event.rank}: {event.message}"
    detail = f"{error}\n{event.traceback}".rstrip()
    return terminal(state, now, Status.FAILED, error, [], detail=detail)


def on_group_stopped(
    state: SupervisorState,
    event: GroupStopped,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    if state.group is GroupPhase.STOPPING and state.status is Status.EXPORTING:
        stopped = replace(state, group=GroupPhase.NONE, group_since=now)
        if stopped.export_started_at is not None:
            return decision(stopped, [], "group stopped; the export already runs")
        return start_export(stopped, now, config, f"group of attempt {state.attempt} stopped")
    if state.group is GroupPhase.STOPPING:
        stopped = replace(state, group=GroupPhase.NONE, group_since=now)
        return try_launch(stopped, now, config, [], f"group of attempt {state.attempt} stopped")
    if state.group in (GroupPhase.LAUNCHING, GroupPhase.UP):
        gone = replace(state, group=GroupPhase.NONE, group_since=now)
        what = f"worker group of attempt {state.attempt} stopped unexpectedly"
        return fault(gone, now, config, "worker_failed", what)
    return ignore(state, "GroupStopped with no group")


def on_tick(state: SupervisorState, event: Tick, now: float, config: SupervisorConfig) -> Decision:
    if state.status is Status.EXPORTING:
        return export_tick(state, now, config)
    since = state.group_since if state.group_since is not None else now
    if state.group is GroupPhase.UP:
        idle = now - (state.last_progress_at if state.last_progress_at is not None else now)
        if idle > config.policy.heartbeat_timeout_s:
            what = (
                f"no step progress for {idle:.0f}s (heartbeat_timeout_s={config.policy.heartbeat_timeout_s:g}), "
                f"stuck at step {state.step}"
            )
            if state.hang_asked_at is None:  # [10] ask the ranks where they are first
                asked = replace(state, hang_asked_at=now)
                return decision(
                    asked, [DiagnoseHang(attempt=state.attempt)], f"{what}: asking the ranks where they are"
                )
            if now - state.hang_asked_at <= HANG_DIAGNOSIS_S:
                return decision(state, [], "tick: waiting for the hang's diagnosis")
            return fault(
                replace(state, hang_asked_at=None),
                now,
                config,
                "hang_detected",
                f"{what}; the ranks' diagnosis (or the culprit's loss) did not come within {HANG_DIAGNOSIS_S:g}s",
            )
        if state.pending and now - state.checkpoint_requested_at > config.policy.checkpoint_timeout_s:
            return pending_checkpoint_timed_out(state, now, config)
        return decision(state, [], "tick: running")
    if state.group is GroupPhase.LAUNCHING:
        # an in-place attempt first waits for the survivors to leave the old one: up to two of the job's steps
        leaving = in_place_leave_allowance_s(event.step_s) if state.launched_in_place else 0.0
        if now - since > config.start_timeout_s + leaving:
            allowed = f" + {leaving:.0f}s for the survivors to leave the last attempt" if leaving else ""
            return fault(
                state,
                now,
                config,
                "start_timeout",
                f"worker group of attempt {state.attempt} not ready after {now - since:.0f}s "
                f"(start_timeout_s={config.start_timeout_s:g}{allowed})",
            )
        return decision(state, [], "tick: group launching")
    if state.group is GroupPhase.STOPPING:
        if now - since > config.stop_timeout_s:
            return terminal(
                state,
                now,
                Status.FAILED,
                f"worker group of attempt {state.attempt} did not stop within stop_timeout_s={config.stop_timeout_s:g}",
                [],
            )
        return decision(state, [], "tick: waiting for the group to stop")
    if state.status is Status.QUEUED:
        return decision(state, [], "tick: queued")
    return try_launch(state, now, config, [], "tick")


def on_cancel(state: SupervisorState, event: Cancel, now: float, config: SupervisorConfig) -> Decision:
    return terminal(state, now, Status.CANCELLED, None, [], detail=event.reason)


def on_abort(state: SupervisorState, event: Abort, now: float, config: SupervisorConfig) -> Decision:
    return terminal(state, now, Status.FAILED, event.error, [])
