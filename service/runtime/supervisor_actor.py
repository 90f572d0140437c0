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

It runs by the job's policy (``JobPolicy``, service/decisions/job_policy.py), handed over whole at its start.
The actor's parts with a job of their own live beside it: its checkpoints on storage (job_checkpoints.py:
verify, commit, prune, export), rank 0's step reports (step_reports.py), the cluster's capacity and node
verdicts (capacity_watch.py), its gauges (job_metrics.py), the export task (hf_export.py) and, only when
enabled, its drills (chaos_drills.py).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import traceback
from typing import Any

import ray

from etrain.service.decisions.admission import MEMORY, tp_groups_across_nodes
from etrain.service.decisions.hangs import find_culprit
from etrain.service.decisions.job_policy import JobPolicy
from etrain.service.decisions.job_status import Status
from etrain.service.decisions.supervisor import decide
from etrain.service.decisions.supervisor_events import (
    Abort,
    Action,
    Cancel,
    CheckpointFailed,
    CheckpointFallback,
    CheckpointReported,
    CommitCheckpoint,
    CommitSucceeded,
    DiagnoseHang,
    Event,
    ExcludeNode,
    ExportCheckpoint,
    Finished,
    GroupReady,
    GroupStopped,
    HangDiagnosed,
    JobError,
    KillRank,
    LaunchGroup,
    MarkTerminal,
    RankUnhealthy,
    RecordEvent,
    RepairFailed,
    RepairGroup,
    RequestCheckpoint,
    ResizeFailed,
    ResizeGroup,
    ScaleRequested,
    ScheduleWake,
    Start,
    StopGroup,
    Tick,
    WorkerLost,
)
from etrain.service.decisions.supervisor_state import GroupPhase, SupervisorConfig, initial_state
from etrain.service.errors import ChaosDisabled
from etrain.service.runtime.capacity_watch import CapacityWatch
from etrain.service.runtime.job_checkpoints import JobCheckpoints
from etrain.service.runtime.job_metrics import JobMetrics
from etrain.service.runtime.spares import HEAD_NODE_RESOURCE
from etrain.service.runtime.step_reports import StepReports
from etrain.service.runtime.worker_group import NAMESPACE, GroupOutcome, PlacementTimeout, WorkerGroup
from etrain.workers.protocol import compile_sharing
from etrain.workers.protocol.compile_sharing import CompileArtifacts
from etrain.workers.protocol.memory_resume import snapshots_are_read
from etrain.workers.protocol.messages import LaunchPlan
from etrain.workers.protocol.run_config import RunConfig

log = logging.getLogger(__name__)

TICK_S = 0.2
#: How long a hang's diagnosis waits for the ranks' answers (a rank that holds the GIL never answers).
HANG_ASK_TIMEOUT_S = 3.0
#: The event kinds a rank may add to the job's events (``report_note``): a rank's own decisions.
RANK_NOTES = frozenset({"checkpoint_interval", "compiled", "device_memory"})


#: Names of pre-started supervisors (``service/runtime/supervisor_spares.py``); a job's own is
#: :func:`supervisor_name`.
PRE_STARTED_PREFIX = "etrain/supervisor-spare/"
#: How long giving a job to a pre-started supervisor may take (its own start included, when still under way).
BEGIN_TIMEOUT_S = 10.0
#: How long a pre-started supervisor is given to say which job it keeps.
ASK_TIMEOUT_S = 2.0
#: job id -> the pre-started supervisor that took it, as far as this process knows (see find_supervisor).
_taken: dict[str, str] = {}
_taken_lock = threading.Lock()


def supervisor_name(job_id: str) -> str:
    return f"etrain/{job_id}/supervisor"


class JobSupervisor:
    """Keeps one job alive. Wrapped with ``ray.remote`` by :func:`start_supervisor`."""

    def __init__(self, *, job_id: str | None = None, config: RunConfig | None = None, policy: JobPolicy | None = None):
        """With a job: supervise it now. Without one: a pre-started supervisor (its interpreter, Ray and
        these modules loaded) waiting for :meth:`begin` (``service/runtime/supervisor_spares.py``)."""
        self.job_id: str | None = None
        self._begin_lock = threading.Lock()
        if job_id is not None:
            self.begin(job_id, config, policy)

    def job(self) -> str | None:
        """The job this supervisor keeps alive; None for a pre-started one not yet given a job."""
        return self.job_id

    def begin(self, job_id: str, config: RunConfig, policy: JobPolicy) -> bool:
        """Start supervising ``job_id``: True; False if this supervisor already keeps exactly that job
        (a retried call). A supervisor never changes jobs: another job id is refused."""
        with self._begin_lock:
            if self.job_id is not None:
                if self.job_id != job_id:
                    raise ValueError(f"this supervisor keeps job {self.job_id}; it cannot take job {job_id}")
                return False
            self._begin(job_id, config, policy)
            return True

    def _begin(self, job_id: str, config: RunConfig, policy: JobPolicy) -> None:
        self.job_id = job_id
        self.config = config
        self.policy = policy
        self.sm_config = SupervisorConfig.of(policy, config, job_id=job_id)
        if policy.checkpoint_key is None:  # fail closed: an unsigned commit or an unverified load is never right
            raise ValueError(
                f"job {job_id}: the supervisor needs the service's checkpoint key (JobPolicy.checkpoint_key)"
            )
        #: A resolved local folder or an ``s3://`` URL (workers/checkpoints/storage.py): manifests,
        #: verification, pruning, fallback and the corruption drill work the same on both.
        self.root: str = config.checkpoint.path
        self._log: list[dict[str, Any]] = []
        self._log_lock = threading.Lock()
        self._checkpoints = JobCheckpoints(
            job_id=job_id,
            root=self.root,
            key=policy.checkpoint_key,
            keep_last=config.checkpoint.keep_last,
            record=self._record,
            resume_owners=policy.resume_owners,
        )
        # Signatures are checked now (the launch re-verifies fully): a forged newest step is never the
        # step this job believes it has, and is moved aside.
        resume_step = self._checkpoints.latest()
        self.state = initial_state(
            self.sm_config,
            dp=config.parallel.dp,
            last_committed_step=resume_step,
            restarts_used=policy.restarts_used,
            target_dp=policy.grow_limit_dp,
        )
        self._inbox: queue.Queue = queue.Queue()
        # Held while a decision is applied (its new state and its actions, recorded events included), so
        # ``updates`` never shows a state without the events that came with it: a CANCELLED status read
        # before its "cancelled" event is recorded would end the job (and its supervisor) without it.
        self._decide_lock = threading.RLock()
        self._group: WorkerGroup | None = None
        # attempt -> ready rank -> (where its state came from, the step it resumes from)
        self._ready: dict[int, dict[int, tuple[str | None, int | None]]] = {}
        self._last_start: int | None = None  # the step the newest attempt whose ranks were all ready resumed from
        self._metrics = JobMetrics(job_id)
        self._steps = StepReports(
            stragglers=policy.stragglers,
            evict=policy.straggler_action == "evict",
            metrics=self._metrics,
            parallel=config.parallel,
            reserved_host_bytes=int(policy.resources_per_rank.get(MEMORY, 0)),
        )
        # Each pipeline stage's compiled code as its writer reported it: named in every later plan, so a rank
        # started on a new node loads it instead of compiling (workers/protocol/compile_sharing.py).
        self._compile_artifacts: tuple[CompileArtifacts, ...] = ()
        self._compile_lock = threading.Lock()
        self._drills = None  # the job's fault drills, loaded only when the policy enables them
        if policy.chaos_enabled:
            from etrain.service.runtime.chaos_drills import JobDrills

            self._drills = JobDrills(root=self.root, record=self._record)
            self._drills.arm_requests(
                policy.chaos_requests, world_size=self.sm_config.world_size(self.state.dp), committed_step=resume_step
            )  # posted before this actor existed
        self._capacity = CapacityWatch(
            per_rank=policy.resources_per_rank,
            tp=config.parallel.tp,
            pp=config.parallel.pp * config.parallel.cp,  # a replica's tp groups: one per (stage, sequence slice)
            interval_s=policy.elastic_check_interval_s,
            held=self._held_per_node,
        )
        self._closed = threading.Event()
        self._stop_threads: list[threading.Thread] = []  # group stops under way (updates() says so)
        self._self_handle = ray.get_runtime_context().current_actor
        if resume_step is not None:
            self._record("resuming", f"found committed checkpoint at step {resume_step} in {self.root}")
        self._inbox.put(Start())
        self._thread = threading.Thread(target=self._loop, name=f"supervisor-{job_id}", daemon=True)
        self._thread.start()

    # --- reports from ranks (any thread) ---------------------------------------------------------

    def report_ready(self, attempt: int, rank: int, node_info: dict) -> None:
        """A rank of ``attempt`` is set up and restored; ``node_info["state_source"]`` says from where and
        ``node_info["start_step"]`` at which step."""
        self._inbox.put(("ready", attempt, rank, node_info.get("state_source"), node_info.get("start_step")))

    def report_steps(self, attempt: int, records: list[dict]) -> None:
        """Rank 0's batch of completed steps (``workers/rank/report_batch.py``), each its ``StepMetrics`` plus
        every rank's timings under ``ranks`` (from the step-boundary exchange): the only per-step call a
        job makes, so one actor keeps up with any number of ranks. It is also the job's heartbeat."""
        self._steps.arrived(attempt, records)
        self._inbox.put(("steps", attempt, records))

    def report_stats(self) -> dict[str, int]:
        """How many step-report calls this supervisor took in, the step rows they gave (one per step of a
        live attempt) and the last step (tests, operators: one actor per job must keep up with every rank)."""
        return self._steps.stats()

    def report_checkpoint(self, attempt: int, rank: int, completed_steps: int, report: Any) -> None:
        self._inbox.put(("checkpoint", attempt, rank, completed_steps, report))

    def report_checkpoint_failed(self, attempt: int, rank: int, completed_steps: int, reason: str) -> None:
        """The ranks abandoned the save of ``completed_steps`` (a storage fault); ``reason`` says why in words."""
        self._inbox.put(CheckpointFailed(attempt=attempt, step=completed_steps, reason=str(reason)[:2000]))

    def report_note(self, attempt: int, kind: str, detail: str) -> None:
        """Something a rank decided or measured that users should see as a job event (``checkpoint_interval``,
        ``compiled``, ``device_memory``)."""
        if kind in RANK_NOTES:
            self._inbox.put(("note", attempt, kind, str(detail)[:2000]))

    def report_compile_artifacts(self, attempt: int, rank: int, report: dict) -> None:
        """A stage's first rank wrote its compiled code to the checkpoint folder: later plans name the set with
        the digest reported here, the only one a rank will load (``workers/protocol/compile_sharing.py``)."""
        try:
            record = compile_sharing.parse_report(report, stages=self.config.parallel.pp)
        except ValueError as err:
            log.warning("job %s: rank %s's compile artifacts ignored: %s", self.job_id, rank, err)
            return
        with self._compile_lock:  # stages report from their own calls; _attempt_plan reads one whole tuple
            self._compile_artifacts = compile_sharing.replace_stage(self._compile_artifacts, record)

    def report_chaos(self, attempt: int, rank: int, order_id: int, step: int | None) -> None:
        self._inbox.put(("chaos_fired", attempt, rank, order_id, step))

    # --- requests from the control plane ---------------------------------------------------------

    def cancel(self, reason: str = "cancelled by user") -> None:
        self._inbox.put(Cancel(reason=reason))

    def scale(self, dp: int) -> None:
        self._inbox.put(ScaleRequested(dp=dp))

    def chaos(self, request: dict) -> dict:
        """Arm or fire a fault drill (service/runtime/chaos_drills.py); returns the order as recorded.
        Refused for a job whose policy does not enable drills."""
        if self._drills is None:
            raise ChaosDisabled(
                f"fault drills are disabled for job {self.job_id}: its supervisor was started "
                "by a server without enable_chaos."
            )
        order, answer = self._drills.order(request)
        self._inbox.put(("chaos", order))
        return answer

    def updates(self, since_seq: int = 0, since_step_seq: int = 0) -> dict[str, Any]:
        """Everything new since the caller's cursors (event seq, step-row seq), plus the job's fields.

        Step rows have their own sequence because a restarted attempt re-reports step numbers.

        ``pruning``: whether a prune of old checkpoints is still under way. Once the job has ended, the
        caller keeps the supervisor until its last prune is done (``service/jobs/poller.py``): releasing
        (killing) it would stop the prune half-way (it hashes what it keeps: slow on an object store and on
        large checkpoints) and leave more than ``keep_last`` checkpoints behind. Answered at once: this call
        used to wait up to 5 s for that prune, which held up the poller's updates of every other job and,
        on a loaded machine, still let a prune on S3 be cut short.

        ``stopping``: whether the group's stop is still under way. The caller keeps an ended job's supervisor
        until it is done, for the same reason: a finished group hands its ranks back to the warm pool for
        the tenant's next job (``WorkerGroup.stop``), and a supervisor killed half-way takes them with it.
        """
        with self._decide_lock, self._log_lock:
            events = [event for event in self._log if event["seq"] > since_seq]
            steps = self._steps.since(since_step_seq)
            state = self.state
            latest = dict(self._steps.latest)
        # Read after the state it answers with: an ended job's last prune started before its state turned terminal.
        pruning = self._checkpoints.pruning()
        stopping = any(thread.is_alive() for thread in self._stop_threads)
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
            "step": latest.get("step", state.step),
            "loss": latest.get("loss"),
            "tokens_per_s": latest.get("tokens_per_s"),
            "mfu": latest.get("mfu"),
            "host_memory_gib": latest.get("host_memory_gib"),
            "stragglers": list(self._steps.findings),
            "artifacts": {"hf": state.hf_export} if state.hf_export else {},
            "events": events,
            "steps": steps,
            "pruning": pruning,
            "stopping": stopping,
        }

    def shutdown(self) -> None:
        """Stop the control loop and any group; the manager calls this after persisting the end."""
        self._inbox.put(Cancel(reason="supervisor shut down"))
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
                self._apply(Abort(error=f"supervisor internal error: {traceback.format_exc(limit=5)}"), time.time())

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
            outcome = group.poll(now, restarts_left=self.state.restarts_used < self.policy.max_restarts)
            if outcome is not None:
                # Ranks have their reports acknowledged before run() returns: take them in first,
                # so a final checkpoint is committed before the group's end is acted on.
                self._drain(time.time())
                charged = self.state.restarts_used
                self._apply(self._outcome_event(group, outcome), now)
                if outcome.kind == "worker_lost" and outcome.node and self.state.restarts_used > charged:
                    self._capacity.watch(outcome.node, group.attempt, now)  # a late node verdict refunds it [8]
        known = self.state.available_dp if self.state.available_dp is not None else 0
        for confirmed in self._capacity.confirmed(now, excluded=self.state.excluded_nodes, fallback_dp=known):
            self._apply(confirmed, now)
        if self._capacity.due(now) and not self.state.status.terminal:
            self._check_capacity(force=False)
        # the recent step time matters only to an in-place attempt's start timeout: not read on other ticks
        step_s = self._steps.recent_step_s() if self.state.launched_in_place else None
        self._apply(Tick(step_s=step_s), time.time())

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
            _, attempt, rank, source, start_step = item
            if attempt != self.state.attempt:
                return
            ranks = self._ready.setdefault(attempt, {})
            ranks[rank] = (source, start_step)
            if len(ranks) == self.sm_config.world_size(self.state.dp):
                nodes = self._group.nodes if self._group is not None else {}
                warm = self._group.warm_ranks if self._group is not None else 0
                reused = self._group.reused_ranks if self._group is not None else 0
                # tp groups on two nodes or more: only where pinning them gave way (service/runtime/worker_group.py)
                straddling = [
                    f"{first}-{last}"
                    for first, last in tp_groups_across_nodes(nodes, tp=self.config.parallel.tp, ranks=len(ranks))
                ]
                self._record(
                    "placed",
                    " ".join(f"rank{r}={nodes.get(r, '?')}" for r in sorted(ranks))
                    + f"; {warm} of {len(ranks)} ranks from warm spares"
                    + (f" ({reused} kept from the tenant's earlier jobs)" if reused else "")
                    + (f"; tp group(s) of ranks {', '.join(straddling)} span nodes" if straddling else ""),
                )
                starts = {start for _, start in ranks.values() if start is not None}
                start = max(starts) if starts else None  # the ranks agreed on it: one value
                if start is not None:
                    self._last_start = start
                self._record_state_sources(attempt, {r: source for r, (source, _) in ranks.items()}, start)
                if self._drills is not None and self._group is not None:
                    self._drills.deliver(self._group)  # orders that arrived while the group launched
                self._apply(GroupReady(attempt=attempt, world_size=len(ranks), start_step=start), now)
        elif kind == "steps":
            _, attempt, records = item
            if attempt == self.state.attempt and records:
                with self._decide_lock:  # ``updates`` reads the rows and the job's step of one moment
                    for record in records:  # each step is every rank's heartbeat: StepReported is the progress
                        world = self.sm_config.world_size(self.state.dp)
                        for event in self._steps.take(
                            attempt, record, world_size=world, node_of=self._node_of, now=now
                        ):
                            self._apply(event, now)
                        note = self._steps.host_memory_note(attempt, record, node_of=self._node_of)
                        if note is not None:
                            self._record("host_memory", note)
                    self._steps.show(records[-1], attempt=attempt, restarts=self.state.restarts_used)
            elif records and attempt < self.state.attempt:  # the failed attempt's last steps, sent as it ended
                for record in records:
                    self._steps.keep_late(attempt, record, now=now)
        elif kind == "checkpoint":
            _, attempt, rank, completed, report = item
            if attempt == self.state.attempt:
                self._checkpoints.reported(completed, rank, report)
                self._apply(CheckpointReported(attempt=attempt, step=completed, rank=rank), now)
        elif kind == "chaos":  # only with drills (chaos() refuses otherwise)
            group_up = self._group is not None and self.state.group == GroupPhase.UP
            self._drills.arm(
                item[1],
                world_size=self.sm_config.world_size(self.state.dp),
                group=self._group if group_up else None,
                committed_step=self.state.last_committed_step,
            )
        elif kind == "note":
            _, attempt, note, detail = item
            if attempt == self.state.attempt:
                self._record(note, detail)
        elif kind == "chaos_fired":
            _, attempt, rank, order_id, step = item
            if self._drills is not None:
                self._drills.fired(rank, order_id, step)
        else:
            raise AssertionError(f"unknown inbox item {kind!r}")

    def _apply(self, event: Event, now: float) -> None:
        with self._decide_lock:
            decision = decide(self.state, event, now, self.sm_config)
            self.state = decision.state
            answers = [answer for action in decision.actions if (answer := self._carry_out(action, now)) is not None]
            # A commit's outcome is decided on before any other event (the inbox waits), so nothing acts
            # on a checkpoint whose manifest was not written ([3] in service/decisions/supervisor.py).
            for answer in answers:
                self._apply(answer, time.time())
                if isinstance(answer, CommitSucceeded) and self._drills is not None:
                    self._drills.corrupt_due(self.state.last_committed_step)

    # --- actions ---------------------------------------------------------------------------------

    def _carry_out(self, action: Action, now: float) -> Event | None:
        """Do one action; the event it answers with at once (a commit's outcome), else None."""
        if isinstance(action, RecordEvent):
            self._record(action.kind, action.detail)
        elif isinstance(action, LaunchGroup):
            self._launch(action)
        elif isinstance(action, RepairGroup):
            self._repair(action)
        elif isinstance(action, ResizeGroup):
            self._resize(action)
        elif isinstance(action, StopGroup):
            self._stop(action)
        elif isinstance(action, CommitCheckpoint):
            return self._checkpoints.commit(
                action.step,
                world_size=self.sm_config.world_size(self.state.dp),
                parallel=dataclasses.replace(self.config.parallel, dp=self.state.dp),
            )
        elif isinstance(action, RequestCheckpoint):
            if self._group is not None:
                # Rank 0 decides at a step boundary, for every rank, to save the first step past the one
                # the supervisor knows (workers/rank/step_control.py): all ranks save the same step.
                self._group.call(0, "request_checkpoint", self.state.step + 1)
        elif isinstance(action, DiagnoseHang):
            self._diagnose_hang(action)
        elif isinstance(action, KillRank):
            if self._group is not None and self._group.attempt == action.attempt:
                self._group.kill_actor(action.rank)
        elif isinstance(action, ExcludeNode):
            self._check_capacity(force=True)
        elif isinstance(action, ScheduleWake):
            pass  # the loop ticks every TICK_S anyway
        elif isinstance(action, ExportCheckpoint):
            self._checkpoints.export(
                action.step,
                model=self.config.model,
                dtype=self.policy.export_dtype,
                timeout_s=self.policy.export_timeout_s,
                answer=self._inbox.put,
            )
        elif isinstance(action, MarkTerminal):  # its RecordEvent comes in the same action list
            self._checkpoints.end_export(succeeded=action.status is Status.SUCCEEDED)
            self._metrics.finish(action.status.value)
        else:
            raise AssertionError(f"unhandled action {action!r}")
        return None

    def _diagnose_hang(self, action: DiagnoseHang) -> None:
        """Ask every rank where its training thread is, off the control thread, and answer HangDiagnosed
        ([10] in service/decisions/supervisor.py; the verdict is service/decisions/hangs.py's)."""
        group = self._group
        if group is None or group.attempt != action.attempt:
            self._inbox.put(HangDiagnosed(attempt=action.attempt, rank=None, node="", detail="no group to ask"))
            return

        def ask() -> None:
            try:
                reports = group.where(timeout_s=HANG_ASK_TIMEOUT_S)
                verdict = find_culprit(reports)
                node = group.node_of(verdict.rank) if verdict.rank is not None else ""
                answer = HangDiagnosed(attempt=action.attempt, rank=verdict.rank, node=node, detail=verdict.detail)
            except Exception as err:  # noqa: BLE001 - no verdict: the state machine relaunches every rank
                answer = HangDiagnosed(attempt=action.attempt, rank=None, node="", detail=f"diagnosis failed: {err}")
            self._inbox.put(answer)

        threading.Thread(target=ask, name=f"hang-{self.job_id}-{action.attempt}", daemon=True).start()

    def _launch(self, action: LaunchGroup) -> None:
        config = self.config.with_dp(action.dp)
        resume_step = self._checkpoints.verified_resume_step(action.resume_step)
        if resume_step != action.resume_step:
            self._inbox.put(
                CheckpointFallback(
                    attempt=action.attempt, step=resume_step, reason="newer checkpoint failed verification"
                )
            )
        plan = self._attempt_plan(action.attempt, config, resume_step)
        group = WorkerGroup(
            job_id=self.job_id,
            plan=plan,
            world_size=action.world_size,
            resources_per_rank=self.policy.resources_per_rank,
            strategy=self.policy.placement_strategy,
            excluded_nodes=action.excluded_nodes,
            supervisor=self._self_handle,
            tenant=self.policy.tenant,
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
                self._inbox.put(WorkerLost(attempt=group.attempt, rank=-1, node="", cause="node", detail=str(err)))
                self._capacity.check_soon()
            except Exception as err:  # actor creation / rendezvous failure: infrastructure
                self._inbox.put(
                    WorkerLost(
                        attempt=group.attempt, rank=-1, node="", cause="process", detail=f"group start failed: {err}"
                    )
                )

        threading.Thread(target=start, name=f"launch-{self.job_id}-{action.attempt}", daemon=True).start()

    def _repair(self, action: RepairGroup) -> None:
        """Carry out an in-place repair ([9] in service/decisions/supervisor.py) on the launch thread's terms:
        any failure becomes RepairFailed, and the state machine relaunches every rank instead."""
        group = self._group
        step = action.resume_step
        # The step's digest is known since this supervisor committed it: ranks that must read the checkpoint
        # check that very manifest and hash every file themselves (no full pass here: memory usually serves).
        plan = self._attempt_plan(action.attempt, self.config.with_dp(self.state.dp), step, state_from_memory=True)
        self._record(
            "repairing",
            f"attempt {action.attempt}: rank {action.lost_rank} replaced in place (with any rank whose process "
            f"died beside it), the other ranks kept, resuming from step {step} or a later step held in memory",
        )
        if group is None or group.world_size != action.world_size:
            self._inbox.put(RepairFailed(attempt=action.attempt, reason="no running group to repair"))
            return

        failed, started = action.attempt - 1, self._last_start  # the failed attempt's start, or an earlier one's

        def memory_limit() -> int:
            """The newest step the ranks may resume at from memory: the failed attempt's last reported step
            (where it reported none, the newest start: every step up to it was reported), never before the
            committed one."""
            reported = self._steps.reported_through(failed)
            return max(step or 0, reported or 0, started or 0)

        def also_lost(others: dict[int, str]) -> None:
            """Ranks whose processes died in the same fault (their nodes up): each said, then replaced too."""
            for rank, why in others.items():
                where = group.nodes.get(rank, "?")
                self._record(
                    "worker_failed",
                    f"rank {rank} on node {where} lost as well ({why}): replaced in the same in-place repair",
                )

        def repair() -> None:
            try:
                group.repair(
                    action.lost_rank,
                    plan,
                    memory_limit=memory_limit,
                    also_lost=also_lost,
                    step_s=self._steps.recent_step_s(),
                )
            except Exception as err:
                self._inbox.put(RepairFailed(attempt=action.attempt, reason=f"{type(err).__name__}: {err}"))

        threading.Thread(target=repair, name=f"repair-{self.job_id}-{action.attempt}", daemon=True).start()

    def _resize(self, action: ResizeGroup) -> None:
        """Carry out an in-place resize ([11] in service/decisions/supervisor.py) on its own thread: any
        failure becomes ResizeFailed, and the state machine relaunches every rank at the new size."""
        group = self._group
        step = action.resume_step
        plan = self._attempt_plan(action.attempt, self.config.with_dp(action.dp), step, state_from_memory=True)
        if group is None or group.world_size != self.sm_config.world_size(action.from_dp):
            self._inbox.put(ResizeFailed(attempt=action.attempt, reason="no running group to resize"))
            return

        def resize() -> None:
            try:
                done = group.resize(plan, from_dp=action.from_dp, step_s=self._steps.recent_step_s())
            except Exception as err:
                self._inbox.put(ResizeFailed(attempt=action.attempt, reason=f"{type(err).__name__}: {err}"))
            else:
                self._record(
                    "resize_in_place",
                    f"attempt {action.attempt}: dp {action.from_dp} -> {action.dp} in place: {done}, "
                    f"resuming from step {step}",
                )

        threading.Thread(target=resize, name=f"resize-{self.job_id}-{action.attempt}", daemon=True).start()

    def _attempt_plan(
        self, attempt: int, config: RunConfig, resume_step: int | None, *, state_from_memory: bool = False
    ) -> LaunchPlan:
        """The plan of a new attempt (a launch or an in-place repair), with a fresh straggler detector
        judging ranks within their pipeline stage of its layout."""
        self._steps.new_attempt(config.parallel)
        resume_dir, resume_digest = self._checkpoints.resume_from(resume_step)
        return LaunchPlan(
            attempt=attempt,
            config=config,
            start_step=resume_step or 0,
            resume_dir=resume_dir,
            resume_digest=resume_digest,
            chaos=self._drills.plan_orders() if self._drills is not None else (),
            chaos_enabled=self._drills is not None,
            state_from_memory=state_from_memory,
            keep_snapshots=snapshots_are_read(  # only an in-place repair or resize ever reads them
                in_place=self.policy.in_place,
                repairs_in_place=self.policy.collectives_fail_on_peer_loss,
                resizable=self.policy.min_dp < self.policy.max_dp,
            ),
            may_grow=self.policy.max_dp > config.parallel.dp,
            host_memory_bytes=int(self.policy.resources_per_rank.get(MEMORY, 0)),
            compile_artifacts=self._compile_artifacts,
        )

    def _record_state_sources(self, attempt: int, sources: dict[int, str | None], start: int | None) -> None:
        """One event saying where every rank's restored state came from (a resume only)."""
        by_source: dict[str, list[int]] = {}
        for rank, source in sorted(sources.items()):
            if source:
                by_source.setdefault(source, []).append(rank)
        if not by_source:
            return
        self._record(
            "state_restored",
            f"attempt {attempt}, step {self.state.step if start is None else start}: "
            + "; ".join(f"ranks {','.join(map(str, ranks))} from {source}" for source, ranks in by_source.items()),
        )

    def _stop(self, action: StopGroup) -> None:
        group = self._group
        attempt = action.attempt

        def stop() -> None:
            if group is not None:
                group.stop()
            self._inbox.put(GroupStopped(attempt=attempt))

        thread = threading.Thread(target=stop, name=f"stop-{self.job_id}-{attempt}", daemon=True)
        self._stop_threads = [*(t for t in self._stop_threads if t.is_alive()), thread]
        thread.start()

    def _outcome_event(self, group: WorkerGroup, outcome: GroupOutcome) -> Event:
        if outcome.kind == "finished":
            digests = {rank: result.get("param_digest") for rank, result in sorted(group.results().items())}
            self._record("ranks_finished", "param digests " + " ".join(f"rank{r}={d}" for r, d in digests.items()))
            return Finished(attempt=group.attempt, final_step=outcome.final_step)
        if outcome.kind == "unhealthy":
            return RankUnhealthy(attempt=group.attempt, rank=outcome.rank, node=outcome.node, reason=outcome.message)
        if outcome.kind == "job_error" and outcome.unreadable_checkpoint and group.plan.state_from_memory:
            # An in-place attempt's supervisor checked only the step's signed manifest (memory usually
            # serves); a rank that had to read the files found one it cannot use. Not the job's fault:
            # the relaunch verifies every file and falls back to the newest step that passes.
            reason = f"rank {outcome.rank} could not read the checkpoint it restores: {outcome.message}"
            failed = ResizeFailed if self.state.status is Status.RESIZING else RepairFailed
            return failed(attempt=group.attempt, reason=reason)
        if outcome.kind == "job_error":
            return JobError(
                attempt=group.attempt, rank=outcome.rank, message=outcome.message, traceback=outcome.traceback
            )
        if outcome.cause == "node":
            self._capacity.check_soon()
        return WorkerLost(
            attempt=group.attempt, rank=outcome.rank, node=outcome.node, cause=outcome.cause, detail=outcome.message
        )

    # --- capacity --------------------------------------------------------------------------------

    def _check_capacity(self, *, force: bool) -> None:
        changed = self._capacity.check(
            force=force, excluded=self.state.excluded_nodes, awaiting=self.state.awaiting_capacity
        )
        if changed is not None:
            self._apply(changed, time.time())

    def _held_per_node(self) -> dict[str, int] | None:
        """``{node: bundles}`` the current group's placement group holds (a relaunch gets them back); None
        while it is being reserved (service/runtime/capacity_watch.py then reads capacity at the next turn)."""
        return self._group.bundles_per_node() if self._group is not None else {}

    # --- bookkeeping -----------------------------------------------------------------------------

    def _node_of(self, rank: int) -> str:
        return self._group.node_of(rank) if self._group is not None else ""

    def _record(self, kind: str, detail: str) -> None:
        with self._log_lock:
            seq = len(self._log) + 1
            self._log.append({"seq": seq, "ts": time.time(), "kind": kind, "detail": detail})
        log.info("job %s: %s: %s", self.job_id, kind, detail)


def supervisor_options(name: str) -> dict[str, Any]:
    """Ray options of a supervisor actor, a job's or a pre-started one (they must be the same)."""
    return dict(
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        num_cpus=0,
        # Pinned to the head node: it lives as long as the cluster, so losing a worker node (the very
        # thing the supervisor must handle) never takes the supervisor with it.
        resources={HEAD_NODE_RESOURCE: 0.001},
        max_concurrency=64,
        max_restarts=0,
    )


def start_supervisor(*, job_id: str, config: RunConfig, policy: JobPolicy, spare: Any = None):
    """The job's detached supervisor actor: ``spare`` (a pre-started one, ``supervisor_spares.py``) given the
    job, or a new actor named for the job (or the live one of that name).

    A spare that cannot take the job (it died, or did not answer in time) is killed and the job gets a new
    actor, as it would without spares; an error of the job's own (its policy) is raised either way.
    """
    if spare is not None:
        try:
            ray.get(spare.actor.begin.remote(job_id, config, policy), timeout=BEGIN_TIMEOUT_S)
        except ray.exceptions.RayTaskError:  # the job's own error, raised in begin: the same in a new actor
            _kill_quietly(spare.actor)
            raise
        except Exception as err:
            _kill_quietly(spare.actor)
            log.warning(
                "job %s: pre-started supervisor %s could not take it (%s); starting one", job_id, spare.name, err
            )
        else:
            with _taken_lock:
                _taken[job_id] = spare.name
            return spare.actor
    return (
        ray.remote(JobSupervisor)
        .options(**supervisor_options(supervisor_name(job_id)), get_if_exists=True)
        .remote(job_id=job_id, config=config, policy=policy)
    )


def find_supervisor(job_id: str):
    """The live supervisor of ``job_id``, or None: the actor named for the job, or the pre-started one that
    took it. Which pre-started actor took a job is known in the process that gave it; any other process (a
    restarted control plane) asks the pre-started actors it has not placed yet (``job()``), once each."""
    try:
        return ray.get_actor(supervisor_name(job_id), namespace=NAMESPACE)
    except ValueError:
        pass
    with _taken_lock:
        name = _taken.get(job_id)
    if name is None:
        name = _ask_pre_started(job_id)
    if name is None:
        return None
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # it ended
        with _taken_lock:
            _taken.pop(job_id, None)
        return None


def forget_supervisor(job_id: str) -> None:
    """The job's supervisor was released: this process stops remembering which actor it was."""
    with _taken_lock:
        _taken.pop(job_id, None)


def pre_started_supervisors() -> list[str]:
    """Names of the pre-started supervisor actors alive on the cluster, idle or running a job."""
    return sorted(
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry.get("namespace") == NAMESPACE and entry["name"].startswith(PRE_STARTED_PREFIX)
    )


def jobs_of_pre_started(names: list[str], timeout_s: float = ASK_TIMEOUT_S) -> dict[str, str | None]:
    """``{name: job id or None (idle)}`` for the pre-started supervisors among ``names`` that answered in
    time (all asked at once); a job's answer is remembered, as a supervisor never changes jobs."""
    handles = {}
    for name in names:
        try:
            handles[name] = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue
    refs = {name: handle.job.remote() for name, handle in handles.items()}
    done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    answers: dict[str, str | None] = {}
    for name, ref in refs.items():
        if ref in done:
            try:
                answers[name] = ray.get(ref, timeout=0)
            except Exception:  # it died meanwhile
                continue
    with _taken_lock:
        for name, job in answers.items():
            if job is not None:
                _taken[job] = name
    return answers


def _ask_pre_started(job_id: str) -> str | None:
    with _taken_lock:
        placed = set(_taken.values())
    unplaced = [name for name in pre_started_supervisors() if name not in placed]
    jobs_of_pre_started(unplaced)
    with _taken_lock:
        return _taken.get(job_id)


def _kill_quietly(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone
        pass
