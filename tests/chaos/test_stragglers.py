"""Stragglers per pipeline stage on a real Ray cluster (the chaos ``slow_rank`` drill, real ranks).

The model has a large vocabulary (4096 on d_model 32), so the last stage, which carries the output
head and the loss, computes several times longer than the first by design. Judged across stages it
would be flagged on every healthy run; judged within its stage (PP x DP: against its DP peer) or, with
one rank per stage (PP only), against its own earlier windows, only a rank that really slows down is.
"""

from __future__ import annotations

import pytest

from tests.chaos.conftest import spec
from tests.service_harness import event_kinds

pytestmark = [pytest.mark.slow, pytest.mark.timing]  # timing: make test runs it alone (tests/conftest.py)

HEAD_HEAVY = {"n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": 4096, "seq_len": 16}
DETECTOR = {"enabled": True, "window": 4, "threshold": 1.5, "patience": 2}
SLOW_AT = 20


def _slowed_job(plane, name: str, *, dp: int, slow_rank: int) -> dict:
    body = spec(name, steps=48, dp=dp, pp=2, every=0, model=HEAD_HEAVY, stragglers=DETECTOR,
                parallelism={"pp_schedule": "1f1b"}, training={"timing_sync_every": 1})
    job = plane.submit(body)
    plane.chaos(job["id"], action="slow_rank", rank=slow_rank, factor=3.0, at_step=SLOW_AT)
    final = plane.wait_terminal(job["id"], timeout_s=300)
    assert final["status"] == "SUCCEEDED", final
    return final


def test_pp_dp_flags_only_the_slowed_rank_of_the_head_stage(shared_plane):
    final = _slowed_job(shared_plane, "pp2-dp2-slow", dp=2, slow_rank=3)  # stage 1: ranks 2, 3
    flagged = final["stragglers"]
    assert [(f["rank"], f["stage"], f["basis"]) for f in flagged] == [(3, 1, "peers")], flagged
    assert SLOW_AT < flagged[0]["step"] <= SLOW_AT + 16, flagged  # within 4 windows of 4 steps
    assert flagged[0]["factor"] > 1.5
    assert "in stage 1" in flagged[0]["evidence"]
    assert "straggler_detected" in event_kinds(shared_plane.events(final["id"]))


def test_pp_only_judges_each_stage_against_its_own_history(shared_plane):
    # Rank 1 holds the head stage: slower than rank 0 all along (never flagged for it), then slowed.
    final = _slowed_job(shared_plane, "pp2-slow", dp=1, slow_rank=1)
    flagged = final["stragglers"]
    assert [(f["rank"], f["stage"], f["basis"]) for f in flagged] == [(1, 1, "history")], flagged
    assert SLOW_AT < flagged[0]["step"] <= SLOW_AT + 16, flagged
    assert "has no peer" in flagged[0]["evidence"]
