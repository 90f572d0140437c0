"""Issue #9, keep the survivors: a SIGKILLed rank is replaced in place, the other ranks keep their
processes, and the replacement's state comes from a data-parallel replica's memory.

Real local Ray, the real control plane, a real SIGKILL (chaos ``kill_rank``). Process ids come from
the ranks' own logs ("attempt N: rank R ... pid P"); where each rank's state came from, from the
``state_restored`` event. That the state from memory is bit-identical to the disk checkpoint is
tests/integration/test_snapshot.py; here, the whole recovered curve equals the clean run's exactly.
"""

from __future__ import annotations

import re

import pytest

from tests.chaos.conftest import losses, resumed_from, spec
from tests.service_harness import event_kinds, event_text

pytestmark = pytest.mark.slow


def rank_pids(plane, job_id: str, rank: int) -> list[int]:
    lines = plane.client.get(f"/v1/jobs/{job_id}/logs", params={"rank": rank}).json()["lines"]
    return [int(pid) for line in lines for pid in re.findall(r"pid (\d+)\)", line)]


@pytest.fixture(scope="module")
def clean(plane) -> dict:
    job = plane.wait_terminal(plane.submit(spec("clean-dp2", steps=24))["id"], timeout_s=300)
    assert job["status"] == "SUCCEEDED", job
    return job


@pytest.mark.parametrize("in_place", [True, False])
def test_killed_rank_is_replaced_in_place_and_the_run_ends_like_the_clean_run(plane, clean, in_place):
    """One shared control plane (tests/e2e/conftest.py) and one clean run for both paths."""
    body = spec("repair-dp2", steps=24, fault_tolerance={"in_place": in_place})
    job = plane.submit(body)
    plane.chaos(job["id"], action="kill_rank", rank=1, at_step=10)
    final = plane.wait_terminal(job["id"], timeout_s=300)
    assert final["status"] == "SUCCEEDED", final
    assert final["restarts"] == 1
    events = plane.events(job["id"])
    kinds = event_kinds(events)
    assert resumed_from(events) == [None, 8]  # killed during step 11; the last commit was step 8
    assert losses(plane, job["id"]) == losses(plane, clean["id"])  # exact, every step
    survivor, replaced = rank_pids(plane, job["id"], 0), rank_pids(plane, job["id"], 1)
    assert len(survivor) == len(replaced) == 2, (survivor, replaced)
    assert replaced[0] != replaced[1]
    restored = [event_text(e) for e in events if e["kind"] == "state_restored"]
    if in_place:
        assert "repairing" in kinds and "launching" in kinds and kinds.count("launching") == 1
        assert survivor[0] == survivor[1]  # the survivor's process was not restarted
        assert restored == ["attempt 2, step 8: ranks 0 from own memory; ranks 1 from rank 0's memory"], restored
    else:
        assert "repairing" not in kinds and kinds.count("launching") == 2
        assert survivor[0] != survivor[1]
        assert restored == ["attempt 2, step 8: ranks 0,1 from storage"], restored
