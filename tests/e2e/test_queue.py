"""The queue on real Ray: a 2-CPU machine, jobs that each need all of it (2 ranks x 1 CPU).

* Submitted with priorities 0, 5, 1 while something else holds the machine, they wait QUEUED and then
  start one at a time in the order 5, 1, 0: the events' timestamps show no two ever ran at once.
* A job bigger than the machine is refused at submit (422) with the numbers.
* GET /v1/cluster reports the machine (2 CPUs) and what the running job holds.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.e2e.conftest import owned_ray
from tests.service_harness import control_plane, event_kinds

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def two_cpus():
    """A 2-CPU local Ray owned by this module (the control plane joins it)."""
    with owned_ray(2):
        yield


def whole_machine(name: str, *, priority: int = 0, dp: int = 2) -> dict:
    return {
        "name": name,
        "priority": priority,
        "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "vocab_size": 32, "seq_len": 8},
        "data": {"kind": "synthetic", "seed": 1},
        "parallelism": {"dp": dp},
        "resources": {"cpus_per_worker": 1, "host_memory_gb": 0.5},  # given: the messages below stay exact
        "training": {"steps": 6, "global_batch": 8, "micro_batch": 2, "lr": 0.01, "seed": 1},
        "stragglers": {"enabled": False},
    }


@ray.remote(num_cpus=2)
class Holder:
    """Something else that holds the whole machine while the jobs are submitted."""

    def ready(self) -> bool:
        return True


def at(events: list[dict], kind: str) -> float:
    [event] = [e for e in events if e["kind"] == kind]
    return event["ts"]


def test_whole_machine_jobs_start_one_at_a_time_by_priority(two_cpus, tmp_path):
    with control_plane(tmp_path) as plane:
        holder = Holder.remote()
        ray.get(holder.ready.remote(), timeout=30)

        too_big = plane.client.post("/v1/jobs", json=whole_machine("huge", dp=4))
        assert too_big.status_code == 422, too_big.text
        [problem] = too_big.json()["detail"]
        assert problem["field"] == "parallelism.dp"
        # (the machine's host memory, Ray's `memory` resource, is whatever this machine has)
        assert re.fullmatch(
            r"the minimum layout needs 4 ranks \(dp=4 x tp=1 x pp=1\) of 1 CPU \+ 0\.50 GiB of host memory = 4 CPUs "
            r"\+ 2\.00 GiB of host memory, but the cluster has 2 CPUs \+ [0-9.]+ GiB of host memory on 1 node\(s\), room "
            r"for at most 2 replica\(s\) of 1 rank\(s\) \(tp groups node-local\)\.",
            problem["message"],
        ), problem["message"]

        ids = {p: plane.submit(whole_machine(f"p{p}", priority=p))["id"] for p in (0, 5, 1)}
        assert {plane.job(job_id)["status"] for job_id in ids.values()} == {"QUEUED"}
        cluster = plane.client.get("/v1/cluster").json()
        assert (cluster["totals"]["cpus"], cluster["totals"]["free_cpus"], cluster["totals"]["queued_jobs"]) == (
            2,
            0,
            3,
        )
        assert [(q["job_id"], q["position"]) for q in cluster["queue"]] == [(ids[5], 1), (ids[1], 2), (ids[0], 3)]
        assert re.fullmatch(
            r"waiting for 2 CPUs \+ 1\.00 GiB of host memory \(2 rank\(s\) of 1 CPU \+ 0\.50 GiB of host memory: dp=2 "
            r"tp=1 pp=1\); free now: 0 CPUs \+ [0-9.]+ GiB of host memory on 1 node\(s\); position 1 in the queue",
            cluster["queue"][0]["reason"],
        ), cluster["queue"][0]["reason"]
        assert cluster["totals"]["free_memory_gib"] == cluster["totals"]["memory_gib"] > 1  # the Holder asked for none

        ray.kill(holder)
        plane.wait_until(ids[5], lambda job: job["status"] in ("RUNNING", "SUCCEEDED"), timeout_s=60, what="p5 starts")
        holding = _holding(plane, ids[5])
        if holding is not None:  # (p5 may already be done: 6 steps are quick)
            assert (holding["cpus"], holding["memory_gib"], holding["world_size"], len(holding["nodes"])) == (
                2,
                1,
                2,
                1,
            )
            assert holding["nodes"][0]["node_id"] == cluster["nodes"][0]["node_id"]

        finals = {p: plane.wait_terminal(job_id, timeout_s=90) for p, job_id in ids.items()}
        assert {p: job["status"] for p, job in finals.items()} == {0: "SUCCEEDED", 5: "SUCCEEDED", 1: "SUCCEEDED"}
        spans = []
        for p, job_id in ids.items():
            events = plane.events(job_id)
            kinds = event_kinds(events)
            assert kinds[:3] == ["submitted", "queued", "admitted"], kinds
            assert kinds.count("started") == 1 and kinds[-1] == "succeeded", kinds
            spans.append((at(events, "started"), at(events, "succeeded"), p))
        spans.sort()
        assert [p for _, _, p in spans] == [5, 1, 0]
        assert all(spans[i][1] <= spans[i + 1][0] for i in range(2)), spans  # never two at once
        assert plane.client.get("/v1/cluster").json()["totals"]["queued_jobs"] == 0


def _holding(plane, job_id: str, timeout_s: float = 10) -> dict | None:
    """What GET /v1/cluster says ``job_id`` holds once its placement group shows (None if it ended first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for job in plane.client.get("/v1/cluster").json()["jobs"]:
            if job["job_id"] == job_id and job["cpus"] > 0:
                return job
        if plane.job(job_id)["status"] == "SUCCEEDED":
            return None
        time.sleep(0.1)
    raise AssertionError(f"GET /v1/cluster never showed what {job_id} holds")
