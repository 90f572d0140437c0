"""The supervisor's handlers that change a running job's size: capacity reports, scale requests, stragglers.

All three end in the same planned stop ([4]): save a checkpoint, then resize at the best legal dp
(service/decisions/elastic.py), in place where it can ([11]), or relaunch without the slow node. Rows and notes: service/decisions/supervisor.py.
"""

from __future__ import annotations

from dataclasses import replace

from etrain.service.decisions.job_status import Status
from etrain.service.decisions.supervisor_events import (
    Action,
    CapacityChanged,
    RecordEvent,
    ResizeFailed,
    ScaleRequested,
    StragglerFlagged,
)
from etrain.service.decisions.supervisor_moves import (
    begin_pending,
    decision,
    ignore,
    maybe_resize,
    stop_group,
    try_launch,
)
from etrain.service.decisions.supervisor_state import Decision, GroupPhase, SupervisorConfig, SupervisorState


def on_capacity(
    state: SupervisorState,
    event: CapacityChanged,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    if event.available_dp < 0:
        return ignore(state, f"negative capacity {event.available_dp}")
    updated = replace(state, available_dp=event.available_dp, awaiting_capacity=False)
    reason = f"capacity {event.available_dp} replica(s)"
    if state.status is Status.EXPORTING:
        return decision(updated, [], f"{reason}; training is done, nothing to launch")
    if state.group is GroupPhase.UP:
        return maybe_resize(updated, now, config, [], reason)
    if state.group is GroupPhase.NONE and state.status is not Status.QUEUED:
        return try_launch(updated, now, config, [], reason)
    return decision(updated, [], f"{reason}; applies at the next launch")


def on_scale(
    state: SupervisorState,
    event: ScaleRequested,
    now: float,
    config: SupervisorConfig,
) -> Decision:
    policy = config.elastic
    if state.status is Status.EXPORTING:
        why = f"dp={event.dp} rejected: every step is trained; the job is exporting its final checkpoint"
        return decision(state, [RecordEvent(kind="scale_rejected", detail=why)], why)
    if not policy.is_legal(event.dp):
        why = (
            f"dp={event.dp} rejected: legal sizes for global_batch={config.global_batch}, "
            f"micro_batch={config.micro_batch} in [min_dp={config.policy.min_dp}, max_dp={config.policy.max_dp}] "
            f"are {policy.legal_sizes()}"
        )
        return decision(state, [RecordEvent(kind="scale_rejected", detail=why)], why)
    if state.available_dp is not None and event.dp > state.available_dp:
        why = f"dp={event.dp} rejected: the cluster can place only {state.available_dp} replica(s) now"
        return decision(state, [RecordEvent(kind="scale_rejected", detail=why)], why)
    updated = replace(state, target_dp=event.dp)
    actions: list[Action] = [RecordEvent(kind="scale_requested", detail=f"dp {state.dp} -> {event.dp}")]
    reason = f"scale to dp={event.dp} accepted"
    if state.group is GroupPhase.UP:
        return maybe_resize(updated, now, config, actions, reason)
    if state.group is GroupPhase.NONE and state.status is not Status.QUEUED:
        return try_launch(updated, now, config, actions, reason)
    return decision(updated, actions, f"{reason}; applies at the next launch")


def on_straggler(
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
        return decision(state, actions, "straggler reported (no eviction)")
    if state.status is not Status.RUNNING:
        return decision(state, actions, f"straggler not evicted: job is {state.status.value}")
    if state.pending:
        return decision(state, actions, "straggler not evicted: another change is waiting for a checkpoint")
    if state.step >= config.total_steps:
        return decision(state, actions, "straggler not evicted: every step is done, the job is finishing")
    if event.node in state.excluded_nodes:
        return decision(state, actions, f"node {event.node} is already excluded")
    pending = replace(state, pending_evict_node=event.node, pending_evict_rank=event.rank)
    return begin_pending(pending, now, actions, f"evict node {event.node} (rank {event.rank})", config)


def on_resize_failed(state: SupervisorState, event: ResizeFailed, now: float, config: SupervisorConfig) -> Decision:
    """[11] Fall back to relaunching every rank at the new size from the same committed step (no restart
    spent: a resize is not the job's fault); the `resized` event says why it was not in place."""
    if state.group is not GroupPhase.LAUNCHING:
        return ignore(state, f"ResizeFailed while group is {state.group.value}")
    what = f"in-place resize of attempt {state.attempt} failed: {event.reason}; relaunching every rank"
    stopped, stop_actions = stop_group(state, now, what)
    relaunching = replace(stopped, resize_note=f"relaunched: in place failed ({event.reason})")
    return decision(relaunching, [RecordEvent(kind="resize_failed", detail=what), *stop_actions], what)
