"""Goodput: kept step time over wall time since submit; recomputed steps count once (their last run)."""

import math
import random

import pytest

from etrain.service.decisions.goodput import ProductiveTally, StepTime, goodput, productive_seconds


def run(attempt, steps, seconds=1.0):
    return [StepTime(step=s, attempt=attempt, step_s=seconds) for s in steps]


class TestProductiveSeconds:
    def test_clean_run_is_the_sum_of_its_steps(self):
        assert productive_seconds(run(1, range(1, 11), 0.5)) == pytest.approx(5.0)

    def test_a_recomputed_step_counts_once_with_its_last_run(self):
        # Attempt 1 runs steps 1..20 at 1 s, fails; attempt 2 resumes from checkpoint 10 and runs
        # 11..30 at 2 s. Steps 11..20 ran twice: the 1 s runs were thrown away, the 2 s runs count.
        records = run(1, range(1, 21), 1.0) + run(2, range(11, 31), 2.0)
        assert productive_seconds(records) == pytest.approx(10 * 1.0 + 20 * 2.0)

    def test_rows_the_newest_attempt_has_not_reached_yet_are_already_discarded(self):
        # Attempt 2 restarted at step 11 and has run 11..14 so far: attempt 1's 15..20 are waste now.
        records = run(1, range(1, 21), 1.0) + run(2, range(11, 15), 3.0)
        assert productive_seconds(records) == pytest.approx(10 * 1.0 + 4 * 3.0)

    def test_three_attempts_keep_each_committed_part_of_the_lineage(self):
        # 1: 1..20 (ckpt 10); 2: 11..14 (ckpt 12 committed), fails; 3: resumes at 13, runs 13..16.
        records = run(1, range(1, 21), 1.0) + run(2, range(11, 15), 2.0) + run(3, range(13, 17), 4.0)
        assert productive_seconds(records) == pytest.approx(10 * 1.0 + 2 * 2.0 + 4 * 4.0)

    def test_a_late_report_of_an_earlier_attempt_changes_nothing(self):
        records = run(1, range(1, 11)) + run(2, range(6, 11), 2.0) + [StepTime(step=8, attempt=1, step_s=100.0)]
        assert productive_seconds(records) == pytest.approx(5 * 1.0 + 5 * 2.0)

    def test_same_attempt_reported_twice_the_later_record_wins(self):
        records = [StepTime(1, 1, 1.0), StepTime(1, 1, 3.0)]
        assert productive_seconds(records) == pytest.approx(3.0)

    @pytest.mark.parametrize("bad", [None, -1.0, math.nan, math.inf])
    def test_missing_or_bad_step_times_count_zero(self, bad):
        assert productive_seconds([StepTime(1, 1, 2.0), StepTime(2, 1, bad)]) == pytest.approx(2.0)

    def test_no_records(self):
        assert productive_seconds([]) == 0.0


class TestGoodput:
    def test_ratio_of_productive_time_to_wall_time_since_submit(self):
        # Submitted at t=100, queued 30 s, then 60 s of kept steps and 10 s of restart: 60 / 100.
        assert goodput(60.0, submitted_at=100.0, now=200.0) == pytest.approx(0.6)

    def test_queued_time_counts_against_it(self):
        # The same 60 s of steps after a 140 s queue wait.
        assert goodput(60.0, submitted_at=0.0, now=200.0) == pytest.approx(0.3)

    def test_none_before_the_first_step(self):
        assert goodput(None, submitted_at=0.0, now=50.0) is None

    def test_none_without_wall_time(self):
        assert goodput(1.0, submitted_at=10.0, now=10.0) is None

    def test_clamped_to_one(self):
        # Clock skew between the ranks' step timers and the control plane's clock can overshoot.
        assert goodput(12.0, submitted_at=0.0, now=10.0) == 1.0


def realistic_history(rng, *, steps=300, attempts=6):
    """Reports in arrival order: attempts run ascending steps from a committed checkpoint, fail at
    random, and a few late reports of earlier attempts arrive after the next one started."""
    records, committed, attempt, late = [], 0, 0, []
    while committed < steps and attempt < attempts:
        attempt += 1
        start = committed + 1
        stop = min(steps, start + rng.randrange(5, 80))
        for step in range(start, stop + 1):
            if late and rng.random() < 0.3:
                records.append(late.pop())
            seconds = rng.choice([None, rng.uniform(0.1, 2.0), rng.uniform(0.1, 2.0), rng.uniform(0.1, 2.0)])
            records.append(StepTime(step, attempt, seconds))
            if step % 10 == 0 and rng.random() < 0.8:
                committed = step
        if records:
            late += [r for r in records[-3:] if r.attempt == attempt]
    return records


class TestProductiveTally:
    @pytest.mark.parametrize("seed", range(30))
    def test_equals_the_definition_after_every_record(self, seed):
        records = realistic_history(random.Random(seed))
        tally = ProductiveTally()
        for index, record in enumerate(records):
            tally.add(record)
            assert tally.total == pytest.approx(productive_seconds(records[: index + 1]), rel=1e-5, abs=1e-6)

    @pytest.mark.parametrize("seed", range(10))
    def test_equals_the_definition_in_any_order(self, seed):
        rng = random.Random(seed)
        records = realistic_history(rng)
        rng.shuffle(records)
        # Shuffled, ties within an attempt may resolve differently: keep one record per (step, attempt).
        unique = list({(r.step, r.attempt): r for r in records}.values())
        assert ProductiveTally(unique).total == pytest.approx(productive_seconds(unique), rel=1e-5, abs=1e-6)

    def test_rebuilt_from_the_store_rows_equals_the_live_tally(self):
        # The control plane rebuilds the tally from the steps table (one row per step, the highest
        # attempt's, replaced in arrival order) after a restart: same number as the live tally.
        records = realistic_history(random.Random(7))
        live = ProductiveTally(records)
        table: dict[int, StepTime] = {}
        for record in records:
            if record.step not in table or record.attempt >= table[record.step].attempt:
                table[record.step] = record
        rows = sorted(table.values(), key=lambda r: (r.attempt, r.step))
        assert ProductiveTally(rows).total == pytest.approx(live.total, rel=1e-6)

    def test_value_is_none_before_the_first_record(self):
        tally = ProductiveTally()
        assert tally.value is None
        tally.add(StepTime(1, 1, None))
        assert tally.value == 0.0

    def test_restart_discards_the_rolled_back_steps_at_once(self):
        tally = ProductiveTally(run(1, range(1, 21), 1.0))
        assert tally.total == pytest.approx(20.0)
        tally.add(StepTime(11, 2, 2.0))  # attempt 2 resumed from checkpoint 10
        assert tally.total == pytest.approx(10 * 1.0 + 2.0)

    def test_negative_step_is_refused(self):
        with pytest.raises(ValueError, match="step -1"):
            ProductiveTally().add(StepTime(-1, 0, 1.0))
