"""Issue #20, a fast start as installed: a job's supervisor is a pre-started one (service/runtime/supervisor_spares.py).

Real local Ray and the real control plane. The proof is by actor: the supervisor pre-started before the
submit, by name, is the one that keeps the job (it says so itself), a restarted control plane (this
process forgetting what it gave) finds it by asking, and a replacement is pre-started after the take.
Idle ones are adopted by the next control plane or killed at its close; a job whose policy its supervisor refuses fails the same way
through a pre-started one, which is not leaked.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from etrain.service.runtime import supervisor_actor
from etrain.service.runtime.supervisor_actor import find_supervisor, jobs_of_pre_started, pre_started_supervisors
from etrain.service.runtime.supervisor_spares import REFILL_DELAY_S, SupervisorSpares
from tests.chaos.conftest import spec
from tests.e2e.conftest import owned_ray
from tests.service_harness import control_plane, event_kinds

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def own_ray():
    """A 4-CPU local Ray of this module's own: the tests count every pre-started supervisor in the cluster, so
    none may be left by another module's control plane (on the shared instance, one that an earlier module's
    job had taken was still there in one whole run out of two)."""
    with owned_ray(4):
        yield


def idle_pre_started(count: int, *, timeout_s: float = 60, exclude: frozenset[str] = frozenset()) -> list[str]:
    """Names of ``count`` idle pre-started supervisors (started and answering), once there are that many."""
    deadline = time.monotonic() + timeout_s
    while True:
        answers = jobs_of_pre_started(pre_started_supervisors())
        idle = sorted(name for name, job in answers.items() if job is None and name not in exclude)
        if len(idle) >= count:
            return idle
        assert time.monotonic() < deadline, f"no {count} idle pre-started supervisor(s) within {timeout_s}s: {answers}"
        time.sleep(0.2)


def test_a_job_is_kept_by_the_supervisor_started_before_it_and_a_replacement_is_started(own_ray, tmp_path):
    # (Every other e2e and chaos test runs through pre-started supervisors too, the service default, and
    # checks its losses against one process or the clean run.)
    with control_plane(tmp_path, supervisor_spares=1) as plane:
        (before,) = idle_pre_started(1)
        # Long enough to outlive the wait for the replacement below (REFILL_DELAY_S and an actor start): it is
        # cancelled. 400 steps (~6 s) once ended first on a loaded machine, and the cancel answered 409.
        job_id = plane.submit(spec("pre-started", steps=20_000, dp=1, every=500))["id"]
        plane.wait_until(job_id, lambda job: (job.get("step") or 0) >= 2, timeout_s=120, what="step 2")
        # The pre-started actor says it keeps the job, and a process that did not give it finds it by asking.
        assert jobs_of_pre_started([before]) == {before: job_id}
        supervisor_actor._taken.clear()  # as a restarted control plane
        found = find_supervisor(job_id)
        assert found is not None and ray.get(found.job.remote(), timeout=10) == job_id
        assert ray.get_actor(before, namespace="etrain")._actor_id == found._actor_id  # noqa: SLF001
        # A replacement is pre-started after the take, under another name.
        (after,) = idle_pre_started(1, timeout_s=REFILL_DELAY_S + 60, exclude=frozenset({before}))
        plane.client.post(f"/v1/jobs/{job_id}/cancel").raise_for_status()
        assert plane.wait_terminal(job_id, timeout_s=120)["status"] == "CANCELLED"
        assert {"admitted", "launching", "started"} <= set(event_kinds(plane.events(job_id)))
        deadline = time.monotonic() + 30
        while find_supervisor(job_id) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert find_supervisor(job_id) is None  # released with the job
    # The control plane's close kills its idle one.
    deadline = time.monotonic() + 30
    while pre_started_supervisors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pre_started_supervisors() == [], after


def test_idle_ones_are_adopted_by_the_next_control_plane_and_a_refused_job_leaks_none(own_ray, tmp_path):
    from etrain.service.decisions.job_policy import policy_for
    from etrain.service.planning.spec import JobSpec
    from etrain.service.runtime.supervisor_actor import start_supervisor
    from etrain.service.runtime.supervisor_spares import PreStarted

    first = SupervisorSpares(1)
    (name,) = idle_pre_started(1)
    del first  # a control plane that ended without closing (killed) leaves its idle one: the next adopts it
    second = SupervisorSpares(1)
    deadline = time.monotonic() + 30
    while second.ready() < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    spare = second.take()
    assert isinstance(spare, PreStarted) and spare.name == name
    second.close()  # before its refill

    # The supervisor refuses a policy without the checkpoint key: the same error as a new actor's, and
    # the pre-started one that was given the job is killed, not left idle or half-begun.
    job = JobSpec.model_validate(spec("refused"))
    config = job.to_run_config(job_id="refused-1", checkpoint_root=str(tmp_path / "ckpt"))
    policy = dataclasses.replace(policy_for(job), checkpoint_key=None)
    with pytest.raises(ray.exceptions.RayTaskError, match="checkpoint key"):
        start_supervisor(job_id="refused-1", config=config, policy=policy, spare=spare)
    deadline = time.monotonic() + 30
    while pre_started_supervisors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pre_started_supervisors() == []
