"""The warm pool's returned ranks (service/decisions/returned_ranks.py): a finished job's rank processes serve
its tenant's next jobs on the same node, within a per-node bound and an idle limit, and never another tenant's."""

from __future__ import annotations

import itertools
import random

import pytest

from etrain.service.decisions.returned_ranks import (
    MAX_RETURNED_PER_NODE,
    RETURNED_IDLE_S,
    ReturnedRanks,
    returned_per_node,
)


def test_a_tenant_gets_back_only_its_own_ranks_on_the_node_asked_for():
    kept = ReturnedRanks()
    assert kept.add("n1", "alice", "a1", pid=1, now=0, per_node=4) == []
    assert kept.add("n1", "bob", "b1", pid=2, now=0, per_node=4) == []
    assert kept.add("n2", "alice", "a2", pid=3, now=0, per_node=4) == []
    assert kept.take("n1", "carol") is None
    assert kept.take("n3", "alice") is None
    assert kept.take("n1", "alice") == "a1"
    assert kept.take("n1", "alice") is None  # taken once
    assert kept.take("n1", "bob") == "b1"
    assert kept.take("n2", "alice") == "a2"
    assert kept.counts() == {} and kept.pids() == []


def test_the_most_recently_returned_rank_is_taken_first():
    kept = ReturnedRanks()
    for index in range(3):
        kept.add("n", "t", f"r{index}", pid=index, now=index, per_node=8)
    assert [kept.take("n", "t") for _ in range(4)] == ["r2", "r1", "r0", None]


def test_a_rank_without_a_tenant_or_on_a_node_that_keeps_none_is_stopped_at_once():
    kept = ReturnedRanks()
    assert kept.add("n", "", "r", pid=1, now=0, per_node=4) == ["r"]
    assert kept.add("n", "t", "s", pid=2, now=0, per_node=0) == ["s"]
    assert kept.counts() == {}
    assert kept.take("n", "") is None  # no tenant is nobody's


def test_beyond_the_nodes_bound_the_oldest_returned_ranks_are_stopped_whatever_their_tenant():
    kept = ReturnedRanks()
    assert kept.add("n", "alice", "a0", pid=10, now=0, per_node=2) == []
    assert kept.add("n", "bob", "b0", pid=11, now=1, per_node=2) == []
    assert kept.add("n", "alice", "a1", pid=12, now=2, per_node=2) == ["a0"]
    assert kept.add("other", "alice", "x", pid=13, now=2, per_node=2) == []  # another node's bound
    assert kept.counts() == {"n": 2, "other": 1}
    assert kept.pids() == [11, 12, 13]
    assert kept.trim({"n": 1}) == ["b0", "x"]  # a node missing from the bounds keeps none
    assert kept.counts() == {"n": 1}


def test_idle_ranks_expire_at_the_idle_limit_and_not_before():
    kept = ReturnedRanks(idle_s=10)
    kept.add("n", "t", "old", pid=1, now=0, per_node=4)
    kept.add("n", "t", "new", pid=2, now=5, per_node=4)
    assert kept.expire(9.999) == []
    assert kept.expire(10) == ["old"]
    assert kept.expire(14.9) == []
    assert kept.expire(15) == ["new"]
    assert kept.counts() == {}
    with pytest.raises(ValueError, match="idle_s"):
        ReturnedRanks(idle_s=-1)
    assert ReturnedRanks().idle_s == RETURNED_IDLE_S


def test_ranks_on_a_node_that_died_are_forgotten_and_close_stops_the_rest():
    kept = ReturnedRanks()
    kept.add("a", "t", "ra", pid=1, now=0, per_node=4)
    kept.add("b", "t", "rb", pid=2, now=0, per_node=4)
    assert kept.keep_nodes({"b", "c"}) == ["ra"]
    assert kept.take("a", "t") is None
    assert kept.pop_all() == ["rb"]
    assert kept.counts() == {} and kept.pop_all() == []


@pytest.mark.parametrize(
    ("resources", "bound"),
    [
        ({"CPU": 4.0}, 4),
        ({"CPU": 2.5}, 2),
        ({"CPU": 0.5}, 0),
        ({}, 0),
        ({"CPU": 1000.0}, MAX_RETURNED_PER_NODE),
        ({"CPU": 64.0, "GPU": 8.0}, 0),  # ranks on GPUs are never returned
        ({"CPU": 8.0, "GPU": 0.0}, 8),
    ],
)
def test_a_node_keeps_as_many_returned_ranks_as_cpu_ranks_run_there_at_once(resources, bound):
    assert returned_per_node(resources) == bound


def test_against_a_brute_force_model_of_the_rules():
    """Random adds, takes, expiries and trims against a list kept by the plain rules: the bound evicts the oldest
    returned, a take is the newest of that tenant on that node, an expiry drops every rank idle for idle_s."""
    rng = random.Random(7)
    for trial in range(300):
        kept, model = ReturnedRanks(idle_s=5), []  # model: [node, tenant, item, since], oldest first
        now, counter = 0.0, itertools.count()
        for _ in range(40):
            now += rng.choice([0.0, 0.5, 2.0])
            node, tenant = rng.choice("xy"), rng.choice(["", "p", "q"])
            op = rng.choice(["add", "add", "take", "expire", "trim"])
            if op == "add":
                item, bound = f"i{next(counter)}", rng.choice([0, 1, 2, 3])
                got = kept.add(node, tenant, item, pid=0, now=now, per_node=bound)
                if bound <= 0 or not tenant:
                    want = [item]
                else:
                    model.append([node, tenant, item, now])
                    on_node = [entry for entry in model if entry[0] == node]
                    over = on_node[: max(0, len(on_node) - bound)]
                    want = [entry[2] for entry in over]
                    model = [entry for entry in model if entry not in over]
                assert got == want, (trial, op)
            elif op == "take":
                matches = [entry for entry in model if entry[0] == node and tenant and entry[1] == tenant]
                want = matches[-1][2] if matches else None
                if matches:
                    model.remove(matches[-1])
                assert kept.take(node, tenant) == want, (trial, op)
            elif op == "expire":
                want = [entry[2] for entry in model if now - entry[3] >= 5]
                model = [entry for entry in model if now - entry[3] < 5]
                assert sorted(kept.expire(now)) == sorted(want), (trial, op)
            else:
                bounds = {"x": rng.choice([0, 1, 2]), "y": rng.choice([0, 1, 2])}
                want = []
                for name in "xy":
                    on_node = [entry for entry in model if entry[0] == name]
                    over = on_node[: max(0, len(on_node) - bounds[name])]
                    want += [entry[2] for entry in over]
                    model = [entry for entry in model if entry not in over]
                assert sorted(kept.trim(bounds)) == sorted(want), (trial, op)
            counts = {}
            for entry in model:
                counts[entry[0]] = counts.get(entry[0], 0) + 1
            assert kept.counts() == counts, (trial, op)
