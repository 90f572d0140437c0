"""The supervisor's handlers for checkpoints: ranks' reports, the manifest's commit, and a fallback.

A step becomes the job's checkpoint only when every rank reported it and the adapter then wrote its
manifest ([3]); a save the storage failed is recorded and training goes on; a failed commit or save
retries a pending resize's checkpoint ([7]); a launch that finds the
newest checkpoint rotten moves the commit point back. Rows and notes: service/decisions/supervisor.py.
"""

from __future__ import annotations

from dataclasses import replace

from etrain.service.decisions.job_status import Status
from etrain.service.decisions.supervisor_events import (
    Action,
    CheckpointFailed,
    CheckpointFallback,
    CheckpointReported,
    CommitCheckpoint,
    CommitFailed,
    CommitSucceeded,
    RecordEvent,
    RequestCheckpoint,
)
from etrain.service.decisions.supervisor_moves import carry_out_pending, decision, ignore
from etrain.service.decisions.supervisor_state import Decision, GroupPhase, SupervisorConfig, SupervisorState


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
            replace(state, checkpoint_reports=reports),
            [],
            f"checkpoint step {event.step}: {reported}/{world} ranks reported",
        )
    # Every rank saved its shards; the step counts only once the adapter wrote its manifest ([3]).
    committing = replace(
        state,
        committing=state.committing | {event.step},
        checkpoint_reports=frozenset(r for r in reports if r[0] != event.step),
    )
    return decision(
        committing,
        [CommitCheckpoint(step=event.step)],
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
    return _not_committed(failed, event.step, "checkpoint_commit_failed", event.error, "commit")


def on_checkpoint_failed(
    state: SupervisorState, event: CheckpointFailed, now: float, config: SupervisorConfig
) -> Decision:
    """The ranks abandoned a save (a storage fault): say why, forget its reports, keep training; the
    schedule's next save tries again (a pending resize or eviction asks again at once, [7])."""
    abandoned = replace(state, checkpoint_reports=frozenset(r for r in state.checkpoint_reports if r[0] != event.step))
    return _not_committed(abandoned, event.step, "checkpoint_failed", f"{event.reason}; training continues", "save")


def _not_committed(state: SupervisorState, step: int, kind: str, why: str, what_failed: str) -> Decision:
    """A step that will not be a checkpoint (its commit or its save failed): the event, and a retry when a
    resize or an eviction waits for a checkpoint at or after it."""
    kept = "nothing" if state.last_committed_step is None else f"step {state.last_committed_step}"
    detail = f"step {step}: {why}; the last committed checkpoint stays {kept}"
    actions: list[Action] = [RecordEvent(kind=kind, detail=detail)]
    if (
        state.status is Status.RUNNING
        and state.group is GroupPhase.UP
        and state.pending
        and step >= (state.checkpoint_requested_step or 0)
    ):
        # The change waits for a checkpoint that did not happen: ask again, within the same deadline [7].
        what = "resize" if state.pending_resize_dp is not None else "eviction"
        retry = RequestCheckpoint(
            attempt=state.attempt, reason=f"retry before the {what}: {what_failed} of step {step} failed"
        )
        actions += [
            retry,
            RecordEvent(
                kind="checkpoint_requested", detail=f"again before the {what}: the {what_failed} of step {step} failed"
            ),
        ]
        return decision(state, actions, f"{detail}; checkpoint requested again for the pending {what}")
    return decision(state, actions, detail)


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
