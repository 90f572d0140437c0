"""Goodput by cause (service/decisions/goodput_breakdown.py) on scripted timelines: every second of the
wall time since submit lands in exactly one cause, and each cause is the stretch the docstring names."""

from __future__ import annotations

import math
import random

import pytest

from etrain.service.decisions.goodput import productive_seconds
from etrain.service.decisions.goodput_breakdown import CAUSES, BreakdownEvent, BreakdownStep, goodput_breakdown

E = BreakdownEvent


def steps(attempt: int, first: int, start: float, *, n: int, step_s: float = 1.0, gap: float = 0.0):
    """``n`` steps from ``first`` of ``attempt``, the first starting at ``start``, ``gap`` between them."""
    out, t = [], start
    for i in range(n):
        t += step_s
        out.append(BreakdownStep(step=first + i, attempt=attempt, ts=t, step_s=step_s))
        t += gap
    return out


def test_a_clean_run_is_queue_startup_steps_checkpoints_and_the_end():
    rows = steps(1, 1, 10.0, n=4, gap=0.5)  # starts 10, 11.5, 13, 14.5; ends 11, 12.5, 14, 15.5
    events = [E(2.0, "launching"), E(12.6, "checkpoint_committed", "step 2, 2 ranks")]
    got = goodput_breakdown(submitted_at=0.0, until=20.0, steps=rows, events=events)
    assert got == {
        "queued": 2.0,
        "startup": 8.0,
        "productive": 4.0,
        "stragglers": 0.0,
        "checkpoint": 0.5,  # after step 2, the one saved
        "between_steps": 1.0,  # after steps 1 and 3
        "recomputed": 0.0,
        "recovery": 0.0,
        "resizing": 0.0,
        "since_last_step": 4.5,
    }
    assert list(got) == list(CAUSES)


def test_a_failure_splits_into_thrown_away_work_and_recovery():
    # Attempt 1 kept steps 1..4 (ends at 14) and ran on to 17.5, when rank 1 died; attempt 2 resumed
    # from step 4 and started step 5 at 22.
    rows = steps(1, 1, 10.0, n=4) + steps(2, 5, 22.0, n=3)
    events = [
        E(1.0, "launching"),
        E(17.5, "worker_failed", "rank 1 lost"),
        E(17.6, "restarting"),
        E(18.0, "repairing"),
    ]
    got = goodput_breakdown(submitted_at=0.0, until=25.0, steps=rows, events=events)
    assert (got["recomputed"], got["recovery"], got["resizing"]) == (3.5, 4.5, 0.0)
    assert got["productive"] == 7.0 == productive_seconds(rows)
    assert math.isclose(sum(got.values()), 25.0)


def test_a_resize_is_resizing_and_a_lost_supervisor_counts_its_queue_time_as_queued():
    rows = steps(1, 1, 5.0, n=2) + steps(2, 3, 12.0, n=2) + steps(3, 5, 40.0, n=1)
    events = [
        E(1.0, "launching"),
        E(7.5, "resizing", "dp 2 -> 1"),
        E(9.0, "launching"),
        E(20.0, "worker_failed", "supervisor gone"),
        E(21.0, "queued", "waits for its gang"),
        E(35.0, "launching"),
    ]
    got = goodput_breakdown(submitted_at=0.0, until=41.0, steps=rows, events=events)
    assert got["resizing"] == 12.0 - 7.5 and got["recomputed"] == 0.5 + (20.0 - 14.0)
    assert got["queued"] == 1.0 + (35.0 - 21.0) and got["recovery"] == (40.0 - 20.0) - 14.0
    assert math.isclose(sum(got.values()), 41.0)


def test_flagged_steps_beyond_the_attempts_median_are_stragglers_counted_once():
    normal = steps(1, 1, 1.0, n=4)  # 1 s each, ends at 5
    slow = steps(1, 5, 5.0, n=3, step_s=3.0)  # ends at 8, 11, 14
    events = [E(0.5, "launching"), E(6.0, "straggler_detected", "rank 1"), E(9.0, "straggler_detected", "rank 1")]
    got = goodput_breakdown(submitted_at=0.0, until=14.0, steps=normal + slow, events=events)
    assert got["stragglers"] == 3 * (3.0 - 1.0)  # steps 5..7, each once, against the 1 s median
    assert got["productive"] == 4.0 + 3 * 1.0
    assert math.isclose(sum(got.values()), 14.0)


def test_before_the_first_step_the_time_is_queue_then_startup():
    assert goodput_breakdown(submitted_at=0.0, until=3.0, steps=[], events=[])["queued"] == 3.0
    got = goodput_breakdown(submitted_at=0.0, until=3.0, steps=[], events=[E(1.0, "launching")])
    assert (got["queued"], got["startup"], sum(got.values())) == (1.0, 2.0, 3.0)


@pytest.mark.parametrize("seed", range(20))
def test_the_causes_always_add_up_to_the_wall_time(seed):
    """Random timelines, jittered so that steps overlap by milliseconds and events fall anywhere."""
    rng = random.Random(seed)
    rows, t, attempt, step = [], rng.uniform(0, 5), 1, 1
    events = [E(t * 0.5, "launching")]
    for _ in range(rng.randint(1, 40)):
        if rng.random() < 0.1:
            attempt += 1
            kind = rng.choice(["worker_failed", "resizing", "hang_detected", "queued"])
            events += [E(t + rng.uniform(0, 2), kind), E(t + 2.5, "launching")]
            t += 3 + rng.uniform(0, 2)
            step = max(1, step - rng.randint(0, 3))
        step_s = rng.uniform(0.1, 2)
        t += step_s + rng.uniform(-0.01, 0.5)
        rows.append(BreakdownStep(step=step, attempt=attempt, ts=t, step_s=step_s))
        if rng.random() < 0.2:
            events.append(E(t + 0.1, "checkpoint_committed", f"step {step}, 2 ranks"))
        if rng.random() < 0.05:
            events.append(E(t, "straggler_detected", "rank 0"))
        step += 1
    kept = {row.step: row for row in rows}  # the store keeps one row per step, the newest attempt's
    until = t + rng.uniform(0, 5)
    got = goodput_breakdown(submitted_at=0.0, until=until, steps=kept.values(), events=events)
    assert math.isclose(sum(got.values()), until, rel_tol=1e-9, abs_tol=1e-9)
    assert got["productive"] + got["stragglers"] == pytest.approx(sum(r.step_s for r in kept.values()))
