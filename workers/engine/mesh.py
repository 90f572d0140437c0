"""Build the torch ``DeviceMesh`` (and so the process groups) from a ``Topology``.

The root mesh has shape ``(pp, dp_replicate, dp_shard, tp)`` with those dimension names: the data
parallel axis is split into HSDP's replica groups and the ranks that shard the model inside one
replica (``dp = dp_replicate × dp_shard``; ``dp_replicate = 1`` is plain FSDP / DDP, a size-1
dimension). The two data-parallel dimensions are then flattened into one ``dp`` mesh, so everything
that means "all data-parallel ranks" — the sampler's dp coordinate, the loss average, DDP, ZeRO-1,
plain FSDP — keeps using one ``dp`` axis whatever the HSDP split, and only FSDP2 under HSDP sees the
2-D ``(dp_replicate, dp_shard)`` mesh.

DeviceMesh lays ranks out row-major (last dimension fastest), which is exactly Megatron order:
``rank = ((pp·R + r)·S + s)·tp + t = (pp·dp + (r·S + s))·tp + t``, so the flattened ``dp`` index is
``r·S + s`` = ``Topology``'s dp coordinate and each axis's process group equals the group
``Topology`` computes for it; ``tests/integration/test_mesh_groups.py`` checks that on real gloo
process groups.

Expert parallelism (``parallelism.ep``, torchtitan's composition) borrows its ranks from ``dp``: a second
mesh, :attr:`ParallelMesh.expert_root`, views the same ranks as ``(pp, edp, ep, tp)`` with ``dp = edp × ep``
(``ep`` fastest, so the flattened dp index is ``edp_index · ep + ep_index``, as on the root mesh, and an
ep group is a run of consecutive dp ranks, on one node where a node holds them). Its ``(edp, ep)``
sub-mesh is what the expert weights are DTensors on: ``Shard(0)`` (by expert) over ``ep``, ``Replicate``
over ``edp``, the ranks that hold the same experts and average their gradients. Where FSDP2 shards the
experts (``layout_rules.expert_fsdp_shards``, ``experts_sharded``) the weights are DTensors on ``ep`` alone and
FSDP2 adds its own dimension over the ranks holding the same experts (:attr:`ParallelMesh.expert_fsdp`):
``edp``; under HSDP the expert mesh is ``(pp, edp_replicate, edp_shard, ep, tp)``
(:data:`EXPERT_HSDP_MESH_DIMS`), the same ranks with edp split into the replica groups and the ranks of one
group that hold the same experts, ``edp`` is its flattening, and FSDP2 gets ``(edp_replicate, edp_shard)``.

Context parallelism (``parallelism.cp``) adds a ``cp`` dimension between ``dp_shard`` and ``tp``: the root
mesh is then ``(pp, dp_replicate, dp_shard, cp, tp)`` (:data:`CP_MESH_DIMS`; Megatron order with cp between
dp and tp, as ``Topology`` numbers it), and a second flattening, ``dp_cp`` = ``(dp_replicate, dp_shard,
cp)``, is the group the parameters' gradients are averaged over (DDP, FSDP2): torchtitan's composition,
where cp ranks are one more data dimension for the parameters. Without cp the root mesh is the 4-D one
above, so every existing layout keeps its ranks and groups. With both, the ranks are numbered ``(pp, edp, ep,
cp, tp)`` and the expert mesh lists them as ``(pp, edp, cp, ep, tp)`` (:data:`EXPERT_CP_MESH_DIMS`, a permuted
rank map): an ep group is the dp ranks of one cp index, which hold the same slice of their sequences, and the
expert weights are replicated over cp like every other parameter, or, where FSDP2 shards them, sharded over
the flattened ``edp_cp`` = ``(edp, cp)`` (under HSDP ``(edp_replicate, edp_shard_cp)``,
:data:`EXPERT_HSDP_CP_MESH_DIMS`).

torch 2.13 deprecates slicing a flattened dimension out of the root mesh (``root["dp"]``) and asks
callers to keep the mesh ``_flatten`` returns; :class:`ParallelMesh` is that bookkeeping: one object
that hands out every named sub-mesh. Nothing is cached here: callers hold the ``ParallelMesh`` and
pass it (or one of its sub-meshes) to whatever needs a group, so a restart or an elastic resize
simply builds a new one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.topology import Topology, TopologyError

__all__ = [
    "CP_MESH_DIMS",
    "EXPERT_CP_MESH_DIMS",
    "EXPERT_HSDP_CP_MESH_DIMS",
    "EXPERT_HSDP_MESH_DIMS",
    "EXPERT_MESH_DIMS",
    "MESH_DIMS",
    "ParallelMesh",
    "backend_for",
    "build_device_mesh",
    "mesh_group_ranks",
    "validate_dp_replicate",
]

#: The root mesh's dimensions, slowest-varying first.
MESH_DIMS: tuple[str, str, str, str] = ("pp", "dp_replicate", "dp_shard", "tp")
#: The root mesh's dimensions with context parallelism (``cp > 1``), slowest-varying first.
CP_MESH_DIMS: tuple[str, str, str, str, str] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: Every name :meth:`ParallelMesh.__getitem__` accepts.
_NAMES = (*MESH_DIMS, "dp", "ep", "edp", "cp", "dp_cp")
#: The expert mesh's dimensions (``ep > 1`` only), slowest-varying first.
EXPERT_MESH_DIMS: tuple[str, str, str, str] = ("pp", "edp", "ep", "tp")
#: The expert mesh's dimensions with context parallelism too: cp listed before ep (the ranks are numbered with
#: cp between dp and tp, as on the root mesh: :func:`_expert_meshes` says why).
EXPERT_CP_MESH_DIMS: tuple[str, str, str, str, str] = ("pp", "edp", "cp", "ep", "tp")
#: The expert mesh's dimensions where FSDP2 shards the experts under HSDP: edp split as the replica groups and
#: the ranks of one replica that hold the same experts (``layout_rules.expert_fsdp_shards``).
EXPERT_HSDP_MESH_DIMS: tuple[str, str, str, str, str] = ("pp", "edp_replicate", "edp_shard", "ep", "tp")
#: ... and with context parallelism too.
EXPERT_HSDP_CP_MESH_DIMS: tuple[str, ...] = ("pp", "edp_replicate", "edp_shard", "cp", "ep", "tp")


def backend_for(device_type: str, *, cpu_offload: bool = False) -> str:
    """The collective backend for a device type: NCCL on CUDA, gloo everywhere else (CPU).

    With FSDP2's CPU offload on CUDA the gradient shards live in host memory, and the gradient
    norm's reductions over them run on CPU tensors, which NCCL cannot carry: the group then gets
    gloo for CPU tensors beside NCCL for CUDA ones (``"cuda:nccl,cpu:gloo"``, as torchtitan does).
    """
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def validate_dp_replicate(dp: int, dp_replicate: int) -> None:
    """HSDP splits the dp ranks into ``dp_replicate`` equal replica groups: it must divide ``dp``
    (``etrain.workers.protocol.layout_rules.dp_replicate_problems``)."""
    layout_rules.check(layout_rules.dp_replicate_problems(dp, dp_replicate))


@dataclass(frozen=True)
class ParallelMesh:
    """The root ``(pp, dp_replicate, dp_shard, tp)`` mesh and its flattened ``dp`` mesh.

    ``mesh[name]`` is the sub-mesh of ``name`` holding this rank: ``"pp"``, ``"dp"``, ``"tp"``,
    ``"dp_replicate"`` or ``"dp_shard"`` (1-D each), and with expert parallelism ``"ep"`` and ``"edp"``.
    :attr:`fsdp` is the mesh FSDP2 runs on; :attr:`expert_root` the ranks seen as ``(pp, edp, ep, tp)``
    (None without expert parallelism), and :attr:`expert_fsdp` the mesh FSDP2 shards the experts on.
    """

    root: DeviceMesh
    dp: DeviceMesh
    expert_root: DeviceMesh | None = None
    #: context parallelism: the flattened ``(dp_replicate, dp_shard, cp)`` mesh (None when cp = 1)
    dp_cp: DeviceMesh | None = None
    #: context parallelism under HSDP: the 2-D ``(dp_replicate, dp_shard_cp)`` mesh FSDP2 runs on
    hsdp_cp: DeviceMesh | None = None
    #: under HSDP with the experts sharded: ``edp`` flattened from the expert root's ``(edp_replicate, edp_shard)``
    edp: DeviceMesh | None = None
    #: where FSDP2 shards the experts (``build_device_mesh(experts_sharded=True)``): the mesh it shards them on
    experts_fsdp: DeviceMesh | None = None

    def __getitem__(self, name: str) -> DeviceMesh:
        if name == "dp":
            return self.dp
        if name == "dp_cp":
            return self.dp if self.dp_cp is None else self.dp_cp
        if name == "cp" and self.dp_cp is None:
            raise TopologyError("mesh axis 'cp' exists only with context parallelism (parallelism.cp > 1)")
        if name in ("ep", "edp"):
            if self.expert_root is None:
                raise TopologyError(f"mesh axis {name!r} exists only with expert parallelism (parallelism.ep > 1)")
            if name == "edp" and self.edp is not None:
                return self.edp
            return self.expert_root[name]
        if name not in CP_MESH_DIMS:
            raise TopologyError(f"mesh axis must be one of {_NAMES}, got {name!r}")
        return self.root[name]

    @property
    def fsdp(self) -> DeviceMesh:
        """FSDP2's mesh: the 1-D ``dp`` mesh (shard over every dp rank), or for HSDP the 2-D
        ``(dp_replicate, dp_shard)`` mesh (replicate over dim 0, shard over dim 1). With context
        parallelism the flattened ``dp_cp`` mesh, or under HSDP ``(dp_replicate, dp_shard_cp)``: a replica's
        dp_shard·cp ranks shard the model (torchtitan's composition)."""
        if self.hsdp_cp is not None:
            return self.hsdp_cp
        if self.dp_cp is not None:
            return self.dp_cp
        if self.root.size(MESH_DIMS.index("dp_replicate")) == 1:
            return self.dp
        return self.root["dp_replicate", "dp_shard"]

    @property
    def expert_fsdp(self) -> DeviceMesh:
        """The mesh FSDP2 shards the experts on (``layout_rules.expert_fsdp_shards``): the ranks that hold the
        same experts, ``edp`` (``edp_cp``, flattened, with context parallelism), or under HSDP the 2-D
        ``(edp_replicate, edp_shard)`` mesh (``(edp_replicate, edp_shard_cp)``): replicated over the replica
        groups, sharded over the ranks of one group that hold the same experts."""
        if self.experts_fsdp is None:
            raise TopologyError(
                "the experts' FSDP2 mesh exists only where FSDP2 shards them (build_device_mesh(experts_sharded=True))"
            )
        return self.experts_fsdp

    @property
    def shape(self) -> tuple[int, ...]:
        """The root mesh's shape, in :data:`MESH_DIMS` order."""
        return tuple(self.root.mesh.shape)

    def get_group(self, name: str) -> dist.ProcessGroup:
        """The process group of axis ``name`` that holds this rank."""
        return self[name].get_group()

    def get_coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate on the root mesh, in :data:`MESH_DIMS` (or :data:`CP_MESH_DIMS`) order."""
        return tuple(self.root.get_coordinate())


def build_device_mesh(
    topology: Topology, device_type: str, *, dp_replicate: int = 1, ep: int = 1, experts_sharded: bool = False
) -> ParallelMesh:
    """The ``(pp, dp_replicate, dp_shard, tp)`` mesh of ``topology``, with ``dp`` flattened, and with
    ``ep > 1`` the ``(pp, edp, ep, tp)`` expert mesh over the same ranks. With ``topology.cp > 1`` the root
    is ``(pp, dp_replicate, dp_shard, cp, tp)`` and ``dp_cp`` is flattened too. ``experts_sharded``: FSDP2
    shards the experts (``layout_rules.expert_fsdp_shards``), so :attr:`ParallelMesh.expert_fsdp` is built.

    The caller owns the default process group: it must already be initialized (with
    ``backend_for(device_type)``) and span exactly ``topology.world_size`` ranks. Every rank
    must call this collectively, since creating the per-axis groups is a collective. Torch's caches of
    earlier meshes in this process are dropped first (:func:`forget_mesh_state` says why).
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
    validate_dp_replicate(topology.dp, dp_replicate)
    forget_mesh_state()  # an earlier job's or attempt's mesh in this process must not answer for this one
    expert_root = edp = experts_fsdp = None
    if ep > 1:
        expert_root, edp, experts_fsdp = _expert_meshes(
            topology, device_type, dp_replicate=dp_replicate, ep=ep, experts_sharded=experts_sharded
        )
    elif experts_sharded:
        raise TopologyError(f"FSDP2 shards the experts apart only under expert parallelism, not at ep={ep}")
    if topology.cp > 1:
        shape = (topology.pp, dp_replicate, topology.dp // dp_replicate, topology.cp, topology.tp)
        root = init_device_mesh(device_type, shape, mesh_dim_names=CP_MESH_DIMS)
        dp = root["dp_replicate", "dp_shard"]._flatten("dp")
        dp_cp = root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        hsdp_cp = None
        if dp_replicate > 1:  # torch warns that slicing a flattened dimension is deprecated; torchtitan does it too
            root["dp_shard", "cp"]._flatten("dp_shard_cp")
            hsdp_cp = root["dp_replicate", "dp_shard_cp"]
        return ParallelMesh(
            root=root,
            dp=dp,
            dp_cp=dp_cp,
            hsdp_cp=hsdp_cp,
            expert_root=expert_root,
            edp=edp,
            experts_fsdp=experts_fsdp,
        )
    shape = (topology.pp, dp_replicate, topology.dp // dp_replicate, topology.tp)
    root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    dp = root["dp_replicate", "dp_shard"]._flatten("dp")
    return ParallelMesh(root=root, dp=dp, expert_root=expert_root, edp=edp, experts_fsdp=experts_fsdp)


def _expert_meshes(
    topology: Topology, device_type: str, *, dp_replicate: int, ep: int, experts_sharded: bool
) -> tuple[DeviceMesh, DeviceMesh | None, DeviceMesh | None]:
    """The expert root mesh (the same ranks, dp split as ``(edp, ep)``), ``edp`` where it is a flattening
    (HSDP with the experts sharded), and the mesh FSDP2 shards the experts on (None unless
    ``experts_sharded``).

    With cp an ep group is the dp ranks of one cp index (the ranks that hold the same slice of their
    sequences), so tokens only ever meet tokens of their slice. The ranks are numbered ``(pp, edp, ep, cp,
    tp)`` (Megatron order, as the root mesh), but the mesh lists its dimensions as ``(pp, edp, cp, ep, tp)``
    (a permuted rank map): the ranks holding the same experts, edp and cp, are then adjacent dimensions,
    which FSDP2 needs. Flattened across ep instead, FSDP2's mesh for the experts joined with ep gave DTensor
    a mesh whose dimensions torch 2.13's redistribution cannot slice (``KeyError: Mesh dim indices should be
    in ascending order``, in the gradient norm's reduction)."""
    if topology.dp % ep:
        raise TopologyError(f"parallelism.ep={ep} does not divide parallelism.dp={topology.dp}")
    cp = topology.cp > 1
    hsdp = experts_sharded and dp_replicate > 1  # as the dense weights: edp as (replicas, ranks of one replica)
    if hsdp and (topology.dp // dp_replicate) % ep:
        raise TopologyError(
            f"the experts' HSDP mesh needs ep={ep} to divide dp / dp_replicate = {topology.dp // dp_replicate}"
        )
    edp_dims = (dp_replicate, topology.dp // dp_replicate // ep) if hsdp else (topology.dp // ep,)
    names = (
        (EXPERT_HSDP_CP_MESH_DIMS if cp else EXPERT_HSDP_MESH_DIMS)
        if hsdp
        else (EXPERT_CP_MESH_DIMS if cp else EXPERT_MESH_DIMS)
    )
    with torch.device("cpu"):  # the rank map lives on the CPU whatever the default device (as init_device_mesh's)
        ranks = torch.arange(topology.world_size, dtype=torch.int).view(
            topology.pp, *edp_dims, ep, topology.cp, topology.tp
        )
    ep_axis = 1 + len(edp_dims)
    ranks = ranks.transpose(ep_axis, ep_axis + 1) if cp else ranks.squeeze(ep_axis + 1)  # cp before ep
    root = DeviceMesh(device_type, ranks, mesh_dim_names=names)
    edp = root["edp_replicate", "edp_shard"]._flatten("edp") if hsdp else None  # the ranks as (pp, edp, ep, tp)
    if not experts_sharded:
        return root, edp, None
    if hsdp:
        if not cp:
            return root, edp, root["edp_replicate", "edp_shard"]
        # torch warns that slicing a flattened dimension is deprecated; the dense weights' hsdp_cp does it too
        root["edp_shard", "cp"]._flatten("edp_shard_cp")
        return root, edp, root["edp_replicate", "edp_shard_cp"]
    return root, edp, root["edp", "cp"]._flatten("edp_cp") if cp else root["edp"]


def mesh_group_ranks(mesh: ParallelMesh, axis: str) -> tuple[int, ...]:
    """Global ranks of this rank's process group along ``axis``, in group-rank order."""
    if axis not in _NAMES:
        raise TopologyError(f"axis must be one of {_NAMES}, got {axis!r}")
    return tuple(dist.get_process_group_ranks(mesh.get_group(axis)))


def forget_mesh_state() -> None:
    """Drop torch's DTensor caches that hold device meshes, before a process builds a new mesh for a new job
    or attempt on new process groups (an in-place repair's survivors, a rank process reused by its tenant).

    Why by hand: ``DeviceMesh`` equality is by ranks, layout, dimension names and creating thread, not by the
    process groups it holds, so the caches below answer a new mesh with objects made for an equal mesh of
    an earlier job, whose groups were destroyed: the first collective then fails with "Could not resolve
    the process group registered under the name N" wherever the new groups got other names (another
    number of groups created before the mesh). Torch offers no single reset (2.13); each cache is cleared
    where torch exposes it, and a cache torch has moved or renamed is skipped, not an error:
    ``tests/integration/test_mesh_reuse.py`` fails if one that matters is missed.
    """
    from torch.distributed.tensor import DTensor, _redistribute

    _redistribute.clear_redistribute_planner_cache()  # planners keep their mesh and flattened meshes
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:  # the C++ dispatch fast path's cache of output specs (their meshes)
        clear_native()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (
        getattr(getattr(propagator, "propagate_op_sharding", None), "cache", None),  # this thread's
        getattr(propagator, "_propagate_tensor_meta_cached", None),
    ):
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
