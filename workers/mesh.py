"""Build the torch ``DeviceMesh`` (and so the process groups) from a ``Topology``.

The mesh has shape ``(pp, dp, tp)`` with named axes ``("pp", "dp", "tp")``. DeviceMesh lays ranks
out row-major (last axis fastest), which is exactly Megatron order, so each mesh axis's process
group equals the group ``Topology`` computes for it; ``tests/integration/test_mesh_groups.py``
checks that on real gloo process groups.

Nothing is cached here: callers hold the mesh and pass it (or ``mesh[axis]``) to whatever needs
a group, so a restart or an elastic resize simply builds a new one.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workers.topology import AXES, Topology, TopologyError

__all__ = ["backend_for", "build_device_mesh", "mesh_group_ranks"]


def backend_for(device_type: str) -> str:
    """The collective backend for a device type: NCCL on CUDA, gloo everywhere else (CPU)."""
    return "nccl" if device_type == "cuda" else "gloo"


def build_device_mesh(topology: Topology, device_type: str) -> DeviceMesh:
    """The ``(pp, dp, tp)`` DeviceMesh of ``topology`` over the default process group.

    The caller owns the default process group: it must already be initialized (with
    ``backend_for(device_type)``) and span exactly ``topology.world_size`` ranks. Every rank
    must call this collectively, since creating the per-axis groups is a collective.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "build_device_mesh needs an initialized default process group; call "
            "torch.distributed.init_process_group first"
        )
    world_size = dist.get_world_size()
    if world_size != topology.world_size:
        raise TopologyError(
            f"topology {topology} needs {topology.world_size} ranks but the process group has "
            f"{world_size}; choose degrees whose product is {world_size}"
        )
    return init_device_mesh(device_type, topology.mesh_shape, mesh_dim_names=AXES)


def mesh_group_ranks(mesh: DeviceMesh, axis: str) -> tuple[int, ...]:
    """Global ranks of this rank's process group along ``axis``, in group-rank order."""
    if axis not in AXES:
        raise TopologyError(f"axis must be one of {AXES}, got {axis!r}")
    return tuple(dist.get_process_group_ranks(mesh.get_group(axis)))
