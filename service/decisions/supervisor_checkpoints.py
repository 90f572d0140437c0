"""The supervisor's handlers for checkpoints: ranks' reports, the manifest's commit, and a fallback.

A step becomes the job's checkpoint only when every rank reported it and the adapter then wrote its
manifest ([3]); a failed commit retries a pending resize's checkpoint ([7]); a launch that finds the
newest checkpoint rotten moves the commit point back. Rows and notes: service/decisions/supervisor.py.
"""

from __future__ import annotations

from dataclasses import replace

from etrain.service.decisions.job_status import Status
from etrain.service.decisions.supervisor_events import (
    Action,
    CheckpointFallback,
    CheckpointReported,
    CommitCheckpoint,
    CommitFailed,
    CommitSucceeded,
    RecordEvent,
    RequestCheckpoint,
)
from etrain.service.decisions.supervisor_state import Decision, GroupPhase, SupervisorConfig, SupervisorState
from etrain.service.decisions.supervisor_moves import carry_out_pending, decision, ignore


def on_checkpoint(
    state: SupervisorState,
    event: CheckpointReported,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    world = config.world_size(state.dp)
    if state.attempt == 0:
        return ignore(state, "CheckpointReported before any launch")
    if not 0 <= event.rank < world:
        return ignore(state, f"checkpoint report from rank {event.rank}, outside world of {world}")
    if state.last_committed_step is not None and event.step <= state.last_committed_step:
        return ignore(state, f"checkpoint step {event.step} <= committed step {state.last_committed_step}")
    if event.step in state.committing:
        return ignore(state, f"checkpoint step {event.step} is already being committed")
    reports = state.checkpoint_reports | {(event.step, event.rank)}
    reported = sum(1 for step, _ in reports if step == event.step)
    if reported < world:
        return decision(
            replace(state, checkpoint_reports=reports), [],
            f"checkpoint step {event.step}: {reported}/{world} ranks reported",
        )
    # Every rank saved its shards; the step counts only once the adapter wrote its manifest ([3]).
    committing = replace(
        state,
        committing=state.committing | {event.step},
        checkpoint_reports=frozenset(r for r in reports if r[0] != event.step),
    )
    return decision(
        committing, [CommitCheckpoint(step=event.step)],
        f"checkpoint step {event.step}: {world}/{world} ranks reported; writing its manifest",
    )


def on_commit_succeeded(
    state: SupervisorState, event: CommitSucceeded, now: float, config: SupervisorConfig
) -> Decision:
    if event.step not in state.committing:
        return ignore(state, f"CommitSucceeded(step {event.step}) for a step not being committed")
    done = replace(state, committing=state.committing - {event.step})
    if state.last_committed_step is not None and event.step <= state.last_committed_step:
        why = f"checkpoint step {event.step} committed, but step {state.last_committed_step} is newer"
        return decision(done, [], why)
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
        return carry_out_pending(committed, now, config, actions, reason)
    return decision(committed, actions, reason)


def on_commit_failed(state: SupervisorState, event: CommitFailed, now: float, config: SupervisorConfig) -> Decision:
    if event.step not in state.committing:
        return ignore(state, f"CommitFailed(step {event.step}) for a step not being committed")
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
        return decision(failed, actions, f"{detail}; checkpoint requested again for the pending {what}")
    return decision(failed, actions, detail)


def on_checkpoint_fallback(
    state: SupervisorState, event: CheckpointFallback, now: float, config: SupervisorConfig
) -> Decision:
    if state.group is not GroupPhase.LAUNCHING:
        return ignore(state, f"CheckpointFallback while the group is {state.group.value}")
    if event.step is not None and state.last_committed_step is not None and event.step >= state.last_committed_step:
        return ignore(state, f"fallback to step {event.step} is not older than step {state.last_committed_step}")
    moved = replace(state, last_committed_step=event.step, step=event.step or 0)
    to = f"step {event.step}" if event.step is not None else "a fresh start"
    detail = f"step {state.last_committed_step} failed verification; restoring {to}" + (
        f" ({event.reason})" if event.reason else ""
    )
    return decision(moved, [RecordEvent(kind="checkpoint_fallback", detail=detail)], detail)
