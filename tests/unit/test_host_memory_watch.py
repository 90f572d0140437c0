"""``service/decisions/host_memory_watch.py``: when a rank holds more host memory than its bundle reserves."""

from __future__ import annotations

import pytest

from etrain.service.decisions.host_memory_watch import (
    SLACK_BYTES,
    HostMemoryOver,
    allowance,
    over_reservation,
)

GiB = 1024**3


@pytest.mark.parametrize(
    ("reserved", "allowed"),
    [
        (int(0.28 * GiB), int(0.28 * GiB) + GiB // 2),  # a CPU rank of a small model: half a GiB of slack
        (5 * GiB, 5 * GiB + GiB // 2),  # where a tenth is exactly the half GiB
        (int(15.8 * GiB), int(15.8 * GiB) + int(1.58 * GiB)),  # Llama-3.2-1B under DDP on a GPU: a tenth
    ],
)
def test_a_rank_may_hold_the_larger_of_half_a_gib_and_a_tenth_more(reserved, allowed):
    assert allowance(reserved) == pytest.approx(allowed, abs=2)
    assert over_reservation([allowance(reserved)], reserved) is None  # at the allowance: unsaid
    assert over_reservation([allowance(reserved) + 1], reserved) == HostMemoryOver(0, allowance(reserved) + 1, reserved)


def test_the_rank_holding_the_most_is_named():
    over = over_reservation([GiB, 4 * GiB, 3 * GiB, 0], 2 * GiB)
    assert (over.rank, over.held, over.reserved) == (1, 4 * GiB, 2 * GiB)
    assert over.suggested_gb == 4.4  # what it held and a tenth more, rounded up to 0.01 GiB
    assert over_reservation([GiB, 2 * GiB + SLACK_BYTES], 2 * GiB) is None


def test_nothing_is_said_without_a_reservation_or_a_sample():
    assert over_reservation([64 * GiB], 0) is None  # a job stored before host memory was reserved
    assert over_reservation([], 2 * GiB) is None
    assert over_reservation([0, 0], 2 * GiB) is None
