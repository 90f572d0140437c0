"""The supervisor's end-of-job export ([6]): stop the group, write the final checkpoint as a Hugging Face
folder, and only then SUCCEEDED.

Its own module because it is a phase of its own (status EXPORTING) with its own timeouts and error text
(the error tells the user how to retry the export by hand); lifecycle handlers enter and tick it.
"""

from __future__ import annotations

from dataclasses import replace

from etrain.service.decisions.job_status import Status
from etrain.service.decisions.supervisor_events import (
    Action,
    ExportCheckpoint,
    Exported,
    ExportFailed,
    RecordEvent,
)
from etrain.service.decisions.supervisor_moves import clear_pending, decision, ignore, stop_group, terminal
from etrain.service.decisions.supervisor_state import Decision, GroupPhase, SupervisorConfig, SupervisorState


def begin_export(state: SupervisorState, now: float, config: SupervisorConfig, final_step: int) -> Decision:
    """Every step is trained: stop the group, then export the final checkpoint (on GroupStopped)."""
    if state.last_committed_step != final_step:
        committed = "nothing" if state.last_committed_step is None else f"step {state.last_committed_step}"
        return terminal(
            state,
            now,
            Status.FAILED,
            f"finished {final_step}/{config.total_steps} steps but the final checkpoint (step {final_step}) was "
            f"not committed (last committed: {committed}), so there is no checkpoint to export",
            [],
        )
    stopped, stop_actions = stop_group(state, now, "training finished; exporting")
    exporting = replace(
        clear_pending(stopped), status=Status.EXPORTING, exporting_step=final_step, export_started_at=None
    )
    detail = f"finished {final_step}/{config.total_steps} steps; exporting checkpoint step {final_step}"
    actions: list[Action] = [RecordEvent(kind="training_finished", detail=detail), *stop_actions]
    if exporting.group is GroupPhase.NONE:
        return start_export(exporting, now, config, detail, tuple(actions))
    return decision(exporting, actions, f"{detail} once the group has stopped")


def start_export(
    state: SupervisorState, now: float, config: SupervisorConfig, reason: str, actions: tuple[Action, ...] = ()
) -> Decision:
    step = state.exporting_step
    started = replace(state, export_started_at=now)
    return decision(
        started,
        [
            *actions,
            RecordEvent(kind="exporting", detail=f"checkpoint step {step} to Hugging Face format"),
            ExportCheckpoint(step=step),
        ],
        f"{reason}; export of step {step} started (export_timeout_s={config.policy.export_timeout_s:g})",
    )


def export_tick(state: SupervisorState, now: float, config: SupervisorConfig) -> Decision:
    if state.export_started_at is None:  # still waiting for the group to stop
        since = state.group_since if state.group_since is not None else now
        if now - since > config.stop_timeout_s:
            # The checkpoint is committed: exporting it does not need the group, so do not wait on it.
            what = (
                f"worker group of attempt {state.attempt} did not stop within "
                f"stop_timeout_s={config.stop_timeout_s:g}; exporting anyway"
            )
            return start_export(state, now, config, what, (RecordEvent(kind="stop_timeout", detail=what),))
        return decision(state, [], "tick: waiting for the group to stop before the export")
    if now - state.export_started_at > config.policy.export_timeout_s:
        why = (
            f"did not finish within export_timeout_s={config.policy.export_timeout_s:g} "
            f"({now - state.export_started_at:.0f}s)"
        )
        return terminal(state, now, Status.FAILED, _export_error(state.exporting_step, None, why, config), [])
    return decision(state, [], "tick: exporting")


def _export_error(step: int | None, checkpoint_dir: str | None, why: str, config: SupervisorConfig) -> str:
    where = f"checkpoint step {step}" + (f" ({checkpoint_dir})" if checkpoint_dir else "")
    return (
        f"training finished but exporting {where} to Hugging Face format failed: {why}. The checkpoint is "
        f"intact; retry with `etrain export {config.job_id} --step {step} --out DIR`"
    )


def on_exported(state: SupervisorState, event: Exported, now: float, config: SupervisorConfig) -> Decision:
    if state.status is not Status.EXPORTING or event.step != state.exporting_step:
        return ignore(
            state, f"Exported(step {event.step}) while {state.status.value}, exporting step {state.exporting_step}"
        )
    done = replace(state, hf_export=event.path)
    record = RecordEvent(kind="exported", detail=f"step {event.step} -> {event.path}")
    detail = f"finished {config.total_steps}/{config.total_steps} steps; Hugging Face folder {event.path}"
    return terminal(done, now, Status.SUCCEEDED, None, [record], detail=detail)


def on_export_failed(state: SupervisorState, event: ExportFailed, now: float, config: SupervisorConfig) -> Decision:
    if state.status is not Status.EXPORTING or event.step != state.exporting_step:
        return ignore(
            state, f"ExportFailed(step {event.step}) while {state.status.value}, exporting step {state.exporting_step}"
        )
    error = _export_error(event.step, event.checkpoint_dir, event.error, config)
    return terminal(state, now, Status.FAILED, error, [])
