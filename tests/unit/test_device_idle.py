"""The GPU check before a failed attempt keeps its live state (workers/rank/worker.py ``_device_idle``): a
stream polled, never waited on, so a collective a dead peer never joined cannot hang the rank."""

from __future__ import annotations

import time

from etrain.workers.rank.worker import _device_idle


class _Stream:
    def __init__(self, busy_polls: int | None):
        self.busy_polls, self.polls = busy_polls, 0

    def query(self) -> bool:
        self.polls += 1
        return self.busy_polls is not None and self.polls > self.busy_polls


def test_a_stream_that_drains_is_idle_and_one_that_never_does_is_given_up_on_in_time():
    assert _device_idle(_Stream(0))
    draining = _Stream(3)
    assert _device_idle(draining) and draining.polls == 4
    started = time.monotonic()
    assert not _device_idle(_Stream(None), wait_s=0.2)
    assert 0.2 <= time.monotonic() - started < 2.0
