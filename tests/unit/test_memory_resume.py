"""The step an in-place repair resumes from memory (workers/protocol/memory_resume.py), against a brute force
over every small case: the newest step in [floor, below) that every holder group can serve."""

from __future__ import annotations

import itertools
import random

from etrain.workers.protocol.memory_resume import memory_resume_step


def _brute(held, groups, floor, below):
    for step in range(below - 1, floor - 1, -1):
        if all(any(step in held[rank] for rank in group) for group in groups):
            return step
    return None


def _dp_groups(world: int, dp: int) -> list[tuple[int, ...]]:
    """Replica groups of a (dp, rest) layout, dp slowest: ranks r, r + rest, r + 2·rest..."""
    rest = world // dp
    return [tuple(range(r, world, rest)) for r in range(rest)]


def test_a_live_step_a_replica_holds_serves_the_replacement():
    # DP2, committed step 8: rank 0 survived with its copies of 4 and 8 and its live state at 9;
    # rank 1 is a new process with nothing.
    assert memory_resume_step([{4, 8, 9}, set()], [(0, 1)], floor=8, below=24) == 9
    # Without replicas (ZeRO: each rank is its own group) the new rank cannot be served at all.
    assert memory_resume_step([{4, 8, 9}, set()], [(0,), (1,)], floor=8, below=24) is None


def test_never_before_the_commit_nor_at_the_last_step():
    assert memory_resume_step([{4}, {4}], [(0, 1)], floor=8, below=24) is None  # older than the commit
    assert memory_resume_step([{8, 24}, set()], [(0, 1)], floor=8, below=24) == 8  # the final save is still due


def test_every_group_must_be_served_and_every_rank_belong_to_one():
    # DP2 × TP2 (groups {0,2} and {1,3}): rank 1 died; rank 3 holds 9, rank 0 and 2 hold 9 too.
    held = [{8, 9}, set(), {8, 9}, {8, 9}]
    assert memory_resume_step(held, [(0, 2), (1, 3)], floor=8, below=20) == 9
    # Rank 3 fell behind (it holds only 8): 8 is the newest step both groups serve.
    assert memory_resume_step([{8, 9}, set(), {8, 9}, {8}], [(0, 2), (1, 3)], floor=8, below=20) == 8
    assert memory_resume_step(held, [(0, 2)], floor=8, below=20) is None  # ranks 1 and 3 in no group
    assert memory_resume_step(held, [], floor=8, below=20) is None


def test_against_a_brute_force_over_small_worlds():
    rng = random.Random(0)
    for trial in range(3000):
        world = rng.choice((1, 2, 3, 4, 6, 8))
        dp = rng.choice([d for d in (1, 2, 3, 4, 6, 8) if world % d == 0])
        groups = _dp_groups(world, dp) if rng.random() < 0.8 else [(rank,) for rank in range(world)]
        floor = rng.randint(0, 6)
        below = floor + rng.randint(1, 6)
        held = [set(rng.sample(range(0, 14), rng.randint(0, 3))) for _ in range(world)]
        got = memory_resume_step(held, groups, floor=floor, below=below)
        assert got == _brute(held, groups, floor, below), (trial, held, groups, floor, below, got)
        if got is not None:
            assert floor <= got < below
    for world, dp in itertools.product((2, 4, 8), (1, 2, 4)):  # every rank holding a step: that step
        if world % dp == 0:
            assert memory_resume_step([{5}] * world, _dp_groups(world, dp), floor=5, below=6) == 5
