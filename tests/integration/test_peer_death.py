"""On gloo a collective fails at once when its peer's process dies inside it, so the survivors of a lost
rank leave the failed attempt by themselves, which a repair in place needs (the NCCL half, where they do
not: tests/gpu/test_nccl_peer_death.py). But a collective whose peer is alive and has left it (a survivor
that left the failed attempt first) never ends, not even when the waiting rank aborts its own groups:
why a repair in place replaces a survivor still inside the attempt after a grace
(service/decisions/in_place_waits.py ``STUCK_SURVIVOR_GRACE_S``)."""

from __future__ import annotations

import pytest

from etrain.service.decisions.job_policy import policy_for
from etrain.service.planning.spec import JobSpec
from tests.peer_death import DIE_AFTER_S, survivor_outcome

pytestmark = pytest.mark.slow


def test_a_gloo_survivors_collective_fails_as_its_peer_dies():
    outcome = survivor_outcome("gloo", wait_s=DIE_AFTER_S + 10.0)
    assert outcome["ended"] and "error" in outcome, outcome
    # It failed when the peer died (1 s in), not at the group's timeout (120 s).
    assert DIE_AFTER_S - 0.5 <= outcome["seconds"] <= DIE_AFTER_S + 5.0, outcome
    spec = JobSpec.model_validate(
        {
            "name": "x",
            "model": {"preset": "gpt-tiny"},
            "training": {"steps": 1, "global_batch": 2, "micro_batch": 1},
            "parallelism": {"dp": 2},
        }
    )
    assert policy_for(spec).collectives_fail_on_peer_loss  # what the supervisor assumes of a CPU job


def test_a_gloo_collective_whose_peer_left_alive_waits_even_through_its_own_abort():
    outcome = survivor_outcome("gloo", wait_s=DIE_AFTER_S + 2.0, abort=2.0, peer_dies=False)
    assert not outcome["ended"] and not outcome["ended_after_abort"], outcome
    assert outcome["after_abort_s"] >= 2.0, outcome
