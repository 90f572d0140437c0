"""The supervisor's step intake (service/runtime/step_reports.py) with Ray's real gauges (no cluster needed).

The supervisor is a threaded actor, so rank 0's batches can arrive out of order: a job once ended showing
step 11 with its step-12 row stored (CI, test_control_plane_restart). The job's fields only move forward
within an attempt; a new attempt (a restore) may go back.
"""

from __future__ import annotations

from types import SimpleNamespace

from etrain.service.decisions.stragglers import StragglerConfig
from etrain.service.runtime.job_metrics import JobMetrics
from etrain.service.runtime.step_reports import StepReports


def _reports() -> StepReports:
    return StepReports(
        stragglers=StragglerConfig(),
        evict=False,
        metrics=JobMetrics("job-under-test"),
        parallel=SimpleNamespace(dp=1, tp=1, pp=1, cp=1),
    )


def _metrics(step_index: int) -> dict:
    return {"step": step_index, "loss": 10.0 - step_index, "tokens_per_s": 100.0 + step_index}


def _take_batch(reports: StepReports, attempt: int, indices: list[int]) -> None:
    records = [_metrics(index) for index in indices]
    for record in records:
        reports.take(attempt, record, world_size=1, node_of=lambda rank: "node", now=0.0)
    reports.show(records[-1], attempt=attempt, restarts=0)


def test_a_late_older_batch_does_not_move_the_job_back():
    reports = _reports()
    _take_batch(reports, 0, [0, 1, 2])
    _take_batch(reports, 0, [11])  # step 12 (the last, sent at once) overtakes the batch before it
    _take_batch(reports, 0, [3, 4, 5, 6, 7, 8, 9, 10])
    assert reports.latest["step"] == 12
    assert reports.latest["loss"] == 10.0 - 11
    assert sorted(row["step"] for row in reports.since(0)) == list(range(1, 13))
    assert reports.stats()["step"] == 12


def test_a_new_attempt_may_report_an_earlier_step():
    reports = _reports()
    _take_batch(reports, 0, [0, 1, 2, 3, 4])
    _take_batch(reports, 1, [2])  # restored from the checkpoint at step 2
    assert reports.latest["step"] == 3
    _take_batch(reports, 1, [1])  # ... and within that attempt only forward again
    assert reports.latest["step"] == 3
