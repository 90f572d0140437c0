"""The job policy: what a job's spec says about how it runs besides its run config, in one place.

:class:`JobPolicy` holds the values (restarts, timeouts, elasticity, stragglers, placement, export) and
:func:`policy_for` builds it from a validated spec; :data:`FROM_SPEC` names the spec field behind each
value (spec checks name it in their problems). The manager builds the policy whenever it starts a
supervisor (service/manager.py), adding what only it knows (the :data:`NOT_FROM_SPEC` values), and hands
it to the supervisor actor (service/runtime/supervisor_actor.py), whose state machine holds it whole in
its config (``SupervisorConfig.policy``, service/decisions/supervisor_state.py). A supervisor recreated
after a control-plane loss gets a policy built afresh from the stored spec and the job's record.
:func:`gang_for` is the other thing a spec means to the runtime: what the queue must get at once.

Adding a knob: its spec field (service/planning/spec.py), its policy field here (with its
:data:`FROM_SPEC` entry and its line in :func:`policy_for`), and the one place that reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from etrain.service.decisions import admission
from etrain.service.decisions.elastic import ElasticPolicy
from etrain.service.decisions.stragglers import StragglerConfig
from etrain.service.planning.plan_memory import GiB
from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.run_config import ExportDtype

if TYPE_CHECKING:
    from etrain.service.planning.spec import JobSpec

__all__ = ["FROM_SPEC", "NOT_FROM_SPEC", "JobPolicy", "collectives_fail_on_peer_loss", "gang_for", "policy_for"]


@dataclass(frozen=True, kw_only=True)
class JobPolicy:
    """The parts of a job spec the supervisor runs by besides the run config (plain values).

    The values without a default come from the spec (:data:`FROM_SPEC`); the others are the service's
    limits or what the manager sets at each start (:data:`NOT_FROM_SPEC`)."""

    min_dp: int  # the elastic floor (resources.min_dp, else parallelism.dp)
    max_dp: int  # the elastic ceiling (resources.max_dp, else parallelism.dp)
    max_restarts: int  # faults survived before FAILED (node loss/resize/evict are free)
    heartbeat_timeout_s: float  # RUNNING with no step progress this long = hang
    backoff_base_s: float  # the first restart's delay; doubles per restart used ...
    backoff_max_s: float  # ... up to this
    in_place: bool  # repair a single lost rank, and resize, in place instead of relaunching every rank
    #: Whether a survivor's pending collective fails when a peer's process dies, which a repair in place
    #: needs (the survivors must leave the failed attempt to rejoin the new one): true for gloo (CPU), whose
    #: waits fail as the dead peer's sockets close; false for NCCL (``resources.device: cuda``), whose
    #: kernels keep waiting for the dead peer (pytorch/elastic#134): a survivor's host thread blocks behind
    #: them until the process group's timeout, when NCCL's watchdog ends its process. Without it a rank's
    #: loss relaunches every rank (a resize, which stops at a step boundary, still runs in place).
    collectives_fail_on_peer_loss: bool
    elastic_check_interval_s: float  # how often the supervisor re-checks capacity
    stragglers: StragglerConfig
    straggler_action: str  # report | evict
    resources_per_rank: dict[str, float]
    placement_strategy: str  # PACK | SPREAD
    export: bool  # checkpoint.export == "hf": write <checkpoint root>/hf-export before SUCCEEDED
    export_dtype: ExportDtype  # checkpoint.export_dtype: the exported weights' dtype
    start_timeout_s: float = 300.0  # LaunchGroup -> GroupReady (never shorter than heartbeat_timeout_s)
    checkpoint_timeout_s: float = 120.0  # RequestCheckpoint -> committed
    capacity_wait_timeout_s: float = 900.0  # waiting for min_dp replicas / a capacity report
    export_timeout_s: float = 3600.0  # ExportCheckpoint -> Exported
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
    #: The service's checkpoint signing key (service/access/checkpoint_key.py): manifests are signed with it at
    #: commit and verified with it before any rank loads one. Only the manager sets it; never printed.
    checkpoint_key: bytes | None = field(default=None, repr=False)
    #: Besides the job itself, the jobs whose signed steps it may resume from: those of its tenant that
    #: recorded the same checkpoint directory (service/access/checkpoint_dirs.py ``may_resume``). Empty: its own.
    resume_owners: frozenset[str] = frozenset()
    #: The most data-parallel replicas the job grows to by itself (its initial ``scale`` target): the dp of
    #: the ranks its tenant's worker quota granted it; None: no quota, as far as capacity and max_dp allow.
    grow_limit_dp: int | None = None
    #: The job's tenant: the rank processes of a finished job serve that tenant's later jobs only
    #: (service/decisions/returned_ranks.py). Empty: none is reused.
    tenant: str = ""


#: Each policy value :func:`policy_for` takes from the spec -> the spec fields it reads (the first is the one
#: a problem with the value names: service/planning/spec_checks.py). Where a field is unset its default may
#: come from another (min_dp and max_dp: parallelism.dp; checkpoint.export: model.hf).
FROM_SPEC: dict[str, tuple[str, ...]] = {
    "min_dp": ("resources.min_dp",),
    "max_dp": ("resources.max_dp",),
    "max_restarts": ("fault_tolerance.max_restarts",),
    "heartbeat_timeout_s": ("fault_tolerance.heartbeat_timeout_s",),
    "backoff_base_s": ("fault_tolerance.backoff_base_s",),
    "backoff_max_s": ("fault_tolerance.backoff_max_s",),
    "in_place": ("fault_tolerance.in_place",),
    "collectives_fail_on_peer_loss": ("resources.device",),
    "elastic_check_interval_s": ("elastic.check_interval_s",),
    "stragglers": (
        "stragglers.enabled",
        "stragglers.window",
        "stragglers.threshold",
        "stragglers.patience",
        "stragglers.sustained_windows",
    ),
    "straggler_action": ("stragglers.action",),
    "resources_per_rank": ("resources.cpus_per_worker", "resources.gpus_per_worker", "resources.host_memory_gb"),
    "placement_strategy": ("resources.placement_strategy",),
    "export": ("checkpoint.export",),
    "export_dtype": ("checkpoint.export_dtype",),
}

#: The policy values the spec does not set (each has its default in :class:`JobPolicy`) -> who sets it.
NOT_FROM_SPEC: dict[str, str] = {
    "start_timeout_s": "the service's limit",
    "checkpoint_timeout_s": "the service's limit",
    "capacity_wait_timeout_s": "the service's limit",
    "export_timeout_s": "the service's limit",
    "chaos_enabled": "the manager, from the server setting enable_chaos",
    "chaos_requests": "the manager, with the chaos requests posted before the supervisor existed",
    "restarts_used": "the manager, from the job's record",
    "attempt_base": "the manager, from the job's record",
    "checkpoint_key": "the manager, the service's checkpoint signing key",
    "resume_owners": "the manager, from the store's checkpoint directories",
    "grow_limit_dp": "the manager, from the ranks the tenant's worker quota granted the job",
    "tenant": "the manager, the job's tenant (a finished job's rank processes serve its later jobs only)",
}


def collectives_fail_on_peer_loss(device: str) -> bool:
    """Whether a survivor's collective fails when a peer dies (so it can leave the failed attempt and be kept
    by a repair in place): gloo's do, off CUDA (workers/engine/mesh.py); NCCL's wait on (docs/limits.md)."""
    return device != "cuda"


def policy_for(spec: JobSpec) -> JobPolicy:
    """The job policy of a (validated, explicit-layout) spec; the :data:`NOT_FROM_SPEC` values at their defaults."""
    resources: dict[str, float] = {"CPU": spec.resources.cpus_per_worker}
    if spec.resources.gpus_per_worker:
        resources["GPU"] = spec.resources.gpus_per_worker
    if spec.resources.host_memory_gb:  # Ray's logical memory resource, in bytes (service/planning/plan_host.py)
        resources[admission.MEMORY] = float(math.ceil(spec.resources.host_memory_gb * GiB))
    tolerance, stragglers = spec.fault_tolerance, spec.stragglers
    return JobPolicy(
        min_dp=spec.min_dp,
        max_dp=spec.max_dp,
        max_restarts=tolerance.max_restarts,
        heartbeat_timeout_s=tolerance.heartbeat_timeout_s,
        backoff_base_s=tolerance.backoff_base_s,
        backoff_max_s=tolerance.backoff_max_s,
        in_place=tolerance.in_place,
        collectives_fail_on_peer_loss=collectives_fail_on_peer_loss(spec.resources.device),
        elastic_check_interval_s=spec.elastic.check_interval_s,
        stragglers=StragglerConfig(
            enabled=stragglers.enabled,
            window=stragglers.window,
            threshold=stragglers.threshold,
            patience=stragglers.patience,
            sustained_windows=stragglers.sustained_windows,
        ),
        straggler_action=stragglers.action,
        resources_per_rank=resources,
        placement_strategy=spec.resources.placement_strategy,
        export=spec.export_format == "hf",
        export_dtype=spec.checkpoint.export_dtype,
    )


def gang_for(spec: JobSpec) -> admission.Gang:
    """What a (validated, explicit-layout) job must get at once to start: its legal dps up to the planned
    one (the first is the elastic minimum), tp groups of ranks of the worker resources.

    Needed at submit (to refuse a job the cluster can never hold) and at every admission pass
    (service/jobs/scheduler.py)."""
    layout = spec.layout
    policy = policy_for(spec)
    legal = ElasticPolicy(
        global_batch=spec.training.global_batch,
        micro_batch=spec.training.micro_batch,
        min_dp=policy.min_dp,
        max_dp=policy.max_dp,
        dp_multiple=layout_rules.dp_multiple(dp_replicate=layout.dp_replicate, ep=layout.ep),
    ).legal_sizes()
    sizes = tuple(dp for dp in legal if dp <= layout.dp) or (layout.dp,)
    return admission.Gang(
        per_rank=policy.resources_per_rank,
        dp_sizes=sizes,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        strategy=policy.placement_strategy,
        dp_field="resources.min_dp" if spec.resources.min_dp else "parallelism.dp",
    )
