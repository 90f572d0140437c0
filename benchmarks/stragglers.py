"""Straggler detection latency and false positives under DP, TP, ZeRO-3 and PP, on measured compute times.

For the benchmark suite's figure 4. Per layout, one short real run (``etrain.workers.engine.train.Trainer`` on gloo
ranks, ``tests.dist_utils``; no Ray) records every rank's ``compute_s`` on every step (all steps are
timing-sync steps there): first healthy, then with one rank slowed by the chaos ``slow_rank`` drill
(``etrain.workers.rank.chaos.RankDrills``, the rank's drill plugin) at each slowdown in turn. Those measured
per-step rows (all ranks of one step together, so a load spike that hits every rank stays one) are then
replayed through the production :class:`etrain.service.decisions.stragglers.StragglerDetector` with the job defaults
(window 4, threshold 1.5, patience 3; every step a timing-sync step), resampled with replacement:

* **false positives**: a healthy stream of ``HEALTHY_OBSERVATIONS`` timing-sync steps; every finding is
  false; reported per 1,000 training steps at ``timing_sync_every`` (the default 1: every step is an
  observation);
* **detection latency**: a healthy prefix (``history`` + 2 windows plus a random phase, so the detector
  has learned each rank's usual standing among its peers and the slowdown does not start on a window
  boundary), then slowed rows until the slowed rank is reported; latency is the
  number of training steps from the first slowed step to the step whose window reports it (median
  over ``TRIALS``), None where it is not reported within ``HORIZON_WINDOWS`` windows in most trials
  (a slowdown under the threshold, e.g. 1.25x at 1.5). A finding about any other rank meanwhile is
  counted in ``wrong_rank_findings``.

Layouts: which rank is slowed is chosen so each comparison basis is exercised: under PP the slowed
rank is on the last stage (the one with the vocabulary head, slower by design); ``PP x2`` has one
rank per stage (judged against its own history), ``PP x2 · DP x2`` two (judged against its stage peer).

Use :func:`bench_stragglers` for one (layout, slowdown) figure, :func:`bench_all` for the grid; the
measured traces are cached per layout within a process, so the grid costs one run per layout
(about 40 steps in ``quick`` mode, 70 otherwise).
"""

from __future__ import annotations

import functools
import random
import statistics
from dataclasses import dataclass
from typing import Any

from etrain.service.decisions.stragglers import HISTORY, PEERS, StragglerConfig, StragglerDetector, stage_map
from etrain.workers.protocol.run_config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainingConfig

__all__ = ["LAYOUTS", "SLOWDOWNS", "Trace", "bench_all", "bench_stragglers", "measure", "replay"]

#: layout name -> (parallel layout, the rank slowed)
LAYOUTS: dict[str, tuple[ParallelConfig, int]] = {
    "DP ×2": (ParallelConfig(dp=2), 1),
    "TP ×2": (ParallelConfig(tp=2), 1),
    "ZeRO-3 ×2": (ParallelConfig(dp=2, zero=3), 1),
    "PP ×2": (ParallelConfig(pp=2), 1),
    "PP ×2 · DP ×2": (ParallelConfig(pp=2, dp=2), 3),
}
SLOWDOWNS: tuple[float, ...] = (1.25, 1.5, 2.0, 4.0)
TIMING_SYNC_EVERY = 1  # training.timing_sync_every's default: training steps per observation
HEALTHY_OBSERVATIONS = 2000  # 20,000 training steps of healthy replay
TRIALS = 40
HORIZON_WINDOWS = 12
WARMUP_STEPS = 2  # first steps of a run (allocation, DDP bucket rebuild) are not measured
MODEL = ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=64)


@dataclass(frozen=True)
class Trace:
    """Measured per-step ``{rank: compute_s}`` rows of one layout: healthy, and per slowdown."""

    layout: str
    parallel: ParallelConfig
    slow_rank: int
    healthy: tuple[dict[int, float], ...]
    slowed: dict[float, tuple[dict[int, float], ...]]

    @property
    def stages(self) -> dict[int, int]:
        return stage_map(pp=self.parallel.pp, dp=self.parallel.dp, tp=self.parallel.tp)


def _config(parallel: ParallelConfig, steps: int) -> RunConfig:
    return RunConfig(
        job_id="bench-stragglers",
        model=MODEL,
        data=DataConfig(kind="synthetic", seed=0),
        parallel=parallel,
        # 2 micro-batches of 2 per dp replica; every step a timing-sync step (each one is measured)
        training=TrainingConfig(
            steps=steps, global_batch=4 * parallel.dp, micro_batch=2, lr=1e-3, seed=0, timing_sync_every=1
        ),
    )


def _rank(
    rank: int,
    world_size: int,
    parallel: ParallelConfig,
    slow_rank: int,
    healthy: int,
    per_slowdown: int,
    slowdowns: tuple[float, ...],
) -> list[tuple[float, float, bool]]:
    """One rank of the measured run: ``(slowdown in force, compute_s, timing_synced)`` per step."""
    import torch

    from etrain.workers.engine.train import Trainer
    from etrain.workers.protocol.messages import ChaosOrder
    from etrain.workers.rank.chaos import RankDrills

    phases = [1.0] * (WARMUP_STEPS + healthy) + [f for f in slowdowns for _ in range(per_slowdown)]
    # no supervisor to tell here; four ranks share two cores: the slowed rank spins rather than sleeps, so it
    # keeps its share of them as a slow device would (ChaosCallback)
    drills = RankDrills(rank=rank, report=lambda order, step: None, busy_wait=True)
    trainer = Trainer(
        _config(parallel, len(phases)),
        rank=rank,
        world_size=world_size,
        device=torch.device("cpu"),
        callbacks=[drills.callback],
    )
    rows = []
    for step, factor in enumerate(phases):
        if rank == slow_rank and factor != drills.slow_factor:  # a slow_rank order at each new slowdown
            drills.receive(ChaosOrder(id=step, action="slow_rank", rank=rank, factor=factor))
        metrics = trainer.train_step(step)
        rows.append((factor, metrics.compute_s, metrics.timing_synced))
    return rows


@functools.cache
def measure(layout: str, *, quick: bool = False, slowdowns: tuple[float, ...] = SLOWDOWNS) -> Trace:
    """Run ``layout`` once on real gloo ranks and return its measured rows (cached per process)."""
    from tests.dist_utils import run_distributed

    parallel, slow_rank = LAYOUTS[layout]
    healthy, per_slowdown = (10, 6) if quick else (20, 12)
    ranks = run_distributed(
        _rank, parallel.world_size, parallel, slow_rank, healthy, per_slowdown, slowdowns, timeout_s=900.0
    )
    by_phase: dict[float, list[dict[int, float]]] = {}
    previous = None
    for index in range(WARMUP_STEPS, len(ranks[0])):
        factor = ranks[0][index][0]
        synced = all(rows[index][2] for rows in ranks)
        # The first step of each slowdown is a transition (the drill sizes its sleep on the step before).
        if synced and factor == previous:
            by_phase.setdefault(factor, []).append({rank: rows[index][1] for rank, rows in enumerate(ranks)})
        previous = factor
    return Trace(
        layout=layout,
        parallel=parallel,
        slow_rank=slow_rank,
        healthy=tuple(by_phase.get(1.0, ())),
        slowed={f: tuple(by_phase.get(f, ())) for f in slowdowns},
    )


def replay(
    trace: Trace,
    slowdown: float,
    *,
    config: StragglerConfig | None = None,
    timing_sync_every: int = TIMING_SYNC_EVERY,
    healthy_observations: int = HEALTHY_OBSERVATIONS,
    trials: int = TRIALS,
    seed: int = 0,
) -> dict[str, Any]:
    """Detection latency and false positives of ``trace``'s rows replayed through the detector."""
    config = config or StragglerConfig()
    rng = random.Random(seed)
    stages = trace.stages
    healthy, slowed = list(trace.healthy), list(trace.slowed[slowdown])
    if not healthy or not slowed:
        raise ValueError(
            f"{trace.layout}: no measured rows for slowdown {slowdown} (healthy {len(healthy)}, slowed {len(slowed)})"
        )

    detector = StragglerDetector(config, stages=stages)
    false_positives = sum(len(detector.observe(i, rng.choice(healthy))) for i in range(healthy_observations))

    latencies: list[int | None] = []
    wrong_rank = 0
    for _ in range(trials):
        detector = StragglerDetector(config, stages=stages)
        # A job runs healthy for a while before a rank slows down: long enough here for the detector to learn
        # each rank's usual standing among its peers (`history` windows), and two more, from a random phase.
        prefix = (config.history + 2) * config.window + rng.randrange(config.window)
        for i in range(prefix):
            wrong_rank += len(detector.observe(i, rng.choice(healthy)))
        latency = None
        for k in range(HORIZON_WINDOWS * config.window):
            for finding in detector.observe(prefix + k, rng.choice(slowed)):
                if finding.rank == trace.slow_rank and latency is None:
                    latency = k + 1
                elif finding.rank != trace.slow_rank:
                    wrong_rank += 1
            if latency is not None:
                break
        latencies.append(latency)

    detected = [value for value in latencies if value is not None]
    in_most = len(detected) * 2 > len(latencies)
    slow = trace.slow_rank
    peers = [rank for rank, stage in stages.items() if stage == stages[slow] and rank != slow]

    others = peers or [rank for rank in stages if rank != slow]

    def relative(rows: list[dict[int, float]]) -> float:
        return statistics.median(r[slow] / statistics.median(r[o] for o in others) for r in rows)

    def factor(rows: list[dict[int, float]]) -> float:
        """The slowed rank's compute as the detector sees it: over its stage peers', or (a lone stage)
        its cost relative to the other stages over that relative cost when healthy; median of rows."""
        return relative(rows) if peers else relative(rows) / relative(healthy)

    return {
        "layout": trace.layout,
        "slowdown": slowdown,
        "detection_latency_steps": statistics.median(detected) * timing_sync_every if in_most else None,
        "false_positives_per_1000_steps": false_positives * 1000 / (healthy_observations * timing_sync_every),
        "detected_fraction": len(detected) / len(latencies),
        "latency_samples_steps": [None if v is None else v * timing_sync_every for v in latencies],
        "wrong_rank_findings": wrong_rank,
        "basis": PEERS if peers else HISTORY,
        # what the drill achieved, as the detector sees it (against stage peers, or its own healthy rows),
        # and the same statistic on the healthy rows (the noise floor: 1.0 on a quiet machine)
        "measured_factor": factor(slowed),
        "healthy_factor": factor(healthy),
        "measured_rows": {"healthy": len(healthy), "slowed": len(slowed)},
        "timing_sync_every": timing_sync_every,
        "detector": {"window": config.window, "threshold": config.threshold, "patience": config.patience},
    }


def bench_stragglers(layout: str, slowdown: float, *, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """``{layout, slowdown, detection_latency_steps, false_positives_per_1000_steps, ...}`` for one figure."""
    if slowdown not in SLOWDOWNS:
        raise ValueError(f"slowdown {slowdown} is not one of the measured {SLOWDOWNS}")
    return replay(measure(layout, quick=quick), slowdown, seed=seed)


def bench_all(
    layouts: tuple[str, ...] = tuple(LAYOUTS),
    slowdowns: tuple[float, ...] = SLOWDOWNS,
    *,
    quick: bool = False,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """The grid: every layout at every slowdown (one measured run per layout)."""
    return [bench_stragglers(layout, slowdown, quick=quick, seed=seed) for layout in layouts for slowdown in slowdowns]


if __name__ == "__main__":  # python -m benchmarks.stragglers [--quick]
    import json
    import sys

    print(json.dumps(bench_all(quick="--quick" in sys.argv[1:]), indent=1))
