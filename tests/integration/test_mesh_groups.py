"""The DeviceMesh process groups that real ranks build equal the groups ``Topology`` computes.

Each layout runs as separate processes over gloo (no Ray). Every rank builds the mesh and reports
what torch says its groups are; the parent compares with ``Topology`` computed on its own side.
The mesh is ``(pp, dp_replicate, dp_shard, tp)`` with ``dp`` flattened from the two data-parallel
dimensions, so the ``dp`` group is the same whatever the HSDP split, and HSDP's replica and shard
groups are the dp group cut row-major (``dp index = replica * dp_shard + shard``).
"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch.distributed as dist

from etrain.workers.engine.mesh import MESH_DIMS, backend_for, build_device_mesh, mesh_group_ranks
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.topology import AXES, Coords, Topology, TopologyError
from tests.dist_utils import RankFailedError, run_distributed

TIMEOUT_S = 90.0

LAYOUTS = [  # (topology, dp_replicate)
    (Topology(pp=1, dp=2, tp=2), 1),
    (Topology(pp=2, dp=2, tp=2), 1),
    (Topology(pp=2, dp=1, tp=2), 1),
    (Topology(pp=2, dp=2, tp=1), 1),
    (Topology(pp=1, dp=4, tp=1), 2),  # HSDP: 2 replicas of 2 shards
    (Topology(pp=1, dp=2, tp=2), 2),  # HSDP with TP: dp_shard = 1
]


def _report_mesh(rank: int, world_size: int, topology: Topology, dp_replicate: int) -> dict[str, object]:
    """Runs in each rank: build the mesh and report what torch says about this rank's place.

    Also shards a small weight with FSDP2 on ``mesh.fsdp``, to report the placements HSDP gives it.
    """
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    mesh = build_device_mesh(topology, "cpu", dp_replicate=dp_replicate)
    axes = (*AXES, "dp_replicate", "dp_shard")
    layer = nn.Linear(4, 8, bias=False)
    fully_shard(layer, mesh=mesh.fsdp)
    return {
        "backend": dist.get_backend(),
        "coordinate": mesh.get_coordinate(),
        "pg_ranks": {axis: mesh_group_ranks(mesh, axis) for axis in axes},
        "submesh_ranks": {axis: tuple(mesh[axis].mesh.flatten().tolist()) for axis in axes},
        "mesh_shape": mesh.shape,
        "fsdp_mesh": tuple(mesh.fsdp.mesh.shape),
        "fsdp_placements": tuple((type(p).__name__, getattr(p, "dim", None)) for p in layer.weight.placements),
        "fsdp_local_rows": layer.weight.to_local().shape[0],
    }


def _hsdp_groups(topology: Topology, dp_replicate: int, rank: int) -> dict[str, tuple[int, ...]]:
    """Replica and shard groups by arithmetic: dp index r * dp_shard + s, at the rank's pp and tp."""
    coords = topology.coords(rank)
    dp_shard = topology.dp // dp_replicate
    replica, shard = divmod(coords.dp, dp_shard)

    def rank_at(dp_index: int) -> int:
        return topology.rank(Coords(pp=coords.pp, dp=dp_index, tp=coords.tp))

    return {
        "dp_replicate": tuple(rank_at(r * dp_shard + shard) for r in range(dp_replicate)),
        "dp_shard": tuple(rank_at(replica * dp_shard + s) for s in range(dp_shard)),
    }


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda case: f"pp{case[0].pp}-dp{case[0].dp}-tp{case[0].tp}-rep{case[1]}"
)
def test_device_mesh_groups_equal_topology_groups(layout: tuple[Topology, int]) -> None:
    topology, dp_replicate = layout
    reports = run_distributed(_report_mesh, topology.world_size, topology, dp_replicate, timeout_s=TIMEOUT_S)

    dp_shard = topology.dp // dp_replicate
    for rank, report in enumerate(reports):
        coords = topology.coords(rank)
        assert report["backend"] == "gloo"
        assert report["mesh_shape"] == (topology.pp, dp_replicate, dp_shard, topology.tp)
        coordinate = dict(zip(MESH_DIMS, report["coordinate"]))
        assert (coordinate["pp"], coordinate["tp"]) == (coords.pp, coords.tp), f"rank {rank}"
        assert coordinate["dp_replicate"] * dp_shard + coordinate["dp_shard"] == coords.dp, f"rank {rank}"
        # The flattened dp group is the topology's dp group, whatever the HSDP split.
        expected = {axis: topology.group(rank, axis) for axis in AXES} | _hsdp_groups(topology, dp_replicate, rank)
        # The process group's rank order is ascending too, so group rank i == expected[axis][i].
        assert report["pg_ranks"] == expected, f"rank {rank} at {coords}"
        assert report["submesh_ranks"] == expected, f"rank {rank} at {coords}"
        # FSDP2 shards within a replica and replicates across replicas (HSDP), or shards over all dp.
        if dp_replicate > 1:
            assert report["fsdp_mesh"] == (dp_replicate, dp_shard)
            assert report["fsdp_placements"] == (("Replicate", None), ("Shard", 0))
        else:
            assert report["fsdp_mesh"] == (topology.dp,)
            assert report["fsdp_placements"] == (("Shard", 0),)
        assert report["fsdp_local_rows"] == 8 // dp_shard


def test_dp_replicate_must_divide_dp() -> None:
    from etrain.workers.engine.mesh import validate_dp_replicate

    validate_dp_replicate(4, 2)
    with pytest.raises(ConfigError) as info:
        validate_dp_replicate(4, 3)
    assert info.value.field == "parallelism.dp_replicate"
    assert "does not divide parallelism.dp=4" in str(info.value)


def _build_wrong_size_mesh(rank: int, world_size: int) -> str:
    try:
        build_device_mesh(Topology(pp=1, dp=1, tp=world_size * 2), "cpu")
    except TopologyError as exc:
        return str(exc)
    return "no error"


def test_build_device_mesh_rejects_a_topology_of_another_world_size() -> None:
    messages = run_distributed(_build_wrong_size_mesh, 2, timeout_s=TIMEOUT_S)
    expected = "topology pp1·dp1·tp4 needs 4 ranks but the process group has 2; choose degrees whose product is 2"
    assert messages == [expected, expected]


def test_backend_for_device_type() -> None:
    assert backend_for("cuda") == "nccl"
    assert backend_for("cpu") == "gloo"
    # CPU offload on CUDA: gradient-norm reductions over host-resident shards need gloo too.
    assert backend_for("cuda", cpu_offload=True) == "cuda:nccl,cpu:gloo"
    assert backend_for("cpu", cpu_offload=True) == "gloo"


# -- the run_distributed helper's own contract -------------------------------------------------


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one broke on purpose")
    dist.barrier()  # rank 0 would wait here until the timeout: the helper must not
    return rank


def test_run_distributed_raises_the_failing_ranks_traceback_without_waiting() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 of 2 failed first") as info:
        run_distributed(_fail_on_rank_one, 2, timeout_s=TIMEOUT_S)
    assert info.value.rank == 1
    assert "ValueError: rank one broke on purpose" in info.value.failures[1]
    assert "in _fail_on_rank_one" in str(info.value)
    assert time.monotonic() - started < TIMEOUT_S / 2


def _exit_silently_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)


def test_run_distributed_reports_a_rank_that_exits_without_a_result() -> None:
    with pytest.raises(RankFailedError, match="rank 0 of 2 failed first:\nexited with code 3"):
        run_distributed(_exit_silently_on_rank_zero, 2, timeout_s=TIMEOUT_S)


def _hang(rank: int, world_size: int) -> None:
    time.sleep(3600)


def test_run_distributed_times_out_and_stops_the_ranks() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailedError, match=r"ranks \[0, 1\] of 2 did not finish within 2 s"):
        run_distributed(_hang, 2, timeout_s=2.0)
    assert time.monotonic() - started < 15
    assert not [child for child in multiprocessing.active_children() if child.is_alive()]
