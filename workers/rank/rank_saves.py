"""One rank's checkpoint saves during one attempt: synchronous or async, storage faults, ``every_steps: auto``.

Why a module of its own: a save is a protocol with the supervisor of its own (a shard report per rank,
or rank 0's ``checkpoint_failed``), with its own threads (an async save reports when its files are
written) and its own clock (how long a save blocked training, which ``every_steps: auto`` feeds on).
The rank actor (``workers/rank/worker.py``) decides *when* a step saves (the step-boundary exchange); this
decides *how*, and tells the supervisor what came of it.

* **Sync** (CPU default): ``Trainer.save`` blocks until the files are written and hashed.
* **Async** (CUDA default, ``checkpoint.async``): the state is staged in host memory (pinned, reused
  buffers on CUDA, prepared in the background while the attempt's first step runs) and training goes on; the
  shard report follows when the files are written. The final save waits for its write: it is the job's
  result.
* **Storage faults** (``workers/checkpoints/storage_faults.py``): a save the storage fails is abandoned on every rank
  alike; rank 0 says why (``checkpoint_failed``) and training goes on; the next save tries again. Only
  the final save failing fails the attempt.
* **``every_steps: auto``** (``workers/checkpoints/checkpoint_cadence.py``): rank 0 requests a save at the Young-Daly
  interval (every rank saves it at the same boundary) and announces the interval as a job event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from etrain.workers.checkpoints.storage_faults import StorageFault
from etrain.workers.protocol.messages import REPORT_TIMEOUT_S, LaunchPlan
from etrain.workers.rank.step_control import ControlRequests

__all__ = ["CUDA_WRITE_THREADS", "FINAL_WRITE_TIMEOUT_S", "RankSaves"]

#: Writer threads (a file each, hashed as written) per rank for an async save on CUDA. Measured on an
#: H100 node's disk (`benchmarks/gpu/write_threads.py`, 4 GiB of a 1B model's tensors, fsync included):
#: 1 thread 0.64 GiB/s, 4: 1.50, 8: 1.71, 16: 2.05 GiB/s.
CUDA_WRITE_THREADS = 16
#: How long a save's background write may take before the rank gives up on it (15 GB per rank at
#: ~100 MB/s of network storage is 150 s; this leaves room for slower).
FINAL_WRITE_TIMEOUT_S = 1800.0


class RankSaves:
    """The saves of one attempt on one rank. Construction is collective when the save is async (the
    background writer's gloo group): every rank builds one at the same point of the attempt.

    ``drills_due(step, moment)`` fires the fault drills due inside a save; ``keep_snapshot(trainer, step)``
    keeps the in-memory copy an in-place repair restores from.
    """

    def __init__(
        self,
        *,
        rank: int,
        plan: LaunchPlan,
        device_type: str,
        supervisor: Any,
        control: ControlRequests,
        drills_due: Callable[[int, str], None],
        keep_snapshot: Callable[[Any, int], None],
    ):
        self.rank = rank
        self._plan = plan
        self._supervisor = supervisor
        self._control = control
        self._drills_due = drills_due
        self._keep_snapshot = keep_snapshot
        self._cuda = device_type == "cuda"
        self._threads: list[threading.Thread] = []
        self._final_wait_s: float | None = None  # the final async save: its write and commit, waited for
        self._queued_s = 0.0  # the last async save: how long it waited for the write before it
        self._last_save: tuple[int, float] | None = None  # (step, monotonic start) of the last save
        self._queued_noted = False  # the queued-saves note is made once per attempt
        checkpoint = plan.config.checkpoint
        self.async_save = None
        #: Writes a held save (:meth:`save_held`) where saves are synchronous (CPU): made by that save.
        self._held_writer = None
        self._held_report: threading.Thread | None = None  # the held save's write and report, until they land
        if checkpoint.async_save:
            from etrain.workers.checkpoints.checkpoint import AsyncCheckpointer

            self.async_save = AsyncCheckpointer(
                pinned=self._cuda, write_threads=CUDA_WRITE_THREADS if self._cuda else 1
            )
        self._cadence = None
        if checkpoint.auto_interval and rank == 0:  # rank 0 decides for every rank
            from etrain.workers.checkpoints.checkpoint_cadence import AutoCadence

            self._cadence = AutoCadence(mtbf_hours=checkpoint.mtbf_hours, start_step=plan.start_step)

    def before_first_step(self, trainer) -> None:
        """On CUDA, pin the async staging buffers in the background while the attempt's first step runs
        (its compilation, seconds of host work, hides the pinning); the optimizer's state is made first
        (``Trainer.materialize_optimizer_state``). Where it cannot be, :meth:`after_first_step` does it."""
        if self.async_save is not None and self._cuda and trainer.materialize_optimizer_state():
            self.async_save.prepare(*trainer.state_for_checkpoint()[:2])

    def after_first_step(self, trainer) -> None:
        """On CUDA, pin the async staging buffers in the background unless :meth:`before_first_step` did
        (the optimizer has its state now)."""
        if self.async_save is not None and self._cuda:
            self.async_save.prepare(*trainer.state_for_checkpoint()[:2])

    def save(self, trainer, completed_steps: int, *, final: bool) -> float | None:
        """Write this rank's shards of the checkpoint after ``completed_steps`` and report them; returns the
        seconds the save blocked training, or None when the storage failed it (reported; training goes
        on). The supervisor commits the step only when every rank has reported. The *final* save failing
        raises: the job's result would be lost.
        """
        from etrain.workers.checkpoints.checkpoint_commit import step_dir

        directory = step_dir(self._plan.config.checkpoint.path, completed_steps)  # a path or an s3:// URL
        started = time.monotonic()
        self._held_landed()
        self._keep_snapshot(trainer, completed_steps)
        try:
            if self.async_save is None:
                report = trainer.save(directory)
            else:  # training goes on once the state is staged in host memory
                model_parts, optimizers, extra = trainer.state_for_checkpoint()
                pending = self.async_save.save(
                    directory, model_parts, optimizers, extra, owner=self._plan.config.job_id
                )
        except StorageFault as fault:
            if final:
                raise
            self._report_failed(completed_steps, fault)
            return None
        blocked_s = self._blocked(completed_steps, started)
        if self.async_save is not None:
            self._queued_s = self.async_save.waited_for_previous_s
            self._note_queued(completed_steps, started, final=final)
        self._last_save = (completed_steps, started)

        if self.async_save is None:
            self._report_written(completed_steps, report)
        elif final:  # the job's result: its write must land (or fail the attempt) before run() returns
            self._report_written(completed_steps, pending.wait(timeout_s=FINAL_WRITE_TIMEOUT_S))
            self._final_wait_s = time.monotonic() - started - blocked_s
        else:
            self._report_when_written(completed_steps, pending)
        return blocked_s

    def save_held(self, trainer, snapshot) -> float | None:
        """Save ``snapshot`` (``workers/checkpoints/snapshot.py``: the state this attempt resumed from, equal to
        the trainer's now, at a step whose scheduled save never committed) with its write in the background,
        whatever ``checkpoint.async`` says; returns the seconds it blocked training, or None when the storage
        refused it (reported, as :meth:`save`). Collective, like :meth:`save`.

        Why: the copy in host memory is what a save would stage, so nothing needs copying, and nothing
        changes it while it is written. Made from the live state instead, this save blocked every rank
        before the repaired attempt's first step: on CPU for the whole write (1.0-1.5 s of a 2.6 s node-loss
        repair of the small GPT), on a GPU for the staging copy, in a new process with its buffers allocated
        and pinned first (6.1-6.8 s for a 1B model on an H100). The next save waits until this one's write
        and report have landed, so the supervisor commits the steps in order.
        """
        from etrain.workers.checkpoints.checkpoint import AsyncCheckpointer
        from etrain.workers.checkpoints.checkpoint_commit import step_dir

        step = snapshot.step
        directory = step_dir(self._plan.config.checkpoint.path, step)
        started = time.monotonic()
        writer = self.async_save
        if writer is None:  # collective: every rank makes this save at the same point of the attempt
            writer = self._held_writer = AsyncCheckpointer(write_threads=1)
        model_parts, optimizers, extra = trainer.state_for_checkpoint()
        if extra.get("step") != step:
            raise ValueError(f"the held copy is of step {step}, the trainer is at step {extra.get('step')}")
        try:
            pending = writer.save_held(
                directory, model_parts, optimizers, snapshot.state, extra, owner=self._plan.config.job_id
            )
        except StorageFault as fault:
            self._report_failed(step, fault)
            return None
        blocked_s = self._blocked(step, started)
        self._last_save = (step, started)
        self._held_report = self._report_when_written(step, pending)
        return blocked_s

    def _blocked(self, step: int, started: float) -> float:
        """A save of ``step`` begun at ``started`` has released training: the seconds it blocked it (the
        ``every_steps: auto`` cadence hears of them)."""
        blocked_s = time.monotonic() - started
        if self._cadence is not None:
            self._cadence.observe_save(step, blocked_s)
        return blocked_s

    def _report_written(self, step: int, report: Any) -> None:
        """Tell the supervisor this rank's shards of ``step`` are written (the fault drills due around it fire)."""
        import ray

        self._drills_due(step, "checkpoint_write")
        ray.get(
            self._supervisor.report_checkpoint.remote(self._plan.attempt, self.rank, step, report),
            timeout=REPORT_TIMEOUT_S,
        )
        self._drills_due(step, "checkpoint_commit")

    def _report_when_written(self, step: int, pending: Any) -> threading.Thread:
        """Report ``step`` from a thread once its background write landed (a storage fault: rank 0 says why)."""

        def report_when_written() -> None:
            try:
                report = pending.wait(timeout_s=FINAL_WRITE_TIMEOUT_S)
            except StorageFault as fault:
                self._report_failed(step, fault)
                return
            self._report_written(step, report)

        thread = threading.Thread(target=report_when_written, name=f"ckpt-report-{step}", daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def _held_landed(self) -> None:
        """Wait until a held save's write and report are over (the supervisor then commits the steps in order:
        a later step committed first would leave the held one refused as older)."""
        if self._held_report is not None:
            self._held_report.join(timeout=FINAL_WRITE_TIMEOUT_S + REPORT_TIMEOUT_S)
            self._held_report = None

    def _note_queued(self, step: int, started: float, *, final: bool) -> None:
        """Rank 0, once per attempt: a mid-job save that waited for the previous save's write becomes a
        ``checkpoint_interval`` event saying so and what cadence would leave room for a write
        (``checkpoint_cadence.queued_save_note``). The final save's wait is the job's end, not training's."""
        from etrain.workers.checkpoints.checkpoint_cadence import queued_save_note

        checkpoint = self._plan.config.checkpoint
        on_schedule = checkpoint.auto_interval or checkpoint.every_steps > 0  # not only requested saves
        if self.rank != 0 or final or self._queued_noted or self._last_save is None or not on_schedule:
            return
        previous_step, previous_started = self._last_save
        note = queued_save_note(
            step=step,
            previous_step=previous_step,
            waited_s=self._queued_s,
            since_previous_s=started - previous_started,
            every_steps=None if checkpoint.auto_interval else checkpoint.every_steps,
        )
        if note is not None:
            self._queued_noted = True
            self._supervisor.report_note.remote(self._plan.attempt, "checkpoint_interval", note)

    def describe(self, blocked_s: float | None, *, held: bool = False) -> str:
        """The rank log's words for a save's outcome (``held``: :meth:`save_held`'s)."""
        if blocked_s is None:
            return "abandoned (checkpoint_failed)"
        if held:
            return (
                f"save started from the copy in memory (written in the background), training blocked {blocked_s:.2f}s"
            )
        if self.async_save is not None:
            said = f"save started (async), training blocked {blocked_s:.2f}s"
            if self._queued_s >= 0.01:
                said += f" ({self._queued_s:.2f}s of it waiting for the previous save's write)"
            if self._final_wait_s is not None:  # the last save: the attempt waited for its write
                said += f"; its write and commit took {self._final_wait_s:.2f}s more"
            return said
        return f"saved, training blocked {blocked_s:.2f}s"

    def after_step(self, metrics: dict, completed: int, total: int) -> None:
        """``every_steps: auto`` on rank 0: request a save once the Young-Daly interval has passed (every
        rank saves it at the same boundary), and announce a new interval as a job event."""
        cadence = self._cadence
        if cadence is None:
            return
        cadence.observe_step(float(metrics.get("step_s") or 0.0))
        announce = cadence.changed()
        if announce is not None:
            self._supervisor.report_note.remote(self._plan.attempt, "checkpoint_interval", announce)
        if completed + 1 < total and cadence.due(completed):
            self._control.request_checkpoint(completed + 1)
            cadence.observe_save(completed, float("nan"))  # counts from here: one request per interval

    def close(self, log: Any) -> None:
        """Wait for the save in flight and every report (each acknowledged before ``run`` returns). Never
        raises: after a peer died the async writer's close can fail, and this process may run the next
        attempt (an in-place repair)."""
        for writer in (self.async_save, self._held_writer):
            if writer is None:
                continue
            try:
                writer.close(timeout_s=REPORT_TIMEOUT_S * 10)  # the last save must land first
            except Exception as err:
                if log is not None:
                    log.write(f"attempt {self._plan.attempt}: the last async checkpoint did not land: {err}")
        self.async_save = self._held_writer = None
        for thread in self._threads:
            thread.join(timeout=REPORT_TIMEOUT_S)
        self._threads.clear()

    def _report_failed(self, completed_steps: int, fault: Exception) -> None:
        """Rank 0 tells the supervisor why the save of ``completed_steps`` was abandoned (every rank saw
        the same failure: DCP raises it on all of them, the room check is rank 0's verdict for all)."""
        if self.rank != 0:
            return
        import ray

        try:
            ray.get(
                self._supervisor.report_checkpoint_failed.remote(
                    self._plan.attempt, self.rank, completed_steps, str(fault)
                ),
                timeout=REPORT_TIMEOUT_S,
            )
        except Exception:  # noqa: BLE001 - a slow supervisor must not stop training over a lost note
            pass
