"""Issue #9, warm spares: a job's first launch and its replacement rank are pre-started processes.

Real local Ray, the real control plane and its spare pool (service/runtime/spares.py). The test proves it by
process ids: every rank of the first launch, and the rank that replaces a killed one (in place: the
survivor keeps its own process), runs in a process that was a ready spare before (so it paid no
interpreter start and no torch import), and the recovered run still ends exactly where the clean run
ends. A finished job's ranks serve its tenant's next job, and no other tenant's, with the numbers a fresh
process gives.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from etrain.service.runtime.spares import find_pool
from tests.chaos.conftest import clean_run, losses, param_digests, rank_pids, run_clean, spec
from tests.service_harness import control_plane, event_kinds, event_text

CLEAN = "clean-run-tenant-token-3f9a"
WARM = "warm-spares-tenant-token-81c2"

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")


def ready_spare_pids(count: int, timeout_s: float = 90, *, exactly: bool = False) -> set[int]:
    """The pids of the pool's ready spares once there are ``count`` of them (``exactly``: and no more, none
    warming up: the pool has settled at that size after an earlier test's)."""
    pool = find_pool()
    assert pool is not None, "the control plane starts the spare pool"
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get(pool.stats.remote(), timeout=10)
        ready = len(stats["ready_pids"])
        if ready == count and not stats["warming"] if exactly else ready >= count:
            return set(stats["ready_pids"])
        assert time.monotonic() < deadline, f"the pool never had {count} ready spares: {stats}"
        time.sleep(0.2)


def test_first_launch_and_replacement_run_in_warm_spares_and_end_like_the_clean_run(local_ray, tmp_path):
    # Three spares on the one node: a DP2 launch takes two and leaves one ready for the replacement,
    # whatever the refill's pace on a loaded machine.
    # The recovered run is a tenant of its own: ranks an earlier test's job gave back within RETURNED_IDLE_S
    # (the pool outlives control planes) would serve the admin's jobs instead of the ready spares.
    with (
        control_plane(tmp_path, warm_spares_per_node=3, tenant_tokens={"clean": CLEAN, "warm": WARM}) as admin,
        admin.as_token(CLEAN) as other_tenant,
        admin.as_token(WARM) as plane,
    ):
        body = spec("warm-dp2", steps=24)
        # The same spec as tests/chaos' and test_in_place_repair's clean runs, as another tenant: its ranks go back
        # to the pool for that tenant's next job, not for this one (which then takes ready spares only).
        clean = clean_run(other_tenant, body)

        first = ready_spare_pids(3)
        job = plane.submit(body)
        admin.chaos(job["id"], action="kill_rank", rank=1, at_step=10)  # fault injection is the operator's
        final, events = plane.wait_terminal(job["id"], timeout_s=300), plane.events(job["id"])
        assert final["status"] == "SUCCEEDED", final
        assert final["restarts"] == 1
        assert "worker_failed" in event_kinds(events) and "restored" in event_kinds(events)
        placed = [event_text(e) for e in events if e["kind"] == "placed"]
        # The first launch takes a spare per rank; the in-place repair replaces only the killed rank.
        assert [text.rsplit("; ", 1)[-1] for text in placed] == [
            "2 of 2 ranks from warm spares",
            "1 of 2 ranks from warm spares",
        ], placed
        attempts = list(zip(rank_pids(plane, final["id"], 0), rank_pids(plane, final["id"], 1)))
        assert len(attempts) == 2, attempts
        assert set(attempts[0]) <= first, (attempts, first)
        assert attempts[1][0] == attempts[0][0]  # the survivor kept its process
        handed = ray.get(find_pool().stats.remote(), timeout=10)["handed_pids"]
        assert attempts[1][1] in first and attempts[1][1] in handed, (attempts, first, handed)  # a ready spare
        assert losses(plane, final["id"]) == clean.losses  # exact: same data, RNG and state


def test_a_node_is_refilled_only_after_the_launch_that_took_its_spare_has_started(local_ray, tmp_path):
    """A taken spare is replaced REFILL_DELAY_AFTER_TAKE_S later, not at once, so the new spare's start
    (an interpreter, torch, a warm-up step) does not take CPU from the ranks that are starting now."""
    from etrain.service.runtime.spares import REFILL_DELAY_AFTER_TAKE_S, take_spares

    with control_plane(tmp_path, warm_spares_per_node=1):
        (pid,) = ready_spare_pids(1, exactly=True)
        node = ray.get_runtime_context().get_node_id()
        taken_at = time.monotonic()
        (spare,) = take_spares([node])
        assert spare is not None
        try:
            while time.monotonic() - taken_at < REFILL_DELAY_AFTER_TAKE_S - 1.5:  # the refill loop ticks every 1 s
                stats = ray.get(find_pool().stats.remote(), timeout=10)
                assert not stats["warming"] and not stats["ready_pids"], stats
                time.sleep(0.2)
            refilled = ready_spare_pids(1)
            assert pid not in refilled
        finally:
            ray.kill(spare, no_restart=True)


def test_a_launch_takes_a_spare_still_warming_up_rather_than_starting_a_rank_cold(local_ray, tmp_path):
    """While a node's spare is still importing torch (right after the control plane starts, or after a take), a
    launch gets that spare (its assign waits behind the warm-up) instead of None, which would start a second,
    cold process beside it."""
    from etrain.service.runtime.spares import take_spares

    with control_plane(tmp_path, warm_spares_per_node=1):
        node = ray.get_runtime_context().get_node_id()
        pool = find_pool()  # the cluster's, as an earlier test left it: its ready spare is taken first
        for _ in ready_spare_pids(1):
            ray.kill(take_spares([node])[0], no_restart=True)
        deadline = time.monotonic() + 30  # the refill starts a new spare REFILL_DELAY_AFTER_TAKE_S after a take
        while (stats := ray.get(pool.stats.remote(), timeout=10))["warming"].get(node) != 1:
            assert time.monotonic() < deadline, f"the pool never started a spare: {stats}"
            time.sleep(0.05)
        assert not stats["ready_pids"], stats
        (spare,) = take_spares([node])
        assert spare is not None, "a spare still warming up is handed over"
        try:
            after = ray.get(pool.stats.remote(), timeout=10)
            assert not after["warming"] and not after["ready_pids"], after  # the one spare, taken
            pid = ray.get(spare.ready.remote(), timeout=120)["pid"]  # answers once its warm-up is done
            while pid not in ray.get(pool.stats.remote(), timeout=10)["handed_pids"]:
                assert time.monotonic() < deadline + 120, "the handed spare's pid is recorded once it is ready"
                time.sleep(0.2)
        finally:
            ray.kill(spare, no_restart=True)


ALICE, BOB = "alice-reuse-token-5c1e", "bob-reuse-token-77d0"


def wait_returned(pids: set[int], timeout_s: float = 60) -> None:
    """Wait until the pool holds the processes ``pids`` as returned ranks (the job's end gives them back)."""
    pool = find_pool()
    deadline = time.monotonic() + timeout_s
    while not pids <= (returned := set(ray.get(pool.stats.remote(), timeout=10)["returned_pids"])):
        assert time.monotonic() < deadline, f"the pool never held {sorted(pids)} as returned ranks: {returned}"
        time.sleep(0.2)


def test_a_finished_jobs_ranks_serve_its_tenants_next_job_exactly_and_no_other_tenants(local_ray, tmp_path):
    """Bob's job trains Y (tp=2) in fresh spares; Alice's job X (context parallel: ring attention) gets fresh
    spares too (never Bob's returned ranks); then Alice's Y runs in X's very processes and ends with Bob's losses and parameters, bit
    for bit: a reused process carries nothing of its last job into the numbers. Y once more, in Y's own
    processes (the same mesh a second time), gives them again."""
    y = spec("y", steps=8, dp=1, tp=2)  # tensor parallel: a second run of one mesh in one process (its DTensor caches)
    x = spec(
        "x",
        steps=6,
        dp=1,
        parallelism={"cp": 2},
        model={"d_model": 16, "n_layers": 1},
        data={"seed": 9},
        training={"seed": 2},
    )
    with (
        control_plane(tmp_path, warm_spares_per_node=2, tenant_tokens={"alice": ALICE, "bob": BOB}) as admin,
        admin.as_token(ALICE) as alice,
        admin.as_token(BOB) as bob,
    ):
        # The earlier test's take holds the refill back REFILL_DELAY_AFTER_TAKE_S: on a fast machine Bob's job
        # would start its ranks cold (in the pool, and returned too, but not from warm spares) before it has spares.
        ready_spare_pids(2)
        bobs = run_clean(bob, y)
        placed = [event_text(e) for e in bob.events(bobs["id"]) if e["kind"] == "placed"]
        assert placed[-1].endswith("; 2 of 2 ranks from warm spares"), placed  # fresh spares, no kept ones
        bobs_ranks = {rank_pids(bob, bobs["id"], rank)[0] for rank in (0, 1)}
        wait_returned(bobs_ranks)  # they came from the pool and went back to it

        ready_spare_pids(2)  # the pool refilled: Alice's first job gets fresh spares, not Bob's ranks
        xs = run_clean(alice, x)
        x_ranks = {rank_pids(alice, xs["id"], rank)[0] for rank in (0, 1)}
        assert not x_ranks & bobs_ranks, (x_ranks, bobs_ranks)
        wait_returned(x_ranks)
        reused_before = ray.get(find_pool().stats.remote(), timeout=10)["reused"]

        ys = run_clean(alice, y)
        y_ranks = [rank_pids(alice, ys["id"], rank)[0] for rank in (0, 1)]
        assert set(y_ranks) == x_ranks, (y_ranks, x_ranks)  # X's processes, no new one and none of Bob's
        assert ray.get(find_pool().stats.remote(), timeout=10)["reused"] == reused_before + 2
        placed = [event_text(e) for e in alice.events(ys["id"]) if e["kind"] == "placed"]
        assert placed[-1].endswith("2 of 2 ranks from warm spares (2 kept from the tenant's earlier jobs)"), placed
        assert losses(alice, ys["id"]) == losses(bob, bobs["id"])
        assert param_digests(alice, ys["id"]) == param_digests(bob, bobs["id"])

        # A returned rank's process dies while it waits in the pool (SIGKILL: out of memory, an operator): the
        # next launch that takes it starts that rank cold instead, and the job is none the worse.
        wait_returned(set(y_ranks))
        os.kill(y_ranks[0], signal.SIGKILL)
        again = run_clean(alice, y)
        placed = [event_text(e) for e in alice.events(again["id"]) if e["kind"] == "placed"]
        assert placed[-1].endswith("1 of 2 ranks from warm spares (1 kept from the tenant's earlier jobs)"), placed
        assert y_ranks[1] in {rank_pids(alice, again["id"], rank)[0] for rank in (0, 1)}
        assert losses(alice, again["id"]) == losses(bob, bobs["id"])


CAROL = "carol-cold-ranks-token-2b7e"


def test_ranks_started_cold_go_back_to_the_pool_and_serve_the_tenants_next_job(local_ray, tmp_path):
    """A launch with more ranks than the node has spares starts the others cold in the pool
    (``SparePool.start_cold``), which owns them as it owns its spares: so they outlive the job's supervisor and,
    once the job finished, serve its tenant's next job with the spare's rank, every process kept."""
    body = spec("cold-dp3", steps=6, dp=3, training={"global_batch": 6})
    with control_plane(tmp_path, warm_spares_per_node=1, tenant_tokens={"carol": CAROL}) as admin:
        with admin.as_token(CAROL) as carol:
            ready_spare_pids(1)
            first = run_clean(carol, body)
            placed = [event_text(e) for e in carol.events(first["id"]) if e["kind"] == "placed"]
            assert placed[-1].endswith("; 1 of 3 ranks from warm spares"), placed  # two started cold
            pids = {rank_pids(carol, first["id"], rank)[0] for rank in range(3)}
            wait_returned(pids)  # all three, the cold ones included

            second = run_clean(carol, body)
            placed = [event_text(e) for e in carol.events(second["id"]) if e["kind"] == "placed"]
            assert placed[-1].endswith("3 of 3 ranks from warm spares (3 kept from the tenant's earlier jobs)"), placed
            assert {rank_pids(carol, second["id"], rank)[0] for rank in range(3)} == pids
            assert losses(carol, second["id"]) == losses(carol, first["id"])
