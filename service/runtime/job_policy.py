"""The values a job's supervisor runs by besides its run config: restarts, timeouts, elasticity, stragglers.

Plain frozen values built from the validated spec by the manager (service/jobs/policy.py ``policy_for``),
handed to the supervisor actor when it starts (service/runtime/supervisor_actor.py), and carried over when
a supervisor is recreated after a control-plane loss. A module of its own so that the side that builds it
never imports the actor (nor Ray) for it; :func:`supervisor_config` reads it into the state machine's config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from etrain.service.decisions.stragglers import StragglerConfig
from etrain.service.decisions.supervisor_state import SupervisorConfig
from etrain.workers.protocol.run_config import RunConfig

__all__ = ["JobPolicy", "supervisor_config"]


@dataclass(frozen=True, kw_only=True)
class JobPolicy:
    """The parts of a job spec the supervisor needs besides the run config (plain values)."""

    min_dp: int
    max_dp: int
    max_restarts: int
    heartbeat_timeout_s: float
    backoff_base_s: float
    backoff_max_s: float
    elastic_check_interval_s: float
    stragglers: StragglerConfig
    straggler_action: str  # report | evict
    resources_per_rank: dict[str, float]
    placement_strategy: str = "PACK"
    in_place: bool = True  # fault_tolerance.in_place: repair a single lost rank in place
    #: The server setting ``enable_chaos``: only then are fault drills loaded (service/runtime/chaos_drills.py,
    #: and on the ranks workers/rank/chaos.py through ``LaunchPlan.chaos_enabled``) and ``chaos`` requests taken.
    chaos_enabled: bool = False
    #: Chaos requests (``service.ports.ChaosRequest`` dicts) posted before this job's supervisor existed: the
    #: manager kept them (service/runtime/control.py ``ChaosHandOver``) and the supervisor arms them before its
    #: first launch, so they ride in that launch plan. Only with ``chaos_enabled``.
    chaos_requests: tuple[dict[str, Any], ...] = ()
    restarts_used: int = 0  # carried over when a supervisor is recreated after a control-plane loss
    #: The job's last attempt number when this supervisor was created (0 for its first): a supervisor
    #: recreated after a loss reports attempts base+1, base+2, ... so the job's attempts only grow and its
    #: step rows replace the rows of the steps it recomputes (service/store/job_store.py keeps the higher attempt).
    attempt_base: int = 0
    start_timeout_s: float = 300.0
    checkpoint_timeout_s: float = 120.0
    capacity_wait_timeout_s: float = 900.0
    export: bool = False  # checkpoint.export == "hf": write <checkpoint root>/hf-export before SUCCEEDED
    export_timeout_s: float = 3600.0
    #: The service's checkpoint signing key (service/access/checkpoint_key.py): manifests are signed with it at
    #: commit and verified with it before any rank loads one. Only the manager sets it; never printed.
    checkpoint_key: bytes | None = field(default=None, repr=False)
    #: Besides the job itself, the jobs whose signed steps it may resume from: those of its tenant that
    #: recorded the same checkpoint directory (service/access/checkpoint_dirs.py ``may_resume``). Empty: its own.
    resume_owners: frozenset[str] = frozenset()


def supervisor_config(policy: JobPolicy, config: RunConfig, *, job_id: str) -> SupervisorConfig:
    """The state machine's config for a job: the sizes of its run config, the limits of its policy."""
    return SupervisorConfig(
        total_steps=config.training.steps,
        global_batch=config.training.global_batch,
        micro_batch=config.training.micro_batch,
        min_dp=policy.min_dp,
        max_dp=policy.max_dp,
        tp=config.parallel.tp,
        pp=config.parallel.pp,
        dp_multiple=config.parallel.dp_replicate,
        max_restarts=policy.max_restarts,
        heartbeat_timeout_s=policy.heartbeat_timeout_s,
        start_timeout_s=max(policy.start_timeout_s, policy.heartbeat_timeout_s),
        checkpoint_timeout_s=policy.checkpoint_timeout_s,
        capacity_wait_timeout_s=policy.capacity_wait_timeout_s,
        backoff_base_s=policy.backoff_base_s,
        backoff_max_s=policy.backoff_max_s,
        in_place=policy.in_place,
        export=policy.export,
        export_timeout_s=policy.export_timeout_s,
        job_id=job_id,
    )
