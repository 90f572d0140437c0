"""What the supervisor's state machine holds and answers with: its config, its state, its decision.

Plain frozen values, so a test builds any state in one line and the Ray adapter
(service/runtime/supervisor_actor.py) keeps the current one as a single field. The rules that move
between them are :func:`etrain.service.decisions.supervisor.decide` and its handlers; the config's own
range checks live here because spec validation (service/planning/spec_checks.py) builds this config at submit to
run them on a spec before any job exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from etrain.service.decisions.elastic import ElasticPolicy, ResizeError
from etrain.service.decisions.job_policy import JobPolicy
from etrain.service.decisions.job_status import Status
from etrain.service.decisions.supervisor_events import Action
from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.errors import EtrainError

if TYPE_CHECKING:
    from etrain.workers.protocol.run_config import RunConfig

__all__ = [
    "Decision",
    "GroupPhase",
    "SupervisorConfig",
    "SupervisorConfigError",
    "SupervisorState",
    "backoff_delay",
    "initial_state",
]


class SupervisorConfigError(EtrainError, ValueError):
    """A supervisor setting out of range; the message names the setting, the value and the fix."""


class GroupPhase(str, Enum):
    """What the adapter's worker group is doing, as far as the supervisor knows."""

    NONE = "none"  # no group: not launched yet, or GroupStopped confirmed
    LAUNCHING = "launching"  # LaunchGroup sent, GroupReady not yet seen
    UP = "up"  # GroupReady seen; training
    STOPPING = "stopping"  # StopGroup sent, GroupStopped not yet seen


@dataclass(frozen=True, kw_only=True)
class SupervisorConfig:
    """The job's sizes (from its run config) and its policy, held whole (service/decisions/job_policy.py):
    restarts, timeouts, backoff, the elastic range and export are read as ``config.policy.<name>``."""

    total_steps: int
    global_batch: int
    micro_batch: int
    policy: JobPolicy
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: fixed for the job's life, like tp and pp
    dp_multiple: int = 1  # HSDP: every dp the job runs at stays a multiple of dp_replicate
    stop_timeout_s: float = 120.0  # StopGroup -> GroupStopped
    fail_on_nonfinite_loss: bool = True
    job_id: str = "JOB_ID"  # only for messages (the `etrain export` retry command)

    @classmethod
    def of(cls, policy: JobPolicy, config: RunConfig, *, job_id: str) -> SupervisorConfig:
        """The state machine's config for a job: the sizes of its run config, the limits of its policy."""
        return cls(
            total_steps=config.training.steps,
            global_batch=config.training.global_batch,
            micro_batch=config.training.micro_batch,
            policy=policy,
            tp=config.parallel.tp,
            pp=config.parallel.pp,
            cp=config.parallel.cp,
            dp_multiple=config.parallel.dp_multiple,  # HSDP groups and expert parallelism
            job_id=job_id,
        )

    @property
    def start_timeout_s(self) -> float:
        """LaunchGroup -> GroupReady: the policy's, never shorter than its heartbeat timeout."""
        return max(self.policy.start_timeout_s, self.policy.heartbeat_timeout_s)

    def __post_init__(self) -> None:
        # ``field`` names the setting (the policy's or this config's name) so that spec validation, which
        # builds this config at submit to run these same rules, can name the spec field
        # (service/planning/spec_checks.py).
        def need(ok: bool, message: str, field: str) -> None:
            if not ok:
                raise SupervisorConfigError(message, field=field)

        policy = self.policy
        need(self.total_steps >= 1, f"total_steps={self.total_steps} must be >= 1", "total_steps")
        need(self.tp >= 1 and self.pp >= 1, f"tp={self.tp} and pp={self.pp} must be >= 1", "tp")
        need(policy.max_restarts >= 0, f"max_restarts={policy.max_restarts} must be >= 0", "max_restarts")
        for owner, name in (
            (policy, "heartbeat_timeout_s"),
            (self, "start_timeout_s"),
            (self, "stop_timeout_s"),
            (policy, "checkpoint_timeout_s"),
            (policy, "capacity_wait_timeout_s"),
            (policy, "export_timeout_s"),
        ):
            value = getattr(owner, name)
            need(value > 0, f"{name}={value} must be > 0 seconds (every wait has a timeout)", name)
        need(policy.backoff_base_s >= 0, f"backoff_base_s={policy.backoff_base_s} must be >= 0", "backoff_base_s")
        need(
            policy.backoff_max_s >= policy.backoff_base_s,
            f"backoff_max_s={policy.backoff_max_s} must be >= backoff_base_s={policy.backoff_base_s}",
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
            min_dp=self.policy.min_dp,
            max_dp=self.policy.max_dp,
            dp_multiple=self.dp_multiple,
        )

    def world_size(self, dp: int) -> int:
        return layout_rules.world_size(pp=self.pp, dp=dp, tp=self.tp, cp=self.cp)


@dataclass(frozen=True, kw_only=True)
class SupervisorState:
    status: Status
    dp: int  # dp of the current (or last) group
    attempt: int = 0  # bumped by every LaunchGroup; events from other attempts are stale
    group: GroupPhase = GroupPhase.NONE
    group_since: float | None = None  # when `group` last changed (start/stop timeouts)
    # The attempt now launching keeps the survivors' processes ([9] a repair, [11] a resize): its launch
    # first waits for them to leave the old attempt, which its start timeout allows for (in_place_waits).
    launched_in_place: bool = False
    restarts_used: int = 0
    last_committed_step: int | None = None
    step: int = 0  # highest step seen from the current attempt
    last_progress_at: float | None = None
    hang_asked_at: float | None = None  # a hang's DiagnoseHang (then its KillRank) went out then
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
    # The in-place repair now launching replaces ranks lost with their node ([9]): if it fails, the job
    # waits for the capacity left, as for any node loss, rather than relaunching at a size that may be gone.
    node_loss_repair: bool = False
    # A change waiting for a checkpoint while RUNNING (one at a time).
    pending_resize_dp: int | None = None
    pending_evict_node: str | None = None
    pending_evict_rank: int | None = None
    checkpoint_requested_at: float | None = None
    checkpoint_requested_step: int | None = None
    # How the resize now launching is carried out, for its `resized` event: "in place", or "relaunched: why".
    resize_note: str | None = None
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
    target_dp: int | None = None,
) -> SupervisorState:
    """A QUEUED job that will launch at ``dp`` (the planner's choice; capacity may change it). ``target_dp``:
    the most it grows to by itself until a ``scale`` says otherwise (the tenant's worker-quota grant)."""
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
        target_dp=target_dp,
    )


def backoff_delay(restarts_used: int, config: SupervisorConfig) -> float:
    """Seconds before the next restart: none before the first, then ``backoff_base_s * 2**(n - 1)``
    before the restart that follows ``n`` used ones, capped at ``backoff_max_s``.

    Why the first restart waits for nothing: a lost process, a hang or a preempted worker is usually a
    one-off, and every second of waiting is a second of the whole job idle (torchelastic and Ray Train
    restart at once too). A job that fails again right after its restart is what backoff is for: the
    old group's resources are slow to go, or something on the cluster keeps failing it.
    """
    if restarts_used <= 0:
        return 0.0
    policy = config.policy
    return min(policy.backoff_max_s, policy.backoff_base_s * 2.0 ** min(restarts_used - 1, 64))


@dataclass(frozen=True, kw_only=True)
class Decision:
    state: SupervisorState
    actions: tuple[Action, ...] = ()
    reason: str = ""
    ignored: bool = False  # the event changed nothing (late, stale or not legal in this state)
