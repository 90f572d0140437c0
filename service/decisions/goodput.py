"""Goodput: the fraction of a job's wall time that produced training progress it kept.

    goodput = productive step time / (now - submit time)        (None before the first step)

**Productive step time** is the sum of ``step_s`` over the steps of the job's current *lineage*:
each optimizer step counts once, with the time of its **last** run. A step runs more than once when
a failure rolls the job back to a checkpoint and a new attempt recomputes it; the earlier run's
work was thrown away with the rollback, so that run is waste, and the run whose result the model
now descends from is the one that counts (it is also the row the step store keeps: a later
attempt's report replaces an earlier one). Counting the first run instead would credit time whose
result no longer exists and leave the recomputation itself unexplained.

Rows of an earlier attempt at or after the step where the newest attempt started are not counted
either, even before the newest attempt reaches them again: the rollback has already discarded
them (a job that fails or is cancelled while recomputing never gets them back).

**Wall time** runs from the submit (``created_at``), so everything that is not a kept step counts
against goodput: time queued (waiting for admission, or queued again after a lost supervisor),
start-up, checkpoint restores, failure detection and backoff, recomputed steps, and whatever a
step does outside ``step_s``. A job that has ended is measured up to its end.

Everything here is pure (no store, no clock): :func:`productive_seconds` is the definition over
step records, :class:`ProductiveTally` maintains the same number incrementally as records arrive
(so the control plane never rescans a long job's history), and :func:`goodput` is the ratio.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ProductiveTally", "StepTime", "goodput", "productive_seconds"]


@dataclass(frozen=True)
class StepTime:
    """What goodput needs of one step record (``etrain.service.store.records.StepRecord`` has the same fields)."""

    step: int
    attempt: int
    step_s: float | None


def _seconds(step_s: float | None) -> float:
    """A step's time as counted: a missing, negative or non-finite time counts as 0."""
    if step_s is None:
        return 0.0
    value = float(step_s)
    return value if math.isfinite(value) and value > 0 else 0.0


def productive_seconds(records: Iterable[StepTime]) -> float:
    """The definition: per step the record of the highest attempt (a later record wins a tie), minus
    the records of earlier attempts at or after the first step of the newest attempt; their sum."""
    kept: dict[int, StepTime] = {}
    for record in records:
        current = kept.get(record.step)
        if current is None or record.attempt >= current.attempt:
            kept[record.step] = record
    if not kept:
        return 0.0
    newest = max(record.attempt for record in kept.values())
    first = min(record.step for record in kept.values() if record.attempt == newest)
    return sum(_seconds(r.step_s) for r in kept.values() if r.attempt == newest or r.step < first)


def goodput(productive_s: float | None, *, submitted_at: float, now: float) -> float | None:
    """``productive_s / (now - submitted_at)`` clamped to [0, 1]; None before there is a step
    (``productive_s`` None) or when no wall time has passed."""
    if productive_s is None:
        return None
    wall = now - submitted_at
    if not wall > 0:
        return None
    return min(1.0, max(0.0, productive_s / wall))


class ProductiveTally:
    """:func:`productive_seconds` of every record added so far, kept up to date in O(1) per record.

    Records may come in any order; a stale one (an earlier attempt's late report of a step a later
    attempt already ran) changes nothing. Only when a newer attempt appears (a restart), or the
    newest attempt reports a step before its first one, is the part of the history from its start
    recounted. Memory: 8 bytes per step (attempt as int32, seconds as float32: a step's time to
    ~7 digits, summed in float64).
    """

    def __init__(self, records: Iterable[StepTime] = ()) -> None:
        self._attempt = array("i")  # per step: attempt of the kept record, -1 for none
        self._seconds = array("f")
        self._newest = -1
        self._first = 0  # first step of the newest attempt
        self.total = 0.0
        self.steps = 0  # steps with a kept record
        for record in records:
            self.add(record)

    @property
    def value(self) -> float | None:
        """Productive seconds, or None before the first step record."""
        return self.total if self.steps else None

    def add(self, record: StepTime) -> None:
        step, attempt = int(record.step), int(record.attempt)
        if step < 0:
            raise ValueError(f"step {step} < 0")
        if step >= len(self._attempt):
            grow = step + 1 - len(self._attempt)
            self._attempt.extend([-1] * grow)
            self._seconds.extend([0.0] * grow)
        if attempt < self._attempt[step]:
            return  # stale: a later attempt already ran this step
        if attempt > self._newest or (attempt == self._newest and step < self._first):
            # The lineage moves: recount everything from where the old or the new newest attempt began.
            low = min(self._first, step) if self._newest >= 0 else 0
            self.total -= self._tail(low)
            self._put(step, attempt, record.step_s)
            self._newest, self._first = attempt, step
            self.total += self._tail(low)
        else:
            before = self._counted(step)
            self._put(step, attempt, record.step_s)
            self.total += self._counted(step) - before

    def _put(self, step: int, attempt: int, step_s: float | None) -> None:
        if self._attempt[step] < 0:
            self.steps += 1
        self._attempt[step] = attempt
        self._seconds[step] = _seconds(step_s)

    def _counted(self, step: int) -> float:
        attempt = self._attempt[step]
        if attempt < 0 or not (step < self._first or attempt == self._newest):
            return 0.0
        return float(self._seconds[step])

    def _tail(self, low: int) -> float:
        return sum(self._counted(step) for step in range(low, len(self._attempt)))
