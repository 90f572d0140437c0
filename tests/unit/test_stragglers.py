"""Slow-rank detection over per-rank compute times."""

import math
import random

import pytest

from service.stragglers import StragglerConfig, StragglerConfigError, StragglerDetector


def feed(detector, steps, ranks, slow=None, factor=2.0, jitter=0.0, seed=0, base=0.1, first_step=0):
    """Run `steps` steps; return [(step, finding), ...]."""
    rng = random.Random(seed)
    slow = slow or {}
    out = []
    for step in range(first_step, first_step + steps):
        times = {}
        for rank in ranks:
            t = base * (1 + rng.uniform(-jitter, jitter))
            if rank in slow and slow[rank](step):
                t *= factor
            times[rank] = t
        out += [(step, f) for f in detector.observe(step, times)]
    return out


ALWAYS = lambda step: True  # noqa: E731


class TestFlagsASlowRank:
    @pytest.mark.parametrize("num_ranks", [2, 4, 8])
    def test_2x_slow_rank_flagged_within_window_times_patience(self, num_ranks):
        config = StragglerConfig(window=10, threshold=1.5, patience=2)
        detector = StragglerDetector(config)
        slow_rank = num_ranks - 1
        found = feed(detector, 100, range(num_ranks), slow={slow_rank: ALWAYS}, jitter=0.1, seed=num_ranks)
        assert [f.rank for _, f in found] == [slow_rank]  # once, the right one
        step, finding = found[0]
        assert step == config.window * config.patience - 1  # closes the 2nd window: step 19
        assert finding.step == step
        assert finding.windows_flagged == 2
        assert 1.7 < finding.factor < 2.3
        assert finding.window_median == pytest.approx(0.2, rel=0.15)
        assert finding.peer_median == pytest.approx(0.1, rel=0.15)
        assert f"rank {slow_rank}" in finding.evidence and "2 consecutive windows" in finding.evidence

    def test_two_ranks_peer_is_the_other_rank(self):
        detector = StragglerDetector(StragglerConfig(window=4, patience=1))
        found = feed(detector, 4, [0, 1], slow={0: ALWAYS}, factor=3.0)
        assert len(found) == 1
        finding = found[0][1]
        assert finding.rank == 0
        assert finding.factor == pytest.approx(3.0)
        assert finding.peer_median == pytest.approx(0.1)

    def test_two_slow_ranks_among_four_are_both_flagged(self):
        # A rank's peers exclude itself, so a second slow rank does not hide the first.
        detector = StragglerDetector(StragglerConfig(window=5, patience=1))
        found = feed(detector, 5, range(4), slow={0: ALWAYS, 1: ALWAYS})
        # Peers of rank 0 are {0.2, 0.1, 0.1} -> median 0.1 -> factor 2: both slow ranks flagged.
        assert sorted(f.rank for _, f in found) == [0, 1]


class TestNoFalsePositives:
    @pytest.mark.parametrize("seed", range(5))
    @pytest.mark.parametrize("num_ranks", [2, 4, 8, 16])
    def test_noisy_clean_run_flags_nobody(self, num_ranks, seed):
        detector = StragglerDetector(StragglerConfig())
        assert feed(detector, 200, range(num_ranks), jitter=0.2, seed=seed) == []

    def test_single_slow_window_does_not_flag_with_patience_2(self):
        detector = StragglerDetector(StragglerConfig(window=10, patience=2))
        # Rank 3 is slow for steps 10..19 only (exactly one window).
        found = feed(detector, 100, range(4), slow={3: lambda s: 10 <= s < 20})
        assert found == []

    def test_single_long_step_is_absorbed_by_the_median(self):
        detector = StragglerDetector(StragglerConfig(window=10, patience=1))
        found = feed(detector, 40, range(4), slow={2: lambda s: s % 10 == 3}, factor=50.0)
        assert found == []

    def test_disabled_never_flags(self):
        detector = StragglerDetector(StragglerConfig(enabled=False, window=2, patience=1))
        assert feed(detector, 50, range(4), slow={0: ALWAYS}, factor=10.0) == []


class TestReportOnceUntilRecovered:
    def test_reported_once_while_it_stays_slow(self):
        detector = StragglerDetector(StragglerConfig(window=5, patience=2))
        found = feed(detector, 100, range(4), slow={1: ALWAYS})
        assert [(s, f.rank) for s, f in found] == [(9, 1)]

    def test_reported_again_after_recovering_and_slowing_again(self):
        detector = StragglerDetector(StragglerConfig(window=5, patience=2))
        slow = {1: lambda s: s < 20 or s >= 40}
        found = feed(detector, 60, range(4), slow=slow)
        # First streak: windows [0,5),[5,10) -> step 9. Recovers at [20,25). Again [40,45),[45,50) -> 49.
        assert [(s, f.rank, f.windows_flagged) for s, f in found] == [(9, 1, 2), (49, 1, 2)]

    def test_reset_forgets_streaks(self):
        detector = StragglerDetector(StragglerConfig(window=5, patience=2))
        feed(detector, 5, range(4), slow={0: ALWAYS})
        detector.reset()
        # One more slow window after a reset is the first of a new streak, not the second.
        assert feed(detector, 5, range(4), slow={0: ALWAYS}, first_step=5) == []
        assert len(feed(detector, 5, range(4), slow={0: ALWAYS}, first_step=10)) == 1


class TestMissingAndBadData:
    def test_missing_ranks_in_some_steps_are_tolerated(self):
        detector = StragglerDetector(StragglerConfig(window=10, patience=2))
        found = []
        for step in range(40):
            times = {r: 0.1 for r in range(4)}
            times[3] = 0.25
            times.pop(step % 4)  # one rank missing each step, the slow one included
            found += detector.observe(step, times)
        assert [f.rank for f in found] == [3]

    def test_rank_with_too_few_samples_is_left_out_of_the_window(self):
        detector = StragglerDetector(StragglerConfig(window=10, patience=1))
        found = []
        for step in range(10):
            times = {0: 0.1, 1: 0.1, 2: 0.1}
            if step == 0:
                times[3] = 5.0  # one sample only: not judged
            found += detector.observe(step, times)
        assert found == []

    def test_fewer_than_min_ranks_skips_the_window(self):
        detector = StragglerDetector(StragglerConfig(window=2, patience=1, min_ranks=3))
        assert feed(detector, 10, [0, 1], slow={0: ALWAYS}, factor=5.0) == []

    def test_nan_negative_and_inf_samples_are_dropped(self):
        detector = StragglerDetector(StragglerConfig(window=3, patience=1))
        found = []
        for step in range(3):
            found += detector.observe(step, {0: 0.1, 1: 0.1, 2: math.nan, 3: -1.0, 4: math.inf})
        assert found == []

    def test_empty_steps_count_toward_the_window(self):
        detector = StragglerDetector(StragglerConfig(window=2, patience=1))
        assert detector.observe(0, {}) == []
        assert detector.observe(1, {}) == []


class TestConfig:
    @pytest.mark.parametrize(
        "kwargs,match",
        [
            (dict(window=0), "window=0"),
            (dict(threshold=1.0), "threshold=1.0 must be > 1.0"),
            (dict(patience=0), "patience=0"),
            (dict(min_ranks=1), "min_ranks=1"),
        ],
    )
    def test_bad_settings_name_the_setting(self, kwargs, match):
        with pytest.raises(StragglerConfigError, match=match):
            StragglerConfig(**kwargs)

    def test_defaults(self):
        config = StragglerConfig()
        assert (config.enabled, config.window, config.threshold, config.patience, config.min_ranks) == (
            True, 10, 1.5, 2, 2,
        )
