"""Rank 0's batched step reports: few sends, in order, never later than the interval."""

from __future__ import annotations

import threading
import time

import pytest

from etrain.workers.rank.report_batch import ReportBatcher


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Supervisor:
    """Stands for the supervisor actor: records every batch it is sent, with the time it arrived."""

    def __init__(self, clock=time.monotonic) -> None:
        self.batches: list[list[int]] = []
        self.at: list[float] = []
        self._clock = clock
        self.lock = threading.Lock()

    def __call__(self, records):
        with self.lock:
            self.batches.append([r["step"] for r in records])
            self.at.append(self._clock())
            return len(self.batches)


def test_first_step_goes_at_once_then_fast_steps_wait_for_the_interval():
    clock = Clock()
    sent = Supervisor(clock)
    batcher = ReportBatcher(sent, interval_s=1.0, clock=clock)
    batcher.add({"step": 0})
    assert sent.batches == [[0]]  # nothing was sent for a while: at once
    for step in range(1, 9):  # 8 steps/s
        clock.now += 0.125
        batcher.add({"step": step})
        if step < 8:
            assert batcher.due_in() == pytest.approx(1.0 - 0.125 * step)
    assert sent.batches == [[0], list(range(1, 9))]  # the 8th add is 1.0 s after the first send
    assert batcher.due_in() is None
    clock.now += 0.25
    batcher.add({"step": 9})
    assert batcher.due_in() == pytest.approx(0.75)
    assert (batcher.calls, batcher.records) == (2, 9)


def test_slow_steps_are_each_reported_as_they_complete():
    clock = Clock()
    sent = Supervisor(clock)
    batcher = ReportBatcher(sent, interval_s=1.0, clock=clock)
    for step in range(5):
        clock.now += 1.5
        batcher.add({"step": step})
    assert sent.batches == [[0], [1], [2], [3], [4]]


def test_an_urgent_step_flushes_everything_before_it_in_order():
    clock = Clock()
    sent = Supervisor(clock)
    batcher = ReportBatcher(sent, interval_s=1.0, clock=clock)
    batcher.add({"step": 0})
    clock.now += 0.01
    batcher.add({"step": 1})
    batcher.add({"step": 2}, urgent=True)  # a save follows: the supervisor hears of step 3 first
    assert sent.batches == [[0], [1, 2]]


def test_close_sends_what_is_left_and_returns_the_last_sends_result():
    clock = Clock()
    sent = Supervisor(clock)
    batcher = ReportBatcher(sent, interval_s=1.0, clock=clock)
    batcher.add({"step": 0})
    batcher.add({"step": 1})
    assert batcher.close() == 2 and sent.batches == [[0], [1]]
    assert ReportBatcher(sent, clock=clock).close() is None  # nothing ever sent
    with pytest.raises(RuntimeError, match="after close"):
        batcher.add({"step": 2})


def test_a_failed_send_keeps_the_records_for_the_next_one():
    calls = []

    def flaky(records):
        calls.append([r["step"] for r in records])
        if len(calls) == 1:
            raise ConnectionError("supervisor busy")
        return "ok"

    clock = Clock()
    batcher = ReportBatcher(flaky, interval_s=1.0, clock=clock)
    with pytest.raises(ConnectionError):
        batcher.add({"step": 0})
    batcher.add({"step": 1}, urgent=True)
    assert calls == [[0], [0, 1]]


def test_the_timer_thread_sends_buffered_steps_within_the_interval():
    """Real time: 100 steps at 200/s over 0.5 s with a 0.1 s interval -> about 5 sends, none late."""
    sent = Supervisor()
    batcher = ReportBatcher(sent, interval_s=0.1).start()
    added_at = {}
    for step in range(100):
        added_at[step] = time.monotonic()
        batcher.add({"step": step})
        time.sleep(0.005)
    deadline = time.monotonic() + 5.0  # the last buffered steps go out by the timer, without another add
    while True:
        with sent.lock:
            batches, at = list(sent.batches), list(sent.at)
        if sum(len(batch) for batch in batches) >= 100 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert [s for batch in batches for s in batch] == list(range(100))  # all, once, in order
    assert 2 <= len(batches) <= 60, batches  # batched: far fewer sends than steps
    lateness = [at[i] - added_at[batch[0]] for i, batch in enumerate(batches)]
    # The interval plus generous scheduling slack: a 2-core CI machine running other tests delays
    # threads by tenths of a second; a timer that does not fire leaves steps unsent for seconds.
    assert max(lateness) < 0.1 + 1.0, lateness
    batcher.close()
    assert len(sent.batches) == len(batches)  # nothing was left to send


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s=0"):
        ReportBatcher(lambda records: None, interval_s=0)
