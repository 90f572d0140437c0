"""Issue #16, warm spares on GPUs: every rank runs on the GPU Ray reserved for its bundle.

On one H100 the second job on a node took the warm spare and failed at once ("a cuda rank was
scheduled without a GPU"): a spare is created without GPUs (the bundle's reservation accounts for
it), so ``ray.get_gpu_ids()`` is empty in it, and that is what the rank asked. Here a real local Ray
node declares two GPUs that this machine does not have (Ray places by declared resources), a
WorkerGroup of two ranks of ``{CPU: 1, GPU: 1}`` runs a ``device: cpu`` job (the spec allows GPUs per
rank with either device), and each rank says which GPUs it runs on (``TrainWorker.devices``): warm
spares and cold ranks alike hold exactly their own bundle's GPU id (what a task in that bundle gets
from Ray), distinct across ranks, with the process pinned to it (``CUDA_VISIBLE_DEVICES``), and so
does a rank replaced in place from a spare. A stopped group's ranks have exited when ``stop`` returns, so a
relaunch's new ranks never share a GPU with a predecessor still being torn down. The CUDA half (the context on
that GPU) is tests/gpu/test_cuda.py's.
"""

from __future__ import annotations

import time

import pytest
import torch

from etrain.service.runtime.spares import ensure_pool, find_pool
from etrain.service.runtime.worker_group import WorkerGroup, process_runs
from etrain.workers.protocol.messages import LaunchPlan
from etrain.workers.protocol.run_config import ParallelConfig
from tests.equivalence_utils import small_config

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")

from tests.e2e.conftest import owned_ray  # noqa: E402

STEPS = 2
RANK = {"CPU": 1.0, "GPU": 1.0}


@pytest.fixture(scope="module")
def gpu_node():
    """A local Ray node that declares 2 GPUs (and has none: placement only counts them)."""
    with owned_ray(4, num_gpus=2):
        yield


@ray.remote(num_cpus=0)
class ReadyReports:
    """The ranks' side of the supervisor for an attempt with nothing left to train: it counts ready ranks."""

    def __init__(self) -> None:
        self.ready: list[tuple[int, int]] = []

    def report_ready(self, attempt: int, rank: int, node_info: dict) -> None:
        self.ready.append((attempt, rank))

    def report_steps(self, attempt: int, records: list) -> None:
        pass

    def readies(self) -> list[tuple[int, int]]:
        return sorted(self.ready)


@ray.remote(num_cpus=0, num_gpus=1)
def _ray_gpu_ids() -> list[str]:
    """Ray's own answer: the GPU ids a task scheduled in a bundle gets."""
    return [str(gpu) for gpu in ray.get_gpu_ids()]


def _bundle_gpu_ids(group: WorkerGroup, rank: int) -> list[str]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=group.pg, placement_group_bundle_index=rank)
    return ray.get(_ray_gpu_ids.options(scheduling_strategy=strategy).remote(), timeout=60)


def _plan(attempt: int) -> LaunchPlan:
    # Starts at the last step: each rank rendezvouses, builds its Trainer, reports ready and returns.
    config = small_config(steps=STEPS, parallel=ParallelConfig(dp=2))
    return LaunchPlan(attempt=attempt, config=config, start_step=STEPS, resume_dir=None, keep_snapshots=False)


def _finish(group: WorkerGroup, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while (outcome := group.poll(time.monotonic())) is None:
        assert time.monotonic() < deadline, "the attempt did not finish"
        time.sleep(0.1)
    assert outcome.kind == "finished", outcome


def _devices(group: WorkerGroup, *, warm: set[int]) -> list[list[str]]:
    """Each rank's GPU ids, checked: one each, distinct (the node's two), pinned, from the right source.

    Every rank's ids must be what a task in its bundle gets (the bundle's GPU is free for one: no rank
    holds GPUs in Ray's books, so its process outlives the placement group in an in-place resize).
    """
    devices = ray.get([actor.devices.remote() for actor in group.actors], timeout=60)
    for rank, seen in enumerate(devices):
        assert seen["rank"] == rank
        assert seen["cuda_visible_devices"] == ",".join(seen["gpu_ids"]), seen
        assert seen["bundle"] == f"bundle {rank} of placement group {group.pg.id.hex()}", seen
        assert ("warm spare" in seen["source"]) == (rank in warm), seen
        assert ("cold rank" in seen["source"]) == (rank not in warm), seen
        assert seen["cuda_warmup"]["outcome"] != "running", seen  # no CUDA here: it found none, and said so
        assert seen["gpu_ids"] == _bundle_gpu_ids(group, rank), seen
    ids = [seen["gpu_ids"] for seen in devices]
    assert sorted(gpu for each in ids for gpu in each) == ["0", "1"], devices
    if not torch.cuda.is_available():
        # _device (what a cuda job calls first) uses the same ids; on this machine it can only fail, naming them.
        config = small_config(steps=STEPS).replace(device="cuda")
        for rank, actor in enumerate(group.actors):
            with pytest.raises(ray.exceptions.RayTaskError) as failed:
                ray.get(actor._device.remote(config), timeout=60)
            assert f"GPU ids {ids[rank]}" in str(failed.value) and "without a GPU" not in str(failed.value)
    return ids


def _group(reports) -> WorkerGroup:
    return WorkerGroup(
        job_id="gpu-bundles",
        plan=_plan(1),
        world_size=2,
        resources_per_rank=dict(RANK),
        strategy="PACK",
        excluded_nodes=frozenset(),
        supervisor=reports,
    )


def _ready_spares(count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(ray.get(find_pool().stats.remote(), timeout=10)["ready_pids"]) < count:
        assert time.monotonic() < deadline, f"the pool never had {count} ready spares"
        time.sleep(0.2)


def test_cold_ranks_run_on_their_bundles_gpus(gpu_node):
    ensure_pool(0)  # no spares: every rank starts cold, on its bundle's node with its bundle's GPU
    reports = ReadyReports.remote()
    group = _group(reports)
    try:
        group.start()
        assert group.warm_ranks == 0
        _finish(group)
        assert ray.get(reports.readies.remote(), timeout=10) == [(1, 0), (1, 1)]
        _devices(group, warm=set())
    finally:
        group.stop()


def test_a_spare_runs_on_its_bundles_gpu_at_launch_and_when_it_replaces_a_rank_in_place(gpu_node):
    """One spare in the pool: rank 0 starts warm beside a cold rank 1, whose GPU id is Ray's own.
    Rank 1 is then killed and replaced in place by a spare, which must run on exactly that GPU."""
    pool = ensure_pool(1)
    reports = ReadyReports.remote()
    group = _group(reports)
    try:
        _ready_spares(1)
        group.start()
        assert group.warm_ranks == 1
        _finish(group)
        first = _devices(group, warm={0})

        _ready_spares(1)  # the pool refills its node once the launch has started
        replaced_pid = ray.get(group.actors[1].node_info.remote(), timeout=10)["pid"]
        group.kill_actor(1)
        group.repair(1, _plan(2))  # rank 0 keeps its process; rank 1 is a spare, assigned bundle 1
        assert group.warm_ranks == 1
        _finish(group)
        assert ray.get(group.actors[1].node_info.remote(), timeout=10)["pid"] != replaced_pid
        assert ray.get(reports.readies.remote(), timeout=10) == [(1, 0), (1, 1), (2, 0), (2, 1)]
        assert _devices(group, warm={0, 1}) == first  # the cold rank's GPU (Ray's id) is its replacement's
        # A finished job's ranks on GPUs never serve another job: a CUDA context keeps the GPUs it started on.
        released = ray.get([actor.release.remote() for actor in group.actors], timeout=30)
        assert [(answer["reusable"], answer["why"]) for answer in released] == [(False, "it runs on GPUs")] * 2
    finally:
        group.stop()
        ray.get(pool.close.remote(), timeout=30)
        ray.kill(pool, no_restart=True)


def test_a_stopped_groups_ranks_are_gone_before_stop_returns(gpu_node):
    """A relaunch takes the same GPUs for its new ranks at once (a CUDA job's answer to a lost rank), so
    ``stop`` returns only once the ranks it killed have exited: a process still being torn down would hold
    its device memory while a new rank materialises its model there."""
    ensure_pool(0)
    group = _group(ReadyReports.remote())
    try:
        group.start()
        pids = [ray.get(actor.node_info.remote(), timeout=10)["pid"] for actor in group.actors]
        assert all(process_runs(pid) for pid in pids)
        started = time.monotonic()
        group.stop()
        stopped_s = time.monotonic() - started
        assert not any(process_runs(pid) for pid in pids), pids
        assert stopped_s < 5.0, stopped_s
    finally:
        group.stop()
