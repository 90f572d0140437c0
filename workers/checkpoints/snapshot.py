"""In-memory copies of a rank's state at a checkpointed step (or where a failed attempt left it), and handing
them to a replacement rank.

Why: when one rank dies, the others still hold, in memory, exactly what the last checkpoint holds
on storage, if they kept a copy when they saved it. Restoring from that copy (and sending it to the
replacement from a data-parallel replica over the new process group) skips reading the checkpoint
back from storage, which at scale is the slowest part of a recovery. The checkpoint on storage
stays the fallback whenever memory cannot serve every rank (no replica of some rank's state, a
layout that shards state across data-parallel ranks, a snapshot of another step).

A rank whose attempt failed also keeps its live state, at the step it completed last: its collectives with
the dead rank failed before any rank could apply the next update, so that state is exactly the run's at
that step, and a repair that resumes there recomputes nothing (``workers/protocol/memory_resume.py`` picks
the newest step memory can serve to every rank, never one before the last commit).

What a snapshot holds is what a DCP checkpoint holds, through the same state-dict code path
(``etrain.workers.checkpoints.checkpoint_state.collect_state`` / ``apply_state``): each rank's local model and flattened
optimizer state, copied to host memory, and the checkpoint's ``extra`` (next step, data position,
RNG). So a restore from memory is bit-identical to a restore from the disk checkpoint of that step
(``tests/integration/test_snapshot.py``).

Which layouts have replicas: with ``zero=0`` (DDP) every rank of a data-parallel group holds the same
model and optimizer state (its tensor/pipeline shard of them), so any surviving member of the dead
rank's dp group can serve it. With ZeRO-1/2/3 the state is sharded across dp, so a dead rank's share
exists nowhere else: those layouts restore from storage (the survivors still keep their processes).
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


def take_snapshot(
    step: int, model_parts: list[nn.Module], optimizers: list[Optimizer], extra: dict[str, Any]
) -> Snapshot:
    """Copy this rank's local state to host memory (a device-to-host copy on GPU)."""
    collected = collect_state(model_parts, optimizers)
    state = {
        section: {key: _to_host(value) for key, value in values.items()} for section, values in collected.state.items()
    }
    return Snapshot(step=step, state=state, extra=copy.deepcopy(extra))


def restore_snapshot(snapshot: Snapshot, model_parts: list[nn.Module], optimizers: list[Optimizer]) -> dict[str, Any]:
    """Load ``snapshot`` into the parts and optimizers (the same layout); returns its ``extra``."""
    collected = collect_state(model_parts, optimizers)
    for section, values in collected.state.items():
        saved = snapshot.state[section]
        missing = values.keys() - saved.keys()
        if missing:
            raise ValueError(f"the snapshot of step {snapshot.step} lacks {section} keys {sorted(missing)[:3]}")
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


def replicated(zero: int, dp: int) -> bool:
    """Whether every rank's state has a copy on the other ranks of its data-parallel group."""
    return zero == 0 and dp > 1


def share_snapshots(
    held: dict[int, Snapshot], dp_groups: list[tuple[int, ...]], *, replicas: bool, floor: int, below: int
) -> tuple[Snapshot | None, str]:
    """Collective over the default group: every rank ends with a snapshot of one agreed step, or all with None.

    Each rank says which steps it holds (``held``: its checkpoint copies and, after a failed attempt, its
    live state). They agree on the newest step in ``[floor, below)`` that memory can serve to every rank
    (``workers/protocol/memory_resume.py``): with ``replicas`` a dp group is served when one member holds
    it, without them every rank must hold it itself. A rank that holds it keeps its own ("own memory"); one
    that does not receives it from the lowest rank of its dp group that has it ("rank R's memory"). With no
    such step every rank returns None and the caller restores from storage, together (DCP's load is
    collective). Returns (snapshot or None, where it came from).
    """
    from etrain.workers.protocol.memory_resume import memory_resume_step

    world = dist.get_world_size()
    offers: list[Any] = [None] * world
    dist.all_gather_object(offers, sorted(held))
    groups = dp_groups if replicas else [(rank,) for rank in range(world)]
    step = memory_resume_step(offers, groups, floor=floor, below=below)
    if step is None:
        return None, "storage"
    flags = [step in offer for offer in offers]
    own = held.get(step)
    if all(flags):
        return own, "own memory"
    me = dist.get_rank()
    sources = {group: next(rank for rank in group if flags[rank]) for group in dp_groups}
    received, origin = own, "own memory"
    for group, source in sources.items():  # every rank creates every group, in the same order
        process_group = dist.new_group(list(group), backend="gloo")
        if all(flags[rank] for rank in group) or me not in group:
            continue
        payload = [own if me == source else None]
        dist.broadcast_object_list(payload, src=source, group=process_group)
        if own is None:
            received, origin = payload[0], f"rank {source}'s memory"
    return received, origin


def _to_host(value: Any) -> Any:
    if isinstance(value, DTensor):
        value = value.to_local()
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)
