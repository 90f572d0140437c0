"""WorkerGroup.stop() runs on its own thread while the supervisor's loop may still poll the group.

The chaos suite once failed an evicted job with ``KeyError`` from ``poll``: the stop thread cleared the
run table between ``ray.wait`` and the loop's lookup. These tests replay that interleaving with real
Ray object refs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from etrain.service.runtime.worker_group import WorkerGroup

ray = pytest.importorskip("ray")


def _group_with_finished_runs(world_size: int) -> WorkerGroup:
    group = WorkerGroup(
        job_id="stop-race",
        plan=SimpleNamespace(attempt=1),
        world_size=world_size,
        resources_per_rank={"CPU": 1.0},
        strategy="SPREAD",
        excluded_nodes=frozenset(),
        supervisor=None,
    )
    for rank in range(world_size):
        group._runs[ray.put({"final_step": 7 + rank})] = rank
    return group


def test_a_running_group_reports_its_end(local_ray):
    outcome = _group_with_finished_runs(2).poll(now=0.0)
    assert outcome is not None and outcome.kind == "finished" and outcome.final_step == 7


def test_poll_after_stop_reports_nothing(local_ray):
    group = _group_with_finished_runs(2)
    group.stop()
    assert group.poll(now=0.0) is None


def test_stop_between_wait_and_lookup_is_not_a_crash(local_ray, monkeypatch):
    group = _group_with_finished_runs(3)
    classify = group._classify
    calls = []

    def classify_then_stop(ref, rank):
        calls.append(rank)
        result = classify(ref, rank)
        group.stop()  # the stop thread wins the race right after the first rank was classified
        return result

    monkeypatch.setattr(group, "_classify", classify_then_stop)
    assert group.poll(now=0.0) is None
    assert len(calls) == 1
