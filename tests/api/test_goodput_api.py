"""Goodput through the REST API and /metrics with the real ``JobManager`` (Ray replaced by ``FakeRuntime``):
kept step time over wall time since submit, computed from the store, right across a lost supervisor
(the job is queued again, a new supervisor recomputes the steps, each step counts once) and a new
control plane (the tally is rebuilt from the steps table)."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from etrain.service.decisions.goodput import StepTime, goodput, productive_seconds
from etrain.service.decisions.goodput_breakdown import CAUSES
from tests.fakes import FakeRuntime

queue_tests = pytest.importorskip("tests.api.test_queue")  # imports etrain.service.manager (Ray never started)
plane, spec, submit, wait_for, events = (
    queue_tests.plane,
    queue_tests.spec,
    queue_tests.submit,
    queue_tests.wait_for,
    queue_tests.events,
)

STEP_S = 0.01  # simulated seconds per step; the fake advances one step per 0.05 s poll: goodput ~0.2


def steps(client, job_id: str) -> list[dict[str, Any]]:
    return client.get(f"/v1/jobs/{job_id}/metrics").json()["steps"]


def test_goodput_is_null_before_the_first_step_and_in_0_1_after(plane):
    runtime = FakeRuntime(nodes=queue_tests.TWO_CPUS, step_s=STEP_S)
    runtime.hold = True  # no step until the job was read (the poller would race the submit's answer)
    _, client = plane(runtime)
    job = submit(client, spec("g", steps=20))
    assert job["goodput"] is None
    wait_for(client, job["id"], {"RUNNING"})
    time.sleep(0.2)  # several polls, still no step
    running = client.get(f"/v1/jobs/{job['id']}").json()
    assert (running["step"], running["goodput"]) == (0, None), running
    runtime.hold = False
    final = wait_for(client, job["id"], {"SUCCEEDED"})
    rows = steps(client, job["id"])
    assert len(rows) == 20
    wall = final["updated_at"] - final["created_at"]
    assert final["goodput"] == pytest.approx(20 * STEP_S / wall, rel=0.02)
    assert 0.0 < final["goodput"] < 0.5


def test_goodput_spans_a_lost_supervisor_and_a_new_control_plane(tmp_path, plane):
    first_manager, client = plane(FakeRuntime(nodes=queue_tests.TWO_CPUS, step_s=STEP_S))
    job = submit(client, spec("g", steps=40))
    deadline = time.monotonic() + 30
    while len(steps(client, job["id"])) < 10:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert {row["attempt"] for row in steps(client, job["id"])} == {1}
    first_manager.close()

    # A new cluster: the supervisor is gone, the job is queued again and a new supervisor recomputes
    # from step 1 (the fake has no checkpoints), numbering its attempt on from the job's: 2.
    manager, client = plane(FakeRuntime(nodes=queue_tests.TWO_CPUS, step_s=STEP_S))
    final = wait_for(client, job["id"], {"SUCCEEDED"})
    assert [e["kind"] for e in events(client, job["id"])][3:6] == ["supervisor_lost", "admitted", "started"]
    rows = steps(client, job["id"])
    assert [row["step"] for row in rows] == list(range(1, 41))
    assert {row["attempt"] for row in rows} == {2}  # every recomputed step's old row was replaced
    assert final["attempt"] == 2

    # Each of the 40 steps counts once (its last run); the first supervisor's runs of steps 1..k and
    # the time queued in between count as waste: wall time runs from the submit.
    productive = productive_seconds(StepTime(r["step"], r["attempt"], r["step_s"]) for r in rows)
    assert productive == pytest.approx(40 * STEP_S)
    expected = goodput(productive, submitted_at=final["created_at"], now=final["updated_at"])
    assert final["goodput"] == pytest.approx(expected, rel=0.02)

    # Where the wall time went (service/decisions/goodput_breakdown.py), computed at the job's end: every
    # cause, summing to the wall time; the kept steps once; the first supervisor's steps thrown away and
    # the wait for a new one lost.
    seconds = final["goodput_breakdown"]
    assert list(seconds) == list(CAUSES)
    wall = final["updated_at"] - final["created_at"]
    assert sum(seconds.values()) == pytest.approx(wall, abs=0.05)  # rounded to ms, computed at the end
    assert seconds["productive"] == pytest.approx(40 * STEP_S, abs=0.002)
    assert seconds["productive"] / wall == pytest.approx(final["goodput"], abs=0.01)
    assert seconds["recomputed"] + seconds["recovery"] + seconds["queued"] > 0.2


def test_metrics_export_the_stored_goodput(plane):
    _, client = plane(FakeRuntime(nodes=queue_tests.TWO_CPUS, step_s=STEP_S))
    job = submit(client, spec("g", steps=100_000))
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline
        first = client.get(f"/v1/jobs/{job['id']}").json()
        before = first["goodput"]
        text = client.get("/metrics").text
        after = client.get(f"/v1/jobs/{job['id']}").json()["goodput"]
        match = re.search(rf'^etrain_goodput\{{job_id="{job["id"]}",name="g"\}} (\S+)$', text, re.M)
        # From step 5 on (>= 4 polls of 0.05 s for 5 x 0.01 s of steps, goodput <= 0.25): at step 1 a poll
        # landing within 10 ms of the submit rightly reports 0.01 s kept over < 0.01 s of wall time, clamped to 1.
        if before is not None and before == after and match and first["step"] >= 5:
            assert float(match.group(1)) == pytest.approx(before)
            assert 0.0 < before < 1.0
            return
        time.sleep(0.02)


def test_metrics_export_a_running_jobs_breakdown_by_cause(plane, monkeypatch):
    from etrain.service.jobs import poller

    monkeypatch.setattr(poller, "BREAKDOWN_EVERY_S", 0.0)  # every poll: the test need not wait 10 s
    _, client = plane(FakeRuntime(nodes=queue_tests.TWO_CPUS, step_s=STEP_S))
    job = submit(client, spec("g", steps=100_000))
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline
        seconds = client.get(f"/v1/jobs/{job['id']}").json()["goodput_breakdown"]
        if seconds and seconds["productive"] > 0:
            break
        time.sleep(0.02)
    text = client.get("/metrics").text
    found = dict(
        re.findall(rf'^etrain_goodput_seconds\{{cause="(\w+)",job_id="{job["id"]}",name="g"\}} (\S+)$', text, re.M)
    )
    assert set(found) == set(seconds) and float(found["productive"]) > 0
