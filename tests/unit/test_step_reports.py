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


def test_a_failed_attempts_last_steps_are_kept_and_counted_as_reported():
    """Rank 0 sends its last steps as its attempt fails, after the supervisor moved to the repair's attempt:
    their rows are kept (a repair may resume after them from memory), not taken as the new attempt's progress,
    and the newest step each attempt reported bounds where that repair may resume."""
    reports = _reports()
    assert reports.reported_through(1) is None
    reports.arrived(1, [_metrics(0), _metrics(1)])
    _take_batch(reports, 1, [0, 1])
    late = [_metrics(2), _metrics(3)]
    reports.arrived(1, late)
    for record in late:
        reports.keep_late(1, record, now=5.0)
    assert reports.reported_through(1) == 4 and reports.reported_through(2) is None
    rows = reports.since(0)
    assert [(row["step"], row["attempt"]) for row in rows] == [(1, 1), (2, 1), (3, 1), (4, 1)]
    assert reports.latest["step"] == 2  # the job's fields follow the current attempt only
    reports.arrived(1, [_metrics(1)])  # an older batch arriving late does not lower it
    assert reports.reported_through(1) == 4
