"""How long an in-place repair waits for survivors before it replaces the stuck ones, and a resize for every
rank to stop at a step boundary (service/decisions/in_place_waits.py, used by service/runtime/worker_group.py)."""

from __future__ import annotations

from etrain.service.decisions.in_place_waits import (
    STUCK_SURVIVOR_GRACE_S,
    SURVIVOR_EXIT_TIMEOUT_S,
    stuck_survivor_grace_s,
    survivor_exit_timeout_s,
)


def test_the_grace_is_a_few_seconds_or_two_steps_where_steps_are_longer():
    assert stuck_survivor_grace_s(None) == STUCK_SURVIVOR_GRACE_S == 5.0  # no step measured yet
    assert stuck_survivor_grace_s(0.27) == 5.0  # the H200's 1B steps: the survivors return within a second
    assert stuck_survivor_grace_s(2.5) == 5.0
    assert stuck_survivor_grace_s(8.0) == 16.0  # a survivor mid-way through a long step reaches its collective
    # shorter than the wait for a first survivor: a stuck rank is found well before the repair would give up
    for step_s in (None, 0.0, 0.27, 2.5, 8.0, 40.0, 600.0):
        assert stuck_survivor_grace_s(step_s) < survivor_exit_timeout_s(step_s), step_s


def test_a_resize_or_a_first_survivor_gets_the_fixed_wait_plus_two_steps():
    assert survivor_exit_timeout_s(None) == SURVIVOR_EXIT_TIMEOUT_S == 15.0  # no step measured yet
    assert survivor_exit_timeout_s(0.27) == 15.54  # a 1B model's steps on an H200: the wait is the fixed one
    # An 8B model's 20 s steps: a rank ends the step it is in and then the one rank 0 stops at. The fixed 15 s
    # failed every such resize, and the failure relaunched every rank cold.
    assert survivor_exit_timeout_s(20.0) == 55.0
    assert survivor_exit_timeout_s(20.0) > 2 * 20.0
