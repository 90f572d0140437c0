"""The job policy (service/decisions/job_policy.py) is the one copy of the spec's supervisor settings.

Every ``JobPolicy`` value either comes from the spec (``FROM_SPEC`` names its fields, ``policy_for``
reads each of them) or is named in ``NOT_FROM_SPEC`` with a default; and every setting of the spec's
supervisor sections reaches the policy. A knob added to one side only fails here.
"""

from __future__ import annotations

import copy
import math
import typing
from dataclasses import MISSING, fields
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from etrain.service.decisions.job_policy import FROM_SPEC, NOT_FROM_SPEC, JobPolicy, gang_for, policy_for
from etrain.service.decisions.supervisor_state import SupervisorConfig
from etrain.service.planning.spec import JobSpec

#: Every spec field FROM_SPEC reads is set here, away from its default where that is None.
BASE: dict[str, Any] = {
    "name": "policy",
    "model": {"preset": "gpt-tiny"},
    "training": {"steps": 10, "global_batch": 8, "micro_batch": 1},
    "parallelism": {"dp": 2},
    "resources": {"min_dp": 1, "max_dp": 4, "host_memory_gb": 2},
}

#: Settings of the spec's supervisor sections that go somewhere else than the policy, and where.
ELSEWHERE = {
    "fault_tolerance.mtbf_hours": "the run config: the auto checkpoint interval (JobSpec.to_run_config)",
}


def _spec(document: dict[str, Any]) -> JobSpec:
    return JobSpec.model_validate(document)


def _literals(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    return [value for arg in typing.get_args(annotation) for value in _literals(arg)]


def _changed(document: dict[str, Any], path: str) -> dict[str, Any]:
    """``document`` with the spec field at ``path`` set to another valid value."""
    section, name = path.split(".")
    value = getattr(getattr(_spec(document), section), name)
    model: type[BaseModel] = type(getattr(_spec(document), section))
    if isinstance(value, bool):
        other: Any = not value
    elif isinstance(value, (int, float)):
        other = value + 1
    else:
        other = next(v for v in _literals(model.model_fields[name].annotation) if v not in (value, None))
    changed = copy.deepcopy(document)
    changed.setdefault(section, {})[name] = other
    return changed


def test_every_policy_value_comes_from_the_spec_or_is_named_as_not():
    names = {f.name for f in fields(JobPolicy)}
    assert not set(FROM_SPEC) & set(NOT_FROM_SPEC)
    assert names - set(FROM_SPEC) - set(NOT_FROM_SPEC) == set(), "add it to FROM_SPEC (and policy_for) or NOT_FROM_SPEC"
    assert set(FROM_SPEC) | set(NOT_FROM_SPEC) <= names


def test_the_spec_values_have_no_default_and_the_others_have_one():
    """policy_for must give every value FROM_SPEC names (JobPolicy refuses to be built without one)."""
    for f in fields(JobPolicy):
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        assert has_default == (f.name in NOT_FROM_SPEC), f.name


@pytest.mark.parametrize("path", sorted({path for paths in FROM_SPEC.values() for path in paths}))
def test_policy_for_reads_each_spec_field_into_the_values_that_name_it(path):
    before = policy_for(_spec(BASE))
    after = policy_for(_spec(_changed(BASE, path)))
    moved = {f.name for f in fields(JobPolicy) if getattr(before, f.name) != getattr(after, f.name)}
    assert moved == {name for name, paths in FROM_SPEC.items() if path in paths}


def test_policy_for_leaves_the_other_values_at_their_defaults():
    policy = policy_for(_spec(BASE))
    for f in fields(JobPolicy):
        if f.name in NOT_FROM_SPEC:
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            assert getattr(policy, f.name) == default, f.name


@pytest.mark.parametrize("section", ["fault_tolerance", "stragglers", "elastic"])
def test_every_supervisor_setting_of_the_spec_reaches_the_policy(section):
    read = {path for paths in FROM_SPEC.values() for path in paths}
    model = type(getattr(_spec(BASE), section))
    lost = [
        f"{section}.{name}"
        for name in model.model_fields
        if f"{section}.{name}" not in read and f"{section}.{name}" not in ELSEWHERE
    ]
    assert lost == [], "add each to JobPolicy, FROM_SPEC and policy_for (or to ELSEWHERE, saying where it goes)"


def test_unset_dp_range_and_export_take_their_defaults_from_other_fields():
    spec = _spec({**BASE, "resources": {}, "parallelism": {"dp": 4}})
    policy = policy_for(spec)
    assert (policy.min_dp, policy.max_dp, policy.export) == (4, 4, False)
    assert policy.resources_per_rank == {"CPU": 1.0}
    assert policy.export_dtype == "float32"
    halved = policy_for(_spec({**BASE, "checkpoint": {"export": "hf", "export_dtype": "bfloat16"}}))
    assert (halved.export, halved.export_dtype) == (True, "bfloat16")


def test_the_supervisor_config_holds_the_policy_whole():
    policy = policy_for(_spec(BASE))
    config = SupervisorConfig(total_steps=10, global_batch=8, micro_batch=1, policy=policy)
    assert config.policy is policy
    assert config.elastic.legal_sizes() == [1, 2, 4]
    assert config.start_timeout_s == max(policy.start_timeout_s, policy.heartbeat_timeout_s)


def test_the_gang_is_read_from_the_policy():
    spec = _spec(
        {**BASE, "resources": {"min_dp": 1, "max_dp": 4, "gpus_per_worker": 1, "placement_strategy": "SPREAD"}}
    )
    gang = gang_for(spec)
    assert gang.per_rank == {"CPU": 1.0, "GPU": 1.0} and gang.strategy == "SPREAD"
    assert gang.dp_sizes == (1, 2) and gang.dp_field == "resources.min_dp"


def test_only_a_gloo_jobs_survivors_can_leave_a_collective_with_a_dead_peer():
    """A repair in place needs it (service/decisions/supervisor_failures.py): NCCL, CUDA's backend, waits."""
    cpu = policy_for(_spec(BASE))
    cuda = policy_for(_spec({**BASE, "resources": {**BASE["resources"], "device": "cuda", "gpus_per_worker": 1}}))
    assert (cpu.collectives_fail_on_peer_loss, cuda.collectives_fail_on_peer_loss) == (True, False)
    assert cpu.in_place and cuda.in_place  # a resize still runs in place on either


def test_a_rank_asks_ray_for_its_host_memory_in_bytes():
    """``resources.host_memory_gb`` becomes Ray's ``memory`` resource in each rank's bundle (bytes, rounded up);
    a stored spec from before the field (None) asks for none."""
    policy = policy_for(_spec({**BASE, "resources": {"host_memory_gb": 1.5, "gpus_per_worker": 1}}))
    assert policy.resources_per_rank == {"CPU": 1.0, "GPU": 1.0, "memory": 1.5 * 1024**3}
    assert gang_for(_spec({**BASE, "resources": {"host_memory_gb": 0.01}})).per_rank == {
        "CPU": 1.0,
        "memory": float(math.ceil(0.01 * 1024**3)),
    }
