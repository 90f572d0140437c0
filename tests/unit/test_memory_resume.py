"""The step an in-place repair resumes from memory (workers/protocol/memory_resume.py), against a brute force
over every small case: the newest step in [floor, below) that every holder group can serve."""

from __future__ import annotations

import itertools
import random

import pytest

from etrain.workers.protocol.memory_resume import (
    SNAPSHOTS_KEPT,
    every_rank_has_a_replica,
    holder_groups,
    keep_copy,
    memory_resume_step,
    replica_key,
    snapshots_to_drop,
    state_still_fits,
)


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


# -- which ranks hold the same state --------------------------------------------------------------------------


def _state_of(dp_index: int, *, dp: int, zero: int, dp_replicate: int, ep: int) -> tuple:
    """What a dp rank holds, from the mesh coordinates (``workers/engine/mesh.py``): the dense weights' shard
    and optimizer shard, and its experts. Two ranks are replicas exactly when these are equal."""
    dp_shard = dp // dp_replicate
    if zero == 0:
        dense = ("whole",)
    elif zero == 1:
        dense = ("weights whole, optimizer shard", dp_index)  # ZeRO-1 shards the optimizer over every dp rank
    else:
        dense = ("shard", dp_index % dp_shard)  # dp index = replicate · dp_shard + shard
    experts = dp_index % ep  # dp index = edp · ep + ep index
    return dense, experts


def _layouts():
    for dp in range(1, 13):
        for zero in (0, 1, 2, 3):
            for dp_replicate in [r for r in range(1, dp + 1) if dp % r == 0] if zero in (2, 3) else [1]:
                for ep in [e for e in range(1, dp + 1) if dp % e == 0]:
                    yield dp, zero, dp_replicate, ep


def test_replica_holder_groups_are_the_ranks_whose_mesh_coordinates_give_the_same_state():
    """Every layout of up to 12 dp ranks, in a world of two dp groups (tp=2, dp slowest)."""
    for dp, zero, dp_replicate, ep in _layouts():
        layout = {"dp": dp, "zero": zero, "dp_replicate": dp_replicate, "ep": ep}
        dp_groups = _dp_groups(2 * dp, dp)
        got = sorted(holder_groups(dp_groups, **layout))
        expected = sorted(
            tuple(rank for index, rank in enumerate(group) if _state_of(index, **layout) == state)
            for group in dp_groups
            for state in dict.fromkeys(_state_of(index, **layout) for index in range(dp))
        )
        assert got == expected, layout
        assert every_rank_has_a_replica(**layout) == all(len(group) > 1 for group in got), layout


def _state_with_cp(index: int, *, dp: int, zero: int, dp_replicate: int, ep: int, cp: int) -> tuple:
    """What rank ``index`` of a data group holds under context parallelism, from its coordinates (dp index
    ``index // cp``, cp index ``index % cp``) and :func:`_state_of`: cp splits the sequence, so wherever the
    parameters or their optimizer state are sharded (ZeRO, HSDP's shard group) the cp index is part of the
    shard; the experts are replicated over cp."""
    dp_index, cp_index = divmod(index, cp)
    dense, experts = _state_of(dp_index, dp=dp, zero=zero, dp_replicate=dp_replicate, ep=ep)
    return (dense if zero == 0 else (*dense, cp_index)), experts


def test_under_context_parallelism_the_holder_groups_are_every_rank_that_holds_the_same_state():
    """Every layout of up to 12 dp ranks at cp = 2 and 3, in a world of two data groups (tp=2): the holder groups
    are exactly the ranks of a data group that hold the same state (a dp·cp DDP job: one group; with experts,
    the ranks of the same experts, whatever their cp index)."""
    for (dp, zero, dp_replicate, ep), cp in itertools.product(_layouts(), (2, 3)):
        layout = {"dp": dp, "zero": zero, "dp_replicate": dp_replicate, "ep": ep, "cp": cp}
        data_groups = _dp_groups(2 * dp * cp, dp * cp)
        got = sorted(holder_groups(data_groups, **layout))
        expected = sorted(
            tuple(rank for index, rank in enumerate(group) if _state_with_cp(index, **layout) == state)
            for group in data_groups
            for state in dict.fromkeys(_state_with_cp(index, **layout) for index in range(dp * cp))
        )
        assert got == expected, layout
    assert holder_groups([(0, 1)], dp=1, zero=0, cp=2) == [(0, 1)]  # one replica split over two cp ranks
    assert holder_groups([(0, 1)], dp=1, zero=3, cp=2) == [(0,), (1,)]  # FSDP2 over the two cp ranks
    # a shard group of 2 dp shards x 2 cp ranks, replicated twice
    assert holder_groups([range(8)], dp=4, zero=3, dp_replicate=2, cp=2) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # dp2·cp2 with the experts split over ep=2: each dp index's cp pair holds the same experts (before: no
    # group had two ranks, so such a job never resumed from memory)
    assert holder_groups([range(4)], dp=2, zero=0, ep=2, cp=2) == [(0, 1), (2, 3)]
    assert every_rank_has_a_replica(dp=2, zero=0, ep=2, cp=2)


def test_the_layouts_that_have_replicas():
    assert every_rank_has_a_replica(dp=2, zero=0)  # DDP
    assert not every_rank_has_a_replica(dp=1, zero=0)  # one rank: nobody to hold a copy
    assert not every_rank_has_a_replica(dp=4, zero=1)  # ZeRO-1: the optimizer state is sharded
    assert not every_rank_has_a_replica(dp=4, zero=3)  # plain FSDP2
    assert every_rank_has_a_replica(dp=4, zero=3, dp_replicate=2)  # HSDP: shard s is held by ranks s and s + 2
    assert not every_rank_has_a_replica(dp=2, zero=0, ep=2)  # DDP, experts split in two: rank 1's are not rank 0's
    assert every_rank_has_a_replica(dp=4, zero=0, ep=2)
    assert not every_rank_has_a_replica(dp=8, zero=2, dp_replicate=2, ep=8)
    assert holder_groups([(0, 1, 2, 3), (4, 5, 6, 7)], dp=4, zero=3, dp_replicate=2) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert holder_groups([(0, 1)], dp=2, zero=3) == [(0,), (1,)]


@pytest.mark.parametrize(
    "layout", [{"dp": 0, "zero": 0}, {"dp": 4, "zero": 3, "dp_replicate": 3}, {"dp": 4, "zero": 0, "ep": 3}]
)
def test_a_layout_that_cannot_exist_is_refused(layout):
    with pytest.raises(ValueError, match="not a data-parallel layout"):
        replica_key(0, **layout)


def test_a_copy_serves_another_size_only_where_state_is_not_sharded_over_dp():
    """An in-place resize changes dp: a DDP rank's state is whole at any size; a ZeRO/HSDP shard is of other
    tensors at another size (HSDP dp 4 -> 2 halves its shard groups), so only a copy from the same size fits."""
    assert state_still_fits(taken_at_dp=2, dp=1, zero=0) and state_still_fits(taken_at_dp=1, dp=4, zero=0)
    for zero in (1, 2, 3):
        assert state_still_fits(taken_at_dp=4, dp=4, zero=zero)
        assert not state_still_fits(taken_at_dp=4, dp=2, zero=zero)
        assert not state_still_fits(taken_at_dp=2, dp=4, zero=zero)
    assert not state_still_fits(taken_at_dp=None, dp=2, zero=0)  # unknown: never


@pytest.mark.parametrize(
    ("held", "new_step", "dropped"),
    [
        ((), 5, []),
        ((5,), 10, []),
        ((5, 10), 15, [5]),  # the oldest goes before step 15's copy is taken: two copies at most, never three
        ((5, 10), 10, []),  # a copy of a held step replaces it
        ((5, 10), 3, [3]),  # older than both held: not taken at all
        ((5, 10, 15), 20, [5, 10]),
    ],
)
def test_the_copies_to_drop_are_all_but_the_newest_two(held, new_step, dropped):
    assert snapshots_to_drop(held, new_step) == dropped


@pytest.mark.parametrize(
    ("held", "step", "during", "after"),
    [
        ((), 5, [], [5]),
        ((5,), 10, [5], [5, 10]),
        ((5, 10), 15, [10], [10, 15]),  # the oldest goes before step 15's copy is taken: never three copies
        ((5, 10), 10, [5], [5, 10]),  # a held step copied again: its old copy goes first too
        ((5, 10, 15), 20, [15], [15, 20]),
    ],
)
def test_a_rank_drops_its_old_copies_before_it_takes_a_new_one(held, step, during, after):
    kept = {s: f"copy of {s}" for s in held}
    seen = []

    def take():
        seen.append(sorted(kept))  # what the rank holds while it copies
        return f"new copy of {step}"

    assert keep_copy(kept, step, take)
    assert seen == [during] and len(during) < SNAPSHOTS_KEPT
    assert sorted(kept) == after and kept[step] == f"new copy of {step}"


def test_a_copy_older_than_the_two_kept_is_not_taken_and_a_failed_take_keeps_nothing_new():
    kept = {5: "a", 10: "b"}
    assert not keep_copy(kept, 3, lambda: pytest.fail("no copy of an older step is taken"))
    assert kept == {5: "a", 10: "b"}

    def fail():
        raise MemoryError("no host memory left")

    with pytest.raises(MemoryError):
        keep_copy(kept, 15, fail)
    assert kept == {10: "b"}  # the oldest went before the take, as the docstring says
