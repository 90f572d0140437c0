"""``checkpoint.every_steps: auto``: how often to save, from what saves and steps cost (pure).

Why Young-Daly: a checkpoint costs the time it blocks training (``C``: on CUDA the device -> pinned
host copy of an async save, elsewhere the whole save), and a failure costs the work since the last
checkpoint. With failures arriving on average every ``M`` seconds, the interval that wastes the least
is ``sqrt(2 * C * M)`` (Young 1974; Daly 2006 refines it, with the same first term, for ``C << M``).
Saving more often pays ``C`` too often; less often loses more work per failure.

``C`` is measured: every save reports how long it blocked the step loop, and the interval is
re-evaluated from the mean of the saves measured so far (the first save of a job is often slower: it
pins host memory for the staging buffers that later saves reuse). Until a save was measured the
interval uses :data:`ASSUMED_BLOCK_S`. The interval in seconds becomes steps through the median of the
step times seen (steps are what the ranks count, and every rank must save at the same step).

Rank 0 alone decides (``workers/rank/worker.py``): its requests reach every rank through the step-boundary
exchange, so all ranks save the same step. Torch-free and Ray-free: ``tests/unit/test_checkpoint_cadence.py``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

__all__ = ["ASSUMED_BLOCK_S", "QUEUED_NOTE_MIN_S", "AutoCadence", "queued_save_note", "young_daly_interval_s"]

#: The blocking time assumed before any save of the job was measured (an async save's staging on a
#: GPU: ~1 s for a 1B model's 15 GB of state, measured on an H100; a CPU job's small saves are faster).
ASSUMED_BLOCK_S = 1.0
#: Step times kept for the median (enough to ignore a slow first step, small enough to follow drift).
STEP_WINDOW = 50
#: Bounds on the interval, whatever the numbers say: never a save per step, never a silent job.
MIN_INTERVAL_STEPS = 10
MAX_INTERVAL_STEPS = 1_000_000
#: A new interval is announced (an event) when it differs from the last announced one by more than this.
ANNOUNCE_CHANGE = 0.25
#: Steps seen before the first interval is announced (it is still used from the first step on).
SETTLE_STEPS = 10


#: A save that waited at least this long for the write before it is worth telling the user about.
QUEUED_NOTE_MIN_S = 0.5


def queued_save_note(
    *, step: int, previous_step: int, waited_s: float, since_previous_s: float, every_steps: int | None
) -> str | None:
    """The words for a save that had to wait for the previous save's write (an async save reuses one set
    of host buffers, so a save cannot start staging before the write before it has landed), or None where
    the wait is too small to matter. Saves then come faster than their writes land, and each save's wait
    blocks training: the note says by how much, how long a write takes (about the time between the two
    saves plus the wait), and the fixed ``every_steps`` that would leave room for one write."""
    if waited_s < QUEUED_NOTE_MIN_S or step <= previous_step or since_previous_s <= 0:
        return None
    gap = step - previous_step
    write_s = since_previous_s + waited_s  # the previous save's staging was inside since_previous_s: an upper bound
    fits = math.ceil(gap * write_s / since_previous_s * 1.1)  # 10% of room for a write slower than this one
    advice = (
        f"set checkpoint.every_steps >= {fits} (or auto)"
        if every_steps is not None
        else "the auto interval counts this wait as save blocking time and lengthens"
    )
    return (
        f"step {step}'s save waited {waited_s:.2f}s for step {previous_step}'s write: saves {gap} steps "
        f"({since_previous_s:.1f}s) apart come faster than a write lands (~{write_s:.1f}s), and the wait "
        f"blocks training; {advice}"
    )


def young_daly_interval_s(block_s: float, mtbf_s: float) -> float:
    """The checkpoint interval in seconds that minimises lost time: ``sqrt(2 * block_s * mtbf_s)``."""
    if block_s < 0 or mtbf_s <= 0:
        raise ValueError(f"block_s={block_s} must be >= 0 and mtbf_s={mtbf_s} > 0")
    return math.sqrt(2.0 * block_s * mtbf_s)


class AutoCadence:
    """Decides, step by step, when the next checkpoint is due under ``every_steps: auto``.

    ``observe_step`` after each step, ``observe_save`` after each save (its blocking seconds); ``due``
    says whether a save is due after ``completed`` steps; ``interval_steps`` is the current interval,
    and ``changed`` reports a new interval once (for the job's ``checkpoint_interval`` event).
    """

    def __init__(self, *, mtbf_hours: float, start_step: int = 0):
        if mtbf_hours <= 0:
            raise ValueError(f"mtbf_hours={mtbf_hours} must be > 0")
        self.mtbf_s = mtbf_hours * 3600.0
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._blocks: list[float] = []
        self._last_save = start_step  # a resumed attempt counts from the step it restored
        self._announced: int | None = None

    def observe_step(self, step_s: float) -> None:
        if math.isfinite(step_s) and step_s > 0:
            self._steps.append(step_s)

    def observe_save(self, completed: int, block_s: float) -> None:
        """A save after ``completed`` steps blocked training for ``block_s`` seconds."""
        self._last_save = max(self._last_save, completed)
        if math.isfinite(block_s) and block_s >= 0:
            self._blocks.append(block_s)

    @property
    def block_s(self) -> float:
        """The blocking time the interval is computed from: the mean measured, else the assumption."""
        return statistics.fmean(self._blocks) if self._blocks else ASSUMED_BLOCK_S

    @property
    def measured(self) -> bool:
        return bool(self._blocks)

    @property
    def interval_s(self) -> float:
        return young_daly_interval_s(self.block_s, self.mtbf_s)

    @property
    def interval_steps(self) -> int | None:
        """The interval in steps; None until a step time is known."""
        if not self._steps:
            return None
        steps = self.interval_s / statistics.median(self._steps)
        return int(min(MAX_INTERVAL_STEPS, max(MIN_INTERVAL_STEPS, round(steps))))

    def due(self, completed: int) -> bool:
        interval = self.interval_steps
        return interval is not None and completed - self._last_save >= interval

    def changed(self) -> str | None:
        """A sentence for the job's events when the interval moved by more than :data:`ANNOUNCE_CHANGE`
        from the one last announced (step times jitter: a step either way is not news)."""
        interval = self.interval_steps
        if len(self._steps) < SETTLE_STEPS and not self._blocks:
            return None  # the first steps (compile, allocator warm-up) say little about the step time
        if interval is None or (
            self._announced is not None and abs(interval - self._announced) <= ANNOUNCE_CHANGE * self._announced
        ):
            return None
        self._announced = interval
        source = (
            f"mean measured save blocking {self.block_s:.2f}s over {len(self._blocks)} save(s)"
            if self._blocks
            else f"assumed save blocking {self.block_s:.2f}s until a save is measured"
        )
        return (
            f"every {interval} steps (~{self.interval_s:.0f}s at {statistics.median(self._steps):.3f}s/step): "
            f"Young-Daly sqrt(2 x {self.block_s:.2f}s x MTBF {self.mtbf_s / 3600:g}h), {source}"
        )
