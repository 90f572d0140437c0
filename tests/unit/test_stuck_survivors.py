"""How long an in-place repair waits for survivors before it replaces the stuck ones (service/runtime/worker_group.py)."""

from __future__ import annotations

from etrain.service.runtime.worker_group import (
    STUCK_SURVIVOR_GRACE_S,
    SURVIVOR_EXIT_TIMEOUT_S,
    stuck_survivor_grace_s,
)


def test_the_grace_is_a_few_seconds_or_two_steps_where_steps_are_longer():
    assert stuck_survivor_grace_s(None) == STUCK_SURVIVOR_GRACE_S == 5.0  # no step measured yet
    assert stuck_survivor_grace_s(0.27) == 5.0  # the H200's 1B steps: the survivors return within a second
    assert stuck_survivor_grace_s(2.5) == 5.0
    assert stuck_survivor_grace_s(8.0) == 16.0  # a survivor mid-way through a long step reaches its collective
    # shorter than the wait for a first survivor: a stuck rank is found well before the repair would give up
    assert STUCK_SURVIVOR_GRACE_S < SURVIVOR_EXIT_TIMEOUT_S
