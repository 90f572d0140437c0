"""What ``watch`` (and ``submit --watch``, ``demo``) shows while it follows a job: a live progress bar
on a terminal, plain lines anywhere else.

Two displays with one interface (:class:`Display`):

* :class:`BarDisplay`, when the output is a terminal: one bar redrawn in place, with step/steps, loss,
  tokens/s, MFU (when the device's peak is known), ETA and restarts, and the job's status changes and
  events printed as lines above it. Drawn by ``rich`` (its ``Progress`` keeps the bar at the bottom
  while lines are printed above, and measures the terminal); the numbers are ours (:class:`JobProgress`).
* :class:`PlainDisplay`, when it is a pipe, a file or a CI log (or ``TERM=dumb``): one line per status
  change, per event and per step (every ``--every``th), nothing redrawn.

:class:`JobProgress` is the bar's text, kept apart from any terminal so it is tested as plain numbers:
the ETA comes from the step rate of the recent step rows (their server timestamps), restarted when a
restart rolls the step back.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Any, Protocol, TextIO

from etrain.api.cli.output import event_line, step_line, total_steps

#: Step rows the step rate (and so the ETA) is measured over.
RATE_WINDOW = 30
#: The bar's width in characters on a wide terminal (narrower when the numbers need the room).
BAR_WIDTH = 30


def fmt_duration(seconds: float) -> str:
    """``1:05:09``, ``4:09`` or ``0:07``."""
    total = int(round(max(0.0, seconds)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class JobProgress:
    """The numbers on the bar: the job's status, step, loss, throughput, MFU, restarts and ETA."""

    def __init__(self) -> None:
        self.status = ""
        self.total: int | None = None
        self.step = 0
        self.loss: float | None = None
        self.tokens_per_s: float | None = None
        self.mfu: float | None = None
        self.restarts = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)  # (ts, step) of the recent rows

    def on_job(self, job: dict[str, Any]) -> None:
        total = total_steps(job)
        self.total = total if isinstance(total, int) and total > 0 else None
        self.status = job.get("status") or self.status
        self.restarts = int(job.get("restarts") or 0)
        self.step = int(job.get("step") or 0)
        for key in ("loss", "tokens_per_s"):
            if job.get(key) is not None:
                setattr(self, key, job[key])

    def on_step(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        if self._recent and step <= self._recent[-1][1]:
            self._recent.clear()  # a restart rolled back to a checkpoint: measure the new attempt afresh
        self._recent.append((float(row["ts"]), step))
        self.step = step
        for key in ("loss", "tokens_per_s", "mfu"):
            if row.get(key) is not None:
                setattr(self, key, row[key])

    def steps_per_s(self) -> float | None:
        if len(self._recent) < 2:
            return None
        (t0, s0), (t1, s1) = self._recent[0], self._recent[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None

    def eta_s(self) -> float | None:
        rate = self.steps_per_s()
        if rate is None or self.total is None:
            return None
        return max(0, self.total - self.step) / rate

    def text(self) -> str:
        """``step 120/200  loss 3.2145  12,345 tok/s  MFU 41.2%  ETA 1:23  restarts 1``."""
        parts = [f"step {self.step}/{self.total if self.total is not None else '?'}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        if self.mfu is not None:
            parts.append(f"MFU {100 * self.mfu:.1f}%")
        eta = self.eta_s()
        parts.append(f"ETA {fmt_duration(eta)}" if eta is not None else "ETA -")
        parts.append(f"restarts {self.restarts}")
        return "  ".join(parts)


class Display(Protocol):
    """What ``watch`` tells the screen; every method may be called after :meth:`close` (then it is a no-op)."""

    def job(self, job: dict[str, Any], *, changed: bool) -> None: ...
    def event(self, event: dict[str, Any]) -> None: ...
    def step(self, row: dict[str, Any], *, shown: bool) -> None: ...
    def line(self, text: str) -> None: ...
    def close(self) -> None: ...


class PlainDisplay:
    """One line per status change, event and shown step (``output.step_line``), flushed as it goes."""

    def __init__(self, out: TextIO):
        self.out = out
        self.total: Any = "?"
        self._closed = False

    def job(self, job: dict[str, Any], *, changed: bool) -> None:
        self.total = total_steps(job)
        if changed:
            self.line(f"status: {job['status']}")

    def event(self, event: dict[str, Any]) -> None:
        self.line(event_line(event))

    def step(self, row: dict[str, Any], *, shown: bool) -> None:
        if shown:
            self.line(step_line(row, self.total))

    def line(self, text: str) -> None:
        if not self._closed:
            print(text, file=self.out)
            self.out.flush()

    def close(self) -> None:
        self._closed = True


class BarDisplay:
    """A live bar at the bottom of the terminal, status changes and events printed above it.

    Thread-safe: ``demo`` closes it from the main thread (Ctrl-C) while its watcher thread updates it.
    """

    def __init__(self, out: TextIO, *, force_terminal: bool | None = None, width: int | None = None):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn
        from rich.table import Column

        self.console = Console(file=out, force_terminal=force_terminal, width=width, highlight=False)
        self.progress = JobProgress()
        self._lock = threading.Lock()
        self._closed = False
        # The bar is drawn by rich's live display, refreshed a few times a second from its own thread;
        # stdout/stderr are left alone (the demo's server threads write there too). The numbers matter
        # more than the bar: the bar gets what the status and the numbers leave of the line.
        self._bar_column = BarColumn(bar_width=BAR_WIDTH)
        status = TextColumn("{task.description}", table_column=Column(no_wrap=True))
        detail = TextColumn("{task.fields[detail]}", table_column=Column(no_wrap=True, overflow="ellipsis"))
        self._columns = {True: (status, self._bar_column, detail), False: (status, detail)}
        self._bar = Progress(
            *self._columns[True],
            console=self.console,
            refresh_per_second=4,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._task = self._bar.add_task("", total=None, detail="waiting for the job ...")
        self._bar.start()

    def _refresh(self) -> None:
        numbers = self.progress
        detail = numbers.text()
        room = self.console.width - len(numbers.status) - len(detail) - 3
        self._bar_column.bar_width = min(BAR_WIDTH, room)
        self._bar.columns = self._columns[room >= 5]  # too narrow: no bar, the numbers only
        self._bar.update(
            self._task,
            description=numbers.status,
            total=numbers.total,
            completed=numbers.step,
            detail=detail,
            refresh=True,
        )

    def job(self, job: dict[str, Any], *, changed: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self.progress.on_job(job)
            self._refresh()
            if changed:
                self._print(f"status: {job['status']}")

    def event(self, event: dict[str, Any]) -> None:
        self.line(event_line(event))

    def step(self, row: dict[str, Any], *, shown: bool) -> None:
        with self._lock:
            if not self._closed:
                self.progress.on_step(row)
                self._refresh()

    def line(self, text: str) -> None:
        with self._lock:
            if not self._closed:
                self._print(text)

    def _print(self, text: str) -> None:
        # markup off: an event line starts with "[12:00:01]", which rich would read as a style tag
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        """Stop redrawing; the bar's last state stays on the screen. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._refresh()
            self._bar.stop()


def is_terminal(out: TextIO) -> bool:
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def make_display(out: TextIO, *, plain: bool = False) -> Display:
    """A bar on a terminal, plain lines elsewhere (or when ``plain``)."""
    if plain or not is_terminal(out):
        return PlainDisplay(out)
    return BarDisplay(out)
