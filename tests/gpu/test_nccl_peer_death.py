"""On NCCL a collective does not fail when its peer's process dies inside it: the survivor's host blocks
behind the kernel, so the survivors of a lost rank cannot leave the failed attempt by themselves, and the
supervisor relaunches every rank of a CUDA job instead of repairing it in place
(``JobPolicy.collectives_fail_on_peer_loss``; the gloo half: tests/integration/test_peer_death.py).

The second test is what would lift that: aborting the survivor's communicators from another thread (as
torchft does) must end its blocked collective. The host of an NCCL rank blocks at the step's one host read,
which comes before ``optimizer.step()`` (workers/engine/train.py), so a rank that checks for an abort there
leaves with its weights and optimizer state as the last completed step left them: a repair in place could
then keep it. Not built until this passes on two GPUs.

Needs two GPUs (NCCL runs one rank per GPU). Should the first fail on a newer NCCL, its collectives fail with
a dead peer, and a CUDA job could be repaired in place like a CPU one: revisit the policy.
"""

from __future__ import annotations

import pytest
import torch

from tests.peer_death import DIE_AFTER_S, survivor_outcome

ABORT_WAIT_S = 15.0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL runs one rank per GPU)"),
]


def test_an_nccl_survivors_collective_is_still_blocked_long_after_its_peer_died():
    wait_s = DIE_AFTER_S + 20.0
    outcome = survivor_outcome("nccl", wait_s=wait_s)
    assert not outcome["ended"], f"rank 0's collective ended after its peer died: {outcome}"


def test_aborting_the_survivors_communicators_ends_its_blocked_collective():
    outcome = survivor_outcome("nccl", wait_s=DIE_AFTER_S + 5.0, abort=ABORT_WAIT_S)
    assert not outcome["ended"], outcome
    assert outcome["ended_after_abort"], f"still blocked {ABORT_WAIT_S:.0f}s after the abort: {outcome}"
