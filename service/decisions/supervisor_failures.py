"""The supervisor's handlers for lost ranks and nodes: repair in place, restart, or wait for capacity.

A lost process or actor is the job's fault (a restart from the budget, [9] repairs a single rank in
place; a hung rank named by the ranks' diagnosis is killed and repaired the same way, [10]); a lost node is not (no budget, wait for the capacity left); a late node verdict refunds the
restart it was first charged as ([8]). Rows and notes: the transition table of service/decisions/supervisor.py.
"""

from __future__ import annotations

from dataclasses import replace

from etrain.service.decisions.job_status import Status
from etrain.service.decisions.supervisor_events import (
    Action,
    ExcludeNode,
    HangDiagnosed,
    KillRank,
    NodeLossConfirmed,
    RankUnhealthy,
    RecordEvent,
    RepairFailed,
    RepairGroup,
    WorkerLost,
)
from etrain.service.decisions.supervisor_moves import (
    clear_pending,
    decision,
    fault,
    fit_dp,
    ignore,
    next_attempt_in_place,
    node_lost,
    stop_group,
    try_launch,
)
from etrain.service.decisions.supervisor_state import Decision, GroupPhase, SupervisorConfig, SupervisorState


def on_worker_lost(
    state: SupervisorState,
    event: WorkerLost,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    if state.group not in (GroupPhase.LAUNCHING, GroupPhase.UP):
        return ignore(state, f"WorkerLost while group is {state.group.value} (expected during teardown)")
    what = f"rank {event.rank} on node {event.node} lost ({event.cause})"
    if event.detail:
        what += f": {event.detail}"
    spends = event.cause != "node"
    if _can_repair(state, event.rank, config, spends=spends):
        return _repair(state, now, config, event.rank, what, node_loss=not spends)
    what += _relaunch_note(state, event.rank, config, spends=spends)
    if not spends:
        return node_lost(state, now, config, what)
    return fault(state, now, config, "worker_failed", what)


def on_hang_diagnosed(state: SupervisorState, event: HangDiagnosed, now: float, config: SupervisorConfig) -> Decision:
    """[10] The ranks said where they are: kill the one the others wait for and repair it in place (its
    loss comes back as WorkerLost), or, with no single culprit or no repair possible, relaunch every rank."""
    if state.group is not GroupPhase.UP or state.hang_asked_at is None:
        return ignore(state, "HangDiagnosed with no hang being diagnosed (progress resumed, or the group went)")
    idle = now - (state.last_progress_at if state.last_progress_at is not None else now)
    what = (
        f"no step progress for {idle:.0f}s (heartbeat_timeout_s={config.policy.heartbeat_timeout_s:g}), stuck at "
        f"step {state.step}: {event.detail}"
    )
    if event.rank is not None and _can_repair(state, event.rank, config):
        where = f" on node {event.node}" if event.node else ""
        actions: list[Action] = [
            RecordEvent(kind="hang_detected", detail=what),
            KillRank(attempt=state.attempt, rank=event.rank, reason=f"rank {event.rank}{where} hung"),
        ]
        # The kill gets its own diagnosis window: no WorkerLost by then, and the tick relaunches.
        return decision(replace(state, hang_asked_at=now), actions, f"{what}: killing rank {event.rank} to repair it")
    if event.rank is not None:
        what += _relaunch_note(state, event.rank, config)
    return fault(replace(state, hang_asked_at=None), now, config, "hang_detected", what)


#: What a lost rank's event adds where only the collective backend ruled its repair in place out.
NCCL_RELAUNCH_NOTE = (
    "; every rank relaunched, not repaired in place: NCCL does not fail the survivors' collectives with a "
    "dead peer, so they cannot leave the failed attempt (they would wait until the process group's timeout)"
)


def _can_repair(state: SupervisorState, rank: int, config: SupervisorConfig, *, spends: bool = True) -> bool:
    """[9] A repair in place is possible (:func:`_repairable`) and the survivors can leave the failed
    attempt: their collectives with the lost rank fail (gloo), rather than wait for it (NCCL:
    ``JobPolicy.collectives_fail_on_peer_loss``)."""
    return _repairable(state, rank, config, spends=spends) and config.policy.collectives_fail_on_peer_loss


def _relaunch_note(state: SupervisorState, rank: int, config: SupervisorConfig, *, spends: bool = True) -> str:
    """:data:`NCCL_RELAUNCH_NOTE` where the backend alone stopped a repair in place, else nothing."""
    only_the_backend = (
        _repairable(state, rank, config, spends=spends) and not config.policy.collectives_fail_on_peer_loss
    )
    return NCCL_RELAUNCH_NOTE if only_the_backend else ""


def _repairable(state: SupervisorState, rank: int, config: SupervisorConfig, *, spends: bool = True) -> bool:
    """One known rank of a running group that has other ranks to keep, a committed step to resume,
    nothing planned to stop for, and (``spends``: a process fault, not a node loss) a restart left. (A
    one-rank job has no survivor: a relaunch is the same work, and its checkpoint is verified by the
    supervisor first, which moves a refused step aside.)"""
    return (
        config.policy.in_place
        and state.group is GroupPhase.UP
        and config.world_size(state.dp) > 1
        and 0 <= rank < config.world_size(state.dp)
        and state.last_committed_step is not None
        and (not spends or state.restarts_used < config.policy.max_restarts)
        and state.pending_evict_node is None
        and state.pending_resize_dp is None
    )


def _repair(
    state: SupervisorState, now: float, config: SupervisorConfig, rank: int, what: str, *, node_loss: bool = False
) -> Decision:
    """Keep every other rank's process, replace ``rank``, resume the last commit, or a later step the ranks
    still hold in memory (they agree on it when they restore: ``workers/protocol/memory_resume.py``). A
    process fault spends a restart; a node loss does not (the ranks lost with the node are placed on the
    nodes left, where Ray re-reserves their bundles, and a repair that cannot place them waits for capacity)."""
    step = state.last_committed_step
    if node_loss:
        repaired = next_attempt_in_place(state, now, status=Status.RECOVERING, node_loss_repair=True)
        detail = (
            f"in place after a node loss (not the job's fault: restarts used {repaired.restarts_used}/"
            f"{config.policy.max_restarts}): rank {rank} and any rank lost with it replaced on the nodes left, "
            f"the other ranks kept, resuming step {step} or a later step the ranks hold in memory"
        )
        first = RecordEvent(kind="node_lost", detail=what)
    else:
        repaired = next_attempt_in_place(state, now, status=Status.RECOVERING, restarts_used=state.restarts_used + 1)
        detail = (
            f"restart {repaired.restarts_used}/{config.policy.max_restarts} in place: rank {rank} replaced, the "
            f"other ranks kept, resuming step {step} or a later step the ranks hold in memory"
        )
        first = RecordEvent(kind="worker_failed", detail=what)
    actions: list[Action] = [
        first,
        RecordEvent(kind="restarting", detail=detail),
        RepairGroup(attempt=repaired.attempt, lost_rank=rank, world_size=config.world_size(state.dp), resume_step=step),
    ]
    return decision(repaired, actions, f"{what}: {detail}")


def on_repair_failed(state: SupervisorState, event: RepairFailed, now: float, config: SupervisorConfig) -> Decision:
    """[9] Fall back to a full relaunch from the same committed step; the restart was already spent. After
    a node loss, the relaunch waits for a capacity report and fits the job to what is left."""
    if state.group is not GroupPhase.LAUNCHING:
        return ignore(state, f"RepairFailed while group is {state.group.value}")
    if state.node_loss_repair:
        what = f"in-place repair of attempt {state.attempt} after a node loss failed: {event.reason}"
        return node_lost(state, now, config, what, kind="repair_failed")
    what = f"in-place repair of attempt {state.attempt} failed: {event.reason}; relaunching every rank"
    stopped, stop_actions = stop_group(state, now, what)
    return decision(stopped, [RecordEvent(kind="repair_failed", detail=what), *stop_actions], what)


def on_node_loss_confirmed(
    state: SupervisorState,
    event: NodeLossConfirmed,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    """A process fault turned out to be a node loss [8]: refund its restart, re-fit to the capacity left."""
    refunded = replace(state, restarts_used=max(0, state.restarts_used - 1), available_dp=event.available_dp)
    detail = (
        f"node {event.node} of the rank lost in attempt {event.failed_attempt} was declared dead: a node "
        f"loss, not the job's fault; restarts used {refunded.restarts_used}/{config.policy.max_restarts}"
    )
    actions: list[Action] = [RecordEvent(kind="restart_refunded", detail=detail)]
    fit = fit_dp(refunded, config)
    if state.group is GroupPhase.LAUNCHING and fit != state.dp:
        # The relaunch asked for a size the cluster no longer holds: stop it and re-fit.
        lost = node_lost(
            refunded,
            now,
            config,
            f"attempt {state.attempt} cannot be placed at dp={state.dp} without node {event.node}",
        )
        return decision(lost.state, [*actions, *lost.actions], f"{detail}; {lost.reason}")
    if state.group is GroupPhase.NONE and state.status in (Status.RECOVERING, Status.RESIZING):
        return try_launch(replace(refunded, backoff_until=None), now, config, actions, detail)  # no backoff for a node
    return decision(refunded, actions, detail)


def on_rank_unhealthy(state: SupervisorState, event: RankUnhealthy, now: float, config: SupervisorConfig) -> Decision:
    """[12] A rank failed its health check: exclude its node from the job and relaunch without it, as a
    straggler's eviction does (not the job's fault: no restart spent). A node that is not known is an
    ordinary fault. Excluded nodes only accumulate, so a cluster of failing nodes ends in the capacity wait's
    timeout, never in a loop."""
    if state.group not in (GroupPhase.LAUNCHING, GroupPhase.UP):
        return ignore(state, f"RankUnhealthy while group is {state.group.value}")
    what = f"rank {event.rank} on node {event.node or 'unknown'} failed its health check: {event.reason}"
    if not event.node or event.node in state.excluded_nodes:
        return fault(state, now, config, "health_check_failed", what)
    stopped, stop_actions = stop_group(state, now, what)
    excluding = replace(
        clear_pending(stopped),
        status=Status.RECOVERING,
        resize_note=None,
        excluded_nodes=state.excluded_nodes | {event.node},
        awaiting_capacity=True,
        backoff_until=None,
    )
    actions: list[Action] = [
        RecordEvent(kind="health_check_failed", detail=f"{what}; node {event.node} excluded from this job"),
        ExcludeNode(node=event.node, reason=f"rank {event.rank} failed its health check"),
        *stop_actions,
    ]
    return decision(excluding, actions, f"{what}: excluding node {event.node}, relaunching without it")
