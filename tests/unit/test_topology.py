"""Topology rank arithmetic, checked against an independent brute-force reference.

The reference never does mixed-radix arithmetic: it enumerates the coordinates in Megatron order
with ``itertools.product`` (last axis, TP, varies fastest; rank = position in the enumeration) and
builds each axis's groups by bucketing ranks on the other two coordinates. Coverage:

* every layout with world size <= 64: every rank, every method;
* every factorization of a spread of world sizes up to 4096: the full group partitions;
* every one of the 168,736 layouts with world size <= 4096: coordinates, rank and groups of a few
  sampled ranks, against numpy's ``unravel_index`` / ``ravel_multi_index`` (C order).
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import random
from collections import defaultdict
from functools import cache

import numpy as np
import pytest

from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.topology import AXES, Coords, Topology, TopologyError, parse_topology

SMALL_WORLD_MAX = 64
LARGE_WORLD_SIZES = [128, 256, 512, 1024, 2048, 4096, 96, 384, 768, 1000, 1536, 2310, 3072, 4095]
ALL_LAYOUTS_WORLD_MAX = 4096


@cache
def _factorizations(world_size: int) -> tuple[tuple[int, int, int], ...]:
    """Every (pp, dp, tp) with pp * dp * tp == world_size."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return tuple((pp, dp, world_size // (pp * dp)) for pp in divisors for dp in divisors if world_size % (pp * dp) == 0)


def _layouts(world_size: int) -> list[Topology]:
    return [Topology(pp=pp, dp=dp, tp=tp) for pp, dp, tp in _factorizations(world_size)]


def _all_layouts_up_to(max_world: int) -> list[tuple[int, int, int]]:
    return [
        (pp, dp, tp)
        for pp in range(1, max_world + 1)
        for dp in range(1, max_world // pp + 1)
        for tp in range(1, max_world // (pp * dp) + 1)
    ]


@dataclasses.dataclass
class Reference:
    coords: list[tuple[int, int, int]]  # indexed by rank
    groups: dict[str, list[tuple[int, ...]]]  # axis -> groups, sorted


def brute_force(pp: int, dp: int, tp: int) -> Reference:
    """Megatron order by enumeration; groups by bucketing on the coordinates held fixed."""
    coords = list(itertools.product(range(pp), range(dp), range(tp)))
    buckets: dict[str, dict[tuple[int, int], list[int]]] = {a: defaultdict(list) for a in AXES}
    for rank, (p, d, t) in enumerate(coords):
        buckets["tp"][(p, d)].append(rank)
        buckets["dp"][(p, t)].append(rank)
        buckets["pp"][(d, t)].append(rank)
    groups = {axis: sorted(tuple(g) for g in by_key.values()) for axis, by_key in buckets.items()}
    return Reference(coords=coords, groups=groups)


def _assert_partition(groups: tuple[tuple[int, ...], ...], world_size: int, degree: int) -> None:
    assert all(len(group) == degree for group in groups)
    assert sorted(itertools.chain.from_iterable(groups)) == list(range(world_size))


# -- the reference itself, against the published Megatron example ------------------------------


def test_reference_and_topology_match_megatron_docstring_example() -> None:
    # megatron/core/parallel_state.py: 16 GPUs, tp=2, pp=4 (so dp=2).
    topology = Topology(pp=4, dp=2, tp=2)
    tp_groups = [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]
    dp_groups = [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    pp_groups = [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    reference = brute_force(4, 2, 2)
    assert reference.groups == {"tp": tp_groups, "dp": dp_groups, "pp": pp_groups}
    assert list(topology.tp_groups()) == tp_groups
    assert list(topology.dp_groups()) == dp_groups
    assert list(topology.pp_groups()) == pp_groups
    assert topology.coords(13) == Coords(pp=3, dp=0, tp=1)
    assert topology.rank(pp=3, dp=0, tp=1) == 13


# -- exhaustive: every layout with world <= 64, every rank ------------------------------------


@pytest.mark.parametrize("world_size", range(1, SMALL_WORLD_MAX + 1))
def test_every_rank_of_every_small_layout_matches_brute_force(world_size: int) -> None:
    for topology in _layouts(world_size):
        reference = brute_force(*topology.mesh_shape)
        assert topology.world_size == world_size
        assert topology.mesh_shape == (topology.pp, topology.dp, topology.tp)
        groups = {axis: topology.groups(axis) for axis in AXES}
        assert groups["tp"] == topology.tp_groups()
        assert groups["dp"] == topology.dp_groups()
        assert groups["pp"] == topology.pp_groups()
        for axis in AXES:
            assert list(groups[axis]) == reference.groups[axis], f"{topology} {axis}"
            _assert_partition(groups[axis], world_size, topology.degree(axis))
        group_of = {axis: {rank: group for group in groups[axis] for rank in group} for axis in AXES}
        for rank, (p, d, t) in enumerate(reference.coords):
            coords = topology.coords(rank)
            assert coords == Coords(pp=p, dp=d, tp=t), f"{topology} rank {rank}"
            assert topology.rank(coords) == rank
            assert topology.rank(pp=p, dp=d, tp=t) == rank
            assert topology.tp_group(rank) == group_of["tp"][rank]
            assert topology.dp_group(rank) == group_of["dp"][rank]
            assert topology.pp_group(rank) == group_of["pp"][rank]
            assert topology.is_first_stage(rank) == (p == 0)
            assert topology.is_last_stage(rank) == (p == topology.pp - 1)


# -- every factorization of large world sizes: full group partitions ---------------------------


@pytest.mark.parametrize("world_size", LARGE_WORLD_SIZES)
def test_group_partitions_of_every_factorization_match_brute_force(world_size: int) -> None:
    for topology in _layouts(world_size):
        reference = brute_force(*topology.mesh_shape)
        for axis in AXES:
            groups = topology.groups(axis)
            assert list(groups) == reference.groups[axis], f"{topology} {axis}"
            _assert_partition(groups, world_size, topology.degree(axis))


# -- every layout up to 4096: sampled ranks against numpy's C-order indexing -------------------


def test_sampled_ranks_of_every_layout_up_to_4096_match_numpy() -> None:
    rng = random.Random(0)
    layouts = _all_layouts_up_to(ALL_LAYOUTS_WORLD_MAX)
    assert len(layouts) == 168_736
    for pp, dp, tp in layouts:
        topology = Topology(pp=pp, dp=dp, tp=tp)
        world_size = pp * dp * tp
        grid = np.arange(world_size).reshape(pp, dp, tp)  # C order: how DeviceMesh lays out ranks
        rank = rng.randrange(world_size)
        p, d, t = (int(i) for i in np.unravel_index(rank, (pp, dp, tp)))
        coords = topology.coords(rank)
        assert coords == Coords(pp=p, dp=d, tp=t), f"{topology} rank {rank}"
        assert topology.rank(coords) == rank
        assert topology.coords(world_size - 1) == Coords(pp=pp - 1, dp=dp - 1, tp=tp - 1)
        assert topology.pp_group(rank) == tuple(grid[:, d, t].tolist()), f"{topology} rank {rank}"
        assert topology.dp_group(rank) == tuple(grid[p, :, t].tolist()), f"{topology} rank {rank}"
        assert topology.tp_group(rank) == tuple(grid[p, d, :].tolist()), f"{topology} rank {rank}"


# -- compact form ------------------------------------------------------------------------------


def test_str_is_compact_and_parses_back() -> None:
    assert str(Topology(pp=2, dp=4, tp=8)) == "pp2·dp4·tp8"
    for world_size in (1, 12, 36, 64):
        for topology in _layouts(world_size):
            assert parse_topology(str(topology)) == topology


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pp2.dp2.tp2", Topology(pp=2, dp=2, tp=2)),
        ("pp2·dp2·tp2", Topology(pp=2, dp=2, tp=2)),
        ("tp8.pp4", Topology(pp=4, dp=1, tp=8)),
        ("dp8", Topology(pp=1, dp=8, tp=1)),
        (" pp1.dp1.tp1 ", Topology(pp=1, dp=1, tp=1)),
    ],
)
def test_parse_topology(text: str, expected: Topology) -> None:
    assert parse_topology(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "cannot parse topology ''"),
        ("pp2.pp2", "pp is given twice"),
        ("pp2..dp2", "got ''"),
        ("ep2", "got 'ep2'"),
        ("pp-1", "got 'pp-1'"),
        ("pp0.dp2", r"pp \(the pipeline-parallel degree\) must be an integer >= 1, got 0"),
    ],
)
def test_parse_topology_rejects(text: str, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        parse_topology(text)


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("bad", [0, -1, 1.5, 2.0, "2", None, True])
def test_degree_must_be_a_positive_int(axis: str, bad: object) -> None:
    degrees = {"pp": 1, "dp": 1, "tp": 1, axis: bad}
    # the rule and its fix: etrain.workers.protocol.layout_rules
    fix = rf"Fix: set parallelism\.{axis} to an integer >= 1"
    with pytest.raises(TopologyError, match=rf"^{axis} \(the .* degree\) .* got {bad!r} {fix}$"):
        Topology(**degrees)


def test_topology_is_frozen_and_keyword_only() -> None:
    topology = Topology(pp=1, dp=2, tp=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        topology.dp = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        Topology(1, 2, 1)  # type: ignore[misc]


@pytest.mark.parametrize("rank", [-1, 8, 100, True, 1.0, "0"])
def test_out_of_range_rank_names_value_and_range(rank: object) -> None:
    topology = Topology(pp=2, dp=2, tp=2)
    expected = rf"^rank {rank!r} is out of range for pp2·dp2·tp2: valid ranks are 0\.\.7$"
    for method in (
        topology.coords,
        topology.tp_group,
        topology.dp_group,
        topology.pp_group,
        topology.is_first_stage,
        topology.is_last_stage,
    ):
        with pytest.raises(TopologyError, match=expected):
            method(rank)


@pytest.mark.parametrize(
    ("coords", "message"),
    [
        (
            Coords(pp=2, dp=0, tp=0),
            r"pp coordinate 2 is out of range for pp2·dp3·tp4: valid pp "
            r"coordinates are 0\.\.1",
        ),
        (Coords(pp=0, dp=-1, tp=0), r"dp coordinate -1 .* valid dp coordinates are 0\.\.2"),
        (Coords(pp=0, dp=0, tp=4), r"tp coordinate 4 .* valid tp coordinates are 0\.\.3"),
    ],
)
def test_out_of_range_coords_name_value_and_range(coords: Coords, message: str) -> None:
    topology = Topology(pp=2, dp=3, tp=4)
    with pytest.raises(TopologyError, match=message):
        topology.rank(coords)
    with pytest.raises(TopologyError, match=message):
        topology.rank(pp=coords.pp, dp=coords.dp, tp=coords.tp)


def test_rank_needs_exactly_one_form_of_coordinates() -> None:
    topology = Topology(pp=2, dp=2, tp=2)
    with pytest.raises(TopologyError, match="missing dp, tp"):
        topology.rank(pp=1)
    with pytest.raises(TopologyError, match="not both"):
        topology.rank(Coords(pp=0, dp=0, tp=0), pp=0)
    with pytest.raises(TopologyError, match="needs a Coords"):
        topology.rank((0, 0, 0))  # type: ignore[arg-type]


def test_unknown_axis_is_rejected() -> None:
    topology = Topology(pp=2, dp=2, tp=2)
    with pytest.raises(TopologyError, match=r"axis must be one of \('pp', 'dp', 'cp', 'tp'\), got 'ep'"):
        topology.groups("ep")
    with pytest.raises(TopologyError, match="got 'ep'"):
        topology.group(0, "ep")
    with pytest.raises(TopologyError, match="got 'ep'"):
        topology.degree("ep")


def test_topology_error_is_a_value_error_and_survives_pickling() -> None:
    # Errors cross Ray actor boundaries, so they must unpickle with their message.
    with pytest.raises(TopologyError) as info:
        Topology(pp=0, dp=1, tp=1)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, ConfigError)
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is TopologyError and str(copy) == str(info.value)


# -- pipeline stages and elasticity ------------------------------------------------------------


def test_stage_flags() -> None:
    topology = Topology(pp=3, dp=2, tp=2)
    assert [r for r in range(12) if topology.is_first_stage(r)] == [0, 1, 2, 3]
    assert [r for r in range(12) if topology.is_last_stage(r)] == [8, 9, 10, 11]
    single_stage = Topology(pp=1, dp=2, tp=2)
    assert all(single_stage.is_first_stage(r) and single_stage.is_last_stage(r) for r in range(4))


def test_with_dp_changes_only_dp() -> None:
    topology = Topology(pp=2, dp=4, tp=2)
    resized = topology.with_dp(3)
    assert resized == Topology(pp=2, dp=3, tp=2)
    assert topology.dp == 4  # the original is untouched
    assert resized.world_size == 12
    with pytest.raises(TopologyError, match="dp .* got 0"):
        topology.with_dp(0)


def test_a_resize_keeps_every_rank_below_both_sizes_at_its_place_in_every_layout() -> None:
    """Exhaustive over small layouts (pp, cp, tp up to 3, dp 1..4 to 1..4): a kept rank keeps its pipeline
    stage, context chunk and tensor slice (only renumbered), every rank with a dp index below both sizes is
    kept, no rank twice, and the ranks that join are exactly the new dp indices."""
    for pp, cp, tp, old_dp, new_dp in itertools.product(
        range(1, 4), range(1, 4), range(1, 4), range(1, 5), range(1, 5)
    ):
        old = Topology(pp=pp, dp=old_dp, tp=tp, cp=cp)
        new = old.with_dp(new_dp)
        kept = old.kept_on_resize(new_dp)
        assert len(set(kept.values())) == len(kept) == pp * cp * tp * min(old_dp, new_dp)
        for new_rank, old_rank in kept.items():
            was, now = old.coords(old_rank), new.coords(new_rank)
            assert (was.pp, was.dp, was.cp, was.tp) == (now.pp, now.dp, now.cp, now.tp)
        joining = set(range(new.world_size)) - set(kept)
        assert {new.coords(rank).dp for rank in joining} == set(range(old_dp, new_dp))


def test_a_resize_of_a_3d_layout_renumbers_the_kept_ranks() -> None:
    # pp=2 x dp=2 x tp=2 shrinking to dp=1: the dp=0 replica of each stage stays, renumbered.
    assert Topology(pp=2, dp=2, tp=2).kept_on_resize(1) == {0: 0, 1: 1, 2: 4, 3: 5}
    # ... and growing back: the four kept ranks take their old numbers' places again, 2, 3, 6, 7 join.
    assert Topology(pp=2, dp=1, tp=2).kept_on_resize(2) == {0: 0, 1: 1, 4: 2, 5: 3}


# -- placement ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("topology", "ranks_per_node", "expected"),
    [
        (Topology(pp=2, dp=2, tp=2), 4, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (Topology(pp=2, dp=2, tp=2), 8, [[0, 1, 2, 3, 4, 5, 6, 7]]),
        (Topology(pp=1, dp=3, tp=2), 3, [[0, 1], [2, 3], [4, 5]]),  # slot left empty, no split
        (Topology(pp=1, dp=3, tp=4), 8, [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]]),
        (Topology(pp=1, dp=5, tp=1), 2, [[0, 1], [2, 3], [4]]),
    ],
)
def test_bundle_order_examples(topology: Topology, ranks_per_node: int, expected: list[list[int]]) -> None:
    assert topology.bundle_order(ranks_per_node) == expected


def test_bundle_order_keeps_every_tp_group_on_one_node() -> None:
    for world_size in range(1, 33):
        for topology in _layouts(world_size):
            for ranks_per_node in range(topology.tp, 10):
                nodes = topology.bundle_order(ranks_per_node)
                assert [r for node in nodes for r in node] == list(range(world_size))
                assert all(0 < len(node) <= ranks_per_node for node in nodes)
                node_of = {rank: i for i, node in enumerate(nodes) for rank in node}
                for group in topology.tp_groups():
                    assert len({node_of[rank] for rank in group}) == 1, (topology, ranks_per_node)
                groups_per_node = ranks_per_node // topology.tp
                assert len(nodes) == -(-len(topology.tp_groups()) // groups_per_node)


def test_bundle_order_rejects_tp_larger_than_a_node() -> None:
    with pytest.raises(
        TopologyError,
        match="tp=8 does not fit on a node with 4 ranks: a tensor-parallel group must share one "
        "node; lower tp to at most 4 or use nodes with at least 8 devices",
    ):
        Topology(pp=1, dp=1, tp=8).bundle_order(4)
    with pytest.raises(TopologyError, match="ranks_per_node must be an integer >= 1, got 0"):
        Topology(pp=1, dp=1, tp=1).bundle_order(0)


# -- context parallelism: cp between dp and tp -------------------------------------------------


@pytest.mark.parametrize("pp, dp, cp, tp", [(1, 1, 2, 1), (1, 2, 2, 1), (2, 3, 2, 2), (1, 2, 4, 2), (3, 1, 3, 1)])
def test_cp_sits_between_dp_and_tp_in_rank_order(pp: int, dp: int, cp: int, tp: int) -> None:
    topology = Topology(pp=pp, dp=dp, cp=cp, tp=tp)
    grid = np.arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp)  # C order, as the DeviceMesh lays it out
    assert topology.world_size == grid.size
    assert topology.mesh_shape == (pp, dp, cp, tp)
    for rank in range(grid.size):
        p, d, c, t = (int(i) for i in np.unravel_index(rank, grid.shape))
        coords = topology.coords(rank)
        assert coords == Coords(pp=p, dp=d, cp=c, tp=t)
        assert topology.rank(coords) == rank == topology.rank(pp=p, dp=d, cp=c, tp=t)
        assert topology.cp_group(rank) == tuple(grid[p, d, :, t].tolist())
        assert topology.dp_group(rank) == tuple(grid[p, :, c, t].tolist())
        assert topology.tp_group(rank) == tuple(grid[p, d, c, :].tolist())
        assert topology.pp_group(rank) == tuple(grid[:, d, c, t].tolist())
    for axis in ("pp", "dp", "cp", "tp"):
        _assert_partition(topology.groups(axis), grid.size, topology.degree(axis))
    # the data groups: each (pp, tp) index's dp·cp ranks in (dp, cp) order, as the dp_cp mesh dimension
    expected = sorted(tuple(grid[p, :, :, t].reshape(-1).tolist()) for p in range(pp) for t in range(tp))
    assert sorted(topology.data_groups()) == expected
    assert Topology(pp=pp, dp=dp, tp=tp).data_groups() == Topology(pp=pp, dp=dp, tp=tp).dp_groups()


def test_cp_one_renumbers_nothing_and_prints_only_when_used() -> None:
    assert Topology(pp=2, dp=2, tp=2) == Topology(pp=2, dp=2, cp=1, tp=2)
    assert str(Topology(pp=1, dp=2, tp=1)) == "pp1·dp2·tp1"
    assert str(Topology(pp=1, dp=2, cp=2, tp=1)) == "pp1·dp2·cp2·tp1"
    assert parse_topology("dp2.cp2") == Topology(pp=1, dp=2, cp=2, tp=1)
    assert Topology(pp=1, dp=2, tp=1).cp_group(1) == (1,)
