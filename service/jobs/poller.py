"""Each live supervisor's updates into SQLite, pulled by the ``etrain-poller`` thread.

REST reads never touch Ray: they read the store, and this poller keeps it current (events, step rows,
the job's fields, goodput). It also notices a started job whose supervisor is gone and queues it again
(service/jobs/scheduler.py admits it when its gang fits) to resume from its last committed checkpoint.
Goodput spans supervisors and control-plane restarts, so it is computed here from the stored step rows
(service/decisions/goodput.py), never by a supervisor.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from etrain.service.decisions.goodput import ProductiveTally, goodput
from etrain.service.decisions.goodput_breakdown import BreakdownEvent, BreakdownStep, goodput_breakdown
from etrain.service.errors import JobConflict
from etrain.service.jobs.scheduler import Scheduler
from etrain.service.planning.spec import JobSpec
from etrain.service.runtime.cluster import Runtime
from etrain.service.settings import Settings
from etrain.service.store.job_store import JobStore
from etrain.service.store.records import JobRecord, JobStatus, StepRecord

log = logging.getLogger(__name__)

#: How often a running job's goodput_breakdown is recomputed (it reads every kept step row; an ended job's is
#: computed once, at its end).
BREAKDOWN_EVERY_S = 10.0
#: How long an ended job's supervisor is kept while its last prune of old checkpoints runs (the prune hashes the
#: checkpoints it keeps: 2 x 15.9 GB for a Llama-1B job with keep_last 2, minutes on an object store); past
#: it the supervisor is released anyway and the checkpoints beyond keep_last stay (said in the server log).
END_PRUNE_MAX_S = 600.0


class SupervisorPoller:
    """Pulls supervisors' updates into the store, one job at a time, under one lock."""

    def __init__(
        self, *, store: JobStore, runtime: Runtime, settings: Settings, starting: set[str], scheduler: Scheduler
    ):
        self.store = store
        self.runtime = runtime
        self.settings = settings
        self._starting = starting  # jobs whose supervisor is being created (the manager's set): not lost
        self._scheduler = scheduler
        self._lock = threading.Lock()  # one job's pull-and-store at a time (and the end of an orphan)
        self._step_cursor: dict[str, int] = {}  # job -> seq of the supervisor's last step row stored
        # job -> its kept step time, rebuilt from the steps table once per control-plane lifetime and then
        # fed the rows it stores (service/decisions/goodput.py): goodput survives supervisor and server restarts.
        self._tallies: dict[str, ProductiveTally] = {}
        self._breakdown_at: dict[str, float] = {}  # job -> when its goodput_breakdown was last computed
        # Ended jobs whose supervisor still winds down (prunes old checkpoints, stops its ranks) -> when it is
        # released whatever it says.
        self._pruning: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etrain-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        for job_id in list(self._pruning):  # not left running without a control plane to release them
            self._release(job_id, why="the control plane stopped")

    def restarted(self, job_id: str) -> None:
        """A new supervisor starts for ``job_id``: it numbers its step rows from 1 again."""
        self._step_cursor.pop(job_id, None)

    def forget(self, job_id: str) -> None:
        """``job_id`` ended without this poller seeing it (cancelled while queued): its goodput is final."""
        self._tallies.pop(job_id, None)

    def cancel_orphan(self, job_id: str) -> None:
        """Cancel a job that has no supervisor (never started, or lost): nothing to stop, only its end to
        store, under the poll lock so that a poll in flight cannot write another status over it."""
        with self._lock:
            try:
                self.store.update_job(
                    job_id,
                    status=JobStatus.CANCELLED,
                    error=None,
                    expect_status=[s for s in JobStatus if not s.is_terminal],
                )
            except JobConflict:
                return  # it reached another end first
            self.store.add_events(job_id, [(time.time(), "cancelled", {"message": "cancelled (no live supervisor)"})])
            record = self.store.get_job(job_id)
            if record is not None:
                self.store.update_job(job_id, goodput_breakdown=self._breakdown(record, time.time()))
            self._tallies.pop(job_id, None)
            self._breakdown_at.pop(job_id, None)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.poll_interval_s):
            for job in self.store.active_jobs():
                try:
                    self.poll_once(job.id)
                except Exception:  # one broken job must not stop the others' updates
                    log.exception("polling job %s failed", job.id)
            for job_id in list(self._pruning):
                try:
                    self._release_when_pruned(job_id)
                except Exception:
                    log.exception("releasing the supervisor of job %s failed", job_id)

    def _release_when_pruned(self, job_id: str) -> None:
        """Release an ended job's supervisor once its last prune and its ranks' stop are done, or at
        :data:`END_PRUNE_MAX_S`."""
        with self._lock:
            try:
                update = self.runtime.updates(job_id, 2**62, 2**62)  # only the fields: no events or steps
                pruning, last = update is not None and _winding_down(update), ""
            except Exception as err:  # a supervisor that does not answer is asked again, until the cap
                pruning, last = True, f" (last answer: {type(err).__name__}: {err})"
            if pruning and time.monotonic() < self._pruning[job_id]:
                return
            self._release(
                job_id,
                why=f"its last prune or its ranks' stop ran past {END_PRUNE_MAX_S:.0f}s{last}" if pruning else None,
            )

    def _release(self, job_id: str, *, why: str | None) -> None:
        self._pruning.pop(job_id, None)
        if why is not None:
            log.warning(
                "job %s: releasing its supervisor before it wound down (%s); checkpoints beyond keep_last may "
                "remain, and its ranks are stopped rather than kept for its tenant's next job",
                job_id,
                why,
            )
        self.runtime.release(job_id)

    def poll_once(self, job_id: str) -> None:
        """Pull ``job_id``'s updates now (a cancel persists its end without waiting for the next poll)."""
        with self._lock:
            record = self.store.get_job(job_id)
            if record is not None and record.status is JobStatus.QUEUED and record.goodput is not None:
                # Queued again after a lost supervisor: the wait counts against goodput, so keep it current.
                self.store.update_job(job_id, goodput=self._goodput(record, time.time()))
            if record is None or record.is_terminal or job_id in self._starting or record.status is JobStatus.QUEUED:
                return  # (a queued job has no supervisor to ask)
            update = self.runtime.updates(job_id, self.store.get_cursor(job_id), self._step_cursor.get(job_id, 0))
            if update is None:
                self._supervisor_lost(record)
                return
            self._persist(record, update)

    def _persist(self, record: JobRecord, update: dict[str, Any]) -> None:
        job_id = record.id
        events = update.get("events", [])
        if events:
            self.store.add_events(
                job_id,
                [(e["ts"], e["kind"], {"message": e["detail"]}) for e in events],
                cursor=max(e["seq"] for e in events),
            )  # one transaction: no duplicates on a kill
        steps = update.get("steps", [])
        if steps:
            tally = self._tally(job_id)  # (built from the table before these rows land in it)
            records = [
                StepRecord(
                    job_id=job_id,
                    step=row["step"],
                    loss=row.get("loss"),
                    tokens_per_s=row.get("tokens_per_s"),
                    step_s=row.get("step_s"),
                    compute_s=row.get("compute_s"),
                    comm_wait_s=row.get("comm_wait_s"),
                    ts=row["ts"],
                    attempt=row.get("attempt", 0),
                    mfu=row.get("mfu"),
                )
                for row in steps
            ]
            self.store.add_steps(job_id, records)
            for step_record in records:
                tally.add(step_record)
            self._step_cursor[job_id] = max(row["seq"] for row in steps)
        fields = {
            key: update.get(key)
            for key in (
                "step",
                "loss",
                "tokens_per_s",
                "mfu",
                "host_memory_gib",
                "world_size",
                "restarts",
                "last_checkpoint_step",
                "layout",
                "attempt",
                "error",
            )
        }
        now = time.time()
        fields["goodput"] = self._goodput(record, now)
        fields["stragglers"] = update.get("stragglers", [])
        if update.get("artifacts"):
            fields["artifacts"] = update["artifacts"]
        fields["status"] = JobStatus(update["status"])
        if fields["status"] is JobStatus.QUEUED:  # the supervisor's first instant: admitted, about to launch
            fields["status"] = JobStatus.STARTING
        if fields["status"].is_terminal or now - self._breakdown_at.get(job_id, 0.0) >= BREAKDOWN_EVERY_S:
            fields["goodput_breakdown"] = self._breakdown(record, now)
        fields = {key: value for key, value in fields.items() if value is not None or key == "error"}
        self.store.update_job(job_id, **fields)
        if fields["status"].is_terminal:
            if _winding_down(update):  # released when its last prune and stop are done (_release_when_pruned)
                self._pruning[job_id] = time.monotonic() + END_PRUNE_MAX_S
            else:
                self.runtime.release(job_id)
            self._step_cursor.pop(job_id, None)
            self._tallies.pop(job_id, None)  # its goodput is final (measured up to now, its end)
            self._breakdown_at.pop(job_id, None)
            self._scheduler.wake()  # what it held may start the next queued job

    def _tally(self, job_id: str) -> ProductiveTally:
        tally = self._tallies.get(job_id)
        if tally is None:
            tally = self._tallies[job_id] = ProductiveTally(self.store.steps(job_id, limit=2**62))
        return tally

    def _goodput(self, record: JobRecord, now: float) -> float | None:
        """Kept step time over wall time since the submit (service/decisions/goodput.py), from the store's rows."""
        return goodput(self._tally(record.id).value, submitted_at=record.created_at, now=now)

    def _breakdown(self, record: JobRecord, now: float) -> dict[str, float]:
        """Seconds of ``record``'s wall time by cause (service/decisions/goodput_breakdown.py), from the store's
        kept step rows and events: O(steps), so a running job's is refreshed every BREAKDOWN_EVERY_S only."""
        self._breakdown_at[record.id] = now
        rows = [
            BreakdownStep(step=row.step, attempt=row.attempt, ts=row.ts, step_s=row.step_s)
            for row in self.store.steps(record.id, limit=2**62)
        ]
        events = [
            BreakdownEvent(ts=event.ts, kind=event.kind, text=str(event.detail.get("message", "")))
            for event in self.store.events(record.id, limit=2**62)
        ]
        seconds = goodput_breakdown(submitted_at=record.created_at, until=now, steps=rows, events=events)
        return {cause: round(value, 3) for cause, value in seconds.items()}

    def _supervisor_lost(self, record: JobRecord) -> None:
        """A started job without a supervisor (its node died, the cluster restarted, or a control plane
        died between admitting it and starting it): back in the queue, at its priority and original
        submit time, to resume from its newest committed checkpoint once its gang fits again.

        The loss counts against the restart budget, unless the supervisor never launched anything.
        """
        spec = JobSpec.model_validate(record.spec)
        spent = 0 if record.attempt == 0 else 1
        if spent and record.restarts >= spec.fault_tolerance.max_restarts:
            self.store.update_job(
                record.id,
                status=JobStatus.FAILED,
                error=f"supervisor lost and restarted {record.restarts} times, "
                f"max_restarts={spec.fault_tolerance.max_restarts}",
            )
            self.store.add_events(record.id, [(time.time(), "failed", {"message": "supervisor lost; budget spent"})])
            self._tallies.pop(record.id, None)
            return
        # The event first: once QUEUED, the scheduler may admit it (and record "admitted") at once.
        self.store.add_events(
            record.id,
            [
                (
                    time.time(),
                    "supervisor_lost",
                    {"message": "no live supervisor; queued again to resume from the last checkpoint"},
                )
            ],
        )
        self._scheduler.announce(record.id)
        try:
            self.store.update_job(
                record.id, status=JobStatus.QUEUED, restarts=record.restarts + spent, expect_status=[record.status]
            )
        except JobConflict:
            self._scheduler.forget(record.id)
            return  # it ended meanwhile
        self._scheduler.wake()


def _winding_down(update: dict) -> bool:
    """Whether an ended job's supervisor still prunes old checkpoints or stops its ranks (``updates``)."""
    return bool(update.get("pruning") or update.get("stopping"))
