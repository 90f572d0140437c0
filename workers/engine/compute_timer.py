"""The compute time of one training step (``StepMetrics.compute_s``), measured without a host-device sync.

Straggler detection reads ``compute_s`` (and ``comm_wait_s``, the rest of the step), so it must be
measured, not estimated, and measuring must not slow the step: ``workers/engine/train.py`` opens a span around
each forward and backward, and this timer reads them only after the step's one host read. On
timing-sync steps it also subtracts the waits inside TP / FSDP2 collectives
(``workers/engine/collective_waits.py``) that fell inside a span.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from etrain.workers.engine.collective_waits import CollectiveWaitClock

__all__ = ["ComputeTimer"]


class ComputeTimer:
    """The compute time of one step, measured without making the host wait for the device.

    With ``waits`` (a timing-sync step), the collective waits that fell inside a span are subtracted
    from it, so a rank that only waited for a slow TP / FSDP2 peer does not look slow itself.

    On CPU a span is ``perf_counter`` time: the host runs the work itself, so this is free. On CUDA
    a span is a pair of events recorded on the current stream; :meth:`seconds` reads them after
    the step's one host read (``.tolist()``) has already waited for that stream, so they are
    complete and reading them costs no further synchronisation (the last event's
    ``synchronize()`` returns at once; it only guards a caller that reads early). A span that
    contains host work (a chaos sleep in ``on_compute``) still counts on CUDA, as the device idles
    between the events.
    """

    def __init__(self, device: torch.device, waits: CollectiveWaitClock | None = None):
        self._cuda = device.type == "cuda"
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._later: list[Any] = []
        self._waits = waits
        self._wait_spans: list[tuple[Any, Any]] = []  # clock marks at each span's start and end

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        first = self._waits.mark() if self._waits is not None else None
        try:
            if self._cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    yield
                finally:
                    end.record()
                    self._events.append((start, end))
            else:
                started = time.perf_counter()
                try:
                    yield
                finally:
                    self._seconds += time.perf_counter() - started
        finally:
            if first is not None:
                self._wait_spans.append((first, self._waits.mark()))

    def add(self, seconds: float) -> None:
        """Compute measured on the host (callbacks run around the pipeline schedule)."""
        self._seconds += seconds

    def add_later(self, read: Any) -> None:
        """Compute another timer measured, read (free) when :meth:`seconds` is."""
        self._later.append(read)

    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
            self._events.clear()
        while self._later:
            self._seconds += float(self._later.pop(0)())
        while self._wait_spans:
            first, last = self._wait_spans.pop(0)
            self._seconds -= self._waits.between(first, last)
        return max(0.0, self._seconds)
