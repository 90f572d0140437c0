"""Chaos orders before the job's supervisor exists (issue #16): the real ``JobManager`` through the REST API,
Ray replaced by ``FakeRuntime`` on a simulated 2-CPU cluster.

A job that waits QUEUED (or is STARTING while its supervisor is being created) has no supervisor to deliver
an order to; the order used to be a ``503 the supervisor of job ... is not running``. It is now kept and
handed to the supervisor with its start (``JobPolicy.chaos_requests``), which arms it before the first launch.
The same with real Ray, a real SIGKILL and the clean run's losses: tests/e2e/test_before_start.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from etrain.api.app import create_app
from etrain.service.planning.spec import JobSpec
from etrain.service.settings import Settings
from tests.fakes import FakeRuntime
from tests.service_harness import admin_headers

manager_module = pytest.importorskip("etrain.service.manager")  # imports Ray (never started: FakeRuntime)

TWO_CPUS = {"n1": {"CPU": 2.0}}
KILL = {"action": "kill_rank", "rank": 1, "at_step": 3}


def spec(name: str) -> dict[str, Any]:
    """Two ranks of 1 CPU: one such job holds the whole simulated cluster."""
    return {
        "name": name,
        "model": {"preset": "gpt-tiny"},
        "parallelism": {"dp": 2},
        "training": {"steps": 10, "global_batch": 8, "micro_batch": 2},
    }


@pytest.fixture
def plane(tmp_path):
    made = []

    def build(runtime: FakeRuntime):
        manager = manager_module.JobManager(
            Settings(data_dir=tmp_path, poll_interval_s=0.05, enable_chaos=True),
            runtime=runtime,
            base_dir=str(tmp_path),
        )
        made.append(manager)
        app = create_app(Settings(data_dir=tmp_path, enable_chaos=True), manager=manager)
        return manager, TestClient(app, raise_server_exceptions=False, headers=admin_headers(tmp_path))

    yield build
    for manager in made:
        manager.close()


def wait_for(client: TestClient, job_id: str, what: str, predicate, timeout_s: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not predicate(job := client.get(f"/v1/jobs/{job_id}").json()):
        assert time.monotonic() < deadline, f"{job_id}: no {what}: {job}"
        time.sleep(0.02)
    return job


def kinds(client: TestClient, job_id: str) -> list[str]:
    return [event["kind"] for event in client.get(f"/v1/jobs/{job_id}/events").json()["events"]]


def test_an_order_for_a_queued_job_is_kept_and_armed_by_its_supervisor(plane):
    runtime = FakeRuntime(nodes=TWO_CPUS, steps_per_update=0)  # the first job runs until cancelled
    manager, client = plane(runtime)
    holder = client.post("/v1/jobs", json=spec("holder")).json()
    queued = client.post("/v1/jobs", json=spec("queued")).json()
    assert (holder["status"], queued["status"]) == ("STARTING", "QUEUED")  # the holder's supervisor runs

    answer = client.post(f"/v1/jobs/{queued['id']}/chaos", json=KILL)
    assert answer.status_code == 200, answer.text  # was 503: no supervisor yet
    assert answer.json() == {
        **KILL,
        "armed": True,
        "pending": True,
        "message": "kept until the job's supervisor starts; armed before its first launch",
    }
    assert ("chaos", queued["id"]) not in runtime.calls

    client.post(f"/v1/jobs/{holder['id']}/cancel")
    wait_for(client, queued["id"], "start", lambda job: job["status"] == "RUNNING")
    assert runtime.jobs[queued["id"]]["policy"].chaos_requests == (KILL,)  # in the start, not delivered later
    wait_for(client, queued["id"], "chaos_armed", lambda job: "chaos_armed" in kinds(client, queued["id"]))
    assert kinds(client, queued["id"]).index("chaos_armed") < kinds(client, queued["id"]).index("started")

    slow = {"action": "slow_rank", "rank": 0, "factor": 2.0}  # once it runs, straight to its supervisor
    assert client.post(f"/v1/jobs/{queued['id']}/chaos", json=slow).json() == {"id": 2, **slow, "armed": True}


def test_an_order_during_the_supervisors_start_waits_for_it_and_is_delivered(plane):
    """The window the GPU run hit once in three: STARTING, the supervisor's actor not made yet."""

    class SlowStart(FakeRuntime):
        def __init__(self):
            super().__init__(nodes=TWO_CPUS)
            self.entered, self.release = threading.Event(), threading.Event()
            self.starting = ""

        def start(self, job_id: str, config: Any, policy: Any) -> None:
            self.starting = job_id
            self.entered.set()
            assert self.release.wait(10)
            super().start(job_id, config, policy)

    runtime = SlowStart()
    manager, _ = plane(runtime)
    submitter = threading.Thread(target=manager.submit, args=(JobSpec.model_validate(spec("starting")),))
    submitter.start()
    assert runtime.entered.wait(10)
    job_id = runtime.starting
    assert manager.get(job_id).status.value == "STARTING"
    answers: list[dict[str, Any]] = []
    poster = threading.Thread(target=lambda: answers.append(manager.chaos(job_id, dict(KILL))))
    poster.start()
    time.sleep(0.3)
    assert answers == []  # it waits for the start instead of failing or being kept for a start that took the list
    runtime.release.set()
    poster.join(timeout=10)
    submitter.join(timeout=10)
    assert answers == [{"id": 1, **KILL, "armed": True}]  # delivered to the supervisor the start made
    assert runtime.jobs[job_id]["chaos"] == [KILL]


def test_an_order_for_a_job_cancelled_while_queued_is_a_conflict_and_never_armed(plane):
    runtime = FakeRuntime(nodes=TWO_CPUS, steps_per_update=0)
    manager, client = plane(runtime)
    holder = client.post("/v1/jobs", json=spec("holder")).json()
    queued = client.post("/v1/jobs", json=spec("queued")).json()
    assert client.post(f"/v1/jobs/{queued['id']}/chaos", json=KILL).json()["pending"] is True
    client.post(f"/v1/jobs/{queued['id']}/cancel")
    refused = client.post(f"/v1/jobs/{queued['id']}/chaos", json=KILL)
    assert (refused.status_code, refused.json()["error"]) == (409, "conflict"), refused.text
    assert manager._chaos._kept == {}  # dropped with the job
    client.post(f"/v1/jobs/{holder['id']}/cancel")
    assert queued["id"] not in runtime.jobs
