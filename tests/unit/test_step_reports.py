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


def test_a_rank_over_its_host_memory_reservation_is_said_once_per_attempt():
    """Rank 2 of three holds 3 GiB against 2 reserved (beyond the half-GiB slack): said at the first step that
    shows it, naming the rank, its node and the figure to reserve; not again in the same attempt, again in the
    next one (a repair or relaunch may have moved the rank)."""
    gib = 1024**3
    reports = StepReports(
        stragglers=StragglerConfig(),
        evict=False,
        metrics=JobMetrics("job-under-test"),
        parallel=SimpleNamespace(dp=3, tp=1, pp=1, cp=1),
        reserved_host_bytes=2 * gib,
    )
    nodes = {0: "n0", 1: "n0", 2: "n1"}.__getitem__

    def note(attempt: int, step: int, held: list[int]) -> str | None:
        record = {**_metrics(step), "ranks": {"host_mem_bytes": held}}
        return reports.host_memory_note(attempt, record, node_of=nodes)

    within = [2 * gib, int(2.4 * gib), 0]  # up to 2.5 GiB unsaid; 0: a rank that could not say
    assert note(0, 0, within) is None
    assert note(0, 1, [2 * gib, 2 * gib, 3 * gib]) == (
        "attempt 0, step 2: rank 2 (node n1) holds 3.00 GiB of host memory (anonymous pages), more than the 2.00 GiB "
        "its bundle reserves (resources.host_memory_gb; the planner counts the model's state, not the data loader's "
        "or the process's own memory: POST /v1/plan's host_memory). Ray places ranks by the reservation without "
        "enforcing it, so the node can run out of memory and lose ranks: resubmit with resources.host_memory_gb: 3.3"
    )
    assert note(0, 2, [2 * gib, 2 * gib, 4 * gib]) is None  # once per attempt
    assert note(1, 2, [2 * gib, 2 * gib, 4 * gib]).startswith("attempt 1, step 3: rank 2 (node n1) holds 4.00 GiB")
    assert note(2, 0, [0, 0, 0]) is None  # nothing sampled (no smaps_rollup)
    unsettled = {**_metrics(1), "ranks": None}  # a step whose exchange never settled: no rank's figures
    assert reports.host_memory_note(2, unsettled, node_of=nodes) is None


def test_the_job_shows_the_most_host_memory_a_rank_held_at_the_latest_sample():
    reports = _reports()
    _take_batch(reports, 0, [0])
    assert reports.latest["host_memory_gib"] is None  # nothing sampled yet
    record = {**_metrics(1), "ranks": {"host_mem_bytes": [3 * 1024**3, 5 * 1024**3 + 1024**2]}}
    reports.take(0, record, world_size=2, node_of=lambda rank: "node", now=0.0)
    reports.show(record, attempt=0, restarts=0)
    assert reports.latest["host_memory_gib"] == 5.001
    _take_batch(reports, 0, [2])  # a step whose exchange never settled says nothing: the last sample stays
    assert reports.latest["host_memory_gib"] == 5.001
