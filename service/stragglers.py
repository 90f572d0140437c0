"""Slow-rank detection from per-rank COMPUTE time.

Why compute time and not step time: data/tensor/pipeline parallel ranks meet in collectives every
step, so one slow rank makes every other rank wait for it. Their *step* times rise to the slow
rank's, and step time alone cannot say who is slow. The time a rank spends in its own forward /
backward / optimizer math (``compute_s`` in the worker's step report, collective waits excluded)
is what separates them: the slow rank's compute is long, its peers' compute is normal and their
extra time shows up as ``comm_wait_s`` instead.

The statistic is deliberately robust:

* steps are grouped into windows of ``window`` observations; each rank's value for a window is the
  **median** of its compute times, so one long step (GC pause, checkpoint flush) does not count;
* a rank is compared with the **median of the other ranks' medians** (its peers, itself
  excluded), so a slow rank does not drag its own baseline up. With two ranks the peer is simply
  the other rank;
* a rank is flagged only after ``patience`` consecutive windows over ``threshold``, and then
  reported **once**; it is reported again only after a window at or under the threshold (it
  recovered) followed by a new streak.

The detector knows ranks, not nodes; the adapter maps a finding to a node and turns it into a
``StragglerFlagged`` event for the supervisor.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from workers.errors import EtrainError

__all__ = ["StragglerConfig", "StragglerConfigError", "StragglerDetector", "StragglerFinding"]


class StragglerConfigError(EtrainError, ValueError):
    """A straggler setting out of range; the message names the setting, the value and the fix."""


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    enabled: bool = True
    window: int = 10  # observations (steps) per window
    threshold: float = 1.5  # flag when window_median / peer_median is above this
    patience: int = 2  # consecutive windows over threshold before a rank is reported
    min_ranks: int = 2  # windows with fewer ranks reporting are skipped (no peers to compare)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise StragglerConfigError(f"window={self.window} must be >= 1 step")
        if not self.threshold > 1.0:
            raise StragglerConfigError(
                f"threshold={self.threshold} must be > 1.0 (a factor over the peer median, e.g. 1.5)"
            )
        if self.patience < 1:
            raise StragglerConfigError(f"patience={self.patience} must be >= 1 window")
        if self.min_ranks < 2:
            raise StragglerConfigError(
                f"min_ranks={self.min_ranks} must be >= 2: a rank needs at least one peer"
            )


@dataclass(frozen=True, kw_only=True)
class StragglerFinding:
    rank: int
    factor: float  # window_median / peer_median in the window that completed the streak
    window_median: float  # the rank's median compute seconds in that window
    peer_median: float  # median of the other ranks' window medians
    windows_flagged: int  # consecutive windows over threshold (== patience when first reported)
    step: int  # last step of the window that completed the streak
    evidence: str  # one line for the event log


@dataclass(frozen=True, kw_only=True)
class _Streak:
    windows: int = 0
    reported: bool = False
    factors: tuple[float, ...] = ()


class StragglerDetector:
    """Feeds on per-step ``{rank: compute_s}`` maps; returns findings when a window closes.

    Owned by one worker group: call :meth:`reset` when the group is relaunched (ranks change).
    Samples that are missing, negative, NaN or infinite are dropped, and a rank with fewer than
    half a window of samples is left out of that window (neither judged nor used as a peer).
    """

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self.reset()

    def reset(self) -> None:
        self._samples: dict[int, list[float]] = {}
        self._steps_in_window = 0
        self._streaks: dict[int, _Streak] = {}

    def observe(self, step: int, compute_s: Mapping[int, float]) -> list[StragglerFinding]:
        """Record one step's compute times; at the end of a window, judge it."""
        if not self.config.enabled:
            return []
        for rank, seconds in compute_s.items():
            if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0:
                self._samples.setdefault(rank, []).append(float(seconds))
        self._steps_in_window += 1
        if self._steps_in_window < self.config.window:
            return []
        samples, self._samples, self._steps_in_window = self._samples, {}, 0
        return self._judge(step, samples)

    def _judge(self, step: int, samples: dict[int, list[float]]) -> list[StragglerFinding]:
        min_samples = max(1, self.config.window // 2)
        medians = {
            rank: statistics.median(values)
            for rank, values in samples.items()
            if len(values) >= min_samples
        }
        if len(medians) < self.config.min_ranks:
            return []
        findings = []
        for rank in sorted(medians):
            peer_median = statistics.median(m for r, m in medians.items() if r != rank)
            if peer_median <= 0:
                continue  # peers report zero compute: no meaningful ratio
            factor = medians[rank] / peer_median
            streak = self._streaks.get(rank, _Streak())
            if factor <= self.config.threshold:
                self._streaks[rank] = _Streak()  # recovered: may be reported again later
                continue
            streak = _Streak(
                windows=streak.windows + 1,
                reported=streak.reported,
                factors=streak.factors + (factor,),
            )
            if streak.windows >= self.config.patience and not streak.reported:
                findings.append(self._finding(rank, factor, medians[rank], peer_median, streak, step))
                streak = _Streak(windows=streak.windows, reported=True, factors=streak.factors)
            self._streaks[rank] = streak
        return findings

    def _finding(
        self,
        rank: int,
        factor: float,
        window_median: float,
        peer_median: float,
        streak: _Streak,
        step: int,
    ) -> StragglerFinding:
        factors = ", ".join(f"{f:.2f}x" for f in streak.factors)
        evidence = (
            f"rank {rank} median compute {window_median:.4f}s vs peer median {peer_median:.4f}s "
            f"({factor:.2f}x > threshold {self.config.threshold}x) for {streak.windows} consecutive "
            f"windows of {self.config.window} steps ending at step {step} [{factors}]"
        )
        return StragglerFinding(
            rank=rank,
            factor=factor,
            window_median=window_median,
            peer_median=peer_median,
            windows_flagged=streak.windows,
            step=step,
            evidence=evidence,
        )
