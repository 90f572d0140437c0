"""``checkpoint.every_steps: auto`` (workers/checkpoints/checkpoint_cadence.py): Young-Daly from measured costs."""

from __future__ import annotations

import math

import pytest

from etrain.workers.checkpoints.checkpoint_cadence import (
    ASSUMED_BLOCK_S,
    MIN_INTERVAL_STEPS,
    QUEUED_NOTE_MIN_S,
    SETTLE_STEPS,
    AutoCadence,
    queued_save_note,
    young_daly_interval_s,
)


def test_young_daly_is_the_square_root_of_twice_cost_times_mtbf():
    assert young_daly_interval_s(1.0, 86_400.0) == pytest.approx(415.69, abs=0.01)  # 1 s save, 24 h MTBF
    assert young_daly_interval_s(2.0, 3600.0) == pytest.approx(120.0)
    assert young_daly_interval_s(0.0, 3600.0) == 0.0
    with pytest.raises(ValueError):
        young_daly_interval_s(1.0, 0.0)
    with pytest.raises(ValueError):
        young_daly_interval_s(-1.0, 10.0)


def test_no_interval_before_a_step_time_is_known():
    cadence = AutoCadence(mtbf_hours=24)
    assert cadence.interval_steps is None
    assert not cadence.due(10_000)
    assert cadence.changed() is None


def test_the_interval_in_steps_uses_the_assumed_cost_until_a_save_is_measured():
    cadence = AutoCadence(mtbf_hours=24)
    for _ in range(5):
        cadence.observe_step(0.4)
    assert not cadence.measured and cadence.block_s == ASSUMED_BLOCK_S
    expected = round(young_daly_interval_s(ASSUMED_BLOCK_S, 86_400) / 0.4)  # 416 s / 0.4 s = 1039 steps
    assert cadence.interval_steps == expected == 1039
    assert not cadence.due(expected - 1) and cadence.due(expected)


def test_the_interval_follows_the_mean_measured_save_and_the_median_step():
    cadence = AutoCadence(mtbf_hours=1)
    for step_s in (0.5, 0.5, 9.0):  # one slow step does not move the median
        cadence.observe_step(step_s)
    cadence.observe_save(100, 2.0)
    cadence.observe_save(200, 4.0)
    assert cadence.block_s == pytest.approx(3.0)
    assert cadence.interval_steps == round(math.sqrt(2 * 3.0 * 3600) / 0.5)  # 147 s / 0.5 s = 294
    assert not cadence.due(200 + 293) and cadence.due(200 + 294)


def test_a_resumed_attempt_counts_from_its_restored_step():
    cadence = AutoCadence(mtbf_hours=1, start_step=500)
    cadence.observe_step(1.0)
    interval = cadence.interval_steps  # sqrt(2 * 1 * 3600) = 84.9 s -> 85 steps
    assert interval == 85
    assert not cadence.due(500 + interval - 1) and cadence.due(500 + interval)


def test_the_interval_has_bounds_and_ignores_non_finite_measurements():
    cadence = AutoCadence(mtbf_hours=0.001)  # 3.6 s MTBF: Young-Daly says save every ~2.7 s
    cadence.observe_step(10.0)
    cadence.observe_step(float("nan"))
    cadence.observe_step(-1.0)
    cadence.observe_save(0, float("nan"))  # a save request, not a measurement
    assert not cadence.measured
    assert cadence.interval_steps == MIN_INTERVAL_STEPS


def test_a_new_interval_is_announced_once_settled_and_again_only_when_it_moves_by_more_than_a_quarter():
    cadence = AutoCadence(mtbf_hours=1)
    for _ in range(SETTLE_STEPS - 1):
        cadence.observe_step(1.0)
    assert cadence.changed() is None and cadence.interval_steps == 85  # used, not yet announced
    cadence.observe_step(1.0)
    first = cadence.changed()
    assert first is not None and "every 85 steps" in first and "assumed save blocking 1.00s" in first
    assert cadence.changed() is None
    cadence.observe_save(85, 1.5)  # sqrt(2*1.5*3600) = 103.9 s -> 104 steps: +22%, not news
    assert cadence.changed() is None
    cadence.observe_save(170, 4.5)  # mean 3.0 s -> 147 steps
    text = cadence.changed()
    assert text is not None and "every 147 steps" in text and "over 2 save(s)" in text


def test_mtbf_must_be_positive():
    with pytest.raises(ValueError):
        AutoCadence(mtbf_hours=0)


def test_a_save_queued_behind_the_previous_write_is_explained_with_the_cadence_that_fits():
    """The H200's clean job: saves every 20 steps of 0.27 s (5.4 s apart, 5.75 s from start to start)
    against a write of ~8 s, so step 40's save waited 2.4 s for step 20's write."""
    note = queued_save_note(step=40, previous_step=20, waited_s=2.4, since_previous_s=5.75, every_steps=20)
    assert note == (
        "step 40's save waited 2.40s for step 20's write: saves 20 steps (5.8s) apart come faster than a "
        "write lands (~8.2s), and the wait blocks training; set checkpoint.every_steps >= 32 (or auto)"
    )
    # the advice leaves room for one write: 32 steps of 5.75/20 s are 9.2 s > 8.15 s
    assert 32 * 5.75 / 20 > 5.75 + 2.4
    auto = queued_save_note(step=900, previous_step=20, waited_s=1.0, since_previous_s=250.0, every_steps=None)
    assert auto is not None and auto.endswith("the auto interval counts this wait as save blocking time and lengthens")
    assert (
        queued_save_note(
            step=40, previous_step=20, waited_s=QUEUED_NOTE_MIN_S - 0.01, since_previous_s=5.75, every_steps=20
        )
        is None
    )
    assert queued_save_note(step=20, previous_step=20, waited_s=3.0, since_previous_s=5.75, every_steps=20) is None
    assert queued_save_note(step=40, previous_step=20, waited_s=3.0, since_previous_s=0.0, every_steps=20) is None
