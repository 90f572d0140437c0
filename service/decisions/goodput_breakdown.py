"""Goodput by cause: where a job's wall time since submit went, in seconds that add up exactly.

``goodput`` (service/decisions/goodput.py) says how much of the wall time produced kept training; this
says where the rest went. The partition is over the job's own timeline: its submit, its events and
its kept step rows (one per step, the run that the model descends from), cut at every row's start
(``ts - step_s``) and end (``ts``):

==================  ==========================================================================
``queued``          submit -> the first ``launching`` (admission, waiting for room), plus time
                    queued again after a lost supervisor (a ``queued`` event) until the next
                    launch
``startup``         the first ``launching`` -> the first step's start (placement, rank start-up,
                    restore, the first step's compile is inside the step itself)
``productive``      kept step time, less what ``stragglers`` takes
``stragglers``      while a rank is flagged (``straggler_detected`` until the next launch), each
                    kept step's time beyond the median step of its attempt before the flag
``checkpoint``      between two steps of one attempt where the first was checkpointed (the save's
                    blocking; ``checkpoint_committed`` names the step)
``between_steps``   between other consecutive steps of one attempt (the step-boundary work)
``recomputed``      after the last kept step of an attempt that failed, until the failure event:
                    work thrown away with the rollback (for a hang, its wait until detection too)
``recovery``        the failure event (``worker_failed``, ``hang_detected``, ``node_lost``, ...) ->
                    the next attempt's first step (detection, backoff, relaunch or repair, restore)
``resizing``        the same for an attempt that a resize or an eviction started (``resizing``,
                    ``straggler_evicted``)
``since_last_step`` the last kept step's end -> now (a running job: the step in flight) or the
                    job's end (the final save, an export)
==================  ==========================================================================

Every gap is signed (clock jitter can make a step start a few milliseconds before the previous one
ended), so the causes always sum to ``until - submitted_at`` exactly. Pure: no store, no clock.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["CAUSES", "BreakdownEvent", "BreakdownStep", "goodput_breakdown"]

#: The causes, in timeline order (the keys of :func:`goodput_breakdown`'s answer).
CAUSES = (
    "queued",
    "startup",
    "productive",
    "stragglers",
    "checkpoint",
    "between_steps",
    "recomputed",
    "recovery",
    "resizing",
    "since_last_step",
)
#: Events that start a new attempt's group.
LAUNCH_KINDS = frozenset({"launching", "repairing"})
#: Events after which the job waits for a relaunch that is not the job's progress.
FAILURE_KINDS = frozenset({"worker_failed", "hang_detected", "node_lost", "start_timeout", "repair_failed"})
RESIZE_KINDS = frozenset({"resizing", "straggler_evicted"})
_STEP = re.compile(r"step (\d+)")


@dataclass(frozen=True)
class BreakdownStep:
    """A kept step row: ``step``, the ``attempt`` that ran it, its end ``ts`` and its ``step_s``."""

    step: int
    attempt: int
    ts: float
    step_s: float | None


@dataclass(frozen=True)
class BreakdownEvent:
    ts: float
    kind: str
    text: str = ""


def goodput_breakdown(
    *,
    submitted_at: float,
    until: float,
    steps: Iterable[BreakdownStep],
    events: Iterable[BreakdownEvent],
) -> dict[str, float]:
    """Seconds per cause (:data:`CAUSES`) from ``submitted_at`` to ``until`` (now, or the job's end)."""
    rows = sorted(steps, key=lambda row: row.step)
    marks = sorted(events, key=lambda event: event.ts)
    out = dict.fromkeys(CAUSES, 0.0)
    launches = [event.ts for event in marks if event.kind in LAUNCH_KINDS]
    if not rows:
        first_launch = min(launches[0], until) if launches else until
        out["queued"] = first_launch - submitted_at
        out["startup"] = until - first_launch
        return out
    saved = {int(m.group(1)) for e in marks if e.kind == "checkpoint_committed" if (m := _STEP.search(e.text))}
    first_start = rows[0].ts - _seconds(rows[0])
    first_launch = min(launches[0], first_start) if launches else first_start
    out["queued"] = first_launch - submitted_at
    out["startup"] = first_start - first_launch
    out["productive"] = _seconds(rows[0])
    for before, row in zip(rows, rows[1:]):
        start = row.ts - _seconds(row)
        out["productive"] += _seconds(row)
        if row.attempt == before.attempt:
            out["checkpoint" if before.step in saved else "between_steps"] += start - before.ts
            continue
        _attempt_gap(out, marks, before.ts, start)
    out["since_last_step"] = until - rows[-1].ts
    moved = _straggler_excess(rows, marks, until)
    out["productive"] -= moved
    out["stragglers"] = moved
    return out


def _attempt_gap(out: dict[str, float], marks: Sequence[BreakdownEvent], last_end: float, next_start: float) -> None:
    """Between the last kept step of one attempt and the first of the next: thrown-away work up to the
    event that ended the attempt, then recovery or resizing; a ``queued`` stretch (a lost supervisor)
    counts as queued until the next launch."""
    inside = [event for event in marks if last_end <= event.ts <= next_start]
    cause = next((event for event in inside if event.kind in FAILURE_KINDS | RESIZE_KINDS), None)
    ended = cause.ts if cause is not None else last_end
    out["recomputed"] += ended - last_end
    queued = 0.0
    for i, event in enumerate(inside):
        if event.kind == "queued" and event.ts >= ended:
            relaunch = next((e.ts for e in inside[i + 1 :] if e.kind in LAUNCH_KINDS), next_start)
            queued += relaunch - event.ts
    out["queued"] += queued
    bucket = "resizing" if cause is not None and cause.kind in RESIZE_KINDS else "recovery"
    out[bucket] += next_start - ended - queued


def _straggler_excess(rows: Sequence[BreakdownStep], marks: Sequence[BreakdownEvent], until: float) -> float:
    """Kept step time beyond the attempt's median step before the flag, for steps that ended while a
    rank was flagged (``straggler_detected`` until the next launch or ``until``; overlapping flags count
    a step once, against the baseline before the first of them)."""
    flagged_since: dict[int, float] = {}  # row index -> start of the first window it ended in
    for event in marks:
        if event.kind != "straggler_detected":
            continue
        end = next((e.ts for e in marks if e.ts > event.ts and e.kind in LAUNCH_KINDS), until)
        for index, row in enumerate(rows):
            if event.ts < row.ts <= end:
                flagged_since.setdefault(index, event.ts)
    excess = 0.0
    medians: dict[tuple[int, float], float | None] = {}
    for index, since in flagged_since.items():
        row = rows[index]
        key = (row.attempt, since)
        if key not in medians:
            baseline = [_seconds(r) for r in rows if r.attempt == row.attempt and r.ts <= since]
            medians[key] = statistics.median(baseline) if baseline else None
        median = medians[key]
        if median is not None:
            excess += max(0.0, _seconds(row) - median)
    return excess


def _seconds(row: BreakdownStep) -> float:
    value = row.step_s
    return float(value) if value is not None and value == value and value > 0 else 0.0
