"""Rank 0's step reports, as the supervisor actor takes them in: step rows, the job's latest fields, the
gauges, straggler findings, and the state-machine events they mean.

Rank 0 reports a batch of completed steps (workers/rank/report_batch.py) after every rank took part in each
step's boundary exchange, so a report is every rank's heartbeat and carries every rank's timings. This
is the one per-step path of a job, kept apart from the actor (service/runtime/supervisor_actor.py) so
that what a step becomes is read in one place: a row for the control plane (its own sequence, since a
restarted attempt re-reports step numbers), a StepReported (progress), per pipeline stage the
stragglers service/decisions/stragglers.py finds (StragglerFlagged), and a rank that holds more host memory than
its bundle reserves (service/decisions/host_memory_watch.py: a note, once per attempt).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
from collections.abc import Callable
from typing import Any

from etrain.service.decisions.host_memory_watch import over_reservation
from etrain.service.decisions.stragglers import StragglerConfig, StragglerDetector, stage_map
from etrain.service.decisions.supervisor_events import Event, StepReported, StragglerFlagged
from etrain.service.planning.plan_memory import GiB
from etrain.service.runtime.job_metrics import JobMetrics

__all__ = ["MAX_STEP_HISTORY", "StepReports"]

#: Step rows kept for the control plane to pull (it stores them; older ones are dropped here).
MAX_STEP_HISTORY = 100_000

#: The StepMetrics fields a step row keeps.
_ROW_FIELDS = (
    "loss",
    "lr",
    "grad_norm",
    "step_s",
    "compute_s",
    "comm_wait_s",
    "tokens_per_s",
    "flops_per_s",
    "mfu",
    "peak_mem_bytes",
)


class StepReports:
    """The step rows and findings of one supervisor. :meth:`take` runs on the actor's control thread;
    :meth:`since` and :meth:`stats` on Ray's method threads."""

    def __init__(
        self,
        *,
        stragglers: StragglerConfig,
        evict: bool,
        metrics: JobMetrics,
        parallel: Any,
        reserved_host_bytes: int = 0,
    ):
        self._config = stragglers
        self._reserved_host = reserved_host_bytes  # each rank's bundle's ``memory`` (0: none reserved)
        self._host_warned: int | None = None  # the attempt the host-memory note was made for
        self._evict = evict  # straggler_action == "evict"
        self._metrics = metrics
        if reserved_host_bytes:
            metrics.host_memory_reserved(reserved_host_bytes)  # fixed for the supervisor's life: set once
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self._seq = 0
        self._calls = 0  # report_steps calls taken in (one per batch from rank 0, not per rank per step)
        self._reported: dict[int, int] = {}  # attempt -> the newest step it reported (completed steps)
        self._detector = self._new_detector(parallel)
        #: The job's newest step, loss and throughput (the job's fields in ``updates``).
        self.latest: dict[str, Any] = {}
        self._shown_attempt: int | None = None  # the attempt ``latest`` belongs to
        #: Every straggler found so far, with its node (the job's ``stragglers`` field).
        self.findings: list[dict[str, Any]] = []

    def new_attempt(self, parallel: Any) -> None:
        """A launch or repair: a fresh detector, judging ranks within their pipeline stage of ``parallel``."""
        self._detector = self._new_detector(parallel)

    def _new_detector(self, parallel: Any) -> StragglerDetector:
        return StragglerDetector(
            self._config, stages=stage_map(pp=parallel.pp, dp=parallel.dp, tp=parallel.tp, cp=parallel.cp)
        )

    def arrived(self, attempt: int, records: list[dict]) -> None:
        """One ``report_steps`` call of ``attempt`` arrived (counted whatever its attempt), on Ray's method
        thread, before the control thread takes it in: so :meth:`reported_through` counts it at once. Rank 0
        sends its batches in order, one caller, so what arrived of an attempt is every step from its start
        to the newest (records come oldest first)."""
        with self._lock:
            self._calls += 1
            if records:
                newest = int(records[-1]["step"]) + 1
                self._reported[attempt] = max(newest, self._reported.get(attempt, 0))

    def reported_through(self, attempt: int) -> int | None:
        """The newest step ``attempt`` reported (completed steps), or None if it reported none."""
        with self._lock:
            return self._reported.get(attempt)

    def recent_step_s(self, last: int = 20) -> float | None:
        """The median step time of the newest ``last`` rows (None before any): how long a survivor may
        still be computing when a peer dies (``WorkerGroup.repair``'s grace for stuck survivors)."""
        with self._lock:
            times = [float(row["step_s"]) for row in self._rows[-last:] if row.get("step_s")]
        return statistics.median(times) if times else None

    def keep_late(self, attempt: int, metrics: dict, *, now: float) -> None:
        """A step of an attempt the job has left, reported after it ended (rank 0 sends what it still held
        when its attempt failed): its row is kept, since an in-place repair may resume after it from the
        ranks' memory and never run it again (a later attempt's row of the same step replaces it). It is
        not progress of the current attempt, and no straggler is judged on it."""
        self._keep_row(attempt, metrics, now=now)

    def _keep_row(self, attempt: int, metrics: dict, *, now: float) -> None:
        """Store a step's row for the control plane to pull (its own sequence number; the oldest dropped)."""
        row = {key: metrics.get(key) for key in _ROW_FIELDS}
        row.update(step=int(metrics["step"]) + 1, attempt=attempt, ts=now)
        with self._lock:
            self._seq += 1
            row["seq"] = self._seq
            self._rows.append(row)
            if len(self._rows) > MAX_STEP_HISTORY:
                del self._rows[: len(self._rows) - MAX_STEP_HISTORY]

    def take(
        self, attempt: int, metrics: dict, *, world_size: int, node_of: Callable[[int], str], now: float
    ) -> list[Event]:
        """One completed step of the current ``attempt``: its row stored; the events to apply, in order
        (StragglerFlagged for each rank found slow, then StepReported)."""
        completed = int(metrics["step"]) + 1
        events: list[Event] = []
        # Only timing-sync steps separate a rank's compute from waiting on a slow peer (between
        # them a fast rank's compute_s includes that wait); every rank agrees which steps they are.
        compute_s = (metrics.get("ranks") or {}).get("compute_s") or []
        if self._config.enabled and metrics.get("timing_synced", True) and len(compute_s) == world_size:
            compute = {rank: float(seconds or 0.0) for rank, seconds in enumerate(compute_s)}
            for finding in self._detector.observe(completed, compute):
                node = node_of(finding.rank)
                self.findings.append(dataclasses.asdict(finding) | {"node": node})
                self._metrics.straggler(finding.rank, finding.factor)
                events.append(
                    StragglerFlagged(
                        attempt=attempt,
                        rank=finding.rank,
                        node=node,
                        factor=finding.factor,
                        evict=self._evict,
                        evidence=finding.evidence,
                    )
                )
        self._keep_row(attempt, metrics, now=now)
        events.append(StepReported(attempt=attempt, step=completed, loss=float(metrics["loss"]), rank=0))
        return events

    def host_memory_note(self, attempt: int, metrics: dict, *, node_of: Callable[[int], str]) -> str | None:
        """The ``host_memory`` event's words when a rank of this step holds more than its bundle reserves, the
        first time in ``attempt`` (a repaired or relaunched attempt may say it again)."""
        over = over_reservation(_host_held(metrics), self._reserved_host)
        if over is None or self._host_warned == attempt:
            return None
        self._host_warned = attempt
        return f"attempt {attempt}, step {int(metrics['step']) + 1}: {over.describe(node_of(over.rank))}"

    def show(self, last: dict, *, attempt: int, restarts: int) -> None:
        """A batch of ``attempt`` was taken in: the job's fields and gauges show its newest step ``last``.

        The supervisor is a threaded actor, so two of rank 0's batches may be taken in out of order (Ray
        orders one caller's calls only on a single-threaded actor): within an attempt the fields only move
        forward, or a job could end showing step 11 of its 12. A new attempt (a restore) may go back.
        """
        step = int(last["step"]) + 1
        if attempt == self._shown_attempt and step <= int(self.latest.get("step") or 0):
            return
        self._shown_attempt = attempt
        held = _host_held(last)
        self.latest = {
            "step": step,
            "loss": last.get("loss"),
            "tokens_per_s": last.get("tokens_per_s"),
            "mfu": last.get("mfu"),
            # the most any rank held at the latest sample; kept from an earlier step where this one has none
            "host_memory_gib": round(max(held) / GiB, 3) if any(held) else self.latest.get("host_memory_gib"),
        }
        self._metrics.step(self.latest["step"], last, restarts)
        if any(held):
            self._metrics.host_memory(max(held))

    def since(self, seq: int) -> list[dict[str, Any]]:
        """Step rows after the caller's cursor ``seq``."""
        with self._lock:
            return [row for row in self._rows if row["seq"] > seq]

    def stats(self) -> dict[str, int]:
        return {"step_report_calls": self._calls, "step_records": self._seq, "step": int(self.latest.get("step") or 0)}


def _host_held(record: dict) -> list[int]:
    """Each rank's host memory at the step ``record`` reports (its sample; 0 where unknown), or [] where the
    step's exchange never settled (no rank's figures)."""
    return list((record.get("ranks") or {}).get("host_mem_bytes") or [])
