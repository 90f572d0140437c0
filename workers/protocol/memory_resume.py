"""Which step an in-place repair resumes from when the survivors still hold their state in memory (pure).

Why: a rank that dies mid-step leaves its peers holding exactly the state of the last step they completed
(their collectives with the dead rank failed before any of them could apply the next update). Resuming
there, instead of at the last committed checkpoint, recomputes nothing: the lost rank's state comes from a
data-parallel replica, as it does for the committed step (``workers/checkpoints/snapshot.py``). The
committed checkpoint stays the floor and the fallback: it is what storage holds, whatever memory does.

Each rank offers the steps it holds in memory: the copies it kept at its last checkpoints and, after a
failed attempt, its live state at the step it completed last. The ranks agree on the newest step that every
*holder group* can serve: a group is a set of ranks with the same state (a rank's data-parallel replicas
under DDP; the rank alone where no replica exists), and a group is served when one member holds the step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["memory_resume_step"]


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
