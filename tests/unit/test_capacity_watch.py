"""How often a job's capacity is read: every elastic.check_interval_s, but every AWAITING_CHECK_S while the
job waits for capacity (after a node loss the first read can come before Ray frees the dead group's
resources; a spare node then waited a whole interval, 30 s by default, measured in tests/chaos)."""

from __future__ import annotations

import time

from etrain.service.runtime.capacity_watch import AWAITING_CHECK_S, CapacityWatch


def _watch(capacities: list[int]) -> CapacityWatch:
    watch = CapacityWatch(per_rank={"CPU": 1.0}, tp=1, pp=1, interval_s=30.0, held=lambda: {})
    watch.available_dp = lambda excluded: capacities.pop(0)  # the cluster's answers, in order
    return watch


def test_a_waiting_job_reads_capacity_again_within_a_second_and_sees_the_freed_node():
    watch = _watch([0, 2])
    first = watch.check(force=False, excluded=(), awaiting=True)
    assert first.available_dp == 0
    now = time.time()
    assert not watch.due(now) and watch.due(now + AWAITING_CHECK_S + 0.01)
    second = watch.check(force=False, excluded=(), awaiting=True)
    assert second.available_dp == 2


def test_a_running_job_reads_capacity_at_its_interval():
    watch = _watch([2, 2])
    assert watch.check(force=False, excluded=(), awaiting=False).available_dp == 2
    now = time.time()
    assert not watch.due(now + AWAITING_CHECK_S + 0.01) and watch.due(now + 30.01)
    assert watch.check(force=False, excluded=(), awaiting=False) is None  # unchanged: nothing to report
