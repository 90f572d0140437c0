"""Between a job's submit and its group being up (issue #16), on real Ray with a job that takes the whole
machine (a 2-CPU local Ray, 2 ranks of 1 CPU), through the real control plane.

* Capacity: while the job's ranks are being created, its placement group already holds the machine, so the
  free resources are 0. The job's own bundles must count as its own from their reservation, or a capacity
  check in that window says "capacity 0" and the job reports a spurious ``capacity_low`` once it is up
  (every GPU job did). Shown on the group itself, in that very window, and on a healthy job end to end.
* Chaos before start: an order posted while the job waits QUEUED (another holder has the machine) used to
  be a 503 (no supervisor yet); it is kept, armed by the supervisor before its first launch, fires (a real
  SIGKILL), the rank is repaired in place and the run ends at the clean run's losses, step for step.
"""

from __future__ import annotations

import time

import pytest

from etrain.service.runtime import worker_group
from etrain.service.runtime.capacity_watch import CapacityWatch
from etrain.service.runtime.worker_group import WorkerGroup
from etrain.workers.protocol.messages import LaunchPlan
from etrain.workers.protocol.run_config import ParallelConfig
from tests.chaos.conftest import assert_repaired_in_place, fired, losses, run_clean, spec
from tests.e2e.conftest import owned_ray
from tests.equivalence_utils import small_config
from tests.service_harness import control_plane, event_kinds, event_text

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

PER_RANK = {"CPU": 1.0}
KILL = {"action": "kill_rank", "rank": 1, "at_step": 6}


def whole_machine(name: str) -> dict:
    """Two ranks of 1 CPU on the 2-CPU machine. The default ``elastic.check_interval_s`` (30 s) matters: the
    supervisor's first check, right after the launch, sees the reserved machine, and the next one comes
    after the group is up, so the group's "started" is judged by that first check (with checks every
    second, a later one corrects it before the ranks are ready and hides the bug)."""
    return spec(name, steps=12, every=4)


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    with owned_ray(2):
        with control_plane(tmp_path_factory.mktemp("etrain-before-start")) as plane:
            yield plane


@pytest.fixture(scope="module")
def clean(plane) -> dict:
    """A healthy run of the whole-machine job: its final record, events and losses."""
    job = run_clean(plane, whole_machine("clean-whole"))
    return {"job": job, "events": plane.events(job["id"]), "losses": losses(plane, job["id"])}


def capacity_low(events: list[dict]) -> list[str]:
    return [event_text(event) for event in events if event["kind"] == "capacity_low"]


@ray.remote(num_cpus=2)
class Holder:
    """Something else that holds the whole machine while the job is submitted."""

    def ready(self) -> bool:
        return True


def test_the_groups_bundles_are_held_from_their_reservation_while_its_ranks_are_made(plane, monkeypatch):
    """Right after the placement group is requested (Ray may already have taken the machine off the free
    resources, a few ms before its table names the nodes) the capacity is not guessed: the check waits for
    the next turn. Once reserved, while the ranks are made, the bundles are the job's own: capacity 2."""
    group = WorkerGroup(
        job_id="held-window",
        plan=LaunchPlan(attempt=1, config=small_config(parallel=ParallelConfig(dp=2)), start_step=0, resume_dir=None),
        world_size=2,
        resources_per_rank=PER_RANK,
        strategy="PACK",
        excluded_nodes=frozenset(),
        supervisor=None,
    )
    watch = CapacityWatch(per_rank=PER_RANK, tp=1, pp=1, interval_s=30.0, held=group.bundles_per_node)
    seen: list[tuple[str, int | None, dict[str, int] | None]] = []

    class InTheWindow(Exception):
        pass

    create = worker_group.placement_group

    def requested(*args, **kwargs):  # the placement group is asked for, not yet known to be reserved
        pg = create(*args, **kwargs)
        seen.append(("requested", watch.available_dp(()), group.bundles_per_node()))
        assert watch.check(force=False, excluded=(), awaiting=True) is None and watch.due(time.time())
        return pg

    def rank_actors():  # called once the placement group is reserved, before any rank exists
        seen.append(("reserved", watch.available_dp(()), group.bundles_per_node()))
        raise InTheWindow

    monkeypatch.setattr(worker_group, "placement_group", requested)
    monkeypatch.setattr(group, "_rank_actors", rank_actors)
    try:
        with pytest.raises(InTheWindow):
            group.start()
    finally:
        group.stop()
    [node] = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
    # reserved: was (0, {}), the machine the job reserved counted as someone else's
    assert seen == [("requested", None, None), ("reserved", 2, {node: 2})]
    assert group.bundles_per_node() == {}  # released with the group


def test_a_healthy_start_that_takes_the_whole_machine_reports_no_capacity_low(clean):
    kinds = event_kinds(clean["events"])
    assert clean["job"]["status"] == "SUCCEEDED" and "started" in kinds
    assert capacity_low(clean["events"]) == []


def test_a_kill_ordered_while_the_job_is_queued_is_armed_fires_and_the_run_ends_like_the_clean_run(plane, clean):
    holder = Holder.remote()
    ray.get(holder.ready.remote(), timeout=60)
    job = plane.submit(whole_machine("queued-kill"))
    assert plane.job(job["id"])["status"] == "QUEUED"
    answer = plane.client.post(f"/v1/jobs/{job['id']}/chaos", json=KILL)
    assert answer.status_code == 200, answer.text  # was 503: the job had no supervisor yet
    assert answer.json()["pending"] is True and answer.json()["armed"] is True

    ray.kill(holder)
    final = plane.wait_terminal(job["id"], timeout_s=300)
    events = plane.events(job["id"])
    assert final["status"] == "SUCCEEDED", final
    kinds = assert_repaired_in_place(final, events, times=1)
    assert kinds.index("queued") < kinds.index("chaos_armed") < kinds.index("launching")
    assert [text.split(" (order")[0] for text in fired(events)] == ["kill_rank on rank 1 at step 6"]
    assert losses(plane, job["id"]) == clean["losses"]  # exact, every step
    assert capacity_low(events) == []
