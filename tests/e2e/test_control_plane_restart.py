"""Invariant 5: nothing is lost when the control plane restarts or a supervisor dies.

* The API server stops mid-job; a new one on the same data directory reattaches to the job's live,
  detached supervisor: the job finishes with no restart, and its events and steps are complete.
* A job's supervisor actor is killed; the control plane notices and queues it again; a new supervisor
  resumes from the last committed checkpoint (counted as one restart) and finishes the job.
* ``etrain serve`` (a real process) is SIGKILLed with one job running and two queued; a new one on
  the same data directory reattaches to the running job and admits the queued ones by priority:
  every job succeeds exactly once, with a complete event list and no duplicate.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.service_harness import REPO, ControlPlane, bearer, control_plane, event_kinds, free_port

ray = pytest.importorskip("ray")


def long_spec(name: str, steps: int = 400) -> dict:
    return {
        "name": name,
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": 64, "seq_len": 16},
        "data": {"kind": "synthetic", "seed": 4},
        "parallelism": {"dp": 2},
        "resources": {"cpus_per_worker": 1},
        "training": {"steps": steps, "global_batch": 8, "micro_batch": 2, "lr": 0.01, "seed": 1},
        "checkpoint": {"every_steps": 20},
        "fault_tolerance": {"backoff_base_s": 0.5},
    }


def test_a_new_control_plane_reattaches_to_the_running_job(local_ray, tmp_path):
    with control_plane(tmp_path) as first:
        job = first.submit(long_spec("reattach"))
        first.wait_until(
            job["id"], lambda j: j["status"] == "RUNNING" and j["step"] >= 20, timeout_s=180, what="step 20"
        )
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
    from etrain.service.runtime.spares import find_pool
    from etrain.service.runtime.supervisor_actor import find_supervisor

    # A tenant of its own: ranks an earlier test's job gave back (the pool outlives control planes) would
    # serve the admin's job instead of the warm spares this test follows.
    token = "lost-supervisor-tenant-token-5d0e"
    with control_plane(tmp_path, tenant_tokens={"lost": token}) as admin, admin.as_token(token) as plane:
        pool = find_pool()
        handed_before = set(ray.get(pool.stats.remote(), timeout=10)["handed_pids"])
        # 120 steps (not 400): the kill lands within a second of the commit at step 40 being seen, at most a
        # few dozen steps later, so the job is still training; every step after the resume is only waited for.
        job = plane.submit(long_spec("lost-supervisor", steps=120))
        plane.wait_until(
            job["id"], lambda j: (j["last_checkpoint_step"] or 0) >= 40, timeout_s=180, what="a checkpoint at step 40"
        )
        # The ranks that came from the warm pool: the pool owns their processes, not the supervisor.
        from_pool = set(ray.get(pool.stats.remote(), timeout=10)["handed_pids"]) - handed_before
        assert from_pool, "the test wants a rank from a warm spare"
        ray.kill(find_supervisor(job["id"]), no_restart=True)
        # Every rank process of the lost supervisor goes: a cold rank with its owner, a rank from the pool with
        # the last reference to it (the pool keeps none for a spare it handed out). One that stayed would train on,
        # or idle for good, beside the new attempt.
        deadline = time.monotonic() + 30
        while (alive := {pid for pid in from_pool if process_alive(pid)}) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive, f"rank processes {sorted(alive)} outlived their supervisor by 30s"
        final = plane.wait_terminal(job["id"], timeout_s=300)
        assert final["status"] == "SUCCEEDED", final
        assert final["restarts"] == 1 and final["step"] == 120
        kinds = event_kinds(plane.events(job["id"]))
        assert "supervisor_lost" in kinds and "resuming" in kinds


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return False
    return "zombie" not in state and "dead" not in state


# --- SIGKILL of a real `etrain serve` with jobs running and queued --------------------------------------


def whole_machine(name: str, priority: int, steps: int) -> dict:
    """A tiny job that takes the whole 4-CPU test machine (2 ranks x 2 CPUs)."""
    return {
        "name": name,
        "priority": priority,
        "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "vocab_size": 32, "seq_len": 8},
        "data": {"kind": "synthetic", "seed": 2},
        "parallelism": {"dp": 2},
        "resources": {"cpus_per_worker": 2},
        "training": {"steps": steps, "global_batch": 8, "micro_batch": 2, "lr": 0.01, "seed": 1},
        "checkpoint": {"every_steps": 10},
        "stragglers": {"enabled": False},
    }


class Server:
    """``etrain serve`` as its own process on the test's Ray cluster (``--ray-address``)."""

    def __init__(self, data_dir: Path, token: str):
        self.port = free_port()
        self.log = data_dir.parent / f"serve-{self.port}.log"
        env = {**os.environ, "ETRAIN_API_TOKEN": token, "ETRAIN_POLL_INTERVAL_S": "0.2"}
        command = [
            sys.executable,
            "-m",
            "etrain.api.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(data_dir),
            "--ray-address",
            ray.get_runtime_context().gcs_address,
            "--log-level",
            "warning",
        ]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30.0, headers=bearer(token))
        self.plane = ControlPlane(url=str(self.client.base_url), data_dir=data_dir, client=self.client, token=token)
        deadline = time.monotonic() + 90
        while True:
            try:
                if self.client.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.kill()
                raise AssertionError(f"etrain serve did not become healthy:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs, the database is left as it was mid-write."""
        self.client.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)


def test_a_sigkilled_control_plane_loses_no_queued_or_running_job(local_ray, tmp_path):
    data_dir, token = tmp_path / "data", "restart-admin-token"
    first = Server(data_dir, token)
    try:
        running = first.plane.submit(whole_machine("running", priority=0, steps=60))["id"]
        first.plane.wait_until(running, lambda job: job["status"] == "RUNNING", timeout_s=60, what="RUNNING")
        low = first.plane.submit(whole_machine("low", priority=1, steps=12))["id"]
        high = first.plane.submit(whole_machine("high", priority=5, steps=12))["id"]
        queue = first.client.get("/v1/cluster").json()["queue"]
        assert [(entry["job_id"], entry["position"]) for entry in queue] == [(high, 1), (low, 2)]
    finally:
        first.kill()

    second = Server(data_dir, token)
    try:
        plane = second.plane
        finals = {job_id: plane.wait_terminal(job_id, timeout_s=120) for job_id in (running, high, low)}
        assert {job_id: job["status"] for job_id, job in finals.items()} == dict.fromkeys(finals, "SUCCEEDED")
        assert [job["restarts"] for job in finals.values()] == [0, 0, 0]
        spans = {}
        for job_id in (running, high, low):
            events = plane.events(job_id)
            kinds = event_kinds(events)
            seen = [(e["kind"], e["ts"], str(e["detail"])) for e in events]
            assert len(set(seen)) == len(seen), f"duplicate events: {kinds}"
            assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
            expected_head = ["submitted", "admitted"] if job_id == running else ["submitted", "queued", "admitted"]
            assert kinds[: len(expected_head)] == expected_head, kinds
            for kind in ("submitted", "admitted", "launching", "started", "succeeded"):
                assert kinds.count(kind) == 1, (kind, kinds)
            assert kinds[-1] == "succeeded" and "supervisor_lost" not in kinds, kinds
            spans[job_id] = (
                next(e["ts"] for e in events if e["kind"] == "started"),
                next(e["ts"] for e in events if e["kind"] == "succeeded"),
            )
            steps = [row["step"] for row in plane.steps(job_id)]
            assert steps == list(range(1, finals[job_id]["step"] + 1)), job_id
        order = sorted(spans, key=lambda job_id: spans[job_id][0])
        assert order == [running, high, low]  # the queued ones by priority
        assert spans[running][1] <= spans[high][0] and spans[high][1] <= spans[low][0]  # one at a time
    finally:
        second.kill()


# --- no --ray-address: a Ray of its own, even beside another ----------------------------------------------

OWN_RAY = """
import sys
import ray
from etrain.service.runtime.cluster import RayRuntime
from etrain.service.settings import Settings

RayRuntime(Settings(dashboard_port=int(sys.argv[1]), warm_spares_per_node=0, supervisor_spares=0))
print(ray.get_runtime_context().gcs_address, flush=True)
ray.shutdown()
"""


def test_a_control_plane_without_a_ray_address_starts_its_own_ray_beside_another(local_ray):
    """Ray's default ``ray.init()`` joins the cluster the last ``ray start`` on the machine recorded
    (``<RAY_TMPDIR>/ray/ray_current_cluster``), or fails when that file is stale: a second ``etrain
    serve`` would share the first one's cluster, named actors and spares. The recorded cluster here is
    this test's, live; with no ray_address the runtime starts a new local instance anyway."""
    ours = ray.get_runtime_context().gcs_address
    temp_root = Path(tempfile.mkdtemp(prefix="er-", dir="/tmp"))  # short: Ray's socket paths fit 107 bytes
    try:
        (temp_root / "ray").mkdir()
        (temp_root / "ray" / "ray_current_cluster").write_text(ours)
        env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
        done = subprocess.run(
            [sys.executable, "-c", OWN_RAY, str(free_port())],
            cwd=REPO,
            env={**env, "RAY_TMPDIR": str(temp_root)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = done.stdout.strip().splitlines()[-1]
    assert theirs and theirs != ours
