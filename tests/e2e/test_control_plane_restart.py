"""Invariant 5: nothing is lost when the control plane restarts or a supervisor dies.

* The API server stops mid-job; a new one on the same data directory reattaches to the job's live,
  detached supervisor: the job finishes with no restart, and its events and steps are complete.
* A job's supervisor actor is killed; the control plane notices and starts a new supervisor that
  resumes from the last committed checkpoint (counted as one restart) and finishes the job.
"""

from __future__ import annotations

import pytest

from tests.service_harness import control_plane, event_kinds

ray = pytest.importorskip("ray")


def long_spec(name: str) -> dict:
    return {
        "name": name,
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": 64, "seq_len": 16},
        "data": {"kind": "synthetic", "seed": 4},
        "parallelism": {"dp": 2},
        "resources": {"cpus_per_worker": 1},
        "training": {"steps": 400, "global_batch": 8, "micro_batch": 2, "lr": 0.01, "seed": 1},
        "checkpoint": {"every_steps": 20},
        "fault_tolerance": {"backoff_base_s": 0.5},
    }


def test_a_new_control_plane_reattaches_to_the_running_job(local_ray, tmp_path):
    with control_plane(tmp_path) as first:
        job = first.submit(long_spec("reattach"))
        first.wait_until(job["id"], lambda j: j["status"] == "RUNNING" and j["step"] >= 20, timeout_s=180,
                         what="step 20")
        seen_before = first.job(job["id"])["step"]
    # The first server is gone; the job kept training under its detached supervisor.
    with control_plane(tmp_path) as second:
        resumed_view = second.job(job["id"])
        assert resumed_view["step"] >= seen_before
        final = second.wait_terminal(job["id"], timeout_s=300)
        assert final["status"] == "SUCCEEDED", final
        assert final["restarts"] == 0 and final["step"] == 400
        steps = [row["step"] for row in second.steps(job["id"])]
        assert steps == list(range(1, 401))  # no step missing from the history across the gap
        kinds = event_kinds(second.events(job["id"]))
        assert kinds.count("started") == 1 and kinds.count("succeeded") == 1  # nothing duplicated
        assert "supervisor_lost" not in kinds


def test_a_killed_supervisor_is_recreated_from_the_last_checkpoint(local_ray, tmp_path):
    from service.runtime import find_supervisor

    with control_plane(tmp_path) as plane:
        job = plane.submit(long_spec("lost-supervisor"))
        plane.wait_until(job["id"], lambda j: (j["last_checkpoint_step"] or 0) >= 40, timeout_s=180,
                         what="a checkpoint at step 40")
        ray.kill(find_supervisor(job["id"]), no_restart=True)  # its rank actors die with their owner
        final = plane.wait_terminal(job["id"], timeout_s=300)
        assert final["status"] == "SUCCEEDED", final
        assert final["restarts"] == 1 and final["step"] == 400
        kinds = event_kinds(plane.events(job["id"]))
        assert "supervisor_lost" in kinds and "resuming" in kinds
