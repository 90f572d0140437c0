"""The DeviceMesh process groups that real ranks build equal the groups ``Topology`` computes.

Each layout runs as separate processes over gloo (no Ray). Every rank builds the mesh and reports
what torch says its groups are; the parent compares with ``Topology`` computed on its own side.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch.distributed as dist

from tests.dist_utils import RankFailedError, run_distributed
from workers.mesh import backend_for, build_device_mesh, mesh_group_ranks
from workers.topology import AXES, Coords, Topology, TopologyError

TIMEOUT_S = 90.0

LAYOUTS = [
    Topology(pp=1, dp=2, tp=2),
    Topology(pp=2, dp=2, tp=2),
    Topology(pp=2, dp=1, tp=2),
    Topology(pp=2, dp=2, tp=1),
]


def _report_mesh(rank: int, world_size: int, topology: Topology) -> dict[str, object]:
    """Runs in each rank: build the mesh and report what torch says about this rank's place."""
    mesh = build_device_mesh(topology, "cpu")
    return {
        "backend": dist.get_backend(),
        "coordinate": tuple(mesh.get_coordinate()),
        "pg_ranks": {axis: mesh_group_ranks(mesh, axis) for axis in AXES},
        "submesh_ranks": {axis: tuple(mesh[axis].mesh.flatten().tolist()) for axis in AXES},
        "mesh_shape": tuple(mesh.mesh.shape),
    }


@pytest.mark.parametrize("topology", LAYOUTS, ids=lambda t: f"pp{t.pp}-dp{t.dp}-tp{t.tp}")
def test_device_mesh_groups_equal_topology_groups(topology: Topology) -> None:
    reports = run_distributed(_report_mesh, topology.world_size, topology, timeout_s=TIMEOUT_S)

    for rank, report in enumerate(reports):
        coords = topology.coords(rank)
        assert report["backend"] == "gloo"
        assert report["mesh_shape"] == (topology.pp, topology.dp, topology.tp)
        assert Coords(**dict(zip(AXES, report["coordinate"]))) == coords, f"rank {rank}"
        expected = {axis: topology.group(rank, axis) for axis in AXES}
        # The process group's rank order is ascending too, so group rank i == expected[axis][i].
        assert report["pg_ranks"] == expected, f"rank {rank} at {coords}"
        assert report["submesh_ranks"] == expected, f"rank {rank} at {coords}"


def _build_wrong_size_mesh(rank: int, world_size: int) -> str:
    try:
        build_device_mesh(Topology(pp=1, dp=1, tp=world_size * 2), "cpu")
    except TopologyError as exc:
        return str(exc)
    return "no error"


def test_build_device_mesh_rejects_a_topology_of_another_world_size() -> None:
    messages = run_distributed(_build_wrong_size_mesh, 2, timeout_s=TIMEOUT_S)
    expected = (
        "topology pp1·dp1·tp4 needs 4 ranks but the process group has 2; "
        "choose degrees whose product is 2"
    )
    assert messages == [expected, expected]


def test_backend_for_device_type() -> None:
    assert backend_for("cuda") == "nccl"
    assert backend_for("cpu") == "gloo"


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
