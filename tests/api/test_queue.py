"""The queue through the REST API with the real ``JobManager``, Ray replaced by ``FakeRuntime`` on a
small simulated cluster (2 CPUs): jobs wait QUEUED and start by priority then FIFO, one whole gang at
a time; cancel of a queued job is immediate; a job the cluster can never hold is a 422 with the
numbers; GET /v1/cluster; the queue survives a new manager on the same data directory. (The same
with real Ray and a real ``etrain serve``: tests/e2e/test_queue.py, test_control_plane_restart.py.)"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from etrain.api.app import create_app
from etrain.service.access.tenancy import Principal
from etrain.service.decisions.admission import ClusterView
from etrain.service.errors import ServiceUnavailable
from etrain.service.planning.spec import JobSpec
from etrain.service.settings import Settings
from etrain.service.store.records import JobStatus
from tests.fakes import FakeRuntime
from tests.service_harness import admin_headers

manager_module = pytest.importorskip("etrain.service.manager")  # imports Ray (never started: FakeRuntime)

TWO_CPUS = {"n1": {"CPU": 2.0}}


def spec(name: str, *, priority: int = 0, steps: int = 10, dp: int = 2, **extra: Any) -> dict[str, Any]:
    """A job whose ranks each ask for 1 CPU and 1 GiB of host memory (``resources.host_memory_gb``, given so
    that the messages do not move with the planner's figure for the tiny model)."""
    resources = {"host_memory_gb": 1, **extra.pop("resources", {})}
    return {
        "name": name,
        "priority": priority,
        "model": {"preset": "gpt-tiny"},
        "parallelism": {"dp": dp},
        "training": {"steps": steps, "global_batch": 8, "micro_batch": 2},
        "resources": resources,
        **extra,
    }


def make(tmp_path, runtime: FakeRuntime, **settings: Any):
    manager = manager_module.JobManager(
        Settings(data_dir=tmp_path, poll_interval_s=0.05, **settings), runtime=runtime, base_dir=str(tmp_path)
    )
    app = create_app(Settings(data_dir=tmp_path, **settings), manager=manager)
    return manager, TestClient(app, raise_server_exceptions=False, headers=admin_headers(tmp_path))


@pytest.fixture
def plane(tmp_path):
    made = []

    def build(runtime: FakeRuntime | None = None, **settings: Any):
        manager, client = make(tmp_path, runtime or FakeRuntime(nodes=TWO_CPUS), **settings)
        made.append(manager)
        return manager, client

    yield build
    for manager in made:
        manager.close()


def submit(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def events(client: TestClient, job_id: str) -> list[dict[str, Any]]:
    return client.get(f"/v1/jobs/{job_id}/events").json()["events"]


def first(client: TestClient, job_id: str, kind: str) -> dict[str, Any]:
    return next(e for e in events(client, job_id) if e["kind"] == kind)


def wait_for(client: TestClient, job_id: str, statuses: set[str], timeout_s: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] not in statuses:
        assert time.monotonic() < deadline, f"{job_id} stayed {job['status']}: {events(client, job_id)}"
        time.sleep(0.02)
    return job


def test_queued_jobs_start_one_gang_at_a_time_by_priority(plane):
    manager, client = plane()
    blocker = submit(client, spec("blocker", steps=100_000))
    assert blocker["status"] in ("STARTING", "RUNNING")  # it fit: started inside the request
    jobs = {p: submit(client, spec(f"p{p}", priority=p)) for p in (0, 5, 1)}
    assert {job["status"] for job in jobs.values()} == {"QUEUED"}
    queued = first(client, jobs[1]["id"], "queued")["detail"]["message"]
    assert queued == (
        "waiting for 2 CPUs + 2.00 GiB of host memory (2 rank(s) of 1 CPU + 1.00 GiB of host memory: dp=2 tp=1 "
        "pp=1); free now: 0 CPUs + 1022.00 GiB of host memory on 1 node(s); position 2 in the queue"
    )

    cluster = client.get("/v1/cluster").json()
    assert cluster["totals"] == {
        "nodes": 1,
        "alive_nodes": 1,
        "cpus": 2.0,
        "gpus": 0.0,
        "memory_gib": 1024.0,  # FakeRuntime.NODE_MEMORY_BYTES, as Ray reports a node's memory
        "free_cpus": 0.0,
        "free_gpus": 0.0,
        "free_memory_gib": 1022.0,  # the blocker's two ranks reserve 1 GiB each (resources.host_memory_gb)
        "running_jobs": 1,
        "queued_jobs": 3,
    }
    assert [(h["job_id"], h["cpus"], h["memory_gib"], h["nodes"]) for h in cluster["jobs"]] == [
        (blocker["id"], 2.0, 2.0, [{"node_id": "n1", "cpus": 2.0, "gpus": 0.0, "memory_gib": 2.0}])
    ]
    assert [(q["job_id"], q["priority"], q["position"]) for q in cluster["queue"]] == [
        (jobs[5]["id"], 5, 1),
        (jobs[1]["id"], 1, 2),
        (jobs[0]["id"], 0, 3),
    ]

    assert client.post(f"/v1/jobs/{blocker['id']}/cancel").status_code in (200, 202)
    finished = [wait_for(client, jobs[p]["id"], {"SUCCEEDED"}) for p in (5, 1, 0)]
    assert [job["status"] for job in finished] == ["SUCCEEDED"] * 3
    spans = sorted(
        (first(client, jobs[p]["id"], "admitted")["ts"], first(client, jobs[p]["id"], "succeeded")["ts"], p)
        for p in (0, 1, 5)
    )
    assert [p for _, _, p in spans] == [5, 1, 0]
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(2)), spans  # never two at once
    starts = [call[1] for call in manager.runtime.calls if call[0] == "start"]
    assert starts == [blocker["id"], jobs[5]["id"], jobs[1]["id"], jobs[0]["id"]]


def test_cancel_of_a_queued_job_is_immediate_and_never_starts_it(plane):
    manager, client = plane()
    submit(client, spec("blocker", steps=100_000))
    waiting = submit(client, spec("waiting"))
    response = client.post(f"/v1/jobs/{waiting['id']}/cancel")
    assert response.status_code in (200, 202) and response.json()["status"] == "CANCELLED"
    assert [e["kind"] for e in events(client, waiting["id"])] == ["submitted", "queued", "cancelled"]
    assert first(client, waiting["id"], "cancelled")["detail"]["message"] == "cancelled by user while queued"
    assert ("start", waiting["id"]) not in manager.runtime.calls
    assert client.get("/v1/cluster").json()["queue"] == []


def test_a_job_bigger_than_the_cluster_is_refused_with_the_numbers(plane):
    _, client = plane()
    response = client.post("/v1/jobs", json=spec("huge", dp=4))
    assert response.status_code == 422
    [problem] = response.json()["detail"]
    assert problem["field"] == "parallelism.dp"
    assert problem["message"] == (
        "the minimum layout needs 4 ranks (dp=4 x tp=1 x pp=1) of 1 CPU + 1.00 GiB of host memory = 4 CPUs + "
        "4.00 GiB of host memory, but the cluster has 2 CPUs + 1024.00 GiB of host memory on 1 node(s), room for "
        "at most 2 replica(s) of 1 rank(s) (tp groups node-local)."
    )
    assert problem["fix"].startswith("lower parallelism.dp to at most 2, or add nodes")
    fat = client.post("/v1/jobs", json=spec("fat", resources={"cpus_per_worker": 4}))
    assert [(p["field"], p["message"]) for p in fat.json()["detail"]] == [
        (
            "resources.cpus_per_worker",
            "one rank needs 4 CPUs + 1.00 GiB of host memory, but no node has 4 CPUs: the most any of the 1 node(s) "
            "has is 2 CPUs.",
        )
    ]
    assert client.get("/v1/jobs").json()["jobs"] == []  # nothing recorded


def test_an_elastic_job_starts_at_the_size_that_fits_now(plane):
    manager, client = plane(FakeRuntime(nodes={"n1": {"CPU": 3.0}}))
    job = submit(client, spec("elastic", dp=4, resources={"min_dp": 1}))
    assert (job["world_size"], job["layout"].split()[0]) == (2, "pp1·dp2·tp1")  # 3 CPUs: dp 2 (dp 3 is not legal)
    assert first(client, job["id"], "admitted")["detail"]["message"] == (
        "2 rank(s) at dp=2 fit now (2 on n1); starting its supervisor"
    )
    assert manager.runtime.jobs[job["id"]]["config"].parallel.dp == 2


def test_beyond_the_cluster_queues_when_the_operator_allows_it(plane):
    _, client = plane(admit_beyond_cluster=True)
    job = submit(client, spec("huge", dp=4))
    assert job["status"] == "QUEUED"
    assert first(client, job["id"], "queued")["detail"]["message"].startswith(
        "larger than the cluster today, waiting for nodes to be added: the minimum layout needs 4 ranks"
    )


def test_the_queue_survives_a_new_control_plane(tmp_path, plane):
    """Supervisors outlive the control plane (the same FakeRuntime); the queue lives in SQLite."""
    runtime = FakeRuntime(nodes=TWO_CPUS)
    first_manager, client = plane(runtime)
    running = submit(client, spec("running", steps=100_000))
    low = submit(client, spec("low", priority=1))
    high = submit(client, spec("high", priority=2))
    first_manager.close()

    second_manager, client = plane(runtime)
    assert [client.get(f"/v1/jobs/{j['id']}").json()["status"] for j in (low, high)] == ["QUEUED", "QUEUED"]
    assert [q["job_id"] for q in client.get("/v1/cluster").json()["queue"]] == [high["id"], low["id"]]
    runtime.cancel(running["id"], "done")  # its slot frees up
    for job in (high, low):
        wait_for(client, job["id"], {"SUCCEEDED"})
        kinds = [e["kind"] for e in events(client, job["id"])]
        assert kinds == ["submitted", "queued", "admitted", "started", "succeeded"]
    assert first(client, high["id"], "admitted")["ts"] < first(client, low["id"], "admitted")["ts"]


def test_a_job_whose_supervisor_is_gone_is_queued_again_in_its_place(tmp_path, plane):
    """A new cluster (no supervisors): the started job is requeued (one restart spent) and, being the
    oldest of its priority, starts again before the job that was queued behind it."""
    first_manager, client = plane()
    running = submit(client, spec("running", steps=30))
    wait_for(client, running["id"], {"RUNNING"})
    behind = submit(client, spec("behind"))
    first_manager.close()

    _, client = plane(FakeRuntime(nodes=TWO_CPUS))
    final = wait_for(client, running["id"], {"SUCCEEDED"})
    assert final["restarts"] == 1
    kinds = [e["kind"] for e in events(client, running["id"])]
    assert kinds[:3] == ["submitted", "admitted", "started"]
    assert kinds[3:6] == ["supervisor_lost", "admitted", "started"]  # it fit at once: no "queued"
    assert wait_for(client, behind["id"], {"SUCCEEDED"})["restarts"] == 0
    assert first(client, behind["id"], "admitted")["ts"] > final["updated_at"] - 60
    assert [e for e in events(client, running["id"]) if e["kind"] == "admitted"][1]["ts"] < first(
        client, behind["id"], "admitted"
    )["ts"]


def test_tenants_see_their_own_jobs_and_the_cluster_totals(plane):
    manager, _ = plane()
    alice, bob = Principal("alice"), Principal("bob")
    mine = manager.submit(JobSpec.model_validate(spec("mine", steps=100_000)), principal=alice)
    theirs = manager.submit(JobSpec.model_validate(spec("theirs")), principal=bob)
    # (the poller may already have seen the fake's first step when submit reads the row back: RUNNING)
    assert mine.status in (JobStatus.STARTING, JobStatus.RUNNING) and theirs.status is JobStatus.QUEUED
    seen_by_bob = manager.cluster(principal=bob)
    assert seen_by_bob["jobs"] == [] and [q["job_id"] for q in seen_by_bob["queue"]] == [theirs.id]
    assert (seen_by_bob["totals"]["running_jobs"], seen_by_bob["totals"]["free_cpus"]) == (1, 0.0)
    seen_by_alice = manager.cluster(principal=alice)
    assert [h["job_id"] for h in seen_by_alice["jobs"]] == [mine.id] and seen_by_alice["queue"] == []
    admin = manager.cluster()
    assert ([h["job_id"] for h in admin["jobs"]], [q["job_id"] for q in admin["queue"]]) == ([mine.id], [theirs.id])


def test_cluster_route_needs_a_token_and_answers_503_when_the_cluster_cannot_be_read(plane, tmp_path):
    class Unreadable(FakeRuntime):
        def cluster(self):
            raise ServiceUnavailable("Ray is away", fix="retry")

    _, client = plane(Unreadable(nodes=TWO_CPUS))
    assert TestClient(client.app).get("/v1/cluster").status_code == 401
    response = client.get("/v1/cluster")
    assert response.status_code == 503 and "Ray is away" in response.json()["message"]
    # Nothing can be judged, so nothing is refused: the job waits in the queue.
    assert submit(client, spec("waits"))["status"] == "QUEUED"


def test_etrain_cluster_prints_nodes_holdings_and_the_queue(tmp_path, monkeypatch, plane):
    from tests.api.test_cli import etrain, serving

    manager, client = plane()
    blocker = submit(client, spec("blocker", steps=100_000))
    waiting = submit(client, spec("waiting", priority=3))
    monkeypatch.setenv("ETRAIN_DATA_DIR", str(tmp_path))  # the CLI finds the local server's token there
    monkeypatch.delenv("ETRAIN_API_TOKEN", raising=False)
    with serving(manager, tmp_path) as url:
        result = etrain(url, "cluster")
    assert result.code == 0, result
    lines = result.out.splitlines()
    assert lines[0] == (
        "nodes 1/1 alive   CPUs 0 free of 2   GPUs 0 free of 0   memory 1022 GiB free of 1024   jobs 1 started, 1 queued"
    )
    assert lines[1].split() == [
        *("node", "n1", "alive", "CPUs", "0/2", "free", "GPUs", "0/0", "free", "memory", "1022/1024", "GiB", "free")
    ]
    assert lines[2] == "holding:" and lines[3].split()[0] == blocker["id"] and "2 CPUs  0 GPUs  2 GiB" in lines[3]
    assert lines[4] == "queue:"
    assert lines[5].split()[:4] == ["1.", waiting["id"], "prio", "3"] and "waiting for 2 CPUs" in lines[5]


def test_on_an_autoscaling_cluster_the_queue_asks_for_room(plane):
    """Queued jobs have no placement group, so the autoscaler is asked for the started jobs' ranks plus
    the waiting jobs' minimum layouts, and the request is withdrawn once nothing waits."""
    manager, client = plane(admit_beyond_cluster=True)
    running = submit(client, spec("running", steps=100_000))
    huge = submit(client, spec("huge", dp=4, resources={"cpus_per_worker": 0.5}))
    assert huge["status"] == "QUEUED"
    deadline = time.monotonic() + 10
    rank, half = {"CPU": 1.0, "memory": 1024.0**3}, {"CPU": 0.5, "memory": 1024.0**3}
    while manager.runtime.capacity_requests[-1:] != [[rank] * 2 + [half] * 4]:
        assert time.monotonic() < deadline, manager.runtime.capacity_requests
        time.sleep(0.02)
    assert client.post(f"/v1/jobs/{huge['id']}/cancel").json()["status"] == "CANCELLED"
    while manager.runtime.capacity_requests[-1] != []:
        assert time.monotonic() < deadline, manager.runtime.capacity_requests
        time.sleep(0.02)
    # the started job is untouched by the withdrawal (under load it may still be STARTING here)
    assert wait_for(client, running["id"], {"RUNNING", "FAILED", "CANCELLED"})["status"] == "RUNNING"


def test_placement_groups_are_mapped_to_their_jobs_by_name():
    from etrain.service.runtime.cluster import job_of_placement_group

    assert job_of_placement_group("etrain/tiny-1a2b3c4d/a3") == "tiny-1a2b3c4d"
    assert [job_of_placement_group(name) for name in ("", "etrain/a1", "other/job/a1", "etrain/job/x1")] == [None] * 4


def test_what_an_ended_job_still_holds_is_counted_free(plane):
    """Ray removes an ended job's placement group a moment after its status is final: the next job is
    admitted whole at once (its group waits that moment in Ray) instead of waiting or starting smaller."""

    class Lingering(FakeRuntime):
        def cluster(self):
            view = super().cluster()
            ended = [job_id for job_id, job in self.jobs.items() if job["status"] == "SUCCEEDED"]
            if not ended:
                return view
            held = {ended[0]: {"n1": {"CPU": 2.0, "GPU": 0.0}}}
            nodes = tuple(dataclasses.replace(node, free={**node.free, "CPU": 0.0, "GPU": 0.0}) for node in view.nodes)
            return ClusterView(nodes=nodes, holdings={**view.holdings, **held})

    manager, client = plane(Lingering(nodes=TWO_CPUS))
    done = submit(client, spec("done", steps=2))
    wait_for(client, done["id"], {"SUCCEEDED"})
    assert manager.runtime.cluster().nodes[0].free["CPU"] == 0.0  # Ray still counts its group
    following = submit(client, spec("following", resources={"min_dp": 1}))
    assert (following["status"], following["world_size"]) == ("STARTING", 2)
