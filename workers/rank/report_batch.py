"""Rank 0's step reports to the supervisor, batched: few calls, and never late by more than ``interval_s``.

Why: one supervisor actor per job, written in Python, handles every report. One call per rank per
step is ``world_size x steps/s`` calls (10,000/s for 1,000 ranks at 10 steps/s) and saturates it. The
step-boundary exchange (``workers/rank/step_control.py``) already gives rank 0 every rank's timings, so only
rank 0 reports, and it batches:

* a step that comes after a quiet period (nothing sent for ``interval_s``) goes at once, so jobs whose
  steps are slower than ``interval_s`` report every step exactly as it completes;
* faster steps are buffered and sent together at most ``interval_s`` after the previous send, by a
  background thread, so the supervisor's view of progress (its hang detection) lags by at most that;
* an *urgent* step (a checkpoint save or a stop follows, or the last step) flushes at once, so the
  supervisor sees the step before the checkpoint reports or the end of the attempt.

Hang detection stays correct: rank 0 reports a step only after the step-boundary collective in which
every rank took part, so a rank that hangs stops rank 0's reports, and the timer thread only ever sends
steps that really completed.

Pure threading (no torch, no Ray): ``send`` is the caller's (the worker passes a fire-and-forget Ray call).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from etrain.workers.protocol.messages import StepReport

__all__ = ["DEFAULT_INTERVAL_S", "ReportBatcher"]

DEFAULT_INTERVAL_S = 1.0


class ReportBatcher:
    """Buffers step records and hands them to ``send`` in order, in as few calls as the policy allows."""

    def __init__(
        self,
        send: Callable[[list[StepReport]], Any],
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s} must be > 0 seconds")
        self._send = send
        self._interval = interval_s
        self._clock = clock
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()  # a batch is taken and sent in one critical section: order kept
        self._buffer: list[StepReport] = []
        self._last_sent = -float("inf")
        self._last_result: Any = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.calls = 0  # sends made (for tests and logs)
        self.records = 0  # records sent

    def add(self, record: StepReport, *, urgent: bool = False) -> None:
        """Queue one step's record; send now when urgent or when nothing was sent for ``interval_s``."""
        with self._cond:
            if self._closed:
                raise RuntimeError("ReportBatcher.add after close()")
            self._buffer.append(record)
            due = urgent or self._clock() - self._last_sent >= self._interval
            if len(self._buffer) == 1 and not due:
                # The buffer just became non-empty: the timer thread (asleep with nothing to send)
                # computes its deadline. Later adds leave the deadline as it is, so they do not wake it.
                self._cond.notify()
        if due:
            self.flush()

    def due_in(self) -> float | None:
        """Seconds until the buffered records must be sent (<= 0: now); None when nothing is buffered."""
        with self._cond:
            return self._due_in_locked()

    def flush(self) -> Any:
        """Send everything buffered now (one call); returns what ``send`` returned, None if nothing was buffered."""
        with self._send_lock:
            with self._cond:
                batch, self._buffer = self._buffer, []
                if batch:
                    self._last_sent = self._clock()
            if not batch:
                return None
            try:
                result = self._send(batch)
            except BaseException:
                with self._cond:  # keep the records, in order, for the next attempt (the timer's)
                    self._buffer[:0] = batch
                    self._cond.notify()
                raise
            self.calls += 1
            self.records += len(batch)
            self._last_result = result
            return result

    def start(self) -> ReportBatcher:
        """Start the thread that sends buffered records once they are due."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="step-report-batcher", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> Any:
        """Stop the timer thread, send what is left; returns the result of the last send ever made
        (the caller may wait on it: calls from one caller reach the supervisor in order)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self.flush()
        return self._last_result

    def _due_in_locked(self) -> float | None:
        if not self._buffer:
            return None
        return self._last_sent + self._interval - self._clock()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                wait = self._due_in_locked()
                if wait is None or wait > 0:
                    self._cond.wait(timeout=wait)
                    continue
            try:
                self.flush()
            except Exception:  # a failed send must not kill the timer; the next add or close retries
                time.sleep(self._interval)
