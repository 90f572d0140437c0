"""On NCCL a collective does not fail when its peer's process dies inside it: the survivor's host blocks
behind the kernel, so the survivors of a lost rank cannot leave the failed attempt by themselves, and the
supervisor relaunches every rank of a CUDA job instead of repairing it in place
(``JobPolicy.collectives_fail_on_peer_loss``; the gloo half: tests/integration/test_peer_death.py).

Needs two GPUs (NCCL runs one rank per GPU). Should this fail on a newer NCCL, its collectives fail with a
dead peer, and a CUDA job could be repaired in place like a CPU one: revisit the policy.
"""

from __future__ import annotations

import pytest
import torch

from tests.peer_death import DIE_AFTER_S, survivor_outcome

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL runs one rank per GPU)"),
]


def test_an_nccl_survivors_collective_is_still_blocked_long_after_its_peer_died():
    wait_s = DIE_AFTER_S + 20.0
    outcome = survivor_outcome("nccl", wait_s=wait_s)
    assert not outcome["ended"], f"rank 0's collective ended after its peer died: {outcome}"
