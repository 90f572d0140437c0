"""The step-boundary control exchange, pure part: what each rank contributes and what rank 0 decides.

Why one decision: a checkpoint save and a graceful stop are collective. If one rank saves (or stops)
after step 12 and another after step 13, their collectives pair up wrongly and the job hangs or
mixes steps. A request delivered asynchronously to every rank (each comparing a target step of its
own) lands at different moments on different ranks, so ranks can disagree. Instead, after every
step, every rank contributes one fixed-size vector of floats (:data:`FIELDS`) to ONE all-gather over
a dedicated gloo group (``workers/rank/step_exchange.py``, the thin torch adapter), which runs in the
background of the next step (:class:`StepBoundaries`). Rank 0's vector carries its requests for the
next boundary (:data:`SAVE`, :data:`STOP`), taken from its own view of the supervisor's requests
(:class:`ControlRequests`); every rank reads them from rank 0's row of the same gathered result, and
computes the deterministic schedule's saves itself, so all ranks act at the same step. The same
exchange gives rank 0 every rank's timings, which it reports to the supervisor in one batched call
(``workers/rank/report_batch.py``) instead of one call per rank per step.

Torch-free and Ray-free: unit-tested in ``tests/unit/test_step_control.py``.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from etrain.workers.protocol.messages import RankTimings, StepReport

__all__ = [
    "FIELDS",
    "RANK_TIMINGS",
    "SAVE",
    "STOP",
    "Boundary",
    "ControlRequests",
    "Decision",
    "Exchange",
    "StepBoundaries",
    "StepDesyncError",
    "decode",
    "encode",
    "scheduled_save",
    "step_record",
]

#: One rank's vector, in order. ``step`` is the step index the rank just finished (a sanity check that
#: every rank is at the same boundary); ``flags`` is meaningful in rank 0's row only.
FIELDS = ("step", "flags", "compute_s", "comm_wait_s", "step_s", "timing_synced", "peak_mem_bytes", "host_mem_bytes")
#: The per-rank timings rank 0 reports for every rank (``record["ranks"]``, one list per field, rank order).
RANK_TIMINGS = FIELDS[2:]

SAVE = 1  # save a checkpoint at this completed step
STOP = 2  # return from the attempt after this step (graceful stop)
_ALL_FLAGS = SAVE | STOP


class StepDesyncError(RuntimeError):
    """Ranks reached the exchange at different steps: a bug (their collectives would mismatch)."""


@dataclass(frozen=True, kw_only=True)
class Boundary:
    """What every rank learns at the end of one step, identical on all ranks."""

    completed: int  # steps completed (the step index + 1)
    #: Rank 0's flags (SAVE, STOP): its requests for the boundary after this one (:class:`StepBoundaries`).
    requested: int
    #: Every rank's vector (FIELDS), in rank order, as exchanged.
    rows: Sequence[Sequence[float]]

    @functools.cached_property
    def timings(self) -> RankTimings:
        """Field name (RANK_TIMINGS) -> one value per rank, in rank order. Built on first use: only
        rank 0 reads it (to report), so the other ranks never pay for the table."""

        def column(name: str) -> list[float]:
            index = FIELDS.index(name)
            return [row[index] for row in self.rows]

        return {
            "compute_s": column("compute_s"),
            "comm_wait_s": column("comm_wait_s"),
            "step_s": column("step_s"),
            "timing_synced": [value != 0.0 for value in column("timing_synced")],
            "peak_mem_bytes": [int(value) for value in column("peak_mem_bytes")],
            "host_mem_bytes": [int(value) for value in column("host_mem_bytes")],
        }


def scheduled_save(completed: int, *, total_steps: int, every_steps: int | None) -> bool:
    """The deterministic saves: every ``every_steps`` completed steps, and after the last step."""
    return completed >= total_steps or bool(every_steps and completed % every_steps == 0)


def encode(metrics: Mapping[str, Any], flags: int = 0) -> list[float]:
    """One rank's vector from its step metrics (``StepMetrics`` as a dict) and, on rank 0, its flags."""
    if not 0 <= flags <= _ALL_FLAGS:
        raise ValueError(f"flags={flags} is not a combination of SAVE={SAVE} and STOP={STOP}")
    values = {
        "step": float(metrics["step"]),
        "flags": float(flags),
        "compute_s": float(metrics.get("compute_s") or 0.0),
        "comm_wait_s": float(metrics.get("comm_wait_s") or 0.0),
        "step_s": float(metrics.get("step_s") or 0.0),
        "timing_synced": 1.0 if metrics.get("timing_synced") else 0.0,
        # float64 holds integers exactly up to 2**53 bytes (8 PiB): exact for any device memory.
        "peak_mem_bytes": float(metrics.get("peak_mem_bytes") or 0),
        # the rank's host memory, sampled (``workers/rank/host_memory.py``: ``HostMemorySampler``); 0 where unknown
        "host_mem_bytes": float(metrics.get("host_mem_bytes") or 0),
    }
    return [values[name] for name in FIELDS]


def decode(rows: Sequence[Sequence[float]], *, step: int) -> Boundary:
    """Every rank's vector (rank order) -> the boundary after step index ``step``.

    Raises :class:`StepDesyncError` when a rank reports another step: acting on such an exchange would
    save or stop different steps on different ranks.
    """
    if not rows:
        raise ValueError("decode needs at least one rank's vector")
    for rank, row in enumerate(rows):
        if len(row) != len(FIELDS):
            raise ValueError(
                f"rank {rank}'s vector has {len(row)} values, expected {len(FIELDS)} ({', '.join(FIELDS)})"
            )
    steps = [row[0] for row in rows]
    if any(value != step for value in steps):
        at = ", ".join(
            f"rank {rank}: {int(value) if math.isfinite(value) else value}" for rank, value in enumerate(steps)
        )
        raise StepDesyncError(f"ranks reached the step-boundary exchange at different steps (expected {step}; {at})")
    flags = rows[0][1]
    if flags != int(flags) or not 0 <= flags <= _ALL_FLAGS:
        raise ValueError(f"rank 0's flags {flags} are not a combination of SAVE={SAVE} and STOP={STOP}")
    flags = int(flags)
    return Boundary(completed=step + 1, requested=flags, rows=rows)


class Exchange(Protocol):
    """What :class:`StepBoundaries` needs of the exchange (``workers/step_exchange.StepExchange``)."""

    def start(self, metrics: Mapping[str, Any], flags: int = 0) -> None: ...

    def done(self) -> bool: ...

    def settle(self) -> Boundary | None: ...


@dataclass(frozen=True)
class Decision:
    """What one rank does at one step boundary, and the step records rank 0 reports now."""

    save: bool
    stop: bool
    #: (record, urgent) pairs for rank 0's report batcher, oldest first; empty on other ranks.
    reports: list[tuple[StepReport, bool]]


class StepBoundaries:
    """The step-boundary protocol one rank follows, with the exchange overlapped with the next step.

    Why overlapped: the exchange is a collective, so waiting for it at every boundary costs its
    latency (a ring all-gather over the world: grows with the number of ranks) plus any skew between
    the ranks, on every step. Measured on the 2-core machine with the gpt-tiny DP2 job, the waiting
    exchange was 6-7% of each rank's wall time. Here the exchange begun after step N runs in the
    background during step N+1 and is settled at the next boundary, so a rank waits only if it is
    still in flight then.

    What stays exact: every rank acts on the same decision at the same step.

    * The schedule's saves (every ``every_steps`` and the last step) are deterministic: each rank
      computes them itself (:func:`scheduled_save`), no exchange needed.
    * The supervisor's requests count on rank 0 only: after step N it takes those due at the *next*
      boundary (``ControlRequests.decide_requests(N + 2)``) and sends them in its row of the exchange
      begun then; every rank reads them when it settles that exchange, at the next boundary. A
      request is so acted on one boundary later than with a waiting exchange, on every rank alike.
    * A boundary that saves, stops or ends the attempt settles its own exchange at once: the
      supervisor must have that step's record before the checkpoint's report (urgent), and no
      exchange may be left in flight when ranks leave the loop.
    * When a rank settles an exchange never changes what it decides: the flags an exchange carries
      are for the boundary after the one that began it, so an exchange already complete when it
      begins (a single rank's, always) is settled at once and its step reported without delay.
      Otherwise rank 0 reports a step one boundary late, and a step after which a rank hangs is
      never reported (the hang is detected from the missing reports all the same).

    Torch-free: ``exchange`` is the adapter; ``control`` is rank 0's requests (None on other ranks).
    """

    def __init__(
        self, exchange: Exchange, *, control: ControlRequests | None, total_steps: int, every_steps: int | None
    ):
        self._exchange = exchange
        self._control = control
        self._total = total_steps
        self._every = every_steps
        self._in_flight: Mapping[str, Any] | None = None  # the metrics whose exchange is not settled yet
        self._requested = 0  # rank 0's requests for the coming boundary, as every rank read them
        self._settled: list[tuple[StepReport, bool]] = []  # records settled by the boundary under way

    def after_step(self, metrics: Mapping[str, Any]) -> Decision:
        """The boundary after the step ``metrics`` describes (collective: every rank calls it each step)."""
        self._settle(urgent=False)
        completed = int(metrics["step"]) + 1
        requested, self._requested = self._requested, 0
        save = bool(requested & SAVE) or scheduled_save(completed, total_steps=self._total, every_steps=self._every)
        stop = bool(requested & STOP) and completed < self._total
        flags = (
            self._control.decide_requests(completed + 1, total_steps=self._total) if self._control is not None else 0
        )
        self._exchange.start(metrics, flags)
        self._in_flight = metrics
        if save or stop or completed >= self._total:
            self._settle(urgent=True)
        elif self._exchange.done():  # already complete (always, for one rank): report the step now, not a step late
            self._settle(urgent=False)
        reports, self._settled = self._settled, []
        return Decision(save=save, stop=stop, reports=reports)

    def unreported(self) -> list[StepReport]:
        """Rank 0's records of the completed steps it has not handed out, once the attempt failed: those a
        boundary that failed half-way had settled, and the step whose exchange never settled (without the
        other ranks' timings, which that exchange would have brought). Sent as the attempt ends, so the
        supervisor holds every step the survivors completed, and an in-place repair may resume after them
        without running them again."""
        if self._control is None:
            return []
        settled = [record for record, _ in self._settled]  # a boundary that failed half-way settled these
        return settled + ([{**self._in_flight, "ranks": None}] if self._in_flight is not None else [])

    def _settle(self, *, urgent: bool) -> None:
        boundary = self._exchange.settle()
        if boundary is None:
            return
        metrics, self._in_flight = self._in_flight, None
        self._requested = boundary.requested
        if self._control is not None and metrics is not None:
            self._settled.append((step_record(metrics, boundary), urgent))


def step_record(metrics: Mapping[str, Any], boundary: Boundary) -> StepReport:
    """What rank 0 reports for one step: its own metrics plus every rank's timings under ``ranks``."""
    return {**metrics, "ranks": boundary.timings}


class ControlRequests:
    """The supervisor's requests as one rank sees them; only rank 0's view is ever acted on.

    Control calls (``request_checkpoint``, ``request_stop``) arrive on the actor's other threads at any
    moment; the training thread calls :meth:`decide_requests` once per step boundary, which takes a consistent
    snapshot under a lock and consumes what it acts on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._checkpoints: set[int] = set()  # save at the first boundary with completed >= each
        self._stop = False

    def request_checkpoint(self, at_least: int | None = None) -> None:
        """Save at the first step boundary with at least ``at_least`` completed steps (None: the next one)."""
        with self._lock:
            self._checkpoints.add(0 if at_least is None else int(at_least))

    def request_stop(self) -> None:
        """Stop after the next step boundary (after its save, if it has one)."""
        with self._lock:
            self._stop = True

    def pending(self) -> tuple[frozenset[int], bool]:
        """(checkpoint targets not yet acted on, stop requested)."""
        with self._lock:
            return frozenset(self._checkpoints), self._stop

    def decide_requests(self, completed: int, *, total_steps: int) -> int:
        """The flags the requests give the boundary after ``completed`` steps; consumes what it satisfies.

        The schedule's saves are not among them: every rank computes those itself (:class:`StepBoundaries`).
        A stop at the last step is not a stop: the attempt ends there anyway, as finished.
        """
        with self._lock:
            due = {target for target in self._checkpoints if target <= completed}
            self._checkpoints -= due
            stop = self._stop and completed < total_steps
            if stop:
                self._stop = False
        return (SAVE if due else 0) | (STOP if stop else 0)
