"""Issue #9, keep the survivors: a SIGKILLed rank is replaced in place, the other ranks keep their
processes, and the replacement's state comes from a data-parallel replica's memory: the survivor's live
state at the step of the kill, so nothing is recomputed.

Real local Ray, the real control plane, a real SIGKILL (chaos ``kill_rank``). Process ids come from
the ranks' own logs ("attempt N: rank R ... pid P"); where each rank's state came from, from the
``state_restored`` event. That the state from memory is bit-identical to the disk checkpoint is
tests/integration/test_snapshot.py; here, the whole recovered curve equals the clean run's exactly.
"""

from __future__ import annotations

import pytest

from tests.chaos.conftest import (
    assert_repaired_in_place,
    clean_run,
    losses,
    rank_pids,
    recover,
    restored,
    resumed_from,
    spec,
)
from tests.service_harness import event_kinds

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def clean(plane) -> dict[int, float]:
    """The clean run's losses by step (shared with tests/chaos: the same spec)."""
    return clean_run(plane, spec("clean-dp2", steps=24)).losses


@pytest.mark.parametrize("in_place", [True, False])
def test_killed_rank_is_replaced_in_place_and_the_run_ends_like_the_clean_run(plane, clean, in_place):
    """One shared control plane (tests/e2e/conftest.py) and one clean run for both paths."""
    body = spec("repair-dp2", steps=24, fault_tolerance={"in_place": in_place})
    final, events = recover(plane, body, {"action": "kill_rank", "rank": 1, "at_step": 10})
    assert resumed_from(events) == [None, 8]  # killed during step 11; the last commit was step 8
    assert losses(plane, final["id"]) == clean  # exact, every step
    survivor, replaced = rank_pids(plane, final["id"], 0), rank_pids(plane, final["id"], 1)
    assert len(survivor) == len(replaced) == 2, (survivor, replaced)
    assert replaced[0] != replaced[1]
    if in_place:
        assert_repaired_in_place(final, events, times=1)
        assert survivor[0] == survivor[1]  # the survivor's process was not restarted
        # The survivor's live state at step 10 (past the commit at 8): steps 9 and 10 are not run again.
        assert restored(events) == ["attempt 2, step 10: ranks 0 from own memory; ranks 1 from rank 0's memory"]
        assert [row["attempt"] for row in plane.steps(final["id"])][8:11] == [1, 1, 2]
    else:
        kinds = event_kinds(events)
        assert final["restarts"] == 1
        assert "repairing" not in kinds and kinds.count("launching") == 2
        assert survivor[0] != survivor[1]
        assert restored(events) == ["attempt 2, step 8: ranks 0,1 from storage"]
