"""Slow-rank detection from per-rank COMPUTE time, judged within a pipeline stage.

Why compute time and not step time: data/tensor/pipeline parallel ranks meet in collectives every
step, so one slow rank makes every other rank wait for it. Their *step* times rise to the slow
rank's, and step time alone cannot say who is slow. The time a rank spends in its own forward /
backward / optimizer math (``compute_s`` in the worker's step report, collective waits excluded:
the timing-sync point and the timed waits inside TP / FSDP2 collectives, see ``workers/engine/train.py``
and ``workers/engine/collective_waits.py``) is what separates them: the slow rank's compute is long, its
peers' compute is normal and their extra time shows up as ``comm_wait_s`` instead.

Why per stage: pipeline stages do different work by design. The last stage carries the vocabulary
head and the loss (with a large vocabulary, several times a middle stage's compute), the first the
embeddings; comparing ranks across stages would flag the last stage on every healthy run. So a rank
is compared only with its **peers in the same stage** (its data- and tensor-parallel partners,
which run the same layers on other data or other shards). The stage of each rank comes from the
run's layout (:func:`stage_map`, Megatron rank order from ``workers/protocol/topology.py``). Without a stage
map every rank is in one stage (plain DP / TP / ZeRO).

A stage with **one rank** (pure pipeline parallelism, ``dp = tp = 1``) has no peer. It is compared
with **its own history** instead: its cost relative to the other stages (its window median over
the median of theirs) against the median of that relative cost over its last ``history`` healthy
windows (windows within the threshold either way). Relative, because what slows every rank alike (a busy
host, every step getting longer) is not a straggler and must not look like one; what is left is a
rank that *became* slow (a throttling GPU, a noisy neighbour, a failing link), which is what
eviction can fix. A stage that is slow from its first window cannot be told from one that is slow
by design, and is not flagged. The first window of a lone stage (of each attempt) is its warm-up and is
neither judged nor learned: its steps include the attempt's first, whose one-off costs (allocations, the
optimizer's state, the first reports) fall on each stage unevenly, so its relative cost is not the stage's
usual one (a first window 1.5x off made three healthy windows after it look slow: rank 1 of a PP x2 job was
flagged at step 16 before it was slowed at step 20, on a quiet 2-core machine, 2026-12-06). The second window
is its baseline and is not judged.
A run with one rank in total is never judged: nobody waits for it.

The statistic is deliberately robust:

* steps are grouped into windows of ``window`` observations; each rank's value for a window is the
  **median** of its compute times, so one long step (GC pause, checkpoint flush) does not count;
* a rank is compared with the **median of the other ranks' medians in its stage** (itself
  excluded), so a slow rank does not drag its own baseline up. With two ranks in a stage the peer
  is simply the other rank;
* a rank is flagged only after ``patience`` consecutive windows over ``threshold``, and then
  reported **once**; it is reported again only after a window at or under the threshold (with the
  slow path on, under its lower threshold: the rank recovered) followed by a new streak;
* a rank is compared with its peers **as it usually compares with them**: where it is persistently
  faster than its peers (a usual ratio under 1, the median of its last ``history`` healthy windows, once
  it has that many), its ratio is divided by that usual one. A rank that usually computes in 0.9 of its
  peer's time and becomes 1.5x slower is then seen at 1.5x, not 1.35x (measured so on the 2-core machine,
  four ranks on two cores). Only a usual ratio under 1 is used (a rank slow from its first window is not
  excused), and only healthy windows within the slow path's band either way teach it (a slow peer makes a
  rank look fast: learning that would flag it when the peer recovers);
* beside that fast path, a **slow path** flags a rank over the lower ``sustained_threshold`` (1.3 at a
  threshold of 1.5) for ``sustained_windows`` consecutive windows: a 1.5x straggler sits right at the
  fast path's threshold, where noise decides whether three windows in a row clear it, but it clears
  1.3 every window, while healthy noise does not stay over 1.3 for 32 steps. Like alerting on an error
  budget at two burn rates: a high bar over a short time, a lower one over a longer time.

The detector knows ranks, not nodes; the adapter maps a finding to a node and turns it into a
``StragglerFlagged`` event for the supervisor. Pure Python: no torch, no Ray.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass

from etrain.workers.protocol.errors import EtrainError
from etrain.workers.protocol.topology import Topology

__all__ = ["StragglerConfig", "StragglerConfigError", "StragglerDetector", "StragglerFinding", "stage_map"]

#: ``StragglerFinding.basis``: compared with the other ranks of its stage, or with its own past.
PEERS = "peers"
HISTORY = "history"


class StragglerConfigError(EtrainError, ValueError):
    """A straggler setting out of range; the message names the setting, the value and the fix."""


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    enabled: bool = True
    window: int = 4  # observations (steps) per window
    threshold: float = 1.5  # flag when window_median / peer_median is above this
    patience: int = 3  # consecutive windows over threshold before a rank is reported
    min_ranks: int = 2  # a stage with fewer ranks reporting in a window is not peer-judged in it
    #: A lone stage's baseline, and a rank's usual ratio to its peers: the median of its last `history`
    #: healthy windows.
    history: int = 5
    #: The slow path: a rank over the lower ``sustained_threshold`` for this many consecutive windows is
    #: reported too (0: off). It finds a milder slowdown that lasts (1.5x at threshold 1.5, which the
    #: fast path flags only some of the time) at the price of a longer wait.
    sustained_windows: int = 8
    #: How far the slow path's threshold sits between 1 and ``threshold`` (0.6: 1.3 at threshold 1.5).
    sustained_fraction: float = 0.6

    @property
    def sustained_threshold(self) -> float:
        return 1.0 + self.sustained_fraction * (self.threshold - 1.0)

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
            raise StragglerConfigError(f"min_ranks={self.min_ranks} must be >= 2: a rank needs at least one peer")
        if self.history < 1:
            raise StragglerConfigError(f"history={self.history} must be >= 1 window")
        if self.sustained_windows < 0:
            raise StragglerConfigError(f"sustained_windows={self.sustained_windows} must be >= 0 (0: off)")
        if not 0.0 < self.sustained_fraction <= 1.0:
            raise StragglerConfigError(f"sustained_fraction={self.sustained_fraction} must be in (0, 1]")


@dataclass(frozen=True, kw_only=True)
class StragglerFinding:
    rank: int
    factor: float  # window_median / peer_median in the window that completed the streak
    window_median: float  # the rank's median compute seconds in that window
    #: What the rank was compared with, in seconds: the median of its stage peers' window medians
    #: (basis "peers"), or, for a stage with one rank (basis "history"), the compute it would have in
    #: this window at its usual cost relative to the other stages (median over its healthy windows).
    peer_median: float
    windows_flagged: int  # consecutive windows over threshold (== patience when first reported)
    step: int  # last step of the window that completed the streak
    evidence: str  # one line for the event log
    stage: int = 0  # the rank's pipeline stage (0 without a stage map)
    basis: str = PEERS  # PEERS | HISTORY


@dataclass(frozen=True, kw_only=True)
class _Streak:
    windows: int = 0  # consecutive windows over the threshold
    sustained: int = 0  # consecutive windows over the sustained (lower) threshold
    reported: bool = False
    factors: tuple[float, ...] = ()


def stage_map(*, pp: int, dp: int, tp: int, cp: int = 1) -> dict[int, int]:
    """``{rank: pipeline stage}`` of a ``pp × dp × cp × tp`` layout (Megatron order, ``workers/protocol/topology.py``).

    A rank's stage is its pp coordinate: with interleaved schedules it holds several virtual stages
    (``s, s + pp, ...``), the same ones as every rank of equal pp coordinate, so those ranks are
    still each other's peers (and the rank holding the head is always pp coordinate ``pp - 1``).
    """
    topology = Topology(pp=pp, dp=dp, tp=tp, cp=cp)
    return {rank: topology.coords(rank).pp for rank in range(topology.world_size)}


class StragglerDetector:
    """Feeds on per-step ``{rank: compute_s}`` maps; returns findings when a window closes.

    Owned by one worker group: build a new one (or :meth:`reset`) when the group is relaunched
    (ranks and maybe the layout change). ``stages`` is the layout's ``{rank: stage}``
    (:func:`stage_map`); None puts every rank in one stage, and a rank missing from a given map is
    ignored (it is not part of the layout). Samples that are missing, negative, NaN or infinite are
    dropped, and a rank with fewer than half a window of samples is left out of that window
    (neither judged nor used as a peer).
    """

    def __init__(self, config: StragglerConfig | None = None, *, stages: Mapping[int, int] | None = None) -> None:
        self.config = config or StragglerConfig()
        self._stages = dict(stages) if stages is not None else None
        self._stage_sizes = Counter(self._stages.values()) if self._stages is not None else Counter()
        self.reset()

    def reset(self) -> None:
        self._samples: dict[int, list[float]] = {}
        self._steps_in_window = 0
        self._streaks: dict[int, _Streak] = {}
        self._warmed: set[int] = set()  # lone ranks whose warm-up window has passed
        self._history: dict[int, deque[float]] = {}  # lone ranks: medians of their healthy windows
        self._standing: dict[int, deque[float]] = {}  # ranks with peers: their healthy windows' peer ratios

    def stage_of(self, rank: int) -> int | None:
        """The rank's stage (0 without a stage map), None for a rank outside the layout."""
        if self._stages is None:
            return 0
        return self._stages.get(rank)

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
        by_stage: dict[int, dict[int, float]] = {}
        for rank, values in samples.items():
            stage = self.stage_of(rank)
            if stage is not None and len(values) >= min_samples:
                by_stage.setdefault(stage, {})[rank] = statistics.median(values)
        findings = []
        for stage in sorted(by_stage):
            medians = by_stage[stage]
            if len(medians) >= self.config.min_ranks:
                for rank in sorted(medians):
                    peer_median = statistics.median(m for r, m in medians.items() if r != rank)
                    finding = self._judge_against_peers(rank, stage, medians[rank], peer_median, step)
                    findings += [finding] if finding else []
            elif self._lone(stage):
                (rank,) = medians
                others = [m for s, stage_medians in by_stage.items() if s != stage for m in stage_medians.values()]
                if others:  # (every other stage silent this window: nothing to scale by, no verdict)
                    finding = self._judge_against_history(rank, stage, medians[rank], statistics.median(others), step)
                    findings += [finding] if finding else []
            # else: a stage of several ranks with too few reporting this window: no peers, no verdict
        return findings

    def _lone(self, stage: int) -> bool:
        """A stage with exactly one rank in a layout of several ranks (someone may wait for it)."""
        return self._stages is not None and self._stage_sizes[stage] == 1 and len(self._stages) >= 2

    def _judge_against_peers(
        self, rank: int, stage: int, median: float, peer_median: float, step: int
    ) -> StragglerFinding | None:
        """``median / peer_median`` against the threshold, over the rank's usual ratio where that is under 1
        (a rank persistently faster than its peers); healthy windows teach the usual ratio."""
        if peer_median <= 0:
            return None
        standing = self._standing.setdefault(rank, deque(maxlen=self.config.history))
        usual = min(1.0, statistics.median(standing)) if len(standing) == self.config.history else 1.0
        finding = self._judge_rank(rank, stage, PEERS, median, peer_median * usual, step, usual=usual)
        ratio, band = median / peer_median, self.config.sustained_threshold
        streak = self._streaks.get(rank, _Streak())
        if streak.windows == 0 and streak.sustained == 0 and 1 / band <= ratio <= band:
            standing.append(ratio)
        return finding

    def _judge_against_history(
        self, rank: int, stage: int, median: float, others: float, step: int
    ) -> StragglerFinding | None:
        """A lone stage's cost *relative to the other stages* (``median / others``) against the median of
        its earlier healthy relative costs. Relative, so that what slows every rank alike (a busier
        machine, a longer step for everyone) moves nothing, and only this rank slowing does."""
        if others <= 0:
            return None
        relative = median / others
        if rank not in self._warmed:
            self._warmed.add(rank)  # the first window is the warm-up: neither judged nor learned
            return None
        history = self._history.setdefault(rank, deque(maxlen=self.config.history))
        if not history:
            history.append(relative)  # the second window is the baseline, not judged
            return None
        usual = statistics.median(history)
        # In seconds: the compute this rank would have now at its usual cost relative to the others.
        finding = self._judge_rank(rank, stage, HISTORY, median, usual * others, step)
        # Only a window within the threshold either way moves the baseline: a slow one (over either path's
        # threshold) never does, nor one that looks fast because another stage was slow (with two stages, a
        # slow neighbour halves this one's relative cost; learning that would flag this stage when the
        # neighbour recovers).
        streak = self._streaks.get(rank, _Streak())
        if streak.windows == 0 and streak.sustained == 0 and relative * self.config.threshold >= usual:
            history.append(relative)
        return finding

    def _judge_rank(
        self, rank: int, stage: int, basis: str, median: float, reference: float, step: int, *, usual: float = 1.0
    ) -> StragglerFinding | None:
        if reference <= 0:
            return None  # the reference is zero compute: no meaningful ratio
        factor = median / reference
        config = self.config
        slow_path = config.sustained_windows > 0
        if factor <= config.threshold and not (slow_path and factor > config.sustained_threshold):
            self._streaks[rank] = _Streak()  # recovered: may be reported again later
            return None
        streak = self._streaks.get(rank, _Streak())
        streak = _Streak(
            windows=streak.windows + 1 if factor > config.threshold else 0,
            sustained=streak.sustained + 1 if slow_path and factor > config.sustained_threshold else 0,
            reported=streak.reported,
            factors=(streak.factors + (factor,))[-max(config.patience, config.sustained_windows) :],
        )
        finding = None
        fast = streak.windows >= config.patience
        sustained = slow_path and streak.sustained >= config.sustained_windows
        if (fast or sustained) and not streak.reported:
            finding = self._finding(
                rank, stage, basis, factor, median, reference, streak, step, sustained=not fast, usual=usual
            )
            streak = _Streak(windows=streak.windows, sustained=streak.sustained, reported=True, factors=streak.factors)
        self._streaks[rank] = streak
        return finding

    def _finding(
        self,
        rank: int,
        stage: int,
        basis: str,
        factor: float,
        window_median: float,
        reference: float,
        streak: _Streak,
        step: int,
        *,
        sustained: bool = False,
        usual: float = 1.0,
    ) -> StragglerFinding:
        windows = streak.sustained if sustained else streak.windows
        threshold = round(self.config.sustained_threshold, 4) if sustained else self.config.threshold
        factors = ", ".join(f"{f:.2f}x" for f in streak.factors[-windows:])
        if basis == PEERS:
            compared = f"peer median {reference / usual:.4f}s" + (
                f" in stage {stage}" if self._stages is not None else ""
            )
            if usual < 1.0:
                compared += f" times its usual ratio to its peers {usual:.2f} = {reference:.4f}s"
        else:
            compared = (
                f"{reference:.4f}s expected from its own earlier windows relative to the other stages "
                f"(stage {stage} has no peer)"
            )
        evidence = (
            f"rank {rank} median compute {window_median:.4f}s vs {compared} "
            f"({factor:.2f}x > {'sustained threshold ' if sustained else 'threshold '}{threshold}x) for {windows} "
            f"consecutive windows of {self.config.window} steps ending at step {step} [{factors}]"
        )
        return StragglerFinding(
            rank=rank,
            factor=factor,
            window_median=window_median,
            peer_median=reference,
            windows_flagged=windows,
            step=step,
            evidence=evidence,
            stage=stage,
            basis=basis,
        )
