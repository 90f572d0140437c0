"""Every tensor-parallel group of a job is reserved on one node (``WorkerGroup._reserve``), also where Ray's
own ``PACK`` would split one: on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``) of a 3-CPU and a
2-CPU node, four 1-CPU ranks at tp=2 fill the roomiest node first, bundle by bundle, so ranks 0-2 land there
and rank 3 on the other node: the tp group of ranks 2 and 3 would run its per-layer all-reduces across the
network. With the groups pinned, each group is whole on one node. Where the free resources read for the plan
are stale (taken since), the pinned placement cannot be reserved, and after ``TP_PIN_GRACE_S`` Ray places the
bundles itself, as before: the job starts, split but not stuck.
"""

from __future__ import annotations

import time

import pytest

from etrain.service.runtime import worker_group
from etrain.service.runtime.worker_group import WorkerGroup
from etrain.workers.protocol.messages import LaunchPlan
from etrain.workers.protocol.run_config import ParallelConfig
from tests.e2e.conftest import release_shared_ray
from tests.equivalence_utils import small_config

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402


@pytest.fixture(scope="module")
def two_uneven_nodes():
    """A head without CPUs, a 3-CPU node and a 2-CPU node: (roomy node id, small node id)."""
    release_shared_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        roomy, small = cluster.add_node(num_cpus=3), cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address, namespace="etrain", log_to_driver=False)
        yield roomy.node_id, small.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


def _group() -> WorkerGroup:
    config = small_config(parallel=ParallelConfig(dp=2, tp=2))
    return WorkerGroup(
        job_id="tp-placement",
        plan=LaunchPlan(attempt=1, config=config, start_step=0, resume_dir=None),
        world_size=4,
        resources_per_rank={"CPU": 1.0},
        strategy="PACK",
        excluded_nodes=frozenset(),
        supervisor=None,
    )


def _all_cpus_free(total: float = 5.0, timeout_s: float = 30) -> None:
    from ray._private.state import available_resources_per_node

    deadline = time.monotonic() + timeout_s
    while sum(node.get("CPU", 0.0) for node in available_resources_per_node().values()) < total:
        assert time.monotonic() < deadline, available_resources_per_node()
        time.sleep(0.1)


def test_each_tp_group_is_reserved_on_one_node_where_rays_pack_splits_one(two_uneven_nodes):
    roomy, small = two_uneven_nodes
    _all_cpus_free()
    # The premise, with Ray's own placement (what _reserve did before): rank 3 is not with rank 2.
    plain = _group()
    plain._place_bundles({}, timeout_s=60)
    try:
        assert [plain._bundle_nodes[rank] for rank in range(4)] == [roomy, roomy, roomy, small]
    finally:
        plain.stop()
    _all_cpus_free()

    group = _group()
    group._reserve()
    try:
        nodes = [group._bundle_nodes[rank] for rank in range(4)]
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and {nodes[0], nodes[2]} == {roomy, small}, nodes
        assert group.bundles_per_node() == {roomy: 2, small: 2}
    finally:
        group.stop()
    _all_cpus_free()


def test_a_stale_plan_gives_way_to_rays_placement_after_the_grace(two_uneven_nodes, monkeypatch):
    """The plan is made from the free resources read just before another reservation took a CPU of the small
    node: its pins cannot be met, and after the grace Ray places the bundles where they fit."""
    from ray._private import state

    roomy, small = two_uneven_nodes
    _all_cpus_free()
    stale = state.available_resources_per_node()  # 3 + 2 CPUs free, read now
    monkeypatch.setattr(state, "available_resources_per_node", lambda: stale)
    monkeypatch.setattr(worker_group, "TP_PIN_GRACE_S", 1.0)
    blocker = placement_group([{"CPU": 1.0}], bundle_label_selector=[{"ray.io/node-id": small}])
    ray.get(blocker.ready(), timeout=60)
    group = _group()
    try:
        started = time.monotonic()
        group._reserve()
        waited = time.monotonic() - started
        assert [group._bundle_nodes[rank] for rank in range(4)] == [roomy, roomy, roomy, small]
        assert waited >= 1.0  # the pinned placement was tried first, for the grace
    finally:
        group.stop()
        remove_placement_group(blocker)
    _all_cpus_free()
