"""In-memory copies of a rank's state at a checkpointed step (or where a failed attempt left it), and handing
them to a replacement rank.

Why: when one rank dies, the others still hold, in memory, exactly what the last checkpoint holds
on storage, if they kept a copy when they saved it. Restoring from that copy (and sending it to the
replacement from a data-parallel replica over the new process group) skips reading the checkpoint
back from storage, which at scale is the slowest part of a recovery. The checkpoint on storage
stays the fallback whenever memory cannot serve every rank (no replica of some rank's state, a
layout that shards state across data-parallel ranks, a snapshot of another step).

A rank whose attempt failed also keeps its live state, at the step it completed last: its collectives with
the dead rank failed before any rank could apply the next update (every rank's update waits for gradient
reductions that, through the dp mesh's groups, depend on the dead rank's; the update itself runs no
collective, so a rank has applied all of it or none), so that state is exactly the run's at
that step, and a repair that resumes there recomputes nothing (``workers/protocol/memory_resume.py`` picks
the newest step memory can serve to every rank, never one before the last commit).

What a snapshot holds is what a DCP checkpoint holds, through the same state-dict code path
(``etrain.workers.checkpoints.checkpoint_state.collect_state`` / ``apply_state``): each rank's local model and flattened
optimizer state, copied to host memory, and the checkpoint's ``extra`` (next step, data position,
RNG). So a restore from memory is bit-identical to a restore from the disk checkpoint of that step
(``tests/integration/test_snapshot.py``).

Which layouts have replicas (``workers/protocol/memory_resume.py``: ``replica_key``): with ``zero=0``
(DDP) every rank of a data group (its dp and cp ranks) holds the same model and optimizer state (its
tensor/pipeline shard of them), so any surviving member of the dead rank's data group can serve it; under HSDP (ZeRO-2/3
with ``dp_replicate > 1``) the ranks of the same shard index in the other replica groups can; under expert
parallelism only those that also hold the same experts. With ZeRO-1 and plain FSDP2 the state is sharded
across dp, so a dead rank's share exists nowhere else: those layouts restore from storage (the survivors
still keep their processes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from etrain.workers.checkpoints.checkpoint_state import apply_state, collect_state, restore_rng_state


@dataclass
class Snapshot:
    """One rank's state after ``step`` completed steps, in host memory."""

    step: int
    state: dict[str, dict[str, Any]]  # {"model": {fqn: tensor}, "optim": {flat key: tensor or value}}
    extra: dict[str, Any]
    #: The data-parallel size it was taken at: under ZeRO/HSDP a copy fits only that size
    #: (``workers/protocol/memory_resume.py``: ``state_still_fits``).
    dp: int | None = None


def take_snapshot(
    step: int,
    model_parts: list[nn.Module],
    optimizers: list[Optimizer],
    extra: dict[str, Any],
    *,
    dp: int | None = None,
) -> Snapshot:
    """Copy this rank's local state to host memory (a device-to-host copy on GPU); ``dp``: the layout's
    data-parallel size, which a later restore checks (``Snapshot.dp``)."""
    collected = collect_state(model_parts, optimizers)
    copies: dict[tuple, torch.Tensor] = {}
    state = {
        section: {key: _to_host(value, copies) for key, value in values.items()}
        for section, values in collected.state.items()
    }
    return Snapshot(step=step, state=state, extra=copy.deepcopy(extra), dp=dp)


def restore_snapshot(snapshot: Snapshot, model_parts: list[nn.Module], optimizers: list[Optimizer]) -> dict[str, Any]:
    """Load ``snapshot`` into the parts and optimizers (the same layout); returns its ``extra``. Every key and
    shape is checked before anything is copied (``ValueError``): a copy from another layout never leaves
    the rank half-overwritten."""
    collected = collect_state(model_parts, optimizers)
    for section, values in collected.state.items():
        saved = snapshot.state.get(section, {})
        missing = values.keys() - saved.keys()
        if missing:
            raise ValueError(f"the snapshot of step {snapshot.step} lacks {section} keys {sorted(missing)[:3]}")
        for key, current in values.items():
            if torch.is_tensor(current):
                here = (current.to_local() if isinstance(current, DTensor) else current).shape
                if not torch.is_tensor(saved[key]) or saved[key].shape != here:
                    kept = tuple(saved[key].shape) if torch.is_tensor(saved[key]) else type(saved[key]).__name__
                    raise ValueError(
                        f"the snapshot of step {snapshot.step} was taken under another layout: {section} {key} is "
                        f"{tuple(here)} on this rank, {kept} in the copy"
                    )
    for section, values in collected.state.items():
        saved = snapshot.state[section]
        for key, current in values.items():
            if torch.is_tensor(current):
                local = current.to_local() if isinstance(current, DTensor) else current
                local.copy_(saved[key])
            else:
                values[key] = copy.deepcopy(saved[key])
    apply_state(collected, model_parts, optimizers)
    return copy.deepcopy(snapshot.extra)


def resume_from_snapshot(trainer: Any, snapshot: Snapshot) -> int:
    """Restore a Trainer (parameters, optimizer, RNG, data position) like ``Trainer.restore`` does
    from storage; returns the step to run next."""
    extra = restore_snapshot(snapshot, trainer.model_parts, trainer.optimizers)
    restore_rng_state(extra.get("rng") or {})
    trainer.next_step = int(extra["step"])
    return trainer.next_step


def _layout(parallel: Any) -> dict[str, int]:
    return {
        "dp": parallel.dp,
        "zero": parallel.zero,
        "dp_replicate": parallel.dp_replicate,
        "ep": parallel.ep,
        "cp": parallel.cp,
    }


def has_replicas(parallel: Any) -> bool:
    """Whether every rank of this layout (a ``ParallelConfig``) has a copy of its state on another rank:
    DDP, or HSDP's replica groups, with the same experts under expert parallelism
    (``workers/protocol/memory_resume.py``: ``replica_key``)."""
    from etrain.workers.protocol.memory_resume import every_rank_has_a_replica

    return every_rank_has_a_replica(**_layout(parallel))


def replica_holder_groups(parallel: Any, topology: Any) -> list[tuple[int, ...]]:
    """The sets of ranks of ``topology`` that hold the same state under ``parallel`` (each rank alone where
    nothing is replicated): the groups :func:`share_snapshots` serves."""
    from etrain.workers.protocol.memory_resume import holder_groups

    return holder_groups(topology.data_groups(), **_layout(parallel))


def share_snapshots(
    held: dict[int, Snapshot], groups: list[tuple[int, ...]], *, floor: int, below: int
) -> tuple[Snapshot | None, str]:
    """Collective over the default group: every rank ends with a snapshot of one agreed step, or all with None.

    Each rank says which steps it holds (``held``: its checkpoint copies and, after a failed attempt, its
    live state). They agree on the newest step in ``[floor, below)`` that memory can serve to every rank
    (``workers/protocol/memory_resume.py``): a holder group (``groups``, ranks holding the same state:
    :func:`replica_holder_groups`) is served when one member holds it. A rank that holds it keeps its own
    ("own memory"); one that does not receives it from the lowest rank of its holder group that has it
    ("rank R's memory"). With no such step every rank returns None and the caller restores from storage,
    together (DCP's load is collective). Returns (snapshot or None, where it came from).
    """
    from etrain.workers.protocol.memory_resume import memory_resume_step

    world = dist.get_world_size()
    offers: list[Any] = [None] * world
    dist.all_gather_object(offers, sorted(held))
    step = memory_resume_step(offers, groups, floor=floor, below=below)
    if step is None:
        return None, "storage"
    flags = [step in offer for offer in offers]
    own = held.get(step)
    if all(flags):
        return own, "own memory"
    me = dist.get_rank()
    # Only the groups with a member to serve: every rank computes the same list from the same offers, and
    # creates each of their process groups in the same order (``new_group`` is collective over the world).
    sources = {
        group: next(rank for rank in group if flags[rank]) for group in groups if not all(flags[rank] for rank in group)
    }
    received, origin = own, "own memory"
    for group, source in sources.items():
        process_group = dist.new_group(list(group), backend="gloo")
        if me not in group:
            continue
        payload = [own if me == source else None]
        dist.broadcast_object_list(payload, src=source, group=process_group)
        if own is None:
            received, origin = payload[0], f"rank {source}'s memory"
    return received, origin


def _to_host(value: Any, copies: dict[tuple, torch.Tensor]) -> Any:
    """A host copy of one state-dict value. A tensor held under two names (a tied embedding: the embedding's and
    the output head's) is copied once and kept under both (``copies``, by what the tensor views), so a snapshot
    holds what the rank holds; the restore copies the one copy into the one tensor under each name. For
    Llama-3.2-1B that is 0.98 GiB less host memory per copy (the planner's ``snapshot_bytes``; DCP's staging of
    an async save still copies each name)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if not torch.is_tensor(value):
        return copy.deepcopy(value)
    view = _view_of(value)
    if view is None:
        return value.detach().to("cpu", copy=True)
    if view not in copies:
        copies[view] = value.detach().to("cpu", copy=True)
    return copies[view]


def _view_of(tensor: torch.Tensor) -> tuple | None:
    """What a tensor views (its storage, offset, shape, strides, dtype, device): two names of one tensor view the
    same. None for a tensor subclass without a storage of its own, such as torchao's float8 weight wrapper under
    FSDP2 (its storage cannot be read): copied under each name, as float8 converts linear layers only, never a
    tied embedding (``workers/engine/float8.py``)."""
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return None
    return (pointer, tensor.device, tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
