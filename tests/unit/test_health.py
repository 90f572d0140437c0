"""The health check's verdict (workers/protocol/health.py): pure, every case by number."""

from __future__ import annotations

import pickle

from etrain.workers.protocol.errors import EtrainError, UnhealthyRankError
from etrain.workers.protocol.health import MIN_RATE_FRACTION, RankHealth, Unhealthy, unhealthy_ranks


def report(rank: int, gflops: float | None = 100.0, failure: str | None = None, device: str = "cuda:0") -> RankHealth:
    return RankHealth(rank=rank, node=f"node{rank}", device=device, failure=failure, gflops=gflops)


def test_healthy_ranks_pass_whatever_their_spread_within_the_fraction():
    assert unhealthy_ranks([report(0, 100.0), report(1, 30.0), report(2, 11.0), report(3, 250.0)]) == []


def test_a_local_failure_fails_its_rank_with_its_reason():
    failing = unhealthy_ranks([report(0), report(1, None, failure="cannot allocate on cuda:0: out of memory")])
    assert failing == [Unhealthy(1, "node1", "cannot allocate on cuda:0: out of memory")]


def test_a_rank_far_below_its_peers_median_fails_and_says_by_how_much():
    failing = unhealthy_ranks([report(0, 100.0), report(1, 120.0), report(2, 9.0)])
    assert [(f.rank, f.node) for f in failing] == [(2, "node2")]
    assert "9 GFLOP/s on cuda:0, below 10% of its peers' median 110 GFLOP/s" in failing[0].reason


def test_with_two_ranks_each_is_compared_with_the_other_so_only_the_slow_one_fails():
    # A median over both would put the slow rank's own rate in its reference.
    assert [f.rank for f in unhealthy_ranks([report(0, 1000.0), report(1, 99.0)])] == [1]
    assert unhealthy_ranks([report(0, 1000.0), report(1, 101.0)]) == []


def test_the_fraction_is_a_strict_bound():
    assert unhealthy_ranks([report(0, 100.0), report(1, 100.0 * MIN_RATE_FRACTION)]) == []
    assert unhealthy_ranks([report(0, 100.0), report(1, 9.99)], min_rate_fraction=0.1)[0].rank == 1


def test_one_rank_alone_fails_only_on_a_local_failure():
    assert unhealthy_ranks([report(0, 0.001)]) == []
    assert [f.rank for f in unhealthy_ranks([report(0, None, failure="x")])] == [0]


def test_failed_peers_do_not_count_in_the_reference_and_order_is_by_rank():
    reports = [report(3, 5.0), report(2, None, failure="broken"), report(0, 100.0), report(1, 100.0)]
    assert [(f.rank, f.reason[:6]) for f in unhealthy_ranks(reports)] == [(2, "broken"), (3, "matmul")]


def test_a_rank_without_a_rate_and_without_a_failure_is_not_judged_but_a_zero_rate_fails():
    assert unhealthy_ranks([report(0, 100.0), report(1, None)]) == []
    assert [f.rank for f in unhealthy_ranks([report(0, 100.0), report(1, 0.0)])] == [1]


def test_the_error_keeps_its_rank_across_pickling_and_is_a_user_error_family_member():
    error = UnhealthyRankError("health check failed on rank 3 (node n): broken", rank=3)
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, EtrainError) and copy.rank == 3 and str(copy) == str(error)


def test_cpu_rates_are_recorded_but_not_judged_since_cpu_ranks_share_cores():
    # Measured in a loaded 2-core test run: a preempted CPU rank read 1.36 against its peers' 55.9 GFLOP/s.
    cpu = [report(0, 55.9, device="cpu"), report(1, 55.9, device="cpu"), report(2, 1.36, device="cpu")]
    assert unhealthy_ranks(cpu) == []
    assert [f.rank for f in unhealthy_ranks([*cpu[:2], report(2, None, failure="cannot allocate", device="cpu")])] == [
        2
    ]
