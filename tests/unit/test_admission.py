"""Gang admission (service/decisions/admission.py): priority, FIFO, whole gangs only, per-node fit, head-of-line
blocking with safe backfill, claims, never-fits refusals, and the same order after a restart."""

from __future__ import annotations

import random

import pytest

from etrain.service.decisions.admission import (
    Claim,
    Gang,
    NodeView,
    QueuedJob,
    decide,
    describe,
    queue_order,
    refusal,
    tp_group_nodes,
    tp_groups_across_nodes,
)


def node(
    name: str,
    cpus: float,
    free: float | None = None,
    *,
    gpus: float = 0,
    free_gpus: float | None = None,
    alive: bool = True,
) -> NodeView:
    total = {"CPU": float(cpus), "GPU": float(gpus)}
    left = {"CPU": float(cpus if free is None else free), "GPU": float(gpus if free_gpus is None else free_gpus)}
    return NodeView(id=name, alive=alive, total=total, free=left)


def gang(
    ranks: int = 2,
    *,
    cpus: float = 1,
    gpus: float = 0,
    tp: int = 1,
    pp: int = 1,
    dp_sizes: tuple[int, ...] | None = None,
    strategy: str = "PACK",
    dp_field: str = "parallelism.dp",
) -> Gang:
    per_rank = {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}
    return Gang(
        per_rank=per_rank,
        dp_sizes=dp_sizes or (ranks // (tp * pp),),
        tp=tp,
        pp=pp,
        strategy=strategy,
        dp_field=dp_field,
    )


def job(name: str, priority: int = 0, created: float = 0.0, **gang_args) -> QueuedJob:
    return QueuedJob(id=name, priority=priority, created_at=created, gang=gang(**gang_args))


def admitted(plan) -> list[str]:
    return [a.job_id for a in plan.admit]


def positions(plan) -> dict[str, int]:
    return {w.job_id: w.position for w in plan.wait}


# --- order -------------------------------------------------------------------------------------------


def test_higher_priority_first_then_fifo_then_id():
    jobs = [job("a", 0, 1.0), job("b", 5, 3.0), job("c", 1, 2.0), job("d", 5, 2.0), job("e", 5, 2.0)]
    assert [j.id for j in queue_order(jobs)] == ["d", "e", "b", "c", "a"]


def test_three_whole_machine_jobs_start_by_priority_one_at_a_time():
    machine = [node("n1", 2)]
    queued = [job("p0", 0, 1.0), job("p5", 5, 2.0), job("p1", 1, 3.0)]
    plan = decide(queued, machine)
    assert admitted(plan) == ["p5"] and plan.admit[0].dp == 2 and plan.admit[0].placement == {"n1": 2}
    assert positions(plan) == {"p1": 2, "p0": 3}
    # p5 now holds the machine (Ray reports 0 free): nobody starts, and the order holds.
    busy = [node("n1", 2, free=0)]
    plan = decide(queued[::2], busy)
    assert admitted(plan) == [] and positions(plan) == {"p1": 1, "p0": 2}
    assert (
        "waiting for 2 CPUs (2 rank(s) of 1 CPU: dp=2 tp=1 pp=1); free now: 0 CPUs on 1 node(s); "
        "position 1 in the queue" == plan.wait[0].reason
    )
    # p5 done: p1 before p0.
    assert admitted(decide(queued[::2], machine)) == ["p1"]


def test_fifo_among_equal_priorities():
    plan = decide([job("late", 3, 9.0), job("early", 3, 1.0)], [node("n1", 2)])
    assert admitted(plan) == ["early"] and positions(plan) == {"late": 2}


def test_the_same_rows_in_any_order_give_the_same_plan_after_a_restart():
    machine = [node("n1", 4, free=3), node("n2", 4, free=1)]
    queued = [job(f"j{i}", priority=i % 3, created=float(i), ranks=1 + i % 3) for i in range(9)]
    expected = decide(queued, machine)
    for seed in range(5):
        shuffled = list(queued)
        random.Random(seed).shuffle(shuffled)
        assert decide(shuffled, machine) == expected
    # Priority 2 first: j2 takes 3 of the 4 free CPUs; j5 (3 ranks) does not fit whole, and blocks the rest.
    assert admitted(expected) == ["j2"]
    assert [w.job_id for w in expected.wait] == ["j5", "j8", "j1", "j4", "j7", "j0", "j3", "j6"]
    assert [w.position for w in expected.wait] == list(range(2, 10))


def test_a_requeued_older_job_goes_before_newer_jobs_of_its_priority():
    """A job whose supervisor was lost is queued again with its original created_at: it keeps its place."""
    plan = decide([job("new", 1, 50.0), job("requeued", 1, 10.0), job("urgent", 2, 60.0)], [node("n1", 2)])
    assert admitted(plan) == ["urgent"] and positions(plan) == {"requeued": 2, "new": 3}


# --- gang and per-node fit -------------------------------------------------------------------------------


def test_no_partial_start():
    plan = decide([job("big", ranks=4)], [node("n1", 4, free=3)])
    assert admitted(plan) == [] and positions(plan) == {"big": 1}
    assert "waiting for 4 CPUs" in plan.wait[0].reason and "free now: 3 CPUs" in plan.wait[0].reason


def test_per_node_fit_not_totals_for_bundle_sizes():
    # 3 CPUs free in total, but no node has the 2 CPUs one rank needs.
    two_halves = [node("a", 4, free=1.5), node("b", 4, free=1.5)]
    assert admitted(decide([job("fat", ranks=1, cpus=2)], two_halves)) == []
    assert admitted(decide([job("fat", ranks=1, cpus=2)], [node("a", 4, free=2), node("b", 4, free=1)])) == ["fat"]


def test_tensor_parallel_groups_stay_on_one_node():
    split = [node("a", 2, free=1), node("b", 2, free=1)]
    assert admitted(decide([job("tp2", ranks=2, tp=2)], split)) == []
    plan = decide([job("tp1", ranks=2)], split)
    assert admitted(plan) == ["tp1"] and plan.admit[0].placement == {"a": 1, "b": 1}
    # pp stages may sit on different nodes: 2 groups of tp=2, one per node.
    plan = decide([job("pp2", ranks=4, tp=2, pp=2)], [node("a", 2), node("b", 3)])
    assert admitted(plan) == ["pp2"] and plan.admit[0].placement == {"a": 2, "b": 2}


def test_gpu_bundles_fit_per_node():
    nodes = [node("g1", 16, gpus=2, free_gpus=1), node("g2", 16, gpus=2, free_gpus=1)]
    assert admitted(decide([job("tp2", ranks=2, gpus=1, tp=2)], nodes)) == []
    plan = decide([job("dp2", ranks=2, gpus=1)], nodes)
    assert plan.admit[0].placement == {"g1": 1, "g2": 1}


def test_starts_at_the_largest_legal_dp_that_fits_now():
    plan = decide([job("elastic", dp_sizes=(1, 2, 4))], [node("n1", 8, free=3)])
    assert (plan.admit[0].dp, plan.admit[0].ranks) == (2, 2)
    plan = decide([job("elastic", dp_sizes=(2, 4), tp=2)], [node("n1", 8, free=7)])
    assert (plan.admit[0].dp, plan.admit[0].ranks) == (2, 4)  # 3 tp groups fit; dp=3 is not legal
    assert admitted(decide([job("elastic", dp_sizes=(2, 4))], [node("n1", 8, free=1)])) == []


def test_jobs_admitted_in_one_pass_do_not_share_a_hole():
    plan = decide([job("a", created=1), job("b", created=2), job("c", created=3)], [node("n1", 4)])
    assert admitted(plan) == ["a", "b"] and positions(plan) == {"c": 3}


def test_pack_fills_the_roomiest_node_and_spread_deals_round_robin():
    nodes = [node("a", 4), node("b", 2), node("c", 3)]
    assert decide([job("p", ranks=5)], nodes).admit[0].placement == {"a": 4, "c": 1}
    assert decide([job("s", ranks=5, strategy="SPREAD")], nodes).admit[0].placement == {"a": 2, "b": 1, "c": 2}


def test_dead_nodes_hold_nothing():
    nodes = [node("dead", 8, alive=False), node("n1", 2)]
    plan = decide([job("four", ranks=4)], nodes)
    assert admitted(plan) == [] and "on 1 node(s)" in plan.wait[0].reason


# --- head-of-line blocking and safe backfill --------------------------------------------------------------


def test_a_lower_priority_job_that_would_fit_waits_behind_the_blocked_head():
    nodes = [node("n1", 4, free=2)]  # something holds 2 CPUs
    plan = decide([job("head", 5, ranks=4), job("small", 1, ranks=1)], nodes)
    assert admitted(plan) == []
    small = plan.waiting("small")
    assert small.behind == "head" and small.position == 2
    assert small.reason == (
        "fits the free resources but waits behind head (priority 5), which waits for the same "
        "nodes: starting this job first could delay it; position 2 in the queue"
    )


def test_backfill_only_on_nodes_the_blocked_job_can_never_use():
    nodes = [node("gpu", 8, gpus=1, free_gpus=0), node("cpu", 4)]  # the GPU is taken
    gpu_job = job("gpu-job", 9, 1.0, ranks=1, gpus=1)
    plan = decide([gpu_job, job("cpu-small", 1, 2.0, ranks=4)], nodes)
    assert admitted(plan) == ["cpu-small"] and plan.admit[0].placement == {"cpu": 4}
    # 6 ranks would fit only by using the GPU node's CPUs, which the GPU job waits for.
    plan = decide([gpu_job, job("cpu-big", 1, 2.0, ranks=6)], nodes)
    assert admitted(plan) == [] and plan.waiting("cpu-big").behind == "gpu-job"
    assert positions(plan) == {"gpu-job": 1, "cpu-big": 2}


def test_an_equal_priority_later_job_also_waits_behind_the_head():
    plan = decide([job("first", 0, 1.0, ranks=3), job("second", 0, 2.0, ranks=1)], [node("n1", 4, free=2)])
    assert admitted(plan) == [] and plan.waiting("second").behind == "first"


# --- claims --------------------------------------------------------------------------------------------


def test_claims_of_started_jobs_are_placed_before_the_queue():
    nodes = [node("n1", 4)]
    plan = decide([job("next", ranks=3)], nodes, claims=[Claim(id="starting", per_rank={"CPU": 1.0}, ranks=2)])
    assert admitted(plan) == [] and "free now: 2 CPUs" in plan.wait[0].reason
    # A claim that cannot be placed (its job waits in Ray for a lost node) reserves nothing.
    plan = decide([job("next", ranks=3)], nodes, claims=[Claim(id="stuck", per_rank={"CPU": 1.0}, ranks=6)])
    assert admitted(plan) == ["next"]


# --- never fits --------------------------------------------------------------------------------------------


def test_a_rank_no_node_can_hold_is_refused_naming_the_resource():
    problem = refusal(gang(ranks=1, cpus=8), [node("a", 4), node("b", 4)])
    assert problem.field == "resources.cpus_per_worker"
    assert (
        problem.message == "one rank needs 8 CPUs, but no node has 8 CPUs: the most any of the 2 node(s) has is 4 CPUs."
    )
    assert problem.fix.startswith("lower resources.cpus_per_worker to at most 4,")
    assert "ETRAIN_ADMIT_BEYOND_CLUSTER=1" in problem.fix
    gpu = refusal(gang(ranks=1, gpus=1), [node("a", 4)])
    assert gpu.field == "resources.gpus_per_worker" and "the most any of the 1 node(s) has is 0 GPUs" in gpu.message


def test_a_rank_needing_what_no_single_node_has_at_once_is_refused():
    split = [node("cpus", 8, gpus=0), node("gpus", 0, gpus=4)]
    problem = refusal(gang(ranks=1, cpus=1, gpus=1), split)
    assert problem.field == "resources"
    assert problem.message == (
        "one rank needs 1 CPU + 1 GPU on one node, but none of the 2 node(s) has all of it (for example: 8 CPUs)."
    )


def test_a_tensor_parallel_group_no_node_can_hold_is_refused():
    problem = refusal(gang(ranks=4, tp=4), [node("a", 2), node("b", 2)])
    assert problem.field == "parallelism.tp"
    assert problem.message == (
        "a tensor-parallel group of tp=4 ranks (4 CPUs) must sit on one node, but the largest "
        "node holds 2 rank(s) of 1 CPU."
    )


def test_a_minimum_layout_beyond_the_cluster_is_refused_with_need_and_have():
    problem = refusal(gang(ranks=3), [node("n1", 2)])
    assert problem.field == "parallelism.dp"
    assert problem.message == (
        "the minimum layout needs 3 ranks (dp=3 x tp=1 x pp=1) of 1 CPU = 3 CPUs, but the "
        "cluster has 2 CPUs on 1 node(s), room for at most 2 replica(s) of 1 rank(s) "
        "(tp groups node-local)."
    )
    assert problem.fix.startswith("lower parallelism.dp to at most 2,")
    elastic = refusal(gang(dp_sizes=(4, 8), dp_field="resources.min_dp"), [node("n1", 2), node("n2", 1)])
    assert elastic.field == "resources.min_dp" and "at most 3 replica(s)" in elastic.message


def test_what_fits_the_totals_is_not_refused_even_when_busy():
    assert refusal(gang(ranks=2), [node("n1", 2, free=0)]) is None
    assert refusal(gang(ranks=4, tp=2, pp=2), [node("a", 2), node("b", 2, free=0)]) is None
    assert refusal(gang(ranks=2), [node("dead", 8, alive=False), node("n1", 2)]) is None
    assert refusal(gang(ranks=2), [node("dead", 8, alive=False)]) is None  # nothing to judge by: queue


def test_a_job_beyond_the_cluster_queues_when_allowed_and_blocks_the_queue():
    plan = decide([job("huge", 5, ranks=8), job("small", 0, ranks=1)], [node("n1", 2)])
    huge = plan.waiting("huge")
    assert huge.beyond_cluster and huge.reason.startswith("larger than the cluster today, waiting for nodes")
    assert admitted(plan) == [] and plan.waiting("small").behind == "huge"


# --- small pieces --------------------------------------------------------------------------------------------


def test_describe_resources():
    assert describe({"CPU": 2.0, "GPU": 0.5}) == "2 CPUs + 0.5 GPU"
    assert describe({"CPU": 1.0, "GPU": 0.0}) == "1 CPU"
    assert describe({}) == "0 CPUs"
    assert describe({"CPU": 0.30000000000000004}) == "0.3 CPU"


@pytest.mark.parametrize("args", [{"dp_sizes": ()}, {"dp_sizes": (2, 1)}, {"dp_sizes": (0,)}, {"tp": 0}])
def test_gang_rejects_nonsense(args):
    values = {"per_rank": {"CPU": 1.0}, "dp_sizes": (1,), **args}
    with pytest.raises(ValueError):
        Gang(**values)
    with pytest.raises(ValueError):
        Gang(per_rank={"CPU": 0.0}, dp_sizes=(1,))


def test_a_long_queue_costs_one_computation_per_job_shape(monkeypatch):
    """GET /v1/cluster and every scheduler pass run decide(): 2,000 queued jobs of two shapes behind a
    blocked head on 200 busy nodes cost a few computations per shape, not a pass over every node for
    every job. Counted, not timed (a timing bound failed on a loaded CI machine); ~0.03 s here."""
    from etrain.service.decisions import admission

    calls = {"_largest_fit": 0, "_why": 0, "_usable": 0}
    for name in calls:
        original = getattr(admission, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(admission, name, counted)
    nodes = [node(f"n{i}", 8, free=1, gpus=8, free_gpus=0) for i in range(200)]
    queued = [job(f"j{i}", i % 7, float(i), ranks=2, gpus=1, tp=1 + i % 2) for i in range(2000)]
    plan = decide(queued, nodes)
    assert admitted(plan) == [] and [w.position for w in plan.wait] == list(range(1, 2001))
    # Two shapes: each shape's answers are computed again only when a blocked job closes nodes (a new
    # version), which happens a few times at the head of the queue; 2,000 per function without memory.
    assert calls["_usable"] == 2 and calls["_largest_fit"] <= 8 and calls["_why"] <= 8, calls


# --- tp_group_nodes: where a worker group pins its bundles so that no tp group straddles nodes --------------


def _room(free: dict[str, dict[str, float]], per_rank: dict[str, float]) -> dict[str, int]:
    """Ranks each node can hold (every resource of a rank, counted by hand)."""
    return {
        name: min(int(have.get(resource, 0.0) // amount) for resource, amount in per_rank.items())
        for name, have in free.items()
    }


def test_tp_groups_fill_nodes_with_room_for_whole_groups_only():
    # Ray's PACK puts ranks 0-2 on the 3-CPU node and rank 3 on the other: group (2, 3) would straddle them.
    free = {"a": {"CPU": 3.0}, "b": {"CPU": 2.0}}
    assert tp_group_nodes(free, {"CPU": 1.0}, tp=2, groups=2) == ["a", "b"]
    assert tp_group_nodes(free, {"CPU": 1.0}, tp=2, groups=3) is None  # 5 CPUs, but only 2 whole groups
    assert tp_group_nodes(free, {"CPU": 1.0}, tp=2, groups=2, excluded={"b"}) is None
    assert tp_group_nodes(free, {"CPU": 1.0}, tp=1, groups=5) == ["a", "a", "a", "b", "b"]


def test_tp_groups_on_gpu_nodes_pack_the_roomiest_node_first_or_spread():
    free = {
        "n1": {"CPU": 16.0, "GPU": 3.0},  # three free GPUs: one group of 2, the third GPU cannot host one
        "n2": {"CPU": 16.0, "GPU": 8.0},
        "n3": {"CPU": 2.0, "GPU": 8.0},  # GPUs, but CPUs for one rank only
    }
    rank = {"CPU": 2.0, "GPU": 1.0}
    assert tp_group_nodes(free, rank, tp=2, groups=5) == ["n2"] * 4 + ["n1"]
    assert tp_group_nodes(free, rank, tp=2, groups=2, strategy="SPREAD") == ["n2", "n1"]
    assert tp_group_nodes(free, rank, tp=2, groups=6) is None


@pytest.mark.parametrize("seed", range(200))
def test_tp_groups_are_whole_within_each_nodes_room_and_found_whenever_they_fit(seed):
    rng = random.Random(seed)
    free = {
        f"n{i}": {"CPU": float(rng.randint(0, 9)), "GPU": float(rng.randint(0, 8))} for i in range(rng.randint(1, 5))
    }
    rank = {"CPU": float(rng.choice([1, 2])), "GPU": float(rng.choice([0, 1, 2]))}
    rank = {name: amount for name, amount in rank.items() if amount}
    tp, groups = rng.choice([1, 2, 4, 8]), rng.randint(1, 6)
    strategy = rng.choice(["PACK", "SPREAD"])
    excluded = {name for name in free if rng.random() < 0.2}
    nodes = tp_group_nodes(free, rank, tp=tp, groups=groups, strategy=strategy, excluded=excluded)
    room = _room({name: have for name, have in free.items() if name not in excluded}, rank)
    fits = sum(slots // tp for slots in room.values()) >= groups
    assert (nodes is not None) == fits, (free, rank, tp, groups, excluded)
    if nodes is not None:
        assert len(nodes) == groups
        for name in set(nodes):
            assert name not in excluded
            assert nodes.count(name) * tp <= room[name]  # every group whole, within what the node has free


def test_tp_group_nodes_refuses_a_nonsense_size():
    with pytest.raises(ValueError, match="tp=0"):
        tp_group_nodes({"a": {"CPU": 4.0}}, {"CPU": 1.0}, tp=0, groups=1)


def test_the_tp_groups_on_several_nodes_are_named_by_their_first_and_last_rank():
    nodes = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b", 6: "c"}  # rank 7 not placed: a node of its own
    assert tp_groups_across_nodes(nodes, tp=2, ranks=8) == [(2, 3), (6, 7)]
    assert tp_groups_across_nodes(nodes, tp=4, ranks=8) == [(0, 3), (4, 7)]
    assert tp_groups_across_nodes(nodes, tp=1, ranks=8) == []
    assert tp_groups_across_nodes({0: "a", 1: "a"}, tp=2, ranks=2) == []


def test_ranks_held_on_a_node_take_their_share_of_it_before_the_tp_groups():
    # A resize keeps 2 ranks pinned on "a": of its 4 free CPUs, 2 are left for whole groups.
    free = {"a": {"CPU": 4.0}, "b": {"CPU": 2.0}}
    assert tp_group_nodes(free, {"CPU": 1.0}, tp=2, groups=2) == ["a", "a"]
    assert tp_group_nodes(free, {"CPU": 1.0}, tp=2, groups=2, held={"a": 2}) == ["a", "b"]
    assert tp_group_nodes(free, {"CPU": 1.0}, tp=2, groups=2, held={"a": 3}) is None
    assert tp_group_nodes(free, {"CPU": 1.0}, tp=2, groups=1, held={"gone": 5}) == ["a"]  # not in free: ignored
    assert free == {"a": {"CPU": 4.0}, "b": {"CPU": 2.0}}  # the caller's view is left as it was


# --- host memory (Ray's ``memory`` resource: resources.host_memory_gb) -------------------------------------

GIB = 1024.0**3


def _with_memory(view: NodeView, total_gib: float, free_gib: float | None = None) -> NodeView:
    free = total_gib if free_gib is None else free_gib
    return NodeView(
        id=view.id,
        alive=view.alive,
        total={**view.total, "memory": total_gib * GIB},
        free={**view.free, "memory": free * GIB},
    )


def test_host_memory_is_a_resource_like_the_others():
    """A rank that asks for 3 GiB fits once on a node of 4 CPUs and 4.5 GiB (whatever its CPUs say), and a
    node of 2 GiB can never hold one: refused naming resources.host_memory_gb, with the fixes that shrink
    what a rank holds (lowering the field below the planner's figure is refused at submit)."""
    fat = Gang(per_rank={"CPU": 1.0, "memory": 3 * GIB}, dp_sizes=(1, 2), tp=1, pp=1)
    two = [_with_memory(node("a", 4), 4.5), _with_memory(node("b", 4), 4.5)]
    [admit] = decide([QueuedJob(id="fat", priority=0, created_at=0.0, gang=fat)], two).admit
    assert (admit.dp, dict(admit.placement)) == (2, {"a": 1, "b": 1})  # one rank per node, 3 CPUs left idle on each
    busy = [_with_memory(node("a", 4), 4.5, free_gib=2.0), _with_memory(node("b", 4), 4.5)]
    assert decide([QueuedJob(id="fat", priority=0, created_at=0.0, gang=fat)], busy).admit[0].dp == 1
    problem = refusal(fat, [_with_memory(node("a", 4), 2.0)])
    assert problem.field == "resources.host_memory_gb"
    assert problem.message == (
        "one rank needs 1 CPU + 3.00 GiB of host memory, but no node has 3.00 GiB of host memory: the most any "
        "of the 1 node(s) has is 2.00 GiB of host memory."
    )
    assert "parallelism.zero: 3" in problem.fix and "checkpoint.async: false" in problem.fix
    assert "fault_tolerance.in_place: false" in problem.fix and "add nodes with 3.00 GiB of host memory" in problem.fix
    assert describe({"CPU": 0.0, "memory": 1.5 * GIB}, zeros=True) == "0 CPUs + 1.50 GiB of host memory"
    assert describe({"CPU": 0.0, "memory": 1.5 * GIB}) == "1.50 GiB of host memory"
