"""What a validated job spec means to the runtime: the supervisor's policy and the queue's gang.

Both come from the spec alone and are needed in more than one place (the gang at submit, to refuse a job
the cluster can never hold, and at every admission pass; the policy whenever a supervisor starts), so
each is one function here rather than a piece of the manager's submit or queue code.
"""

from __future__ import annotations

from etrain.service.decisions import admission
from etrain.service.decisions.elastic import ElasticPolicy
from etrain.service.decisions.stragglers import StragglerConfig
from etrain.service.planning.spec import JobSpec
from etrain.service.runtime.job_policy import JobPolicy

__all__ = ["gang_for", "policy_for"]


def gang_for(spec: JobSpec) -> admission.Gang:
    """What a (validated, explicit-layout) job must get at once to start: its legal dps up to the planned
    one (the first is the elastic minimum), tp groups of ranks of the worker resources."""
    layout = spec.layout
    legal = ElasticPolicy(global_batch=spec.training.global_batch, micro_batch=spec.training.micro_batch,
                          min_dp=spec.min_dp, max_dp=spec.max_dp, dp_multiple=layout.dp_replicate).legal_sizes()
    sizes = tuple(dp for dp in legal if dp <= layout.dp) or (layout.dp,)
    return admission.Gang(per_rank=policy_for(spec).resources_per_rank, dp_sizes=sizes, tp=layout.tp, pp=layout.pp,
                          strategy=spec.resources.placement_strategy,
                          dp_field="resources.min_dp" if spec.resources.min_dp else "parallelism.dp")


def policy_for(spec: JobSpec) -> JobPolicy:
    """The supervisor's policy values from a (validated, explicit-layout) spec."""
    resources: dict[str, float] = {"CPU": spec.resources.cpus_per_worker}
    if spec.resources.gpus_per_worker:
        resources["GPU"] = spec.resources.gpus_per_worker
    stragglers = spec.stragglers
    return JobPolicy(
        min_dp=spec.min_dp,
        max_dp=spec.max_dp,
        max_restarts=spec.fault_tolerance.max_restarts,
        heartbeat_timeout_s=spec.fault_tolerance.heartbeat_timeout_s,
        backoff_base_s=spec.fault_tolerance.backoff_base_s,
        backoff_max_s=spec.fault_tolerance.backoff_max_s,
        in_place=spec.fault_tolerance.in_place,
        elastic_check_interval_s=spec.elastic.check_interval_s,
        stragglers=StragglerConfig(
            enabled=stragglers.enabled,
            window=stragglers.window,
            threshold=stragglers.threshold,
            patience=stragglers.patience,
        ),
        straggler_action=stragglers.action,
        resources_per_rank=resources,
        placement_strategy=spec.resources.placement_strategy,
        export=spec.export_format == "hf",
    )
