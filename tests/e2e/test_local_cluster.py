"""Issue #7 acceptance: etrain without Kubernetes, exactly as deploy/local/up.sh gives it to a user.

The script starts a Ray head (0 CPUs) and two worker nodes of 1 CPU each with ``ray start`` (three
raylets, each with its own Ray temp directory), then ``etrain serve --ray-address`` as a real
subprocess. The test talks to that server over HTTP only, with the admin token the server generated
into ``<data-dir>/api-token``, and submits a DP2 job whose checkpoint.path lies in the one directory
the nodes share. With 1 CPU per worker and ``cpus_per_worker: 1`` the two ranks can only run on two
different Ray nodes; the test checks they did (the placement event, the rank logs and the cluster view
agree), that the checkpoint was committed by the supervisor (signed manifests of steps 4 and 8 next to
both ranks' shards), and that every step's loss equals a one-process run of the same spec in this
process: the multi-node path changes nothing in the numbers. ``down.sh`` then stops exactly what
``up.sh`` started; a backstop SIGKILLs any PID it recorded that is still alive.

Its own ports (free ones) and a state directory under /tmp (short: Ray's socket paths must fit in 107
bytes), so it can run beside other tests' Ray instances.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.equivalence_utils import spec_reference_losses

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "deploy" / "local"
BIN = Path(sys.executable).parent  # the virtualenv's ray and etrain
STEPS = 8


def job_spec(checkpoint_path: Path) -> dict:
    return {
        "name": "local-dp2",
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": 64, "seq_len": 16},
        "data": {"kind": "synthetic", "seed": 1},  # nothing to read: the nodes share only the checkpoints
        "parallelism": {"dp": 2},
        "resources": {"cpus_per_worker": 1},
        "training": {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "lr": 0.003, "seed": 2, "grad_clip": 0.5},
        "checkpoint": {"every_steps": 4, "path": str(checkpoint_path)},
    }


def free_port_block(width: int) -> int:
    """A port p with p .. p+width-1 all free now (worker i uses METRICS_PORT+i and AGENT_PORT+i)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + width > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + width):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise AssertionError("no block of free ports found")


def cluster_env(state: Path) -> tuple[dict[str, str], int]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("ETRAIN_", "RAY_")) or name == "ETRAIN_TORCH_THREADS"
    }
    api_port = free_port_block(1)
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        RAY=str(BIN / "ray"),
        ETRAIN=str(BIN / "etrain"),
        PYTHON=sys.executable,
        STATE_DIR=str(state),
        HEAD_IP="127.0.0.1",
        HEAD_PORT=str(free_port_block(1)),
        CLIENT_PORT=str(free_port_block(1)),
        DASHBOARD_PORT=str(free_port_block(1)),
        INCLUDE_DASHBOARD="0",
        METRICS_PORT=str(free_port_block(3)),
        AGENT_PORT=str(free_port_block(3)),
        HEAD_CPUS="0",
        CPUS_PER_WORKER="1",
        GPUS_PER_WORKER="0",
        API_HOST="127.0.0.1",
        API_PORT=str(api_port),
        START_TIMEOUT_S="150",
        SERVE_TIMEOUT_S="120",
        ETRAIN_TORCH_THREADS=os.environ.get("ETRAIN_TORCH_THREADS", "1"),
        # No pre-started spare rank processes: on 2 cores they would still be importing torch when the
        # job launches, competing with its ranks (up.sh passes this on to `etrain serve`).
        ETRAIN_WARM_SPARES_PER_NODE="0",
    )
    return env, api_port


def stop_everything(state: Path, env: dict[str, str]) -> None:
    """down.sh, then SIGKILL whatever PID the scripts recorded and is still alive (never anything else)."""
    try:
        subprocess.run([str(SCRIPTS / "down.sh")], env=env, capture_output=True, timeout=120)
    finally:
        for pid_file in [*state.glob("*.pid"), *state.glob("server/*.pid")]:
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
            except (OSError, ValueError):
                pass


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(") ")[2][:1] != "Z"
    except OSError:
        return False


def wait_terminal(client: httpx.Client, job_id: str, *, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in {"SUCCEEDED", "FAILED", "CANCELLED"}:
            return job
        if time.monotonic() > deadline:
            events = client.get(f"/v1/jobs/{job_id}/events").json()
            raise AssertionError(f"job not finished after {timeout_s}s: {job}\n{json.dumps(events, indent=1)[:4000]}")
        time.sleep(0.5)


def test_up_sh_runs_a_dp2_job_across_two_ray_nodes_sharing_only_the_checkpoint_directory():
    state = Path(tempfile.mkdtemp(prefix="etl-", dir="/tmp"))
    env, api_port = cluster_env(state)
    shared = state / "checkpoints"  # up.sh's CHECKPOINT_DIR default: ETRAIN_CHECKPOINT_ROOT and a storage root
    body = job_spec(shared / "local-dp2")
    up = subprocess.Popen(
        [str(SCRIPTS / "up.sh"), "2"], env=env, cwd=state, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        expected = spec_reference_losses(body)  # while the nodes start
        try:
            out, err = up.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            up.kill()
            out, err = up.communicate(timeout=10)
            raise AssertionError(f"up.sh did not finish in 300 s:\n{out}\n{err}") from None
        assert up.returncode == 0, f"up.sh failed ({up.returncode}):\n{out}\n{err}"

        # What up.sh prints: the API URL and where the token is.
        url = re.search(r"^etrain API:\s+(\S+)", out, re.M).group(1)
        token_file = Path(re.search(r"^API token:\s+(\S+)", out, re.M).group(1))
        assert url == f"http://127.0.0.1:{api_port}"
        assert token_file == state / "etrain" / "api-token"
        assert re.search(r"^checkpoints:\s+(\S+)", out, re.M).group(1) == str(shared)
        assert token_file.stat().st_mode & 0o777 == 0o600
        server_pid = int((state / "server" / "etrain.pid").read_text())
        os.kill(server_pid, 0)  # the server is a real process of its own, still running

        headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30.0) as client:
            assert httpx.get(f"{url}/v1/jobs", timeout=30.0).status_code == 401  # auth is on

            cluster = client.get("/v1/cluster")
            assert cluster.status_code == 200, cluster.text
            nodes = cluster.json()["nodes"]
            assert sorted((node["alive"], node["cpus"]) for node in nodes) == [(True, 0), (True, 1), (True, 1)]
            workers = {node["node_id"] for node in nodes if node["cpus"] == 1}

            response = client.post("/v1/jobs", json=body)
            assert response.status_code == 201, response.text
            job_id = response.json()["id"]
            assert response.json()["world_size"] == 2

            final = wait_terminal(client, job_id, timeout_s=180)
            assert final["status"] == "SUCCEEDED", final
            assert (final["step"], final["last_checkpoint_step"], final["restarts"]) == (STEPS, STEPS, 0)

            losses = [row["loss"] for row in client.get(f"/v1/jobs/{job_id}/metrics").json()["steps"]]
            assert len(losses) == len(expected) == STEPS
            for step, (got, want) in enumerate(zip(losses, expected), start=1):
                assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: job {got} vs one process {want}"
            assert final["loss"] == pytest.approx(expected[-1], rel=1e-5)

            events = client.get(f"/v1/jobs/{job_id}/events").json()
            events = events["events"] if isinstance(events, dict) else events
            placed = next(e["detail"]["message"] for e in events if e["kind"] == "placed")

        # The two ranks ran on the two worker nodes, one each.
        on = dict(re.findall(r"rank(\d)=([0-9a-f]{56})", placed))
        assert set(on) == {"0", "1"} and on["0"] != on["1"], placed
        assert {on["0"], on["1"]} == workers, (placed, workers)
        for rank in (0, 1):  # each rank's own log (in the shared directory) names the node it ran on
            log = (shared / "local-dp2" / "logs" / job_id / f"rank{rank}.log").read_text()
            assert f"rank {rank}/2 on " in log and f"(node {on[str(rank)][:12]}," in log, log[:500]
            assert f"finished at step {STEPS}" in log

        # Committed: both ranks' shards and the supervisor's signed manifest, for steps 4 and 8.
        root = shared / "local-dp2"
        committed = sorted(p.name for p in root.iterdir() if (p / "manifest.json").exists())
        assert committed == ["step_00000004", "step_00000008"]
        manifest = json.loads((root / "step_00000008" / "manifest.json").read_text())
        assert (manifest["job_id"], manifest["step"], manifest["world_size"]) == (job_id, STEPS, 2)
        assert {"__0_0.distcp", "__1_0.distcp"} <= {f["path"] for f in manifest["files"]}
        assert manifest["hmac"]
        # The nodes share nothing else: each has its own Ray temp directory.
        assert all((state / name).is_dir() for name in ("ray", "ray-worker-1", "ray-worker-2"))

        # down.sh stops the server and the three nodes, and only them, promptly.
        pids = [int(f.read_text()) for f in (*state.glob("*.pid"), *state.glob("server/*.pid"))]
        assert len(pids) == 4 and all(alive(pid) for pid in pids), pids
        started = time.monotonic()
        down = subprocess.run([str(SCRIPTS / "down.sh")], env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
        assert [pid for pid in pids if alive(pid)] == []
        assert list(state.glob("*.pid")) == list(state.glob("server/*.pid")) == []
        assert time.monotonic() - started < 30, down.stderr  # no 30 s drain per node, no SIGKILL fallback
        assert "SIGKILL" not in down.stderr, down.stderr
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(timeout=10)
        stop_everything(state, env)
        shutil.rmtree(state, ignore_errors=True)
