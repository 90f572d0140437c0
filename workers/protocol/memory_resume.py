"""Which step an in-place repair resumes from when the survivors still hold their state in memory (pure).

Why: a rank that dies mid-step leaves its peers holding exactly the state of the last step they completed
(their collectives with the dead rank failed before any of them could apply the next update). Resuming
there, instead of at the last committed checkpoint, recomputes nothing: the lost rank's state comes from a
data-parallel replica, as it does for the committed step (``workers/checkpoints/snapshot.py``). The
committed checkpoint stays the floor and the fallback: it is what storage holds, whatever memory does.

Each rank offers the steps it holds in memory: the copies it kept at its last checkpoints and, after a
failed attempt, its live state at the step it completed last. The ranks agree on the newest step that every
*holder group* can serve: a group is a set of ranks with the same state (a rank's data-parallel and
context-parallel replicas under DDP, the ranks of the same shard under HSDP, narrowed to those holding the same experts under expert
parallelism; the rank alone where no replica exists: :func:`holder_groups`), and a group is served when
one member holds the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import TypeVar

T = TypeVar("T")

__all__ = [
    "every_rank_has_a_replica",
    "holder_groups",
    "memory_resume_step",
    "replica_key",
    "snapshots_are_read",
    "state_still_fits",
]


def replica_key(index: int, *, dp: int, zero: int, dp_replicate: int = 1, ep: int = 1, cp: int = 1) -> tuple:
    """What rank ``index`` of a data group holds (the ``dp · cp`` ranks of one pipeline stage and tp index, in
    the order ``Topology.data_groups`` lists them: index ``dp_index · cp + cp_index``), as a key: two ranks of
    a data group hold the same state exactly when their keys are equal.

    Why each layout gives its key (the dp index is ``replicate · dp_shard + shard`` under HSDP and
    ``edp · ep + ep_index`` under expert parallelism, ``workers/engine/mesh.py``; context parallelism's cp
    ranks split the sequence, not the model, so they are one more data dimension for the parameters):

    * DDP (``zero: 0``): the dense weights and their optimizer state are whole on every dp and cp rank.
    * ZeRO-1 shards the optimizer state over every dp·cp rank, plain FSDP2 (ZeRO-2/3) the weights too: every
      rank's dense state is its own.
    * HSDP (ZeRO-2/3 with ``dp_replicate > 1``): each replica group of ``dp_shard · cp`` consecutive ranks
      shards the model, so a shard's replicas are the ranks of the same index in the other groups.
    * Expert parallelism splits the experts over ``ep`` consecutive dp indices and replicates them over the
      ``dp / ep`` of the same ``ep`` index and over cp (whole, under every ZeRO stage): a rank's replica must
      hold the same experts, ``(index // cp) mod ep``, as well as the same dense state. Under DDP with
      ``ep = 2``, rank 1 holds the other half of the experts from rank 0: rank 0's state is no replica of
      it; at dp=2·cp=2·ep=2 the cp pair of each dp index holds the same experts.
    """
    if dp < 1 or dp_replicate < 1 or ep < 1 or cp < 1 or dp % dp_replicate or dp % ep:
        raise ValueError(f"not a data-parallel layout: dp={dp}, dp_replicate={dp_replicate}, ep={ep}, cp={cp}")
    if zero == 0:
        dense: int | None = None
    elif zero in (2, 3):
        dense = index % (dp // dp_replicate * cp)
    else:  # ZeRO-1: the optimizer state is sharded over every dp·cp rank
        dense = index
    return dense, (index // cp) % ep


def holder_groups(
    data_groups: Iterable[Sequence[int]], *, dp: int, zero: int, dp_replicate: int = 1, ep: int = 1, cp: int = 1
) -> list[tuple[int, ...]]:
    """The sets of ranks that hold the same state: each data group (its ranks in (dp, cp) order, as
    ``Topology.data_groups`` lists them) split by :func:`replica_key`, in the order of each set's first rank;
    every rank alone where nothing is replicated. What :func:`memory_resume_step` serves, and from whom a
    replacement rank receives its state."""
    layout = {"dp": dp, "zero": zero, "dp_replicate": dp_replicate, "ep": ep, "cp": cp}
    groups: list[tuple[int, ...]] = []
    for data_group in data_groups:
        by_key: dict[tuple, list[int]] = {}
        for index, rank in enumerate(data_group):
            by_key.setdefault(replica_key(index, **layout), []).append(rank)
        groups.extend(tuple(ranks) for ranks in by_key.values())
    return groups


def every_rank_has_a_replica(*, dp: int, zero: int, dp_replicate: int = 1, ep: int = 1, cp: int = 1) -> bool:
    """Whether each rank of a data group shares its state with another one (so memory can serve any one
    lost rank)."""
    groups = holder_groups([range(dp * cp)], dp=dp, zero=zero, dp_replicate=dp_replicate, ep=ep, cp=cp)
    return all(len(group) > 1 for group in groups)


def snapshots_are_read(*, in_place: bool, repairs_in_place: bool, resizable: bool) -> bool:
    """Whether anything can read the copies of their state a job's ranks keep in memory, so whether they keep
    them: only an in-place repair (``fault_tolerance.in_place``, where the survivors' collectives fail with a
    lost peer: gloo, ``repairs_in_place``) or an in-place resize (``resizable``: ``resources.min_dp`` below
    ``max_dp``) restores from them. On NCCL a lost rank relaunches every rank, so a GPU job of one size has no
    reader: its copies would cost two times its state in host memory and a device-to-host copy at every
    checkpoint (``service/planning/plan_host.py``) for nothing."""
    return in_place and (repairs_in_place or resizable)


#: In-memory copies of its state a rank keeps at most: the newest may not be committed yet when a rank dies, the
#: one before it is. What the planner reserves host memory for (``service/planning/plan_host.py``).
SNAPSHOTS_KEPT = 2


def snapshots_to_drop(held: Iterable[int], new_step: int) -> list[int]:
    """The steps whose copies go when a copy of ``new_step`` is to be kept beside ``held``: all but the newest
    :data:`SNAPSHOTS_KEPT` of them, ``new_step`` included when it is older than those (then no copy need be
    taken). :func:`keep_copy` drops them before the new copy is taken."""
    return sorted(set(held) | {new_step})[:-SNAPSHOTS_KEPT]


def keep_copy(kept: MutableMapping[int, T], step: int, take: Callable[[], T]) -> bool:
    """Keep ``take()``, a copy of the state after ``step`` completed steps, in ``kept`` (step -> copy): the copies
    :func:`snapshots_to_drop` names, and an earlier copy of ``step`` itself, are dropped *before* ``take`` runs,
    so that a rank never holds more than :data:`SNAPSHOTS_KEPT` copies while it copies (before 2026-12-06 the
    oldest went after the take: three copies at the peak, while the planner reserves two). Returns whether the
    copy was taken (not when ``step`` is older than the ones kept). Where ``take`` raises, the dropped copies
    are gone: a repair then finds fewer steps in memory, and restores from storage where none serves."""
    dropped = snapshots_to_drop(kept, step)
    for old in dropped:
        kept.pop(old, None)
    if step in dropped:
        return False
    kept.pop(step, None)
    kept[step] = take()
    return True


def state_still_fits(*, taken_at_dp: int | None, dp: int, zero: int) -> bool:
    """Whether a rank's state kept at ``taken_at_dp`` data-parallel ranks can be restored at ``dp`` (an in-place
    resize changes dp and nothing else). Under DDP a rank's state is whole whatever dp is (and under expert
    parallelism a kept rank keeps its ep index, so its experts), so a copy serves any size; wherever state is
    sharded over dp (ZeRO, HSDP: ``dp / dp_replicate`` ranks per shard group) each shard changes with dp, and
    a copy from another size is of other tensors: only the same dp. Unknown (None): never."""
    return taken_at_dp is not None and (zero == 0 or taken_at_dp == dp)


def memory_resume_step(
    held: Sequence[Iterable[int]], groups: Iterable[Sequence[int]], *, floor: int, below: int
) -> int | None:
    """The newest step in ``[floor, below)`` that some member of every group in ``groups`` holds, or None.

    ``held[rank]`` are the steps rank ``rank`` holds in memory (a new rank: none). ``floor`` is the last
    committed step (never resume before what storage holds: the steps since were computed once and kept);
    ``below`` is the job's step count: a job whose every step is done still has its final save to make, so
    the last step is recomputed from an earlier state rather than skipped. Every group must be served, and
    every rank of the world must appear in some group, or nothing is served from memory.
    """
    held_sets = [frozenset(steps) for steps in held]
    group_list = [tuple(group) for group in groups]
    covered = {rank for group in group_list for rank in group}
    if not group_list or covered != set(range(len(held_sets))):
        return None
    candidates = sorted({step for steps in held_sets for step in steps if floor <= step < below}, reverse=True)
    for step in candidates:
        if all(any(step in held_sets[rank] for rank in group) for group in group_list):
            return step
    return None
