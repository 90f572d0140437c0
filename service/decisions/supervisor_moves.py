"""The moves the supervisor's event handlers share: stop, fail, restart, launch, wait, resize.

Each handler module (service/decisions/supervisor_lifecycle.py, ..._checkpoints, ..._failures, ..._resize,
..._export) decides *whether* something happens for its family of events; what a restart, a planned stop
or a launch then does to the state is written once, here, so every path that restarts a job spends its
budget, backs off and resumes the same way. The rules these follow are the notes of the transition table
in service/decisions/supervisor.py ("fault", [4], [5], [7]).
"""

from __future__ import annotations

from dataclasses import replace

from etrain.service.decisions.job_status import Status
from etrain.service.decisions.supervisor_events import (
    Action,
    ExcludeNode,
    LaunchGroup,
    MarkTerminal,
    RecordEvent,
    RequestCheckpoint,
    ResizeGroup,
    ScheduleWake,
    StopGroup,
)
from etrain.service.decisions.supervisor_state import (
    Decision,
    GroupPhase,
    SupervisorConfig,
    SupervisorState,
    backoff_delay,
)


def ignore(state: SupervisorState, reason: str) -> Decision:
    """The event changes nothing: late, stale, or not legal in this state (the reason says which)."""
    return Decision(state=state, actions=(), reason=f"ignored: {reason}", ignored=True)


def decision(state: SupervisorState, actions: list[Action] | tuple[Action, ...], reason: str) -> Decision:
    """The new state, the actions to carry out in order, and why."""
    return Decision(state=state, actions=tuple(actions), reason=reason)


def fit_dp(state: SupervisorState, config: SupervisorConfig) -> int | None:
    """Largest legal dp under every ceiling we know of (capacity, user target, max_dp)."""
    if state.target_dp is None and state.available_dp is None:
        ceiling = state.dp  # nothing says more (or less) fits: keep the size we have
    else:
        ceiling = min(x for x in (state.target_dp, state.available_dp) if x is not None)
    return config.elastic.choose(ceiling, state.dp)


def stop_group(state: SupervisorState, now: float, reason: str) -> tuple[SupervisorState, list[Action]]:
    """Stop the group if one exists or is starting; NONE/STOPPING need nothing new."""
    if state.group in (GroupPhase.LAUNCHING, GroupPhase.UP):
        stopped = replace(state, group=GroupPhase.STOPPING, group_since=now, node_loss_repair=False)
        return stopped, [StopGroup(attempt=state.attempt, reason=reason)]
    return state, []


def clear_pending(state: SupervisorState) -> SupervisorState:
    return replace(
        state,
        pending_resize_dp=None,
        pending_evict_node=None,
        pending_evict_rank=None,
        checkpoint_requested_at=None,
        checkpoint_requested_step=None,
    )


def terminal(
    state: SupervisorState,
    now: float,
    status: Status,
    error: str | None,
    actions: list[Action],
    *,
    detail: str | None = None,
) -> Decision:
    stopped, stop_actions = stop_group(state, now, f"job {status.value.lower()}")
    final = replace(clear_pending(stopped), status=status, error=error)
    record = RecordEvent(kind=status.value.lower(), detail=detail or error or status.value.lower())
    return decision(
        final,
        [*actions, *stop_actions, record, MarkTerminal(status=status, error=error)],
        f"{state.status.value} -> {status.value}: {detail or error or status.value.lower()}",
    )


def fault(state: SupervisorState, now: float, config: SupervisorConfig, kind: str, what: str) -> Decision:
    """A group failure the job may survive: restart after backoff, spending one restart."""
    actions: list[Action] = [RecordEvent(kind=kind, detail=what)]
    if state.restarts_used >= config.policy.max_restarts:
        error = f"{what}; restarted {state.restarts_used} times, max_restarts={config.policy.max_restarts}"
        return terminal(state, now, Status.FAILED, error, actions)
    delay = backoff_delay(state.restarts_used, config)
    stopped, stop_actions = stop_group(state, now, what)
    recovering = replace(
        carry_evict(stopped),
        status=Status.RECOVERING,
        resize_note=None,
        restarts_used=state.restarts_used + 1,
        backoff_until=now + delay if delay > 0 else None,
    )
    resume = "scratch" if state.last_committed_step is None else f"step {state.last_committed_step}"
    when = f"in {delay:g}s" if delay > 0 else "at once"
    restart = f"restart {state.restarts_used + 1}/{config.policy.max_restarts}"
    actions += stop_actions
    actions += evict_actions(state)
    actions.append(RecordEvent(kind="restarting", detail=f"{restart} from {resume} {when}"))
    if delay > 0:
        actions.append(ScheduleWake(at=now + delay))
    reason = f"{what}: {restart} after {delay:g}s backoff" if delay > 0 else f"{what}: {restart} at once"
    if recovering.group is GroupPhase.NONE:
        return try_launch(recovering, now, config, actions, reason)
    return decision(recovering, actions, reason)


def node_lost(
    state: SupervisorState, now: float, config: SupervisorConfig, what: str, *, kind: str = "node_lost"
) -> Decision:
    """Capacity went away (not the job's fault): stop, wait for the new capacity, no budget spent. ``kind``:
    the event that says so (``repair_failed`` where an in-place repair after the node loss could not place
    its ranks, the ``node_lost`` event having come with that repair)."""
    stopped, stop_actions = stop_group(state, now, what)
    recovering = replace(
        carry_evict(stopped), status=Status.RECOVERING, resize_note=None, awaiting_capacity=True, backoff_until=None
    )
    actions: list[Action] = [
        RecordEvent(kind=kind, detail=what),
        *stop_actions,
        *evict_actions(state),
    ]
    return decision(recovering, actions, f"{what}: stopping the group, waiting for a capacity report")


def carry_evict(state: SupervisorState) -> SupervisorState:
    """A restart for another reason still honours a pending eviction (the node stays slow)."""
    node = state.pending_evict_node
    cleared = clear_pending(state)
    if node is None:
        return cleared
    return replace(cleared, excluded_nodes=state.excluded_nodes | {node}, awaiting_capacity=True)


def evict_actions(state: SupervisorState) -> list[Action]:
    if state.pending_evict_node is None:
        return []
    node, rank = state.pending_evict_node, state.pending_evict_rank
    return [ExcludeNode(node=node, reason=f"straggler rank {rank}")]


def maybe_resize(
    state: SupervisorState,
    now: float,
    config: SupervisorConfig,
    actions: list[Action],
    reason: str,
) -> Decision:
    """RUNNING: start a resize when the best legal dp differs from the one we run at."""
    if state.pending_evict_node is not None:
        return decision(state, actions, f"{reason}; eviction pending, size re-checked at relaunch")
    fit = fit_dp(state, config)
    if fit is None:
        detail = (
            f"capacity {state.available_dp} replica(s) is below min_dp={config.policy.min_dp}; "
            f"keeping dp={state.dp} while the group runs"
        )
        low = RecordEvent(kind="capacity_low", detail=detail)
        return decision(clear_pending(state), [*actions, low], f"{reason}; {detail}")
    if fit == state.dp:
        if state.pending_resize_dp is not None:
            why = f"{reason}; dp={fit} already fits, resize dropped"
            return decision(clear_pending(state), actions, why)
        return decision(state, actions, f"{reason}; dp={state.dp} still fits")
    if state.pending_resize_dp is not None:
        why = f"{reason}; pending resize now to dp={fit}"
        return decision(replace(state, pending_resize_dp=fit), actions, why)
    what = f"resize dp {state.dp} -> {fit}"
    return begin_pending(replace(state, pending_resize_dp=fit), now, actions, what, config)


def begin_pending(
    state: SupervisorState,
    now: float,
    actions: list[Action],
    what: str,
    config: SupervisorConfig,
) -> Decision:
    """Save progress before a planned stop; stop at once when nothing new would be saved."""
    if state.step <= (state.last_committed_step or 0):
        why = f"{what}: nothing new since the last checkpoint"
        return carry_out_pending(state, now, config, actions, why)
    asked = replace(state, checkpoint_requested_at=now, checkpoint_requested_step=state.step)
    return decision(
        asked,
        [
            *actions,
            RequestCheckpoint(attempt=state.attempt, reason=what),
            RecordEvent(kind="checkpoint_requested", detail=f"before {what}, at step {state.step}"),
        ],
        f"{what}: checkpoint requested at step {state.step}",
    )


def carry_out_pending(
    state: SupervisorState,
    now: float,
    config: SupervisorConfig,
    actions: list[Action],
    reason: str,
) -> Decision:
    if state.pending_evict_node is not None:
        node, rank = state.pending_evict_node, state.pending_evict_rank
        what = f"evict straggler rank {rank} on node {node}"
        stopped, stop_actions = stop_group(state, now, what)
        evicting = replace(carry_evict(stopped), status=Status.RECOVERING)
        return decision(
            evicting,
            [
                *actions,
                RecordEvent(kind="straggler_evicted", detail=what),
                *evict_actions(state),
                *stop_actions,
            ],
            f"{reason}; {what}, relaunching without it",
        )
    target = state.pending_resize_dp
    what = f"resize dp {state.dp} -> {target}"
    if config.policy.in_place and state.group is GroupPhase.UP and state.last_committed_step is not None:
        return resize_in_place(state, now, config, actions, reason, target)
    stopped, stop_actions = stop_group(state, now, what)
    note = "relaunched: fault_tolerance.in_place is off" if not config.policy.in_place else "relaunched"
    return decision(
        replace(clear_pending(stopped), status=Status.RESIZING, resize_note=note),
        [*actions, RecordEvent(kind="resizing", detail=what), *stop_actions],
        f"{reason}; {what}",
    )


def next_attempt_in_place(state: SupervisorState, now: float, *, status: Status, **changes) -> SupervisorState:
    """The next attempt on the processes the group keeps ([9] a repair, [11] a resize): launching from the
    last committed step, the old attempt's progress, hang and checkpoint bookkeeping forgotten."""
    return replace(
        clear_pending(state),
        status=status,
        attempt=state.attempt + 1,
        group=GroupPhase.LAUNCHING,
        group_since=now,
        launched_in_place=True,
        step=state.last_committed_step,
        last_progress_at=None,
        hang_asked_at=None,
        backoff_until=None,
        checkpoint_reports=frozenset(),
        committing=frozenset(),  # a late answer about the old attempt's commit is ignored [3]
        **{"node_loss_repair": False, **changes},
    )


def resize_in_place(
    state: SupervisorState,
    now: float,
    config: SupervisorConfig,
    actions: list[Action],
    reason: str,
    target: int,
) -> Decision:
    """[11] Resize the running group without a relaunch: the next attempt on the kept ranks' processes,
    from the step just committed. Not the job's fault: no restart spent, no backoff."""
    step = state.last_committed_step
    resized = next_attempt_in_place(state, now, status=Status.RESIZING, dp=target, resize_note="in place")
    what = f"resize dp {state.dp} -> {target} in place, resuming step {step}"
    resize = ResizeGroup(
        attempt=resized.attempt,
        dp=target,
        from_dp=state.dp,
        world_size=config.world_size(target),
        resume_step=step,
    )
    return decision(resized, [*actions, RecordEvent(kind="resizing", detail=what), resize], f"{reason}; {what}")


def pending_checkpoint_timed_out(state: SupervisorState, now: float, config: SupervisorConfig) -> Decision:
    waited = (
        f"no checkpoint committed {now - state.checkpoint_requested_at:.0f}s after the request "
        f"(checkpoint_timeout_s={config.policy.checkpoint_timeout_s:g})"
    )
    if state.pending_evict_node is not None:
        # A straggler slows every step from now on: losing the steps since the last commit is cheaper.
        timeout = RecordEvent(kind="checkpoint_timeout", detail=waited)
        return carry_out_pending(state, now, config, [timeout], waited)
    what = f"resize dp {state.dp} -> {state.pending_resize_dp} abandoned: {waited}"
    return decision(clear_pending(state), [RecordEvent(kind="resize_abandoned", detail=what)], what)


def try_launch(
    state: SupervisorState,
    now: float,
    config: SupervisorConfig,
    actions: list[Action],
    reason: str,
) -> Decision:
    """Group gone: launch the next attempt if nothing blocks it, otherwise say what we wait for."""
    if state.backoff_until is not None and now < state.backoff_until:
        return decision(state, actions, f"{reason}; backing off until t={state.backoff_until:g}")
    fit = None if state.awaiting_capacity else fit_dp(state, config)
    if fit is None:
        return wait_for_capacity(state, now, config, actions, reason)
    status = state.status
    if state.attempt > 0:
        # A failed in-place resize relaunches at the size it already took (ResizeFailed keeps its note).
        resizing = fit != state.dp or (state.status is Status.RESIZING and state.resize_note is not None)
        status = Status.RESIZING if resizing else Status.RECOVERING
    launched = replace(
        clear_pending(state),
        status=status,
        dp=fit,
        attempt=state.attempt + 1,
        group=GroupPhase.LAUNCHING,
        group_since=now,
        launched_in_place=False,
        step=state.last_committed_step or 0,
        last_progress_at=None,
        hang_asked_at=None,
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
    return decision(launched, [*actions, launch], why)


def wait_for_capacity(
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
            f"capacity for min_dp={config.policy.min_dp} legal replica(s) (the cluster can place {state.available_dp})"
        )
    since = state.capacity_wait_since if state.capacity_wait_since is not None else now
    if now - since > config.policy.capacity_wait_timeout_s:
        return terminal(
            state,
            now,
            Status.FAILED,
            f"gave up after {now - since:.0f}s waiting for {waiting_for} "
            f"(capacity_wait_timeout_s={config.policy.capacity_wait_timeout_s:g})",
            actions,
        )
    waiting = replace(state, capacity_wait_since=since, waiting_for=waiting_for)
    if waiting_for != state.waiting_for:
        detail = f"waiting for {waiting_for}; failing after {config.policy.capacity_wait_timeout_s:g}s"
        actions = [*actions, RecordEvent(kind="waiting_for_capacity", detail=detail)]
    return decision(waiting, actions, f"{reason}; waiting for {waiting_for} ({now - since:.0f}s so far)")
