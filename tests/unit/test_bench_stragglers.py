"""The straggler benchmark's replay (benchmarks/stragglers.py) on recorded rows: its figures follow the
detector's arithmetic (latency between patience-1 and patience+1 windows of timing-sync steps; none
below the threshold; no false positives on rows without a slow rank)."""

import pytest

from benchmarks.stragglers import Trace, replay
from etrain.service.decisions.stragglers import HISTORY, PEERS, StragglerConfig
from etrain.workers.protocol.run_config import ParallelConfig


def trace(parallel: ParallelConfig, slow_rank: int, base: dict[int, float], slowdowns=(1.25, 2.0)) -> Trace:
    jitter = (0.97, 1.0, 1.03)
    healthy = tuple({r: t * j for r, t in base.items()} for j in jitter)
    slowed = {
        f: tuple({r: t * j * (f if r == slow_rank else 1.0) for r, t in base.items()} for j in jitter)
        for f in slowdowns
    }
    return Trace(layout="test", parallel=parallel, slow_rank=slow_rank, healthy=healthy, slowed=slowed)


@pytest.mark.parametrize(
    "parallel,slow_rank,base,basis",
    [
        (ParallelConfig(tp=2), 1, {0: 0.1, 1: 0.1}, PEERS),
        (ParallelConfig(pp=2, dp=2), 3, {0: 0.1, 1: 0.1, 2: 0.3, 3: 0.3}, PEERS),
        (ParallelConfig(pp=2), 1, {0: 0.1, 1: 0.3}, HISTORY),  # the head stage, 3x slower by design
    ],
)
def test_latency_and_false_positives_follow_the_detector(parallel, slow_rank, base, basis):
    config = StragglerConfig(window=10, patience=2)
    result = replay(
        trace(parallel, slow_rank, base), 2.0, config=config, timing_sync_every=10, healthy_observations=500, trials=20
    )
    assert result["basis"] == basis
    assert result["false_positives_per_1000_steps"] == 0.0
    assert result["wrong_rank_findings"] == 0
    assert result["detected_fraction"] == 1.0
    # Reported when the 2nd window whose median is slow closes: 11..30 observations after the start.
    latencies = result["latency_samples_steps"]
    assert len(latencies) == 20 and all(110 <= s <= 300 for s in latencies), latencies  # one per trial
    assert 110 <= result["detection_latency_steps"] <= 300
    assert result["measured_factor"] == pytest.approx(2.0)
    assert result["healthy_factor"] == pytest.approx(1.0)


def test_a_slowdown_under_the_threshold_is_not_detected():
    result = replay(
        trace(ParallelConfig(dp=2), 1, {0: 0.1, 1: 0.1}),
        1.25,
        config=StragglerConfig(),
        healthy_observations=200,
        trials=5,
    )
    assert result["detection_latency_steps"] is None
    assert result["detected_fraction"] == 0.0
    assert set(result) >= {"layout", "slowdown", "detection_latency_steps", "false_positives_per_1000_steps"}


def test_missing_rows_name_the_slowdown():
    empty = Trace(layout="x", parallel=ParallelConfig(dp=2), slow_rank=1, healthy=({0: 0.1, 1: 0.1},), slowed={4.0: ()})
    with pytest.raises(ValueError, match="no measured rows for slowdown 4.0"):
        replay(empty, 4.0)
