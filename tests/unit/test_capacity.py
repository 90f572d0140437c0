"""Capacity arithmetic: whole tp groups per node, then whole replicas."""

import pytest

from etrain.service.decisions.capacity import rank_slots, replicas_that_fit


@pytest.mark.parametrize(
    "free, per_rank, expected",
    [
        ({"CPU": 4}, {"CPU": 1}, 4),
        ({"CPU": 4}, {"CPU": 0.5}, 8),
        ({"CPU": 4, "GPU": 2}, {"CPU": 1, "GPU": 1}, 2),  # GPUs are the tighter limit
        ({"CPU": 4}, {"CPU": 1, "GPU": 1}, 0),  # no GPU on the node
        ({"CPU": 0.99}, {"CPU": 1}, 0),
        ({"CPU": 3.0000000001}, {"CPU": 1}, 3),
        ({"CPU": 4}, {"CPU": 1, "GPU": 0}, 4),  # zero requests are ignored
        ({"CPU": 4}, {}, 0),
    ],
)
def test_rank_slots(free, per_rank, expected):
    assert rank_slots(free=free, per_rank=per_rank) == expected


@pytest.mark.parametrize(
    "slots, tp, pp, expected",
    [
        ({"a": 4, "b": 4}, 1, 1, 8),
        ({"a": 3, "b": 3}, 2, 1, 2),  # 1 tp group per node: the odd slot cannot host half a group
        ({"a": 3, "b": 1}, 2, 1, 1),
        ({"a": 4, "b": 4}, 2, 2, 2),
        ({"a": 4, "b": 2}, 2, 2, 1),  # 3 tp groups -> 1 replica of pp=2
        ({"a": 8}, 8, 1, 1),
        ({"a": 7, "b": 7}, 8, 1, 0),  # tp=8 never straddles nodes
        ({}, 1, 1, 0),
        ({"a": -1}, 1, 1, 0),
    ],
)
def test_replicas_that_fit(slots, tp, pp, expected):
    assert replicas_that_fit(slots, tp=tp, pp=pp) == expected


def test_replicas_brute_force():
    """Against a direct simulation: fill tp groups node by node, then group them by pp."""
    import itertools

    for nodes in itertools.product(range(0, 9), repeat=3):
        for tp, pp in itertools.product((1, 2, 4), (1, 2, 3)):
            groups = 0
            for slots in nodes:
                while slots >= tp:
                    slots -= tp
                    groups += 1
            assert replicas_that_fit({str(i): s for i, s in enumerate(nodes)}, tp=tp, pp=pp) == groups // pp


def test_bad_degrees():
    with pytest.raises(ValueError, match="tp=0"):
        replicas_that_fit({"a": 1}, tp=0, pp=1)
