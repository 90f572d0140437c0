"""Host memory through the REST API with the real ``JobManager`` (Ray replaced by ``FakeRuntime``, whose nodes
report ``memory`` as Ray's do): the planner's figure is filled into the stored spec and becomes each rank's
``memory`` resource, and a node whose RAM cannot hold the ranks is judged as one without their CPUs
(service/planning/plan_host.py, service/decisions/admission.py)."""

from __future__ import annotations

import math

from tests.api.test_queue import plane, spec, submit  # noqa: F401 - the fixture
from tests.fakes import FakeRuntime

GiB = 1024**3


def test_submit_fills_in_the_planners_host_memory_and_each_rank_asks_ray_for_it(plane):  # noqa: F811
    manager, client = plane(FakeRuntime(nodes={"n1": {"CPU": 4.0, "memory": 64.0 * GiB}}))
    body = spec("filled", resources={})
    del body["resources"]  # the planner's figure
    plan = client.post("/v1/plan", json=body).json()
    host = plan["host_memory"]
    # gpt-tiny on two CPU ranks: the rank's whole plan, plus two snapshots (gloo: an in-place repair reads them)
    assert host["bytes"]["state"] == plan["estimate"]["memory"]["bytes"]["total"]
    assert host["bytes"]["snapshots"] > 0 and host["bytes"]["checkpoint_staging"] == 0
    assert host["reserved_gib"] == math.ceil(host["bytes"]["total"] / GiB * 100) / 100
    job = submit(client, body)
    stored = client.get(f"/v1/jobs/{job['id']}").json()["spec"]["resources"]
    assert stored["host_memory_gb"] == host["reserved_gib"]
    asked = manager.runtime.jobs[job["id"]]["policy"].resources_per_rank
    assert asked == {"CPU": 1.0, "memory": float(math.ceil(host["reserved_gib"] * GiB))}


def test_a_node_whose_ram_cannot_hold_one_rank_refuses_the_job_with_the_fixes(plane):  # noqa: F811
    _, client = plane(FakeRuntime(nodes={"n1": {"CPU": 4.0, "memory": 2.0 * GiB}}))
    problem = _refused(client, spec("fat", resources={"host_memory_gb": 3}), field="resources.host_memory_gb")
    assert problem["message"] == (
        "one rank needs 1 CPU + 3.00 GiB of host memory, but no node has 3.00 GiB of host memory: the most any "
        "of the 1 node(s) has is 2.00 GiB of host memory."
    )
    assert problem["fix"].startswith("hold less state per rank in host memory (parallelism.zero: 3")
    assert "add nodes with 3.00 GiB of host memory" in problem["fix"]


def test_host_memory_bounds_the_ranks_per_node(plane):  # noqa: F811
    """Two nodes of 4 CPUs and 4.5 GiB: at 2 GiB a rank, two ranks fit on each (dp=4 starts); at 3 GiB one does,
    whatever the CPUs say, and dp=4 is refused with the room there is."""
    nodes = {name: {"CPU": 4.0, "memory": 4.5 * GiB} for name in ("n1", "n2")}
    _, client = plane(FakeRuntime(nodes=nodes))
    fits = submit(client, spec("fits", dp=4, resources={"host_memory_gb": 2}))
    assert fits["status"] in ("STARTING", "RUNNING"), fits
    problem = _refused(client, spec("fat", dp=4, resources={"host_memory_gb": 3}), field="parallelism.dp")
    assert "room for at most 2 replica(s) of 1 rank(s)" in problem["message"], problem


def test_a_host_memory_below_the_planners_figure_is_refused(plane):  # noqa: F811
    _, client = plane(FakeRuntime(nodes={"n1": {"CPU": 4.0, "memory": 64.0 * GiB}}))
    body = spec("thin", resources={})
    del body["resources"]
    figure = client.post("/v1/plan", json=body).json()["host_memory"]["reserved_gib"]  # the planner's figure
    problem = _refused(client, spec("thin", resources={"host_memory_gb": 0.01}), field="resources.host_memory_gb")
    assert problem["message"].startswith(f"each rank holds {figure:g} GiB of host memory (state ")
    assert problem["message"].endswith(", more than resources.host_memory_gb=0.01.")
    assert (
        problem["fix"]
        == f"raise resources.host_memory_gb to at least {figure:g}, or leave it out (the planner's figure)"
    )


def _refused(client, body: dict, *, field: str) -> dict:
    """The one problem a submit of ``body`` is refused with (422, nothing recorded), which names ``field``."""
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    [problem] = response.json()["detail"]
    assert problem["field"] == field, problem
    assert body["name"] not in {job["name"] for job in client.get("/v1/jobs").json()["jobs"]}  # nothing recorded
    return problem
