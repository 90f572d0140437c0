"""The queue: gang admission by priority, run by the ``etrain-scheduler`` thread.

A submitted job waits QUEUED until :mod:`etrain.service.decisions.admission` says its whole minimum layout
fits now (priority first, then oldest first). This class runs those passes (at submit, whenever something
ends, is queued or cancelled, and every poll interval), records why a newly queued job waits, keeps the
cluster snapshot the passes and GET /v1/cluster read, refuses at submit a job the cluster can never hold,
and on an autoscaling cluster asks for the room the queue needs.

Starting an admitted job is not done here: the manager's ``start`` callback does it (it holds the
supervisor's policy, the checkpoint key and the poller), so this module decides *who* starts and *when*.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from etrain.service.access.tenancy import Principal
from etrain.service.decisions import admission
from etrain.service.decisions.job_policy import gang_for
from etrain.service.errors import JobConflict, ServiceUnavailable, SpecRejected
from etrain.service.planning.plan_memory import gib
from etrain.service.planning.spec import JobSpec, SpecProblem
from etrain.service.runtime.cluster import Runtime
from etrain.service.settings import Settings
from etrain.service.store.job_store import JobStore
from etrain.service.store.records import JobRecord, JobStatus

log = logging.getLogger(__name__)

#: ``start(record, admit, raise_errors=...)``: start an admitted job's supervisor; False if it did not start.
StartJob = Callable[..., bool]


class Scheduler:
    """Admission passes over the queue (service/decisions/admission.py), and the cluster snapshot they read."""

    #: How old a cluster snapshot GET /v1/cluster may serve while nothing is queued (the scheduler
    #: reads a fresh one on every pass that has queued jobs).
    cluster_refresh_s: float = 2.0

    def __init__(self, *, store: JobStore, runtime: Runtime, settings: Settings, starting: set[str], start: StartJob):
        self.store = store
        self.runtime = runtime
        self.settings = settings
        self._starting = starting  # jobs whose supervisor is being created (the manager's set): not queued
        self._start = start
        self._stop = threading.Event()
        self._admit_lock = threading.Lock()  # one admission pass at a time
        self._wake = threading.Event()  # run a pass now (a job ended, was queued or cancelled)
        self._announce: set[str] = set()  # queued jobs still owed their "queued" event
        self._requested: list[dict[str, float]] = []  # the autoscaler request in force (admit_beyond_cluster)
        self._gangs: dict[str, admission.Gang] = {}  # job -> its gang (specs never change)
        self._view_lock = threading.Lock()  # the snapshot below (never held across a job start)
        self._view: admission.ClusterView | None = None
        self._view_at = 0.0
        self._view_error: str | None = None
        for job in self.store.active_jobs():
            # Admitted by a control plane from before the queue (its supervisor runs): follow it.
            if job.status is JobStatus.QUEUED and self.runtime.exists(job.id):
                self.store.update_job(job.id, status=JobStatus.STARTING, expect_status=[JobStatus.QUEUED])
        self._refresh_view(force=True)
        self._thread = threading.Thread(target=self._run, name="etrain-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)

    def wake(self) -> None:
        """Run a pass now: a job ended, was queued or was cancelled, so another may fit."""
        self._wake.set()

    def announce(self, job_id: str) -> None:
        """``job_id`` is (again) queued: its first pass that leaves it waiting records a "queued" event."""
        self._announce.add(job_id)

    def forget(self, job_id: str) -> None:
        """``job_id`` no longer waits (started, cancelled, or its requeue lost a race): no "queued" event."""
        self._announce.discard(job_id)

    def schedule(self, *, submitted: str | None = None) -> list[str]:
        """One admission pass: start the queued jobs that fit now (service/decisions/admission.py), record why the
        newly queued ones wait; returns the ids started.

        ``submitted``: called from ``submit`` for that job: only it is started on the caller's thread
        (the scheduler thread starts any other job this pass admits), and its start failure is raised.
        """
        with self._admit_lock:
            active = self.store.active_jobs()
            # (a job still in ``submit`` waits for its "submitted" event: submit runs a pass for it)
            queued = [job for job in active if job.status is JobStatus.QUEUED and job.id not in self._starting]
            view = self._refresh_view(force=bool(queued))
            if not queued or view is None:
                if not queued and self.settings.admit_beyond_cluster:
                    self._ask_autoscaler(active, waiting=set())
                return []
            plan = admission.decide(
                [self._queued(job) for job in queued], self._admission_nodes(view, active), self._claims(active, view)
            )
            by_id = {job.id: job for job in queued}
            started = []
            for admit in plan.admit:
                if submitted is not None and admit.job_id != submitted:
                    self._wake.set()
                    continue
                if self._start(by_id[admit.job_id], admit, raise_errors=admit.job_id == submitted):
                    started.append(admit.job_id)
            for wait in plan.wait:
                if wait.job_id in self._announce:
                    self._announce.discard(wait.job_id)
                    reader = Principal.reader_of(by_id[wait.job_id].tenant)  # the job's own events: its tenant's
                    self.store.add_events(
                        wait.job_id, [(time.time(), "queued", {"message": _reason(wait, reader, by_id)})]
                    )
            if self.settings.admit_beyond_cluster:
                self._ask_autoscaler(active, waiting={wait.job_id for wait in plan.wait})
            return started

    def cancel_queued(self, job_id: str) -> bool:
        """Cancel a job that waits in the queue (no supervisor: done at once); False when it was admitted
        (or ended) meanwhile and must be cancelled the usual way."""
        try:
            self.store.update_job(job_id, status=JobStatus.CANCELLED, error=None, expect_status=[JobStatus.QUEUED])
        except JobConflict:
            return False
        self._announce.discard(job_id)
        self.store.add_events(job_id, [(time.time(), "cancelled", {"message": "cancelled by user while queued"})])
        self._wake.set()  # the jobs behind it may start now
        return True

    def refuse_beyond_cluster(self, spec: JobSpec) -> None:
        """SpecRejected (422) when the job's minimum layout can never fit the cluster's total resources,
        unless the operator queues such jobs for an autoscaler (``ETRAIN_ADMIT_BEYOND_CLUSTER=1``).
        Nothing is refused while the cluster cannot be read: the job queues."""
        if self.settings.admit_beyond_cluster:
            return
        view = self._refresh_view(force=False)
        if view is None:
            return
        problem = admission.refusal(gang_for(spec), view.nodes)
        if problem is not None:
            raise SpecRejected([SpecProblem(field=problem.field, message=problem.message, fix=problem.fix)])

    def cluster(self, *, principal: Principal) -> dict[str, Any]:
        """Nodes, totals, what each started job holds and the queue with its reasons (a dry admission
        pass over the latest snapshot). Another tenant's jobs are left out, but counted in the totals."""
        view = self._refresh_view(force=False)  # the scheduler thread keeps it fresh: rarely a Ray call here
        if view is None:
            raise ServiceUnavailable(
                f"the cluster's resources cannot be read: {self._view_error}",
                fix="check the cluster (ray status) and retry",
            )
        active = self.store.active_jobs()
        queued = [job for job in active if job.status is JobStatus.QUEUED]
        plan = admission.decide(
            [self._queued(job) for job in queued], self._admission_nodes(view, active), self._claims(active, view)
        )
        alive = [node for node in view.nodes if node.alive]
        total = {name: sum(node.total.get(name, 0.0) for node in alive) for name in ("CPU", "GPU", admission.MEMORY)}
        free = admission.free_summary(view.nodes)
        visible = {job.id: job for job in active if principal.can_see(job.tenant)}
        for job_id in view.holdings:
            if job_id not in visible:  # a job that just ended may still hold its group for a moment
                record = self.store.get_job(job_id)
                if record is not None and principal.can_see(record.tenant):
                    visible[job_id] = record
        holders = []
        for job in sorted(visible.values(), key=lambda j: (j.created_at, j.id)):
            if job.status is JobStatus.QUEUED:
                continue
            held = view.holdings.get(job.id, {})
            holders.append(
                {
                    "job_id": job.id,
                    "status": job.status.value,
                    "priority": job.priority,
                    "tenant": job.tenant,
                    "world_size": job.world_size,
                    "cpus": _round(sum(r.get("CPU", 0.0) for r in held.values())),
                    "gpus": _round(sum(r.get("GPU", 0.0) for r in held.values())),
                    "memory_gib": gib(sum(r.get(admission.MEMORY, 0.0) for r in held.values())),
                    "nodes": [
                        {
                            "node_id": node,
                            "cpus": _round(r.get("CPU", 0.0)),
                            "gpus": _round(r.get("GPU", 0.0)),
                            "memory_gib": gib(r.get(admission.MEMORY, 0.0)),
                        }
                        for node, r in sorted(held.items())
                    ],
                }
            )
        waiting = {job.id: job for job in queued}
        queue = [
            {
                "job_id": wait.job_id,
                "priority": visible[wait.job_id].priority,
                "position": wait.position,
                "reason": _reason(wait, principal, waiting),
                "submitted_at": visible[wait.job_id].created_at,
            }
            for wait in plan.wait
            if wait.job_id in visible
        ]
        return {
            "nodes": [
                {
                    "node_id": node.id,
                    "alive": node.alive,
                    "cpus": _round(node.total.get("CPU", 0.0)),
                    "gpus": _round(node.total.get("GPU", 0.0)),
                    "memory_gib": gib(node.total.get(admission.MEMORY, 0.0)),
                    "free_cpus": _round(node.free.get("CPU", 0.0)),
                    "free_gpus": _round(node.free.get("GPU", 0.0)),
                    "free_memory_gib": gib(node.free.get(admission.MEMORY, 0.0)),
                }
                for node in view.nodes
            ],
            "totals": {
                "nodes": len(view.nodes),
                "alive_nodes": len(alive),
                "cpus": _round(total["CPU"]),
                "gpus": _round(total["GPU"]),
                "memory_gib": gib(total[admission.MEMORY]),
                "free_cpus": _round(free.get("CPU", 0.0)),
                "free_gpus": _round(free.get("GPU", 0.0)),
                "free_memory_gib": gib(free.get(admission.MEMORY, 0.0)),
                "running_jobs": len(active) - len(queued),
                "queued_jobs": len(queued),
            },
            "jobs": holders,
            "queue": queue,
            "observed_at": time.time() - (time.monotonic() - self._view_at),
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.settings.poll_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.schedule()
                self._refresh_view(force=False)  # keeps GET /v1/cluster's snapshot fresh while nothing is queued
            except Exception:  # the next pass tries again
                log.exception("admission pass failed")

    def _ask_autoscaler(self, active: list[JobRecord], *, waiting: set[str]) -> None:
        """On an autoscaling cluster (``ETRAIN_ADMIT_BEYOND_CLUSTER=1``): a queued job has no placement
        group, so Ray sees no demand for it. Ask the autoscaler for a cluster that holds every started
        job's ranks and every waiting job's minimum layout at once (Ray counts what runs toward such a
        request); an empty request once nothing waits, so it may scale down again."""
        bundles: list[dict[str, float]] = []
        if waiting:
            for job in active:
                gang = self._gang(job)
                if job.id in waiting:
                    bundles += [dict(gang.per_rank) for _ in range(gang.min_ranks)]
                elif job.status not in (JobStatus.QUEUED, JobStatus.EXPORTING):
                    bundles += [dict(gang.per_rank) for _ in range(job.world_size)]
        if bundles == self._requested:
            return
        try:
            self.runtime.request_capacity(bundles)
        except Exception as err:  # a hint only: the next pass asks again
            log.warning("could not ask the autoscaler for %d bundle(s): %s", len(bundles), err)
            return
        self._requested = bundles

    def _gang(self, record: JobRecord) -> admission.Gang:
        gang = self._gangs.get(record.id)
        if gang is None:
            gang = self._gangs[record.id] = gang_for(JobSpec.model_validate(record.spec))
        return gang

    def _queued(self, record: JobRecord) -> admission.QueuedJob:
        return admission.QueuedJob(
            id=record.id, priority=record.priority, created_at=record.created_at, gang=self._gang(record)
        )

    def _claims(self, active: list[JobRecord], view: admission.ClusterView) -> list[admission.Claim]:
        """Started jobs whose placement group Ray does not hold (starting, or between attempts)."""
        claims = []
        for job in active:
            if job.status in (JobStatus.QUEUED, JobStatus.EXPORTING) or view.holdings.get(job.id):
                continue
            gang = self._gang(job)
            claims.append(admission.Claim(id=job.id, per_rank=gang.per_rank, ranks=job.world_size, tp=gang.tp))
        return claims

    def _admission_nodes(self, view: admission.ClusterView, active: list[JobRecord]) -> tuple[admission.NodeView, ...]:
        """The view's nodes, with what jobs that already ended still hold counted as free: their groups
        are on their way out (the supervisor stops its group as the job ends, and ``release`` ends the
        supervisor), so the next job is admitted whole and waits a moment for Ray, instead of starting
        smaller and resizing a second later."""
        live = {job.id for job in active}
        ending: dict[str, dict[str, float]] = {}
        for job_id, held in view.holdings.items():
            if job_id in live or not held:
                continue
            record = self.store.get_job(job_id)
            if record is None or not record.is_terminal:
                continue  # not ours to judge (another control plane's, or unknown)
            for node, resources in held.items():
                on_node = ending.setdefault(node, {})
                for name, amount in resources.items():
                    on_node[name] = on_node.get(name, 0.0) + amount
        nodes = []
        for node in view.nodes:
            extra = ending.get(node.id) if node.alive else None
            if extra:
                node = dataclasses.replace(
                    node, free={name: node.free.get(name, 0.0) + extra.get(name, 0.0) for name in {*node.free, *extra}}
                )
            nodes.append(node)
        return tuple(nodes)

    def _refresh_view(self, *, force: bool) -> admission.ClusterView | None:
        """Read the cluster (forced, or when the snapshot is stale); the fresh view, or None if the read
        failed (then no admission this pass; GET /v1/cluster reports the error)."""
        with self._view_lock:
            if not force and self._view is not None and time.monotonic() - self._view_at < self.cluster_refresh_s:
                return self._view
            try:
                view = self.runtime.cluster()
            except Exception as err:
                self._view_error = str(err)
                log.warning("cannot read the cluster: %s", err)
                return None
            self._view, self._view_at, self._view_error = view, time.monotonic(), None
            return view


def _reason(wait: admission.Wait, reader: Principal, jobs: Mapping[str, JobRecord]) -> str:
    """Why ``wait``'s job waits, as ``reader`` may read it: a job of another tenant it waits behind is
    not named (``jobs``: the queued jobs by id; one missing there is not named either)."""
    behind = jobs.get(wait.behind) if wait.behind is not None else None
    return wait.reason_for(sees_behind=wait.behind is None or (behind is not None and reader.can_see(behind.tenant)))


def _round(amount: float) -> float:
    """Resource amounts for display: float dust (3 x 0.1 CPU) rounded away."""
    return round(amount, 4) + 0.0
