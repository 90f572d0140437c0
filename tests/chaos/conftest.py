"""Fixtures for failure-injection tests: real multi-node Ray clusters and a real control plane.

``ray.cluster_utils.Cluster`` starts several raylets (nodes) on this machine; ``remove_node`` kills
one for real. The head node has no CPUs, so every rank lands on a worker node that a test can
remove. Health checks are tightened so a removed node is declared dead in a few seconds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.service_harness import (  # noqa: F401 - the chaos tests import placements from here
    FAST_NODE_DEATH,
    ControlPlane,
    control_plane,
    event_kinds,
    event_text,
    placements,
)

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow


#: The worker nodes' environment, which their rank processes inherit: a job with ``training.compile`` traces
#: its blocks with ``aot_eager`` (the graphs and guards of inductor, without minutes of C++ builds on 2 cores).
RANK_ENV = {"ETRAIN_COMPILE_BACKEND": "aot_eager"}


@contextmanager
def ray_cluster(worker_cpus: list[int]) -> Iterator[Cluster]:
    """A cluster of its own: a head node without CPUs and one worker node per entry of ``worker_cpus``.

    The driver joins one cluster at a time, so the shared cluster (``shared_plane``), if it is up, is
    shut down first.
    """
    _SHARED.close()
    with _new_cluster(worker_cpus) as cluster:
        yield cluster


@contextmanager
def _new_cluster(worker_cpus: list[int]) -> Iterator[Cluster]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": FAST_NODE_DEATH},
    )
    try:
        for cpus in worker_cpus:
            cluster.add_node(num_cpus=cpus, env_vars=RANK_ENV)
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address, namespace="etrain", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


class _SharedPlane:
    """The cluster and control plane behind ``shared_plane``, kept from one module to the next.

    Starting a cluster and its control plane (head, three raylets, the server, its warm spares) is 15-20 s
    of a 2-core machine, and the modules that share one change nothing in it: every test's jobs end before
    the test does, and no test removes or adds a node. So the first module to ask starts it and the others
    reuse it; it is shut down when the chaos tests end (``_shut_the_shared_plane_down``) or when a test
    needs a cluster of its own (``ray_cluster``).
    """

    def __init__(self) -> None:
        self._stack: ExitStack | None = None
        self.plane: ControlPlane | None = None

    def get(self, tmp_path_factory: pytest.TempPathFactory) -> ControlPlane:
        if self.plane is None:
            with ExitStack() as stack:
                stack.enter_context(_new_cluster([2, 2, 2]))
                self.plane = stack.enter_context(control_plane(tmp_path_factory.mktemp("etrain-chaos")))
                self._stack = stack.pop_all()
        return self.plane

    def close(self) -> None:
        stack, self._stack, self.plane = self._stack, None, None
        if stack is not None:
            stack.close()


_SHARED = _SharedPlane()


@pytest.fixture(scope="package", autouse=True)
def _shut_the_shared_plane_down() -> Iterator[None]:
    yield
    _SHARED.close()


@pytest.fixture(scope="module")
def shared_plane(tmp_path_factory) -> ControlPlane:
    """Three 2-CPU worker nodes shared by the tests that do not remove nodes (across modules: ``_SharedPlane``)."""
    return _SHARED.get(tmp_path_factory)


#: ``spec(..., model=LLAMA_MODEL)``: the same small job on a Llama (RoPE, RMSNorm, SwiGLU, grouped-query
#: attention with 4 query heads on 2 kv heads) instead of the built-in GPT.
LLAMA_MODEL = {
    "kind": "llama",
    "n_layers": 2,
    "d_model": 32,
    "n_heads": 4,
    "n_kv_heads": 2,
    "d_ff": 64,
    "vocab_size": 64,
    "seq_len": 16,
}


def spec(name: str, *, steps: int = 24, dp: int = 2, tp: int = 1, pp: int = 1, every: int = 4, **sections) -> dict:
    """A small, fast, deterministic job (fp32, synthetic data, fixed seeds)."""
    body = {
        "name": name,
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": 64, "seq_len": 16},
        "data": {"kind": "synthetic", "seed": 3},
        "parallelism": {"dp": dp, "tp": tp, "pp": pp},
        "resources": {"cpus_per_worker": 1},
        "training": {"steps": steps, "global_batch": 8, "micro_batch": 2, "lr": 0.01, "seed": 5},
        "checkpoint": {"every_steps": every, "keep_last": 3},
        "fault_tolerance": {"max_restarts": 3, "heartbeat_timeout_s": 30, "backoff_base_s": 0.5, "backoff_max_s": 2},
        "stragglers": {"enabled": False},
    }
    for key, value in sections.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return body


def losses(plane: ControlPlane, job_id: str) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in plane.steps(job_id)}


def run_clean(plane: ControlPlane, body: dict) -> dict:
    job = plane.wait_terminal(plane.submit(body)["id"], timeout_s=300)
    assert job["status"] == "SUCCEEDED", job
    return job


def param_digests(plane: ControlPlane, job_id: str) -> dict[int, str]:
    """Rank -> digest of its final parameters, from the job's last ``ranks_finished`` event."""
    finished = [event_text(e) for e in plane.events(job_id) if e["kind"] == "ranks_finished"]
    assert finished, f"job {job_id} has no ranks_finished event"
    return {int(rank): digest for rank, digest in re.findall(r"rank(\d+)=(\S+)", finished[-1])}


@dataclass(frozen=True)
class CleanRun:
    """What a recovered run is compared with: the uninterrupted run's losses by step and final digests."""

    losses: dict[int, float]
    digests: dict[int, str]  # rank -> digest of its final parameters


_CLEAN_RUNS: dict[str, CleanRun] = {}


def clean_run(plane: ControlPlane, body: dict) -> CleanRun:
    """The uninterrupted run of ``body``, run once per test session.

    Its numbers are a function of the spec alone (fp32, synthetic data, fixed seeds: the same ranks run
    the same operations in the same order wherever Ray places them), not of the cluster or the control
    plane that ran it. So the first module to ask runs it on its own plane, and every later module, on
    another cluster, compares against the same numbers instead of training the same job again (a clean
    run is tens of seconds of a 2-core CI machine). Keyed by the spec without its name.
    """
    key = json.dumps({k: v for k, v in body.items() if k != "name"}, sort_keys=True)
    if key not in _CLEAN_RUNS:
        job_id = run_clean(plane, body)["id"]
        _CLEAN_RUNS[key] = CleanRun(losses=losses(plane, job_id), digests=param_digests(plane, job_id))
    return _CLEAN_RUNS[key]


def recover(plane: ControlPlane, body: dict, *orders: dict) -> tuple[dict, list[dict]]:
    """Submit ``body`` with the chaos ``orders`` armed; wait for it to succeed. The final job and its events."""
    job = plane.submit(body)
    for order in orders:
        plane.chaos(job["id"], **order)
    final = plane.wait_terminal(job["id"], timeout_s=300)
    assert final["status"] == "SUCCEEDED", final
    return final, plane.events(job["id"])


def fired(events: list[dict]) -> list[str]:
    """The chaos orders that fired, as the events say them."""
    return [event_text(e) for e in events if e["kind"] == "chaos_fired"]


def restored(events: list[dict]) -> list[str]:
    """Where each rank's state came from, per recovery (``state_restored`` events)."""
    return [event_text(e) for e in events if e["kind"] == "state_restored"]


def assert_repaired_in_place(final: dict, events: list[dict], times: int) -> list[str]:
    """``times`` restarts, each an in-place repair, and never a full relaunch. The event kinds."""
    kinds = event_kinds(events)
    assert final["restarts"] == times, final
    assert (kinds.count("repairing"), kinds.count("launching")) == (times, 1), kinds
    return kinds


def rank_pids(plane: ControlPlane, job_id: str, rank: int) -> list[int]:
    """The pid of the rank's process in every attempt, from its log ('... (node N, pid P) ...')."""
    lines = plane.client.get(f"/v1/jobs/{job_id}/logs", params={"rank": rank}).json()["lines"]
    return [int(pid) for line in lines for pid in re.findall(r"pid (\d+)\)", line)]


def node_of_rank(plane: ControlPlane, job_id: str, rank: int) -> str:
    """The node running ``rank`` in the job's current launch."""
    placed = placements(plane.events(job_id))
    assert placed, f"job {job_id} has no placed event yet"
    return placed[-1][rank]


def cluster_node(cluster: Cluster, node_id: str):
    for node in cluster.list_all_nodes():
        if node.node_id == node_id:
            return node
    raise AssertionError(f"node {node_id} is not in the cluster")


def resumed_from(events: list[dict]) -> list[int | None]:
    """The step each launch or in-place repair resumed from (None: fresh), in order."""
    out: list[int | None] = []
    for event in events:
        if event["kind"] in ("launching", "repairing"):
            match = re.search(r"resuming from step (\d+)", event_text(event))
            out.append(int(match.group(1)) if match else None)
    return out


def data_dir(plane: ControlPlane) -> Path:
    return plane.data_dir


def assert_only_committed_steps_left(plane: ControlPlane, job_id: str) -> list[int]:
    """Every step directory under the job's checkpoint directory is a commit of the job's own (a partial
    save that a kill interrupted was deleted by the prune after a later commit); returns their steps.
    Each names the job in its manifest and in the ``writer.json`` its rank 0 wrote."""
    root = plane.data_dir / "checkpoints" / job_id
    steps = []
    for directory in sorted(root.glob("step_*")):
        assert (directory / "manifest.json").is_file(), f"{directory.name} never committed and is still there"
        assert json.loads((directory / "manifest.json").read_text())["job_id"] == job_id, directory
        assert json.loads((directory / "writer.json").read_text())["job_id"] == job_id, directory
        steps.append(int(directory.name.split("_")[1]))
    return steps
