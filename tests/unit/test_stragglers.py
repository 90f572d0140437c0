"""Slow-rank detection over per-rank compute times: peers within a pipeline stage, lone stages against their history."""

import math
import random

import pytest

from etrain.service.decisions.stragglers import (
    HISTORY,
    PEERS,
    StragglerConfig,
    StragglerConfigError,
    StragglerDetector,
    stage_map,
)


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
            (dict(history=0), "history=0"),
        ],
    )
    def test_bad_settings_name_the_setting(self, kwargs, match):
        with pytest.raises(StragglerConfigError, match=match):
            StragglerConfig(**kwargs)

    def test_defaults(self):
        config = StragglerConfig()
        assert (config.enabled, config.window, config.threshold, config.patience, config.min_ranks, config.history) == (
            True,
            4,
            1.5,
            3,
            2,
            5,
        )

    @pytest.mark.parametrize("onset", range(5, 9))  # every phase of the slowdown against the windows
    @pytest.mark.parametrize("factor", [2.0, 3.0])
    def test_the_defaults_report_a_straggler_in_tens_of_steps(self, onset, factor):
        """Every step judged (training.timing_sync_every 1), window 4, patience 3: a rank slowed from step
        ``onset`` is reported after three windows over the threshold (the first may be only mostly slowed:
        its median is) and within 15 steps (the issue's goal is <= 20 at 2x); 10% jitter on every rank."""
        detector = StragglerDetector(StragglerConfig())
        found = feed(detector, 80, range(2), slow={1: lambda s: s >= onset}, factor=factor, jitter=0.1, seed=onset)
        assert [f.rank for _, f in found] == [1]
        step, _ = found[0]
        assert onset + 4 * 2 <= step <= onset + 15, (onset, step)


# --- per pipeline stage ----------------------------------------------------------------------------


def feed_stages(detector, steps, stages, *, stage_cost, slow=None, factor=2.0, jitter=0.1, seed=0, first_step=0):
    """Like `feed`, but each rank's base time is its stage's cost (`stage_cost[stage]`)."""
    rng = random.Random(seed)
    slow = slow or {}
    out = []
    for step in range(first_step, first_step + steps):
        times = {}
        for rank, stage in stages.items():
            t = stage_cost[stage] * (1 + rng.uniform(-jitter, jitter))
            if rank in slow and slow[rank](step):
                t *= factor
            times[rank] = t
        out += [(step, f) for f in detector.observe(step, times)]
    return out


class TestStageMap:
    def test_megatron_order_stage_is_the_pp_coordinate(self):
        assert stage_map(pp=2, dp=2, tp=2) == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}
        assert stage_map(pp=4, dp=1, tp=1) == {0: 0, 1: 1, 2: 2, 3: 3}
        assert stage_map(pp=1, dp=3, tp=2) == dict.fromkeys(range(6), 0)

    def test_bad_layout_is_a_topology_error(self):
        from etrain.workers.protocol.topology import TopologyError

        with pytest.raises(TopologyError, match="pp"):
            stage_map(pp=0, dp=1, tp=1)


# Stage costs of a 4-stage pipeline whose last stage carries a large vocabulary head (3x).
HEAD_HEAVY = {0: 0.10, 1: 0.08, 2: 0.08, 3: 0.30}


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 1)], ids=["among-stage-peers", "lone-stages-vs-history"])
@pytest.mark.parametrize("seed", range(5))
def test_healthy_pipeline_whose_last_stage_is_slower_by_design_flags_nobody(dp, tp, seed):
    stages = stage_map(pp=4, dp=dp, tp=tp)
    detector = StragglerDetector(StragglerConfig(), stages=stages)
    assert feed_stages(detector, 1000, stages, stage_cost=HEAD_HEAVY, jitter=0.2, seed=seed) == []


class TestPeersWithinAStage:
    def test_without_a_stage_map_the_head_stage_would_be_flagged(self):
        # Why the map matters: compared across stages, both ranks of the head stage look 3x slow.
        stages = stage_map(pp=2, dp=2, tp=1)
        detector = StragglerDetector(StragglerConfig(window=5, patience=1))
        found = feed_stages(detector, 5, stages, stage_cost={0: 0.1, 1: 0.3}, jitter=0.0)
        assert sorted(f.rank for _, f in found) == [2, 3]

    def test_slow_rank_found_among_its_stage_peers_only(self):
        stages = stage_map(pp=4, dp=2, tp=2)  # 4 ranks per stage
        detector = StragglerDetector(StragglerConfig(window=10, patience=2), stages=stages)
        found = feed_stages(detector, 100, stages, stage_cost=HEAD_HEAVY, slow={6: ALWAYS}, factor=2.0, seed=1)
        assert [(s, f.rank, f.stage, f.basis) for s, f in found] == [(19, 6, 1, PEERS)]
        finding = found[0][1]
        assert finding.factor == pytest.approx(2.0, rel=0.2)
        assert finding.peer_median == pytest.approx(0.08, rel=0.1)  # stage 1's cost, not the world's
        assert "in stage 1" in finding.evidence

    def test_slow_rank_on_the_head_stage_is_found_against_the_head_stage(self):
        stages = stage_map(pp=2, dp=2, tp=1)
        detector = StragglerDetector(StragglerConfig(window=10, patience=2), stages=stages)
        found = feed_stages(detector, 40, stages, stage_cost={0: 0.1, 1: 0.3}, slow={3: ALWAYS}, factor=1.8)
        assert [(s, f.rank, f.stage) for s, f in found] == [(19, 3, 1)]
        assert found[0][1].peer_median == pytest.approx(0.3, rel=0.1)

    def test_stage_with_too_few_reporting_ranks_gets_no_verdict(self):
        # Stage 1 has two ranks; only rank 3 reports: no peer, and it is not a lone stage either.
        stages = stage_map(pp=2, dp=2, tp=1)
        detector = StragglerDetector(StragglerConfig(window=2, patience=1), stages=stages)
        found = []
        for step in range(20):
            found += detector.observe(step, {0: 0.1, 1: 0.1, 3: 0.1 if step < 10 else 0.5})
        assert found == []

    def test_ranks_outside_the_layout_are_ignored(self):
        stages = stage_map(pp=1, dp=2, tp=1)
        detector = StragglerDetector(StragglerConfig(window=2, patience=1), stages=stages)
        found = []
        for step in range(10):
            found += detector.observe(step, {0: 0.1, 1: 0.1, 7: 5.0})
        assert found == []
        assert (detector.stage_of(0), detector.stage_of(7)) == (0, None)


class TestLoneStagesAgainstTheirHistory:
    @pytest.mark.parametrize("slow_rank", [0, 2, 3])
    def test_stage_that_slows_down_is_flagged_after_patience_windows(self, slow_rank):
        stages = stage_map(pp=4, dp=1, tp=1)
        detector = StragglerDetector(StragglerConfig(window=10, patience=2), stages=stages)
        slow = {slow_rank: lambda s: s >= 200}
        found = feed_stages(detector, 400, stages, stage_cost=HEAD_HEAVY, slow=slow, factor=2.0, seed=slow_rank)
        assert [(s, f.rank, f.basis) for s, f in found] == [(219, slow_rank, HISTORY)]
        finding = found[0][1]
        assert finding.stage == slow_rank
        assert finding.peer_median == pytest.approx(HEAD_HEAVY[slow_rank], rel=0.1)  # its own healthy past
        assert finding.factor == pytest.approx(2.0, rel=0.2)
        assert "relative to the other stages" in finding.evidence and "has no peer" in finding.evidence

    def test_every_stage_slowing_alike_is_not_a_straggler(self):
        # A busier host, or every step getting longer: the stages' relative costs do not move.
        stages = stage_map(pp=4, dp=1, tp=1)
        detector = StragglerDetector(StragglerConfig(window=10, patience=2), stages=stages)
        everyone = {rank: (lambda s: s >= 200) for rank in stages}
        assert feed_stages(detector, 400, stages, stage_cost=HEAD_HEAVY, slow=everyone, factor=3.0) == []

    def test_only_the_stage_that_slowed_is_flagged_not_the_others_it_shifts(self):
        # Stage 1 slows 3x: the median of the others for stage 0 rises a little, never past the threshold.
        stages = stage_map(pp=3, dp=1, tp=1)
        detector = StragglerDetector(StragglerConfig(window=10, patience=2), stages=stages)
        found = feed_stages(
            detector,
            300,
            stages,
            stage_cost={0: 0.1, 1: 0.1, 2: 0.3},
            slow={1: lambda s: s >= 100},
            factor=3.0,
            jitter=0.05,
        )
        assert [(s, f.rank) for s, f in found] == [(119, 1)]

    def test_the_first_window_is_the_warm_up_and_the_second_the_baseline_neither_judged(self):
        stages = stage_map(pp=2, dp=1, tp=1)
        detector = StragglerDetector(StragglerConfig(window=5, patience=1), stages=stages)
        # Slow from the very first step: indistinguishable from a stage slow by design.
        assert feed_stages(detector, 200, stages, stage_cost={0: 0.1, 1: 0.1}, slow={1: ALWAYS}, factor=3.0) == []

    def test_an_uneven_warm_up_window_is_not_the_baseline(self):
        """The attempt's first window falls on the stages unevenly (rank 1's relative cost 0.6 of its usual):
        learned as the baseline it made three healthy windows look 1.67x slow (a chaos run, 2026-12-06)."""
        detector = StragglerDetector(StragglerConfig(), stages=stage_map(pp=2, dp=1, tp=1))
        rows = [{0: 0.005, 1: 0.003}] * 4 + [{0: 0.003, 1: 0.003}] * 76  # warm-up: rank 0 slower
        assert feed_times(detector, rows) == []
        slowed = [{0: 0.003, 1: 0.003}] * 20 + [{0: 0.003, 1: 0.009}] * 16
        found = feed_times(StragglerDetector(StragglerConfig(), stages=stage_map(pp=2, dp=1, tp=1)), rows[:4] + slowed)
        assert [(step, f.rank, f.basis) for step, f in found] == [(4 + 20 + 3 * 4 - 1, 1, HISTORY)]

    def test_slow_windows_never_become_the_baseline(self):
        # Slow for 30 windows (reported once), healthy again, slow again: reported a second time,
        # because the baseline is still the healthy median, not the long slow stretch. Nor does rank 0
        # learn the low relative cost it had while rank 1 was slow (it would be flagged at recovery).
        stages = stage_map(pp=2, dp=1, tp=1)
        detector = StragglerDetector(StragglerConfig(window=10, patience=2, history=3), stages=stages)
        slow = {1: lambda s: 50 <= s < 350 or s >= 400}
        found = feed_stages(detector, 450, stages, stage_cost={0: 0.1, 1: 0.2}, slow=slow, factor=2.0, jitter=0.05)
        assert [(s, f.rank) for s, f in found] == [(69, 1), (419, 1)]
        assert found[1][1].peer_median == pytest.approx(0.2, rel=0.06)

    def test_baseline_is_the_median_of_the_last_history_healthy_windows(self):
        stages = stage_map(pp=2, dp=1, tp=1)
        detector = StragglerDetector(StragglerConfig(window=1, patience=1, history=3, threshold=1.5), stages=stages)
        found = []
        # After the warm-up window (1.0), healthy windows 1.2, 1.4, 1.5 (each <= 1.3x the baseline then, the
        # sustained threshold: a window over either threshold is not learned): baseline = median(1.2, 1.4, 1.5).
        for step, t in enumerate([1.0, 1.2, 1.4, 1.5, 2.5]):
            found += detector.observe(step, {0: 1.0, 1: t})
        assert [(f.rank, f.step) for f in found] == [(1, 4)]
        assert found[0].peer_median == pytest.approx(1.4)
        assert found[0].factor == pytest.approx(2.5 / 1.4)

    def test_a_world_of_one_rank_is_never_judged(self):
        detector = StragglerDetector(StragglerConfig(window=1, patience=1), stages=stage_map(pp=1, dp=1, tp=1))
        found = []
        for step, t in enumerate([0.1, 0.1, 1.0, 1.0, 1.0]):
            found += detector.observe(step, {0: t})
        assert found == []

    def test_reset_forgets_the_history(self):
        stages = stage_map(pp=2, dp=1, tp=1)
        detector = StragglerDetector(StragglerConfig(window=1, patience=1), stages=stages)
        for step in range(3):
            detector.observe(step, {0: 0.1, 1: 0.1})
        detector.reset()
        # After a relaunch the first window is a new warm-up and the second a new baseline: 0.5 is not judged
        # against 0.1.
        assert detector.observe(3, {0: 0.1, 1: 0.5}) == []
        assert detector.observe(4, {0: 0.1, 1: 0.5}) == []


class TestTheSustainedPath:
    """A milder slowdown that lasts: over ``sustained_threshold`` (1.3 at threshold 1.5) for
    ``sustained_windows`` (8) consecutive windows, reported once, with the path named in its evidence."""

    def test_a_1_4x_rank_is_reported_after_exactly_the_sustained_windows(self):
        config = StragglerConfig()  # window 4, threshold 1.5, patience 3, sustained 8 windows over 1.3
        assert config.sustained_threshold == pytest.approx(1.3)
        found = feed(StragglerDetector(config), 80, [0, 1], slow={1: ALWAYS}, factor=1.4)
        assert [(step, f.rank) for step, f in found] == [(8 * 4 - 1, 1)]  # the 8th window closes at step 31
        finding = found[0][1]
        assert finding.windows_flagged == 8 and finding.factor == pytest.approx(1.4)
        assert "(1.40x > sustained threshold 1.3x) for 8 consecutive windows" in finding.evidence
        assert finding.evidence.endswith("[" + ", ".join(["1.40x"] * 8) + "]")

    def test_a_2x_rank_still_takes_the_fast_path(self):
        found = feed(StragglerDetector(StragglerConfig()), 80, [0, 1], slow={1: ALWAYS}, factor=2.0)
        assert [(step, f.rank, f.windows_flagged) for step, f in found] == [(3 * 4 - 1, 1, 3)]
        assert "(2.00x > threshold 1.5x) for 3 consecutive windows" in found[0][1].evidence

    def test_one_window_under_the_sustained_threshold_starts_the_count_again(self):
        slowed_except_window_7 = lambda step: step // 4 != 6  # noqa: E731 - the 7th window (steps 24-27) healthy
        found = feed(StragglerDetector(StragglerConfig()), 80, [0, 1], slow={1: slowed_except_window_7}, factor=1.4)
        assert [(step, f.rank) for step, f in found] == [((7 + 8) * 4 - 1, 1)]  # 8 more windows from window 8

    def test_a_window_over_the_fast_threshold_does_not_break_the_sustained_count(self):
        factors = {5: 1.8}  # window 6 of a 1.4x streak is a 1.8x one: still over 1.3

        detector = StragglerDetector(StragglerConfig())
        found = []
        for step in range(80):
            slow = 0.1 * factors.get(step // 4, 1.4)
            found += [(step, f) for f in detector.observe(step, {0: 0.1, 1: slow})]
        assert [(step, f.rank) for step, f in found] == [(31, 1)]

    @pytest.mark.parametrize(
        "config, factor",
        [
            (StragglerConfig(sustained_windows=0), 1.4),  # the slow path off: the fast path alone
            (StragglerConfig(threshold=2.0), 1.5),  # sustained threshold 1.6 at threshold 2.0
            (StragglerConfig(), 1.25),  # under 1.3
        ],
        ids=["off", "scaled-with-threshold", "under"],
    )
    def test_nothing_is_reported_under_the_sustained_threshold_or_with_the_path_off(self, config, factor):
        assert feed(StragglerDetector(config), 400, [0, 1], slow={1: ALWAYS}, factor=factor) == []

    def test_healthy_jitter_is_never_reported(self):
        # +-15% on every step of every rank, 10,000 steps: window medians stay far under 1.3
        assert feed(StragglerDetector(StragglerConfig()), 10_000, [0, 1, 2, 3], jitter=0.15, seed=5) == []

    def test_a_lone_stage_slowed_1_4x_is_found_and_its_baseline_does_not_learn_the_slowdown(self):
        # PP x2: each rank alone in its stage, judged against its own cost relative to the other stage
        detector = StragglerDetector(StragglerConfig(), stages=stage_map(pp=2, dp=1, tp=1))
        found = feed(detector, 200, [0, 1], slow={1: lambda step: step >= 40}, factor=1.4)
        assert [(f.rank, f.basis) for _, f in found] == [(1, HISTORY)]
        assert found[0][0] == 40 + 8 * 4 - 1  # 8 windows from the first slowed one
        assert "sustained threshold 1.3x" in found[0][1].evidence

    @pytest.mark.parametrize(
        "kwargs, message",
        [({"sustained_windows": -1}, "sustained_windows=-1"), ({"sustained_fraction": 0.0}, "sustained_fraction=0.0")],
    )
    def test_the_sustained_settings_are_checked(self, kwargs, message):
        with pytest.raises(StragglerConfigError, match=message):
            StragglerConfig(**kwargs)


def feed_times(detector, rows, first_step=0):
    """Observe one ``{rank: seconds}`` row per step; return [(step, finding), ...]."""
    return [(step, f) for step, row in enumerate(rows, first_step) for f in detector.observe(step, row)]


class TestAgainstTheirUsualStandingAmongPeers:
    """A rank persistently faster than its peers is judged against how it usually compares with them: its
    usual ratio (the median of its last ``history`` healthy windows' ratios), where that is under 1."""

    def test_a_usually_faster_rank_slowed_1_5x_is_found_though_its_peer_ratio_is_1_35(self):
        # rank 1 computes in 0.9 of rank 0's time for 40 steps (10 windows), then 1.5x its own: 1.35 vs rank 0
        rows = [{0: 0.1, 1: 0.09}] * 40 + [{0: 0.1, 1: 0.135}] * 80
        found = feed_times(StragglerDetector(StragglerConfig()), rows)
        assert [(f.rank, f.basis) for _, f in found] == [(1, PEERS)]
        step, finding = found[0]
        assert finding.factor == pytest.approx(1.5)  # 1.35 over its usual 0.9
        assert step <= 40 + 8 * 4 - 1  # within the slow path's 8 windows (at 1.5 exactly, either path may)
        assert "times its usual ratio to its peers 0.90" in finding.evidence
        # judged at its raw ratio (1.35) the fast path never fires: only its usual standing makes it 1.5
        assert all(f.factor < 1.5 for _, f in feed_times(StragglerDetector(StragglerConfig()), rows[40:]))

    def test_without_history_windows_the_raw_ratio_is_judged(self):
        # slowed from its 3rd window: fewer than `history` (5) healthy windows, so its standing is not used
        rows = [{0: 0.1, 1: 0.09}] * 8 + [{0: 0.1, 1: 0.135}] * 80
        found = feed_times(StragglerDetector(StragglerConfig()), rows)
        assert [f.factor for _, f in found] == [pytest.approx(1.35)]  # found by the slow path, at its raw ratio
        assert found[0][0] == 8 + 8 * 4 - 1

    def test_a_usually_slower_rank_is_not_excused(self):
        # rank 1 at 1.6x its peer from the start: its usual ratio is over 1, which is never used
        found = feed(StragglerDetector(StragglerConfig()), 80, [0, 1], slow={1: ALWAYS}, factor=1.6)
        assert [(step, f.rank) for step, f in found] == [(3 * 4 - 1, 1)] and found[0][1].factor == pytest.approx(1.6)

    def test_a_slow_peer_does_not_teach_a_rank_that_it_is_fast(self):
        # rank 0 is 1.5x slow for 200 steps (reported), then recovers: rank 1 looked 0.67x meanwhile, which it
        # must not learn as its usual standing, or it would look 1.5x slow once rank 0 recovers
        rows = [{0: 0.1, 1: 0.1}] * 40 + [{0: 0.15, 1: 0.1}] * 200 + [{0: 0.1, 1: 0.1}] * 200
        found = feed_times(StragglerDetector(StragglerConfig()), rows)
        assert {f.rank for _, f in found} == {0}

    def test_a_mildly_slow_peer_moves_the_standing_but_its_recovery_flags_nobody(self):
        # rank 0 at 1.25x (within the band, so rank 1 learns 0.8 for a while) for 400 steps, then healthy
        rows = [{0: 0.1, 1: 0.1}] * 40 + [{0: 0.125, 1: 0.1}] * 400 + [{0: 0.1, 1: 0.1}] * 400
        assert feed_times(StragglerDetector(StragglerConfig()), rows) == []

    @pytest.mark.parametrize("seed", [1, 2, 3])
    def test_healthy_jitter_around_a_persistent_asymmetry_is_never_reported(self, seed):
        # rank 1 at 0.9 of its peers, +-15% per step on every rank, 10,000 steps
        rng = random.Random(seed)
        rows = [
            {r: (0.09 if r == 1 else 0.1) * (1 + rng.uniform(-0.15, 0.15)) for r in range(4)} for _ in range(10_000)
        ]
        assert feed_times(StragglerDetector(StragglerConfig()), rows) == []
