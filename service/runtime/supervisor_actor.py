"""The Ray side of a job: the supervisor actor that drives ``service/decisions/supervisor.py``.

One detached, named actor per job (``etrain/<job-id>/supervisor``). It outlives the control plane, so
a restarted API server reattaches to it and loses nothing. Its only job is translation:

* what happens (rank reports, finished or failed ``run`` calls, dead nodes, free capacity, user
  requests) becomes state-machine **events**;
* :func:`etrain.service.decisions.supervisor.decide` answers with **actions**, carried out here (launch or stop a
  :class:`~etrain.service.runtime.worker_group.WorkerGroup`, commit a checkpoint manifest, record an event);
* everything users see is appended to an in-memory log that the control plane pulls with
  :meth:`JobSupervisor.updates` and persists in SQLite.

All decisions happen on one control thread (``_loop``); other threads (Ray method calls, group
launch/stop workers) only enqueue events, so the state is never touched concurrently.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from etrain.service.decisions import supervisor as sm
from etrain.service.decisions.capacity import rank_slots, replicas_that_fit
from etrain.service.decisions.stragglers import StragglerConfig, StragglerDetector, stage_map
from etrain.service.runtime.spares import HEAD_NODE_RESOURCE
from etrain.service.runtime.worker_group import NAMESPACE, GroupOutcome, PlacementTimeout, WorkerGroup
from etrain.workers import storage
from etrain.workers.protocol.run_config import ModelConfig, RunConfig
from etrain.workers.protocol.errors import CheckpointError, EtrainError
from etrain.workers.protocol.manifest import ManifestSignatureError, commit, list_steps, prune, resolve_latest, step_dir, verify
from etrain.workers.worker import ChaosOrder, LaunchPlan

log = logging.getLogger(__name__)

TICK_S = 0.2
# How long a node whose rank was lost as a process fault is watched for a late death verdict (Ray's
# health check declares a node dead after period x failure threshold: 5 s x 5 by default), and how
# often the node table is read meanwhile.
UNCONFIRMED_WATCH_S = 60.0
NODE_CHECK_INTERVAL_S = 0.5
MAX_STEP_HISTORY = 100_000
#: Where a job's end-of-run Hugging Face export goes, inside its checkpoint root.
HF_EXPORT_DIR = "hf-export"
#: How long ``updates`` of an ended job waits for its last prune (well inside the caller's Ray call timeout).
END_PRUNE_WAIT_S = 5.0
#: CPUs the export task reserves: it is single-process and streams one output shard at a time.
EXPORT_NUM_CPUS = 1.0


def _stages(parallel: Any) -> dict[int, int]:
    """``{rank: pipeline stage}`` of a layout, for the straggler detector (peers are judged per stage)."""
    return stage_map(pp=parallel.pp, dp=parallel.dp, tp=parallel.tp)


def supervisor_name(job_id: str) -> str:
    return f"etrain/{job_id}/supervisor"


@dataclass(frozen=True, kw_only=True)
class JobPolicy:
    """The parts of a job spec the supervisor needs besides the run config (plain values)."""

    min_dp: int
    max_dp: int
    max_restarts: int
    heartbeat_timeout_s: float
    backoff_base_s: float
    backoff_max_s: float
    elastic_check_interval_s: float
    stragglers: StragglerConfig
    straggler_action: str  # report | evict
    resources_per_rank: dict[str, float]
    placement_strategy: str = "PACK"
    in_place: bool = True  # fault_tolerance.in_place: repair a single lost rank in place
    restarts_used: int = 0  # carried over when a supervisor is recreated after a control-plane loss
    #: The job's last attempt number when this supervisor was created (0 for its first): a supervisor
    #: recreated after a loss reports attempts base+1, base+2, ... so the job's attempts only grow and its
    #: step rows replace the rows of the steps it recomputes (service/store/job_store.py keeps the higher attempt).
    attempt_base: int = 0
    start_timeout_s: float = 300.0
    checkpoint_timeout_s: float = 120.0
    capacity_wait_timeout_s: float = 900.0
    export: bool = False  # checkpoint.export == "hf": write <checkpoint root>/hf-export before SUCCEEDED
    export_timeout_s: float = 3600.0
    #: The service's checkpoint signing key (service/access/checkpoint_key.py): manifests are signed with it at
    #: commit and verified with it before any rank loads one. Only the manager sets it; never printed.
    checkpoint_key: bytes | None = field(default=None, repr=False)


class JobSupervisor:
    """Keeps one job alive. Wrapped with ``ray.remote`` by :func:`start_supervisor`."""

    def __init__(self, *, job_id: str, config: RunConfig, policy: JobPolicy):
        self.job_id = job_id
        self.config = config
        self.policy = policy
        self.sm_config = sm.SupervisorConfig(
            total_steps=config.training.steps,
            global_batch=config.training.global_batch,
            micro_batch=config.training.micro_batch,
            min_dp=policy.min_dp,
            max_dp=policy.max_dp,
            tp=config.parallel.tp,
            pp=config.parallel.pp,
            dp_multiple=config.parallel.dp_replicate,
            max_restarts=policy.max_restarts,
            heartbeat_timeout_s=policy.heartbeat_timeout_s,
            start_timeout_s=max(policy.start_timeout_s, policy.heartbeat_timeout_s),
            checkpoint_timeout_s=policy.checkpoint_timeout_s,
            capacity_wait_timeout_s=policy.capacity_wait_timeout_s,
            backoff_base_s=policy.backoff_base_s,
            backoff_max_s=policy.backoff_max_s,
            in_place=policy.in_place,
            export=policy.export,
            export_timeout_s=policy.export_timeout_s,
            job_id=job_id,
        )
        if policy.checkpoint_key is None:  # fail closed: an unsigned commit or an unverified load is never right
            raise ValueError(f"job {job_id}: the supervisor needs the service's checkpoint key (JobPolicy.checkpoint_key)")
        self._key = policy.checkpoint_key
        #: A resolved local folder or an ``s3://`` URL (workers/storage.py): manifests, verification, pruning,
        #: fallback and the corruption drill work the same on both.
        self.root: str = config.checkpoint.path
        storage.makedirs(self.root)
        # Signatures are checked now (the launch re-verifies fully): a forged newest step is never the
        # step this job believes it has, and is moved aside below.
        found = resolve_latest(self.root, checksums=False, key=self._key)
        resume_step = found.step
        self._verified_digests: dict[int, str] = {}  # step -> digest of the manifest the launch verified
        self.state = sm.initial_state(
            self.sm_config, dp=config.parallel.dp, last_committed_step=resume_step, restarts_used=policy.restarts_used
        )
        self._inbox: queue.Queue = queue.Queue()
        self._log: list[dict[str, Any]] = []
        self._log_lock = threading.Lock()
        # Held while a decision is applied (its new state and its actions, recorded events included), so
        # ``updates`` never shows a state without the events that came with it: a CANCELLED status read
        # before its "cancelled" event is recorded would end the job (and its supervisor) without it.
        self._decide_lock = threading.RLock()
        self._steps: list[dict[str, Any]] = []
        self._step_seq = 0
        self._group: WorkerGroup | None = None
        self._ready: dict[int, dict[int, str | None]] = {}  # attempt -> ready rank -> where its state came from
        self._reports: dict[int, dict[int, Any]] = {}  # step -> rank -> ShardReport
        self._step_calls = 0  # report_steps calls taken in (one per batch from rank 0, not per rank per step)
        self._stragglers = StragglerDetector(policy.stragglers, stages=_stages(config.parallel))
        self._straggler_findings: list[dict[str, Any]] = []
        self._chaos: dict[int, ChaosOrder] = {}
        self._chaos_corrupt: dict[int, int] = {}  # order id -> step to corrupt once committed
        self._chaos_ids = 0
        self._latest: dict[str, Any] = {}
        self._last_capacity: int | None = None
        self._next_capacity_check = 0.0
        # Nodes of ranks lost as process faults (restart charged at once), watched until the cluster
        # declares them dead (refund) or UNCONFIRMED_WATCH_S pass: node -> (attempt, watch until).
        self._unconfirmed: dict[str, tuple[int, float]] = {}
        self._next_node_check = 0.0
        self._closed = threading.Event()
        self._pruner: threading.Thread | None = None
        self._prune_lock = threading.Lock()
        self._prune_wanted = False  # a commit since the running prune started: it prunes once more
        self._export_ref: Any = None  # the export task in flight (cancelled if the job ends otherwise)
        self._metrics = _JobMetrics(job_id)
        self._self_handle = ray.get_runtime_context().current_actor
        for skipped in found.skipped:
            if skipped.refused:
                self._refuse(skipped.step, skipped.step_dir, skipped.reason)
        if resume_step is not None:
            self._record("resuming", f"found committed checkpoint at step {resume_step} in {self.root}")
        self._inbox.put(sm.Start())
        self._thread = threading.Thread(target=self._loop, name=f"supervisor-{job_id}", daemon=True)
        self._thread.start()

    # --- reports from ranks (any thread) ---------------------------------------------------------

    def report_ready(self, attempt: int, rank: int, node_info: dict) -> None:
        """A rank of ``attempt`` is set up and restored; ``node_info["state_source"]`` says from where."""
        self._inbox.put(("ready", attempt, rank, node_info.get("state_source")))

    def report_steps(self, attempt: int, records: list[dict]) -> None:
        """Rank 0's batch of completed steps (``workers/report_batch.py``), each its ``StepMetrics`` plus
        every rank's timings under ``ranks`` (from the step-boundary exchange): the only per-step call a
        job makes, so one actor keeps up with any number of ranks. It is also the job's heartbeat."""
        self._inbox.put(("steps", attempt, records))

    def report_stats(self) -> dict[str, int]:
        """How many step-report calls this supervisor took in, the step rows they gave (one per step of a
        live attempt) and the last step (tests, operators: one actor per job must keep up with every rank)."""
        return {"step_report_calls": self._step_calls, "step_records": self._step_seq,
                "step": int(self._latest.get("step") or 0)}

    def report_checkpoint(self, attempt: int, rank: int, completed_steps: int, report: Any) -> None:
        self._inbox.put(("checkpoint", attempt, rank, completed_steps, report))

    def report_chaos(self, attempt: int, rank: int, order_id: int, step: int | None) -> None:
        self._inbox.put(("chaos_fired", attempt, rank, order_id, step))

    # --- requests from the control plane ---------------------------------------------------------

    def cancel(self, reason: str = "cancelled by user") -> None:
        self._inbox.put(sm.Cancel(reason=reason))

    def scale(self, dp: int) -> None:
        self._inbox.put(sm.ScaleRequested(dp=dp))

    def chaos(self, request: dict) -> dict:
        """Arm or fire a fault drill; returns the order as recorded."""
        self._chaos_ids += 1
        order_id = self._chaos_ids
        action = request["action"]
        if action == "corrupt_checkpoint":
            self._inbox.put(("chaos_corrupt", order_id, int(request["step"])))
            return {"id": order_id, "action": action, "step": request["step"], "armed": True}
        during = request.get("during") or "step"
        order = ChaosOrder(
            id=order_id,
            action=action,
            rank=int(request["rank"]),
            factor=float(request.get("factor") or 1.0),
            # A kill inside a save is always armed (never fired on delivery, carried into the next
            # attempt until it fires): with no at_step it lands in the first save.
            at_step=request.get("at_step") if during == "step" else int(request.get("at_step") or 0),
            during=during,
        )
        self._inbox.put(("chaos", order))
        return dataclasses.asdict(order) | {"armed": True}

    def updates(self, since_seq: int = 0, since_step_seq: int = 0) -> dict[str, Any]:
        """Everything new since the caller's cursors (event seq, step-row seq), plus the job's fields.

        Step rows have their own sequence because a restarted attempt re-reports step numbers.

        Once the job has ended, the prune after its last commit is given up to :data:`END_PRUNE_WAIT_S`
        to finish first (off the locks): the caller releases (kills) a finished supervisor, which would
        stop a prune half-way (slow on an object store, where it hashes what it keeps) and leave more
        than ``keep_last`` checkpoints behind.
        """
        if self.state.status.is_terminal:  # read first: the last prune starts before the state turns terminal
            pruner = self._pruner
            if pruner is not None:
                pruner.join(timeout=END_PRUNE_WAIT_S)
        with self._decide_lock, self._log_lock:
            events = [event for event in self._log if event["seq"] > since_seq]
            steps = [row for row in self._steps if row["seq"] > since_step_seq]
            state = self.state
        # Attempts as the job counts them (JobPolicy.attempt_base). No goodput here: the control plane
        # computes it from the stored rows (service/decisions/goodput.py), across supervisors.
        base = self.policy.attempt_base
        if base:
            steps = [row | {"attempt": row["attempt"] + base} for row in steps]
        return {
            "status": state.status.value,
            "attempt": state.attempt + base,
            "dp": state.dp,
            "world_size": self.sm_config.world_size(state.dp),
            "layout": dataclasses.replace(self.config.parallel, dp=state.dp).describe(),
            "restarts": state.restarts_used,
            "last_checkpoint_step": state.last_committed_step,
            "error": state.error,
            "step": self._latest.get("step", state.step),
            "loss": self._latest.get("loss"),
            "tokens_per_s": self._latest.get("tokens_per_s"),
            "stragglers": list(self._straggler_findings),
            "artifacts": {"hf": state.hf_export} if state.hf_export else {},
            "events": events,
            "steps": steps,
        }

    def shutdown(self) -> None:
        """Stop the control loop and any group; the manager calls this after persisting the end."""
        self._inbox.put(sm.Cancel(reason="supervisor shut down"))
        self._closed.set()
        if self._group is not None:
            self._group.stop()
        ray.actor.exit_actor()

    # --- control loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                self._turn()
            except Exception:  # a bug here must not silently kill the job: fail it loudly
                log.exception("supervisor loop error")
                self._apply(sm.Abort(error=f"supervisor internal error: {traceback.format_exc(limit=5)}"), time.time())

    def _turn(self) -> None:
        try:
            item = self._inbox.get(timeout=TICK_S)
        except queue.Empty:
            item = None
        now = time.time()
        if item is not None:
            self._handle(item, now)
        self._drain(now)
        group = self._group
        if group is not None and group.attempt == self.state.attempt:
            outcome = group.poll(now, restarts_left=self.state.restarts_used < self.sm_config.max_restarts)
            if outcome is not None:
                # Ranks have their reports acknowledged before run() returns: take them in first,
                # so a final checkpoint is committed before the group's end is acted on.
                self._drain(time.time())
                charged = self.state.restarts_used
                self._apply(self._outcome_event(group, outcome), now)
                if outcome.kind == "worker_lost" and outcome.node and self.state.restarts_used > charged:
                    self._unconfirmed[outcome.node] = (group.attempt, now + UNCONFIRMED_WATCH_S)
        if self._unconfirmed and now >= self._next_node_check:
            self._confirm_node_losses(now)
        if now >= self._next_capacity_check and not self.state.status.terminal:
            self._check_capacity(force=False)
        self._apply(sm.Tick(), time.time())

    def _drain(self, now: float) -> None:
        """Handle everything already in the inbox."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(item, time.time())

    def _handle(self, item: Any, now: float) -> None:
        if not isinstance(item, tuple):
            self._apply(item, now)
            return
        kind = item[0]
        if kind == "ready":
            _, attempt, rank, source = item
            if attempt != self.state.attempt:
                return
            ranks = self._ready.setdefault(attempt, {})
            ranks[rank] = source
            if len(ranks) == self.sm_config.world_size(self.state.dp):
                nodes = self._group.nodes if self._group is not None else {}
                warm = self._group.warm_ranks if self._group is not None else 0
                self._record("placed", " ".join(f"rank{r}={nodes.get(r, '?')}" for r in sorted(ranks))
                             + f"; {warm} of {len(ranks)} ranks from warm spares")
                self._record_state_sources(attempt, ranks)
                self._deliver_armed_chaos()
                self._apply(sm.GroupReady(attempt=attempt, world_size=len(ranks)), now)
        elif kind == "steps":
            _, attempt, records = item
            self._step_calls += 1
            if attempt == self.state.attempt and records:
                for record in records:
                    self._on_step(attempt, record, now=now)
                last = records[-1]  # the gauges and the job's fields show the batch's newest step
                self._latest = {"step": int(last["step"]) + 1, "loss": last.get("loss"),
                                "tokens_per_s": last.get("tokens_per_s")}
                self._metrics.step(self._latest["step"], last, self.state.restarts_used)
        elif kind == "checkpoint":
            _, attempt, rank, completed, report = item
            if attempt == self.state.attempt:
                self._reports.setdefault(completed, {})[rank] = report
                self._apply(sm.CheckpointReported(attempt=attempt, step=completed, rank=rank), now)
        elif kind == "chaos":
            self._arm_chaos(item[1])
        elif kind == "chaos_fired":
            _, attempt, rank, order_id, step = item
            order = self._chaos.pop(order_id, None)
            if order is not None:
                self._record("chaos_fired", f"{order.action} on rank {rank} at step {step}"
                             + (f" during {order.during}" if order.during != "step" else "") + f" (order {order_id})")
        elif kind == "chaos_corrupt":
            _, order_id, step = item
            self._chaos_corrupt[order_id] = step
            self._record("chaos_armed", f"corrupt_checkpoint step {step} (order {order_id})")
            self._corrupt_due()
        else:
            raise AssertionError(f"unknown inbox item {kind!r}")

    def _apply(self, event: sm.Event, now: float) -> None:
        with self._decide_lock:
            decision = sm.decide(self.state, event, now, self.sm_config)
            self.state = decision.state
            answers = [answer for action in decision.actions if (answer := self._carry_out(action, now)) is not None]
            # A commit's outcome is decided on before any other event (the inbox waits), so nothing acts
            # on a checkpoint whose manifest was not written ([3] in service/decisions/supervisor.py).
            for answer in answers:
                self._apply(answer, time.time())
                if isinstance(answer, sm.CommitSucceeded):
                    self._corrupt_due()

    # --- actions ---------------------------------------------------------------------------------

    def _carry_out(self, action: sm.Action, now: float) -> sm.Event | None:
        """Do one action; the event it answers with at once (a commit's outcome), else None."""
        if isinstance(action, sm.RecordEvent):
            self._record(action.kind, action.detail)
        elif isinstance(action, sm.LaunchGroup):
            self._launch(action)
        elif isinstance(action, sm.RepairGroup):
            self._repair(action)
        elif isinstance(action, sm.StopGroup):
            self._stop(action)
        elif isinstance(action, sm.CommitCheckpoint):
            return self._commit(action.step)
        elif isinstance(action, sm.RequestCheckpoint):
            if self._group is not None:
                # Rank 0 decides at a step boundary, for every rank, to save the first step past the one
                # the supervisor knows (workers/step_control.py): all ranks save the same step.
                self._group.call(0, "request_checkpoint", self.state.step + 1)
        elif isinstance(action, sm.ExcludeNode):
            self._check_capacity(force=True)
        elif isinstance(action, sm.ScheduleWake):
            pass  # the loop ticks every TICK_S anyway
        elif isinstance(action, sm.ExportCheckpoint):
            self._export(action.step)
        elif isinstance(action, sm.MarkTerminal):  # its RecordEvent comes in the same action list
            if action.status is not sm.Status.SUCCEEDED and self._export_ref is not None:
                _cancel_quietly(self._export_ref)  # cancelled, or failed by the export timeout
            self._export_ref = None
            self._metrics.finish(action.status.value)
        else:
            raise AssertionError(f"unhandled action {action!r}")
        return None

    def _launch(self, action: sm.LaunchGroup) -> None:
        config = self.config.with_dp(action.dp)
        resume_step = self._verified_resume_step(action.resume_step)
        if resume_step != action.resume_step:
            self._inbox.put(sm.CheckpointFallback(attempt=action.attempt, step=resume_step,
                                                  reason="newer checkpoint failed verification"))
        plan = self._attempt_plan(action.attempt, config, resume_step)
        group = WorkerGroup(
            job_id=self.job_id,
            plan=plan,
            world_size=action.world_size,
            resources_per_rank=self.policy.resources_per_rank,
            strategy=self.policy.placement_strategy,
            excluded_nodes=action.excluded_nodes,
            supervisor=self._self_handle,
        )
        self._group = group
        self._record(
            "launching",
            f"attempt {action.attempt}: {action.world_size} ranks, layout {config.parallel.describe()}, "
            + (f"resuming from step {resume_step}" if resume_step else "fresh start"),
        )

        def start() -> None:
            try:
                group.start()
            except PlacementTimeout as err:
                self._inbox.put(sm.WorkerLost(attempt=group.attempt, rank=-1, node="", cause="node", detail=str(err)))
                self._next_capacity_check = 0.0
            except Exception as err:  # actor creation / rendezvous failure: infrastructure
                self._inbox.put(sm.WorkerLost(attempt=group.attempt, rank=-1, node="", cause="process",
                                              detail=f"group start failed: {err}"))

        threading.Thread(target=start, name=f"launch-{self.job_id}-{action.attempt}", daemon=True).start()

    def _repair(self, action: sm.RepairGroup) -> None:
        """Carry out an in-place repair ([9] in service/decisions/supervisor.py) on the launch thread's terms:
        any failure becomes RepairFailed, and the state machine relaunches every rank instead."""
        group = self._group
        step = action.resume_step
        # The step's digest is known since this supervisor committed it: ranks that must read the checkpoint
        # check that very manifest and hash every file themselves (no full pass here: memory usually serves).
        plan = self._attempt_plan(action.attempt, self.config.with_dp(self.state.dp), step, state_from_memory=True)
        self._record("repairing", f"attempt {action.attempt}: rank {action.lost_rank} replaced in place, the other "
                                  f"{action.world_size - 1} ranks kept, resuming from step {step}")
        if group is None or group.world_size != action.world_size:
            self._inbox.put(sm.RepairFailed(attempt=action.attempt, reason="no running group to repair"))
            return

        def repair() -> None:
            try:
                group.repair(action.lost_rank, plan)
            except Exception as err:
                self._inbox.put(sm.RepairFailed(attempt=action.attempt, reason=f"{type(err).__name__}: {err}"))

        threading.Thread(target=repair, name=f"repair-{self.job_id}-{action.attempt}", daemon=True).start()

    def _attempt_plan(self, attempt: int, config: RunConfig, resume_step: int | None, *,
                      state_from_memory: bool = False) -> LaunchPlan:
        """The plan of a new attempt (a launch or an in-place repair), with a fresh straggler detector
        judging ranks within their pipeline stage of its layout."""
        self._stragglers = StragglerDetector(self.policy.stragglers, stages=_stages(config.parallel))
        return LaunchPlan(
            attempt=attempt,
            config=config,
            start_step=resume_step or 0,
            resume_dir=step_dir(self.root, resume_step) if resume_step else None,
            resume_digest=self._verified_digests.get(resume_step) if resume_step else None,
            chaos=tuple(order for order in self._chaos.values() if order.at_step is not None),
            state_from_memory=state_from_memory,
            keep_snapshots=self.policy.in_place,  # only an in-place repair ever reads them
        )

    def _record_state_sources(self, attempt: int, sources: dict[int, str | None]) -> None:
        """One event saying where every rank's restored state came from (a resume only)."""
        by_source: dict[str, list[int]] = {}
        for rank, source in sorted(sources.items()):
            if source:
                by_source.setdefault(source, []).append(rank)
        if not by_source:
            return
        self._record("state_restored", f"attempt {attempt}, step {self.state.step}: " + "; ".join(
            f"ranks {','.join(map(str, ranks))} from {source}" for source, ranks in by_source.items()))

    def _verified_resume_step(self, wanted: int | None) -> int | None:
        """The newest checkpoint at or below ``wanted`` whose signature, manifest and checksums verify.

        The state machine remembers what was committed; a file can rot (or be corrupted by a drill,
        or a manifest be forged) afterwards, so every launch verifies and falls back to the previous
        good step. This is the one full verification of a restore: the ranks then check that the
        manifest is the one verified here (its digest travels in the launch plan), the sizes, and
        the hash of DCP's ``.metadata`` before unpickling it. A manifest whose signature does not
        verify is refused (``checkpoint_refused``) and moved aside, never loaded.
        """
        if wanted is None:
            return None
        for step, directory in reversed(list_steps(self.root)):
            if step > wanted:
                continue
            try:
                manifest = verify(directory, key=self._key)
            except ManifestSignatureError as err:
                self._refuse(step, directory, str(err))
            except CheckpointError as err:
                self._record("checkpoint_skipped", f"step {step}: {err}")
            else:
                self._verified_digests[step] = manifest.digest
                return step
        self._record("checkpoint_skipped", f"no verifying checkpoint under {self.root}; starting fresh")
        return None

    def _refuse(self, step: int, directory: str, reason: str) -> None:
        """A step directory whose manifest is unsigned or forged: an event, and the directory moved
        aside (``<dir>.refused-<time>``, kept for inspection) so nothing ever considers it again and
        the job can save that step afresh. It stays inside this job's own checkpoint directory."""
        aside = f"{directory}.refused-{int(time.time())}"
        try:
            storage.replace(directory, aside)
            where = f"moved to {storage.basename(aside)}"
        except OSError as err:
            where = f"could not be moved aside ({err})"
        self._record("checkpoint_refused", f"step {step}: {reason}; not loaded, {where}")

    def _stop(self, action: sm.StopGroup) -> None:
        group = self._group
        attempt = action.attempt

        def stop() -> None:
            if group is not None:
                group.stop()
            self._inbox.put(sm.GroupStopped(attempt=attempt))

        threading.Thread(target=stop, name=f"stop-{self.job_id}-{attempt}", daemon=True).start()

    def _commit(self, step: int) -> sm.CommitSucceeded | sm.CommitFailed:
        """Write the manifest of ``step`` (atomically, last); the outcome is the state machine's next
        event: only CommitSucceeded makes the step a checkpoint anything resumes from."""
        reports = self._reports.pop(step, {})
        directory = step_dir(self.root, step)
        try:
            manifest = commit(
                directory,
                step=step,
                layout=dataclasses.replace(self.config.parallel, dp=self.state.dp).describe(),
                world_size=self.sm_config.world_size(self.state.dp),
                reports=list(reports.values()),
                key=self._key,
                job_id=self.job_id,
            )
        except Exception as err:  # the step does not count; restore uses the previous one
            return sm.CommitFailed(step=step, error=f"{type(err).__name__}: {err}")
        self._verified_digests[step] = manifest.digest  # written and signed here: its digest is known
        for stale in [s for s in self._reports if s < step]:
            self._reports.pop(stale)
        self._prune_in_background()
        return sm.CommitSucceeded(step=step)

    def _export(self, step: int) -> None:
        """Write committed ``step`` as a Hugging Face folder in a Ray task; answer with Exported/ExportFailed.

        The task runs off the control thread (and off this process: torch is imported only there);
        its timeout is the policy's, and the state machine keeps its own as a backstop.
        """
        directory = step_dir(self.root, step)
        out = (storage.join(self.root, HF_EXPORT_DIR) if storage.is_url(self.root)
               else str((Path(self.root) / HF_EXPORT_DIR).resolve()))
        model = self.config.model
        try:
            ref = submit_export(step_dir=directory, out_dir=out, model=model, source_dir=model.hf_path,
                                replace_existing=True)
        except Exception as err:
            self._inbox.put(sm.ExportFailed(step=step, checkpoint_dir=directory,
                                            error=f"could not start the export task: {err}"))
            return
        self._export_ref = ref

        def wait() -> None:
            try:
                path = wait_export(ref, timeout_s=self.policy.export_timeout_s)
            except Exception as err:  # EtrainError from the task, a timeout, a lost worker
                self._inbox.put(sm.ExportFailed(step=step, checkpoint_dir=directory, error=str(err)))
            else:
                self._inbox.put(sm.Exported(step=step, path=path))

        threading.Thread(target=wait, name=f"export-{self.job_id}-{step}", daemon=True).start()

    def _prune_in_background(self) -> None:
        """Drop checkpoints beyond ``keep_last`` off the control thread.

        Pruning hashes the checkpoints it keeps (so a rotten newest step never causes the good one
        before it to be deleted); on large checkpoints that takes long enough to stall heartbeat
        handling if done here. One prune at a time; a commit during one makes it prune once more when
        it is done (otherwise the last commit of a job, landing while the previous prune still hashes,
        e.g. on an object store, would never be pruned).
        """
        with self._prune_lock:
            self._prune_wanted = True
            if self._pruner is not None:
                return

            def prune_now() -> None:
                while True:
                    with self._prune_lock:
                        if not self._prune_wanted:
                            self._pruner = None
                            return
                        self._prune_wanted = False
                    try:
                        # Only step directories whose signed manifests name this job are ever deleted.
                        prune(self.root, keep_last=self.config.checkpoint.keep_last, key=self._key, owner=self.job_id)
                    except Exception as err:  # never fatal: old checkpoints just stay on disk a while longer
                        log.warning("pruning %s failed: %s", self.root, err)

            self._pruner = threading.Thread(target=prune_now, name=f"prune-{self.job_id}", daemon=True)
            self._pruner.start()

    # --- reports -> events -----------------------------------------------------------------------

    def _on_step(self, attempt: int, metrics: dict, *, now: float) -> None:
        """One completed step as rank 0 reported it: its metrics, and every rank's timings in ``ranks``.

        Rank 0 reports a step only after every rank took part in that step's boundary exchange, so the
        step is every rank's heartbeat: StepReported is the progress.
        """
        completed = int(metrics["step"]) + 1
        # Only timing-sync steps separate a rank's compute from waiting on a slow peer (between
        # them a fast rank's compute_s includes that wait); every rank agrees which steps they are.
        compute_s = (metrics.get("ranks") or {}).get("compute_s") or []
        if metrics.get("timing_synced", True) and len(compute_s) == self.sm_config.world_size(self.state.dp):
            compute_by_rank = {r: float(seconds or 0.0) for r, seconds in enumerate(compute_s)}
            self._observe_stragglers(completed, compute_by_rank, now)
        row = {key: metrics.get(key) for key in ("loss", "lr", "grad_norm", "step_s", "compute_s", "comm_wait_s",
                                                  "tokens_per_s", "flops_per_s", "mfu", "peak_mem_bytes")}
        row.update(step=completed, attempt=attempt, ts=now)
        with self._log_lock:
            self._step_seq += 1
            row["seq"] = self._step_seq
            self._steps.append(row)
            if len(self._steps) > MAX_STEP_HISTORY:
                del self._steps[: len(self._steps) - MAX_STEP_HISTORY]
        self._apply(sm.StepReported(attempt=attempt, step=completed, loss=float(metrics["loss"]), rank=0), now)

    def _observe_stragglers(self, step: int, compute: dict[int, float], now: float) -> None:
        if not self.policy.stragglers.enabled:
            return
        for finding in self._stragglers.observe(step, compute):
            node = self._group.node_of(finding.rank) if self._group else ""
            record = dataclasses.asdict(finding) | {"node": node}
            self._straggler_findings.append(record)
            self._metrics.straggler(finding.rank, finding.factor)
            self._apply(
                sm.StragglerFlagged(
                    attempt=self.state.attempt,
                    rank=finding.rank,
                    node=node,
                    factor=finding.factor,
                    evict=self.policy.straggler_action == "evict",
                    evidence=finding.evidence,
                ),
                now,
            )

    def _outcome_event(self, group: WorkerGroup, outcome: GroupOutcome) -> sm.Event:
        if outcome.kind == "finished":
            digests = {rank: result.get("param_digest") for rank, result in sorted(group.results().items())}
            self._record("ranks_finished", "param digests " + " ".join(f"rank{r}={d}" for r, d in digests.items()))
            return sm.Finished(attempt=group.attempt, final_step=outcome.final_step)
        if outcome.kind == "job_error":
            return sm.JobError(attempt=group.attempt, rank=outcome.rank, message=outcome.message,
                               traceback=outcome.traceback)
        if outcome.cause == "node":
            self._next_capacity_check = 0.0
        return sm.WorkerLost(attempt=group.attempt, rank=outcome.rank, node=outcome.node, cause=outcome.cause,
                             detail=outcome.message)

    def _confirm_node_losses(self, now: float) -> None:
        """Correct an immediate process-fault verdict once the cluster declares the rank's node dead."""
        self._next_node_check = now + NODE_CHECK_INTERVAL_S
        try:
            alive = {node["NodeID"]: bool(node.get("Alive")) for node in ray.nodes()}
        except Exception as err:  # the GCS may be briefly unreachable after a node loss
            log.warning("node table unavailable: %s", err)
            return
        for node, (attempt, until) in list(self._unconfirmed.items()):
            if not alive.get(node, False):
                del self._unconfirmed[node]
                self._next_capacity_check = 0.0
                try:
                    available = self._available_dp()
                except Exception:
                    available = self.state.available_dp if self.state.available_dp is not None else 0
                self._apply(sm.NodeLossConfirmed(node=node, failed_attempt=attempt, available_dp=available), now)
            elif now > until:
                del self._unconfirmed[node]  # the node lives: it was the process after all

    # --- capacity --------------------------------------------------------------------------------

    def _check_capacity(self, *, force: bool) -> None:
        self._next_capacity_check = time.time() + self.policy.elastic_check_interval_s
        try:
            available = self._available_dp()
        except Exception as err:  # the GCS may be briefly unreachable after a node loss
            log.warning("capacity check failed: %s", err)
            return
        if force or available != self._last_capacity or self.state.awaiting_capacity:
            self._last_capacity = available
            self._apply(sm.CapacityChanged(available_dp=available), time.time())

    def _available_dp(self) -> int:
        """Replicas this job could run now: free resources per live node plus what the job holds there."""
        from ray._private.state import available_resources_per_node

        free_per_node = available_resources_per_node()
        held = self._group.bundles_per_node() if self._group is not None else {}
        slots: dict[str, int] = {}
        for node in ray.nodes():
            node_id = node["NodeID"]
            if not node.get("Alive") or node_id in self.state.excluded_nodes:
                continue
            free = dict(free_per_node.get(node_id, {}))
            for name, amount in self.policy.resources_per_rank.items():
                free[name] = free.get(name, 0.0) + amount * held.get(node_id, 0)
            slots[node_id] = rank_slots(free=free, per_rank=self.policy.resources_per_rank)
        return replicas_that_fit(slots, tp=self.config.parallel.tp, pp=self.config.parallel.pp)

    # --- chaos -----------------------------------------------------------------------------------

    def _arm_chaos(self, order: ChaosOrder) -> None:
        world = self.sm_config.world_size(self.state.dp)
        if not 0 <= order.rank < world:
            self._record("chaos_rejected", f"rank {order.rank} is outside the world of {world} ranks")
            return
        group_up = self._group is not None and self.state.group == sm.GroupPhase.UP
        if order.at_step is None and group_up:
            self._send_chaos(order)
            return
        self._chaos[order.id] = order
        self._record("chaos_armed", f"{order.action} on rank {order.rank}"
                     + (f" at step {order.at_step}" if order.at_step is not None else " when the group is up")
                     + (f" during {order.during}" if order.during != "step" else ""))
        if group_up:
            self._send_chaos(order)

    def _deliver_armed_chaos(self) -> None:
        """Hand armed drills to a group that just came up (orders that arrived while it launched).

        Ranks key orders by id, so one already in the launch plan is not fired twice.
        """
        if self._group is None:
            return
        for order in list(self._chaos.values()):
            self._send_chaos(order)

    def _send_chaos(self, order: ChaosOrder) -> None:
        """Give an order to its rank. An immediate actor kill is done from here: a rank cannot
        ``ray.kill`` itself mid-call as cleanly as its owner can."""
        if order.action == "kill_actor" and order.at_step is None:
            self._chaos.pop(order.id, None)
            self._record("chaos_fired", f"kill_actor on rank {order.rank} (order {order.id})")
            self._group.kill_actor(order.rank)
        else:
            self._group.chaos(order)

    def _corrupt_due(self) -> None:
        committed = self.state.last_committed_step
        for order_id, step in list(self._chaos_corrupt.items()):
            directory = step_dir(self.root, step)
            if committed is None or step > committed or not storage.exists(storage.join(directory, "manifest.json")):
                continue
            del self._chaos_corrupt[order_id]
            victim = _largest_shard(directory)
            if victim is None:
                self._record("chaos_rejected", f"corrupt_checkpoint: no shard files in {directory}")
                continue
            _flip_bytes(victim)
            self._record("chaos_fired", f"corrupt_checkpoint flipped bytes in {storage.basename(victim)} of step {step}")

    # --- bookkeeping -----------------------------------------------------------------------------

    def _record(self, kind: str, detail: str) -> None:
        with self._log_lock:
            seq = len(self._log) + 1
            self._log.append({"seq": seq, "ts": time.time(), "kind": kind, "detail": detail})
        log.info("job %s: %s: %s", self.job_id, kind, detail)


class _JobMetrics:
    """Prometheus gauges exported through Ray's metrics agent (visible in the Ray dashboard).

    Goodput is not here: it spans supervisor restarts, so the control plane computes it from its store
    and exports ``etrain_goodput`` on its own ``/metrics`` (service/prometheus.py).
    """

    def __init__(self, job_id: str):
        from ray.util.metrics import Gauge

        self._tags = {"job_id": job_id}
        keys = ("job_id",)
        self._step = Gauge("etrain_job_step", "optimizer steps completed", tag_keys=keys)
        self._loss = Gauge("etrain_job_loss", "training loss of the last step", tag_keys=keys)
        self._tokens = Gauge("etrain_tokens_per_second", "training throughput", tag_keys=keys)
        self._restarts = Gauge("etrain_restarts_total", "restarts spent from the budget", tag_keys=keys)
        self._straggler = Gauge("etrain_straggler_factor", "slow rank's compute / peers' median",
                                tag_keys=("job_id", "rank"))
        self._done = Gauge("etrain_job_finished", "1 once the job reached a terminal status", tag_keys=("job_id", "status"))

    def step(self, step: int, metrics: dict, restarts: int) -> None:
        self._step.set(step, tags=self._tags)
        if metrics.get("loss") is not None:
            self._loss.set(float(metrics["loss"]), tags=self._tags)
        if metrics.get("tokens_per_s") is not None:
            self._tokens.set(float(metrics["tokens_per_s"]), tags=self._tags)
        self._restarts.set(restarts, tags=self._tags)

    def straggler(self, rank: int, factor: float) -> None:
        self._straggler.set(factor, tags=self._tags | {"rank": str(rank)})

    def finish(self, status: str) -> None:
        self._done.set(1, tags=self._tags | {"status": status})


# --- Hugging Face export -------------------------------------------------------------------------


class ExportFailedError(EtrainError):
    """An export task failed or timed out; the checkpoint it read from is untouched."""


def _export_folder(step_dir: str, out_dir: str, model: ModelConfig, source_dir: str | None,
                   replace_existing: bool) -> str:
    """The body of the export task: runs in a Ray worker process, the only place torch is imported.

    ``replace_existing``: the job's own ``hf-export`` folder may be left by an earlier supervisor of the
    same job (recreated after a control-plane loss); it is that job's output, so it is replaced.
    A user's ``--out`` folder is never replaced (``export_hf`` refuses a non-empty one).
    """
    import shutil

    from etrain.workers.hf_io import export_hf

    if replace_existing and storage.is_url(out_dir):
        storage.rmtree(out_dir)
    elif replace_existing and os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    return export_hf(step_dir, out_dir, model, source_dir=source_dir)


_export_task = ray.remote(num_cpus=EXPORT_NUM_CPUS, max_retries=0)(_export_folder)


def submit_export(*, step_dir: str, out_dir: str, model: ModelConfig, source_dir: str | None,
                  replace_existing: bool = False):
    """Start the export task (any node: checkpoints live on shared storage); returns its ObjectRef."""
    return _export_task.options(name=f"etrain-export:{storage.basename(out_dir)}").remote(
        step_dir, out_dir, model, source_dir, replace_existing
    )


def wait_export(ref: Any, *, timeout_s: float) -> str:
    """The exported folder's absolute path, or the task's own :class:`EtrainError` (field + fix intact),
    or :class:`ExportFailedError` on a timeout (the task is cancelled) or any other failure."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        _cancel_quietly(ref)
        raise ExportFailedError(
            f"the export task did not finish within {timeout_s:g}s (it needs {EXPORT_NUM_CPUS:g} free CPU "
            "and reads the whole checkpoint)",
            fix="check that the cluster has a free CPU (ray status) and that the checkpoint storage is readable",
        ) from None
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, EtrainError):
            raise cause from None
        raise ExportFailedError(f"the export task failed: {type(cause).__name__ if cause else 'error'}: "
                                f"{cause if cause is not None else err}") from None
    except ray.exceptions.RayError as err:  # the task's worker or node died
        raise ExportFailedError(f"the export task was lost: {err}", fix="retry the export") from None


def run_export(*, step_dir: str, out_dir: str, model: ModelConfig, source_dir: str | None,
               timeout_s: float) -> str:
    """Export one committed checkpoint and wait for it (the control plane's `etrain export`)."""
    ref = submit_export(step_dir=step_dir, out_dir=out_dir, model=model, source_dir=source_dir)
    return wait_export(ref, timeout_s=timeout_s)


def _cancel_quietly(ref: Any) -> None:
    try:
        ray.cancel(ref, force=True)
    except Exception:  # already finished or gone
        pass


def _largest_shard(directory: str) -> str | None:
    if storage.is_url(directory):
        sizes = {rel: size for rel, size in storage.file_sizes(directory).items()
                 if "/" not in rel and rel.endswith(".distcp")}
        return storage.join(directory, max(sizes, key=sizes.get)) if sizes else None
    shards = [path for path in Path(directory).iterdir() if path.is_file() and path.suffix == ".distcp"]
    return str(max(shards, key=lambda path: path.stat().st_size)) if shards else None


def _flip_bytes(path: str) -> None:
    """Corrupt a file in place (chaos): invert 64 bytes in its middle, keeping its size. An object is
    rewritten whole with the same bytes flipped (an object store has no in-place writes)."""
    if storage.is_url(path):
        data = bytearray(storage.read_bytes(path))
        offset = max(0, len(data) // 2 - 32)
        data[offset:offset + 64] = bytes(b ^ 0xFF for b in data[offset:offset + 64])
        storage.write_bytes(path, bytes(data))
        return
    size = os.path.getsize(path)
    offset = max(0, size // 2 - 32)
    with open(path, "r+b") as handle:
        handle.seek(offset)
        chunk = handle.read(64)
        handle.seek(offset)
        handle.write(bytes(b ^ 0xFF for b in chunk))
        handle.flush()
        os.fsync(handle.fileno())


def start_supervisor(*, job_id: str, config: RunConfig, policy: JobPolicy):
    """Create the job's detached supervisor actor (or return the live one of that name)."""
    actor_cls = ray.remote(JobSupervisor)
    return actor_cls.options(
        name=supervisor_name(job_id),
        namespace=NAMESPACE,
        lifetime="detached",
        num_cpus=0,
        # Pinned to the head node: it lives as long as the cluster, so losing a worker node (the very
        # thing the supervisor must handle) never takes the supervisor with it.
        resources={HEAD_NODE_RESOURCE: 0.001},
        max_concurrency=64,
        max_restarts=0,
        get_if_exists=True,
    ).remote(job_id=job_id, config=config, policy=policy)


def find_supervisor(job_id: str):
    """The live supervisor of ``job_id``, or None."""
    try:
        return ray.get_actor(supervisor_name(job_id), namespace=NAMESPACE)
    except ValueError:
        return None
