"""JobManager: the control plane's one entry point (the API calls nothing else).

``submit`` validates (spec rules, then the planner's layout and memory rules; a job the cluster can
never hold is refused) and stores the job ``QUEUED``. The scheduler (:meth:`JobManager.schedule`, run
at submit and by the ``etrain-scheduler`` thread) starts a queued job's supervisor only when
:mod:`etrain.service.decisions.admission` says its whole minimum layout fits now, by priority then FIFO. A poller
thread pulls each live supervisor's updates into SQLite, so REST reads never touch Ray. On start-up
the manager reattaches to supervisors that outlived a previous control plane, and the queue (rows in
SQLite) is admitted in the same order; a started job whose supervisor is gone is queued again and
resumes from its last committed checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any

from etrain.service.decisions import admission
from etrain.service.store import idempotency
from etrain.service.planning import planner
from etrain.service.runtime.cluster import Runtime
from etrain.service.runtime.control import ControlQueue, ControlRequest, NotYet
from etrain.service.decisions.elastic import ElasticPolicy, ResizeError
from etrain.service.errors import ChaosDisabled, JobConflict, JobNotFound, RankNotFound, ServiceUnavailable, SpecRejected
from etrain.service.decisions.goodput import ProductiveTally, goodput
from etrain.service.runtime.supervisor_actor import JobPolicy
from etrain.service.settings import Settings
from etrain.service.access.checkpoint_dirs import CheckpointDirectories
from etrain.service.access.checkpoint_key import load_or_create_key
from etrain.service.planning.spec import JobSpec, SpecProblem, check_spec, pin_paths
from etrain.service.access.storage_roots import StorageRoots, pin
from etrain.service.store.job_store import EventRecord, JobRecord, JobStatus, JobStore, StepRecord
from etrain.service.access.quotas import TenantQuotas
from etrain.service.access.tenancy import ADMIN, Principal
from etrain.service.decisions.stragglers import StragglerConfig
from etrain.workers import storage
from etrain.workers.protocol.errors import CheckpointError, ConfigError
from etrain.workers.protocol.manifest import latest_committed, list_steps, step_dir, verify
from etrain.workers.rank_log import rank_log_path, read_lines

log = logging.getLogger(__name__)

#: How long POST /v1/jobs/{id}/export waits for its export task (a 70B model is ~280 GB of fp32 to write).
EXPORT_TIMEOUT_S = 3600.0
RANK_ACTIONS = ("kill_rank", "kill_actor", "slow_rank", "hang_rank")


class JobManager:
    #: ``data.tokenizer`` text is tokenized at submit, inside the HTTP request (clients wait 30 s by
    #: default), so that run is bounded: more text than this to tokenize, or a run longer than this, is
    #: a 422 whose fix is ``etrain prepare-data`` (the same function, run ahead, without bounds).
    submit_tokenize_max_bytes: int = 64 << 20
    submit_tokenize_timeout_s: float = 20.0

    def __init__(self, settings: Settings, *, runtime: Runtime | None = None, base_dir: str | None = None):
        self.settings = settings
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = JobStore(settings.db_path)
        if runtime is None:
            from etrain.service.runtime.cluster import RayRuntime

            runtime = RayRuntime(settings)
        self.runtime = runtime
        self._base_dir = base_dir or os.getcwd()
        #: Where job paths may resolve (ETRAIN_STORAGE_ROOTS, default the data directory).
        self.storage = StorageRoots.of(settings.storage_roots, data_dir=settings.data_dir)
        #: Signs and verifies checkpoint manifests; travels only to supervisors, in their JobPolicy.
        self._checkpoint_key = load_or_create_key(settings.data_dir)
        self._directories = CheckpointDirectories(
            tree=settings.checkpoint_tree, key=self._checkpoint_key,
            default_root=lambda job_id: self.settings.checkpoint_location(job_id),
        )
        self._step_cursor: dict[str, int] = {}  # job -> seq of the supervisor's last step row stored
        # job -> its kept step time, rebuilt from the steps table once per control-plane lifetime and then
        # fed the rows it stores (service/decisions/goodput.py): goodput survives supervisor and server restarts.
        self._tallies: dict[str, ProductiveTally] = {}
        self._submitting: set[str] = set()  # jobs whose supervisor is being created: not "lost"
        self._quotas = TenantQuotas(max_jobs=settings.tenant_max_jobs, max_workers=settings.tenant_max_workers)
        self._stop = threading.Event()
        self._poll_lock = threading.Lock()
        self._init_queue()
        self._poller = threading.Thread(target=self._poll_forever, name="etrain-poller", daemon=True)
        self._poller.start()
        self._control = ControlQueue(self._deliver_control, on_give_up=self._control_failed)

    # --- jobs ------------------------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> JobSpec:
        """The spec as it will run (paths pinned, auto layout resolved), or SpecRejected with every problem."""
        spec, outside = pin_paths(spec, self._base_dir, self.storage)
        if outside:  # before anything looks at the files: the answer must not say whether they exist
            raise SpecRejected(outside)
        problems: list[SpecProblem] = list(check_spec(spec))
        available = self.device_memory_gb(spec.resources.device) if not problems else None
        if not problems and spec.is_auto:
            spec = spec.with_layout(planner.resolve_auto(spec, available_gb=available).layout)
            problems += check_spec(spec)
        if not problems:
            problems += planner.check_plan(spec, available_gb=available)
        if problems:
            raise SpecRejected(problems)
        return spec

    def submit(self, spec: JobSpec, *, principal: Principal = ADMIN, idempotency_key: str | None = None) -> JobRecord:
        """``idempotency_key``: a retry with the same key and spec returns the job the first request created
        (an :class:`~etrain.service.store.idempotency.ReplayedJob`), the same key with another spec is JobConflict."""
        digest = idempotency.request_hash(spec) if idempotency_key is not None else None
        if idempotency_key is not None:
            replayed = idempotency.replay(self.store, principal.tenant, idempotency.check_key(idempotency_key), digest)
            if replayed is not None:
                return replayed
        self._check_reach(spec, principal)
        spec = self.validate(spec)
        self._refuse_beyond_cluster(spec)
        tokenized = self._prepare_data(spec)
        job_id = f"{spec.name.lower()}-{uuid.uuid4().hex[:8]}"
        self._claim_directories(job_id, spec, principal)
        config = spec.to_run_config(job_id=job_id, checkpoint_root=self.settings.checkpoint_location(job_id))
        try:
            self._quotas.admit(principal, job_id, config.parallel.world_size, self.store)  # QuotaExceeded: 429
        except Exception:
            self._directories.release(job_id)
            raise
        self._submitting.add(job_id)
        try:
            record = self.store.create_job(
                job_id=job_id,
                name=spec.name,
                spec=spec.model_dump(mode="json", by_alias=True),
                world_size=config.parallel.world_size,
                layout=config.parallel.describe(),
                tenant=principal.tenant,
                priority=spec.priority,
                idempotency_key=idempotency_key,
                request_hash=digest,
            )
        except JobConflict:
            # A concurrent request with the same key won the unique index: answer with its job.
            self._submitting.discard(job_id)
            self._directories.release(job_id)
            replayed = None
            if idempotency_key is not None:
                replayed = idempotency.replay(self.store, principal.tenant, idempotency_key, digest)
            if replayed is None:
                raise
            return replayed
        self.store.add_events(job_id, [(time.time(), "submitted", {"message": f"layout {config.parallel.describe()}"})])
        if tokenized is not None:
            self.store.add_events(job_id, [(time.time(), "data_tokenized", {"message": tokenized})])
        self._submitting.discard(job_id)
        self._announce.add(job_id)
        self.schedule(submitted=job_id)  # it starts before we answer when it fits now, else waits QUEUED
        return self.store.get_job(job_id) or record

    def _check_reach(self, spec: JobSpec, principal: Principal) -> None:
        """The storage roots, then no path into another tenant's checkpoints: both before anything looks at
        the files (validate's checks say what is missing), so neither answer depends on what exists."""
        pinned, outside = pin_paths(spec, self._base_dir, self.storage)
        if outside:
            raise SpecRejected(outside)
        self._directories.check_reach(pinned, principal, tenant_of=self._tenant_of)

    def _claim_directories(self, job_id: str, spec: JobSpec, principal: Principal) -> None:
        """SpecRejected unless the job's checkpoint directory is its own to use (service/access/checkpoint_dirs.py);
        then it is taken until the job row holds it."""
        self._directories.claim(job_id, spec, principal, tenant_of=self._tenant_of,
                                unfinished=[(job.id, job.spec) for job in self.store.active_jobs()])

    def _tenant_of(self, job_id: str) -> str | None:
        record = self.store.get_job(job_id)
        return None if record is None else record.tenant

    def _prepare_data(self, spec: JobSpec) -> str | None:
        """Tokenize ``data.tokenizer`` text now, once (a cache hit costs one hash of the data), so the ranks
        only memory-map it; a line for the job's events, or SpecRejected naming the field and the fix."""
        data = spec.data
        if data.kind != "text" or not data.tokenizer or not data.path:
            return None
        from etrain.workers.protocol.errors import DataError
        from etrain.workers.tokenized import tokenize_text

        try:
            cache = tokenize_text(data.path, data.tokenizer, max_bytes=self.submit_tokenize_max_bytes,
                                  timeout_s=self.submit_tokenize_timeout_s)
        except DataError as err:
            raise SpecRejected([SpecProblem(field=err.field or "data.path", message=err.message, fix=err.fix)]) from err
        return (f"{cache.num_tokens} tokens ({cache.dtype}) {'reused from' if cache.reused else 'written to'} "
                f"{cache.path}")

    def get(self, job_id: str, *, principal: Principal = ADMIN) -> JobRecord:
        """The job, if it exists *for this caller*: another tenant's job is JobNotFound, like a missing one."""
        record = self.store.get_job(job_id)
        if record is None or not principal.can_see(record.tenant):
            raise JobNotFound(job_id)
        return record

    def list(self, status: str | None = None, limit: int = 100, offset: int = 0, *,
             principal: Principal = ADMIN) -> list[JobRecord]:
        return self.store.list_jobs(status=status, limit=limit, offset=offset, tenant=principal.tenant_filter)

    def events(self, job_id: str, since_seq: int = 0, *, principal: Principal = ADMIN) -> list[EventRecord]:
        self.get(job_id, principal=principal)
        return self.store.events(job_id, since_seq=since_seq)

    def steps(self, job_id: str, since_step: int = -1, *, principal: Principal = ADMIN) -> list[StepRecord]:
        self.get(job_id, principal=principal)
        return self.store.steps(job_id, since_step=since_step)

    def cancel(self, job_id: str, *, principal: Principal = ADMIN) -> JobRecord:
        """Ask the job to stop and return at once (HTTP 202): the ``etrain-control`` thread hands the
        request to the supervisor, and the job reaches CANCELLED through the poller like any status."""
        record = self.get(job_id, principal=principal)
        if record.is_terminal:
            raise JobConflict(
                f"job {job_id} is already {record.status.value}.", job_id=job_id, fix="nothing to cancel"
            )
        if record.status is JobStatus.QUEUED and self._cancel_queued(job_id):
            return self.get(job_id)  # it had no supervisor: nothing to stop
        self.store.add_events(job_id, [(time.time(), "cancel_requested", {"message": "cancel requested via API"})])
        self._control.put(ControlRequest(job_id=job_id, action="cancel"))
        return self.get(job_id)

    def scale(self, job_id: str, dp: int, *, principal: Principal = ADMIN) -> JobRecord:
        record = self.get(job_id, principal=principal)
        if record.is_terminal:
            raise JobConflict(f"job {job_id} is {record.status.value}; it cannot be resized.", job_id=job_id)
        spec = JobSpec.model_validate(record.spec)
        try:
            ElasticPolicy(
                global_batch=spec.training.global_batch,
                micro_batch=spec.training.micro_batch,
                min_dp=spec.min_dp,
                max_dp=spec.max_dp,
                dp_multiple=spec.layout.dp_replicate,
            ).check(dp)
        except ResizeError as err:
            raise SpecRejected([SpecProblem(field="dp", message=str(err),
                                            fix=f"choose dp between resources.min_dp={spec.min_dp} and "
                                                f"resources.max_dp={spec.max_dp} that divides the global batch")])
        self.store.add_events(job_id, [(time.time(), "scale_requested", {"message": f"dp -> {dp} requested via API"})])
        self._control.put(ControlRequest(job_id=job_id, action="scale", dp=dp))  # delivered off this thread
        return self.get(job_id)

    def _deliver_control(self, request: ControlRequest) -> None:
        """On the ``etrain-control`` thread: hand a cancel or scale to the job's supervisor (Ray calls
        with timeouts; a failure is retried by the ControlQueue)."""
        job_id = request.job_id
        record = self.store.get_job(job_id)
        if record is None or record.is_terminal:
            return  # it ended meanwhile: nothing to do
        if job_id in self._submitting:
            raise NotYet(job_id)  # its supervisor is being created; cancelling now would orphan it
        if request.action == "scale":
            if record.status is JobStatus.QUEUED:
                raise NotYet(job_id)  # no supervisor before admission: delivered once it starts (or given up)
            self.runtime.scale(job_id, int(request.dp))
            return
        if self.runtime.exists(job_id):
            self.runtime.cancel(job_id, "cancelled by user")
            self.poll_once(job_id)  # the supervisor is CANCELLED now: persist it without waiting a poll
            return
        with self._poll_lock:  # no supervisor (never started, or lost): nothing to stop
            try:
                self.store.update_job(job_id, status=JobStatus.CANCELLED, error=None,
                                      expect_status=[s for s in JobStatus if not s.is_terminal])
            except JobConflict:
                return  # it reached another end first
            self.store.add_events(job_id, [(time.time(), "cancelled", {"message": "cancelled (no live supervisor)"})])
            self._tallies.pop(job_id, None)

    def _control_failed(self, request: ControlRequest, err: BaseException) -> None:
        """The ControlQueue gave up on a request: say so in the job's events (the user asked for it)."""
        if self.store.get_job(request.job_id) is None:
            return
        what = "cancel" if request.action == "cancel" else f"scale to dp={request.dp}"
        self.store.add_events(request.job_id, [(time.time(), f"{request.action}_failed", {
            "message": f"{what} could not be delivered to the job's supervisor: {err}; send it again "
                       "(`etrain cancel` / `etrain scale`) once `etrain status` shows the job running"})])

    def logs(self, job_id: str, rank: int, tail: int = 200, offset: int | None = None, *,
             principal: Principal = ADMIN) -> dict[str, Any]:
        """Recent lines of rank ``rank``'s log file (``workers/rank_log.py``: in the job's checkpoint folder,
        shared by every node and the control plane), read here without Ray. ``offset`` None: the last
        ``tail`` lines; else up to ``tail`` lines from that byte offset (``next_offset`` of the previous
        answer: how ``etrain logs -f`` follows). RankNotFound for a rank the job never had, JobConflict
        when no rank has started yet."""
        record = self.get(job_id, principal=principal)
        path = rank_log_path(self._checkpoint_path(record), job_id, rank)
        if not storage.exists(path):  # a local file, or an object (s3://) that ranks upload
            if rank >= record.world_size:
                raise RankNotFound(job_id, rank, record.world_size)
            if record.attempt == 0:
                raise JobConflict(
                    f"job {job_id} has not started yet ({record.status.value}): no rank has written a log.",
                    job_id=job_id, status=record.status.value, field="rank",
                    fix=f"wait until it runs (`etrain watch {job_id}`)",
                )
        chunk = read_lines(path, tail=tail, offset=offset)
        return {"job_id": job_id, "rank": rank, "lines": chunk.lines, "next_offset": chunk.offset}

    def _checkpoint_path(self, record: JobRecord) -> str:
        """The job's checkpoint root as its ranks see it (the run config the supervisor was given)."""
        spec = JobSpec.model_validate(record.spec)
        root = self.settings.checkpoint_location(record.id)
        return spec.to_run_config(job_id=record.id, checkpoint_root=root).checkpoint.path

    def chaos(self, job_id: str, request: dict[str, Any], *, principal: Principal = ADMIN) -> dict[str, Any]:
        if not self.settings.enable_chaos:
            raise ChaosDisabled()
        record = self.get(job_id, principal=principal)
        if record.is_terminal:
            raise JobConflict(f"job {job_id} is {record.status.value}; nothing to inject into.", job_id=job_id)
        if request.get("action") in RANK_ACTIONS and not 0 <= int(request.get("rank", -1)) < record.world_size:
            raise SpecRejected([SpecProblem(field="rank", message=f"rank {request.get('rank')} is outside the job's "
                                            f"{record.world_size} ranks.", fix=f"use 0..{record.world_size - 1}")])
        order = self.runtime.chaos(job_id, request)
        return order

    def export(self, job_id: str, step: int | None, out: str, *, principal: Principal = ADMIN) -> dict[str, Any]:
        """Write committed checkpoint ``step`` (default: the newest) of ``job_id`` as a Hugging Face folder
        at ``out`` with the same Ray task a job runs at its end; returns ``{"hf": path, "step": step}``.

        Any committed checkpoint qualifies, of a running job too (committed steps never change; a
        checkpoint pruned by ``keep_last`` mid-export fails the export, not the job).
        """
        record = self.get(job_id, principal=principal)
        spec = JobSpec.model_validate(record.spec)
        config = spec.to_run_config(job_id=job_id, checkpoint_root=self.settings.checkpoint_location(job_id))
        model = config.model
        if model.arch != "llama":
            raise ConfigError(
                f"job {job_id} trains the built-in GPT (model.kind={spec.model.kind!r}), which has no Hugging Face "
                "format; only Llama-family models (model.hf or a llama preset) export.",
                field="model.kind", fix="export a job that trains a Llama-family model",
            )
        out_dir = pin(out, self._base_dir)
        refused = self.storage.check("out", out, out_dir)
        if refused is not None:  # before the existence check below: the answer must not depend on it
            raise SpecRejected([SpecProblem(field=refused.field, message=refused.message, fix=refused.fix)])
        if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
            raise JobConflict(f"out {out_dir} already exists and is not empty.", job_id=job_id, field="out",
                              fix="give a new or empty folder; exports never overwrite")
        root = config.checkpoint.path
        step, directory = _committed_step(job_id, root, step, key=self._checkpoint_key)
        path = self.runtime.export(step_dir=directory, out_dir=out_dir, model=model, source_dir=model.hf_path,
                                   timeout_s=EXPORT_TIMEOUT_S)
        self.store.add_events(job_id, [(time.time(), "exported",
                                        {"message": f"step {step} -> {path} (requested via API)"})])
        return {"hf": path, "step": step}

    def plan(self, spec: JobSpec) -> dict[str, Any]:
        pinned, outside = pin_paths(spec, self._base_dir, self.storage)
        if outside:  # the same 422 as a submit: a plan must not probe files outside the roots either
            raise SpecRejected(outside)
        return planner.plan_report(pinned,
                                   available_gb=self.device_memory_gb(spec.resources.device))

    def device_memory_gb(self, device: str) -> float | None:
        """Memory per rank (GiB) this cluster offers for ``device``, for the planner: the operator's
        ``ETRAIN_DEVICE_MEMORY_GB`` when set, else for ``cuda`` the GPU memory the runtime measures on
        the Ray nodes; None (the planner's default: 80 per GPU, 8 per CPU worker) when neither says."""
        if self.settings.device_memory_gb is not None:
            return self.settings.device_memory_gb
        if device == "cuda":
            return self.runtime.accelerator_memory_gb()
        return None

    def health(self) -> dict[str, Any]:
        return {"db": "ok" if self.store.ping() else "error", **self.runtime.health()}

    def metrics_text(self, *, principal: Principal | None = None) -> str:
        from etrain.service.prometheus import render_job_metrics

        return render_job_metrics(self.store, principal)

    def close(self) -> None:
        self._stop.set()
        self._control.close(timeout_s=5)
        self._wake.set()
        self._poller.join(timeout=5)
        self._scheduler.join(timeout=5)
        self.runtime.close()
        self.store.close()

    # --- polling supervisors into the store ------------------------------------------------------

    def _poll_forever(self) -> None:
        while not self._stop.wait(self.settings.poll_interval_s):
            for job in self.store.active_jobs():
                try:
                    self.poll_once(job.id)
                except Exception:  # one broken job must not stop the others' updates
                    log.exception("polling job %s failed", job.id)

    def poll_once(self, job_id: str) -> None:
        with self._poll_lock:
            record = self.store.get_job(job_id)
            if record is not None and record.status is JobStatus.QUEUED and record.goodput is not None:
                # Queued again after a lost supervisor: the wait counts against goodput, so keep it current.
                self.store.update_job(job_id, goodput=self._goodput(record, time.time()))
            if record is None or record.is_terminal or job_id in self._submitting or record.status is JobStatus.QUEUED:
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
            self.store.add_events(job_id, [(e["ts"], e["kind"], {"message": e["detail"]}) for e in events],
                                  cursor=max(e["seq"] for e in events))  # one transaction: no duplicates on a kill
        steps = update.get("steps", [])
        if steps:
            tally = self._tally(job_id)  # (built from the table before these rows land in it)
            records = [
                StepRecord(job_id=job_id, step=row["step"], loss=row.get("loss"), tokens_per_s=row.get("tokens_per_s"),
                           step_s=row.get("step_s"), compute_s=row.get("compute_s"),
                           comm_wait_s=row.get("comm_wait_s"), ts=row["ts"], attempt=row.get("attempt", 0))
                for row in steps
            ]
            self.store.add_steps(job_id, records)
            for step_record in records:
                tally.add(step_record)
            self._step_cursor[job_id] = max(row["seq"] for row in steps)
        fields = {key: update.get(key) for key in ("step", "loss", "tokens_per_s", "world_size", "restarts",
                                                   "last_checkpoint_step", "layout", "attempt", "error")}
        fields["goodput"] = self._goodput(record, time.time())
        fields["stragglers"] = update.get("stragglers", [])
        if update.get("artifacts"):
            fields["artifacts"] = update["artifacts"]
        fields["status"] = JobStatus(update["status"])
        if fields["status"] is JobStatus.QUEUED:  # the supervisor's first instant: admitted, about to launch
            fields["status"] = JobStatus.STARTING
        fields = {key: value for key, value in fields.items() if value is not None or key == "error"}
        self.store.update_job(job_id, **fields)
        if fields["status"].is_terminal:
            self.runtime.release(job_id)
            self._step_cursor.pop(job_id, None)
            self._tallies.pop(job_id, None)  # its goodput is final (measured up to now, its end)
            self._wake.set()  # what it held may start the next queued job

    def _tally(self, job_id: str) -> ProductiveTally:
        tally = self._tallies.get(job_id)
        if tally is None:
            tally = self._tallies[job_id] = ProductiveTally(self.store.steps(job_id, limit=2**62))
        return tally

    def _goodput(self, record: JobRecord, now: float) -> float | None:
        """Kept step time over wall time since the submit (service/decisions/goodput.py), from the store's rows."""
        return goodput(self._tally(record.id).value, submitted_at=record.created_at, now=now)

    def _supervisor_lost(self, record: JobRecord) -> None:
        """A started job without a supervisor (its node died, the cluster restarted, or a control plane
        died between admitting it and starting it): back in the queue, at its priority and original
        submit time, to resume from its newest committed checkpoint once its gang fits again.

        The loss counts against the restart budget, unless the supervisor never launched anything.
        """
        spec = JobSpec.model_validate(record.spec)
        spent = 0 if record.attempt == 0 else 1
        if spent and record.restarts >= spec.fault_tolerance.max_restarts:
            self.store.update_job(record.id, status=JobStatus.FAILED,
                                  error=f"supervisor lost and restarted {record.restarts} times, "
                                        f"max_restarts={spec.fault_tolerance.max_restarts}")
            self.store.add_events(record.id, [(time.time(), "failed", {"message": "supervisor lost; budget spent"})])
            self._tallies.pop(record.id, None)
            return
        # The event first: once QUEUED, the scheduler may admit it (and record "admitted") at once.
        self.store.add_events(record.id, [(time.time(), "supervisor_lost",
                                           {"message": "no live supervisor; queued again to resume from the last "
                                                       "checkpoint"})])
        self._announce.add(record.id)
        try:
            self.store.update_job(record.id, status=JobStatus.QUEUED, restarts=record.restarts + spent,
                                  expect_status=[record.status])
        except JobConflict:
            self._announce.discard(record.id)
            return  # it ended meanwhile
        self._wake.set()

    # --- the queue: gang admission by priority ---------------------------------------------------

    #: How old a cluster snapshot GET /v1/cluster may serve while nothing is queued (the scheduler
    #: reads a fresh one on every pass that has queued jobs).
    cluster_refresh_s: float = 2.0

    def _init_queue(self) -> None:
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
        self._scheduler = threading.Thread(target=self._schedule_forever, name="etrain-scheduler", daemon=True)
        self._scheduler.start()

    def _schedule_forever(self) -> None:
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

    def schedule(self, *, submitted: str | None = None) -> list[str]:
        """One admission pass: start the queued jobs that fit now (service/decisions/admission.py), record why the
        newly queued ones wait; returns the ids started.

        ``submitted``: called from ``submit`` for that job: only it is started on the caller's thread
        (the scheduler thread starts any other job this pass admits), and its start failure is raised.
        """
        with self._admit_lock:
            active = self.store.active_jobs()
            # (a job still in ``submit`` waits for its "submitted" event: submit runs a pass for it)
            queued = [job for job in active if job.status is JobStatus.QUEUED and job.id not in self._submitting]
            view = self._refresh_view(force=bool(queued))
            if not queued or view is None:
                if not queued and self.settings.admit_beyond_cluster:
                    self._ask_autoscaler(active, waiting=set())
                return []
            plan = admission.decide([self._queued(job) for job in queued], self._admission_nodes(view, active),
                                    self._claims(active, view))
            by_id = {job.id: job for job in queued}
            started = []
            for admit in plan.admit:
                if submitted is not None and admit.job_id != submitted:
                    self._wake.set()
                    continue
                if self._start_admitted(by_id[admit.job_id], admit, raise_errors=admit.job_id == submitted):
                    started.append(admit.job_id)
            for wait in plan.wait:
                if wait.job_id in self._announce:
                    self._announce.discard(wait.job_id)
                    self.store.add_events(wait.job_id, [(time.time(), "queued", {"message": wait.reason})])
            if self.settings.admit_beyond_cluster:
                self._ask_autoscaler(active, waiting={wait.job_id for wait in plan.wait})
            return started

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

    def _start_admitted(self, record: JobRecord, admit: admission.Admit, *, raise_errors: bool) -> bool:
        """Start an admitted job's supervisor at the admitted dp (QUEUED -> STARTING first, so a cancel
        that wins the race leaves it cancelled and unstarted)."""
        job_id = record.id
        spec = JobSpec.model_validate(record.spec)
        root = self.settings.checkpoint_location(job_id)
        config = spec.to_run_config(job_id=job_id, checkpoint_root=root).with_dp(admit.dp)
        # attempt_base: a supervisor recreated after a loss numbers its attempts on from the job's last one,
        # so its step rows replace the recomputed steps' old rows (service/store/job_store.py keeps the higher attempt).
        policy = dataclasses.replace(policy_for(spec), restarts_used=record.restarts, attempt_base=record.attempt,
                                     checkpoint_key=self._checkpoint_key)
        self._submitting.add(job_id)  # before the status change: the poller and cancel wait for the start
        try:
            try:
                self.store.update_job(job_id, status=JobStatus.STARTING, world_size=config.parallel.world_size,
                                      layout=config.parallel.describe(), expect_status=[JobStatus.QUEUED])
            except JobConflict:
                return False  # cancelled meanwhile
            self._announce.discard(job_id)
            where = ", ".join(f"{ranks} on {node}" for node, ranks in admit.placement.items())
            self.store.add_events(job_id, [(time.time(), "admitted", {
                "message": f"{admit.ranks} rank(s) at dp={admit.dp} fit now ({where}); starting its supervisor"})])
            self.store.set_cursor(job_id, 0)  # a new supervisor numbers its events from 1
            self._step_cursor.pop(job_id, None)
            try:
                self.runtime.start(job_id, config, policy)
            except Exception as err:
                self.store.update_job(job_id, status=JobStatus.FAILED, error=f"could not start the job: {err}")
                self.store.add_events(job_id, [(time.time(), "failed", {"message": str(err)})])
                if raise_errors:
                    raise
                log.exception("starting job %s failed", job_id)
                return False
        finally:
            self._submitting.discard(job_id)
        return True

    def _cancel_queued(self, job_id: str) -> bool:
        """Cancel a job that waits in the queue (no supervisor: done at once); False when it was admitted
        (or ended) meanwhile and must be cancelled the usual way."""
        try:
            self.store.update_job(job_id, status=JobStatus.CANCELLED, error=None, expect_status=[JobStatus.QUEUED])
        except JobConflict:
            return False
        self._announce.discard(job_id)
        self._tallies.pop(job_id, None)
        self.store.add_events(job_id, [(time.time(), "cancelled", {"message": "cancelled by user while queued"})])
        self._wake.set()  # the jobs behind it may start now
        return True

    def _gang(self, record: JobRecord) -> admission.Gang:
        gang = self._gangs.get(record.id)
        if gang is None:
            gang = self._gangs[record.id] = gang_for(JobSpec.model_validate(record.spec))
        return gang

    def _queued(self, record: JobRecord) -> admission.QueuedJob:
        return admission.QueuedJob(id=record.id, priority=record.priority, created_at=record.created_at,
                                   gang=self._gang(record))

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
                node = dataclasses.replace(node, free={name: node.free.get(name, 0.0) + extra.get(name, 0.0)
                                                       for name in {*node.free, *extra}})
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

    def _refuse_beyond_cluster(self, spec: JobSpec) -> None:
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

    def cluster(self, *, principal: Principal = ADMIN) -> dict[str, Any]:
        """Nodes, totals, what each started job holds and the queue with its reasons (a dry admission
        pass over the latest snapshot). Another tenant's jobs are left out, but counted in the totals."""
        view = self._refresh_view(force=False)  # the scheduler thread keeps it fresh: rarely a Ray call here
        if view is None:
            raise ServiceUnavailable(f"the cluster's resources cannot be read: {self._view_error}",
                                     fix="check the cluster (ray status) and retry")
        active = self.store.active_jobs()
        queued = [job for job in active if job.status is JobStatus.QUEUED]
        plan = admission.decide([self._queued(job) for job in queued], self._admission_nodes(view, active),
                                self._claims(active, view))
        alive = [node for node in view.nodes if node.alive]
        total = {name: sum(node.total.get(name, 0.0) for node in alive) for name in ("CPU", "GPU")}
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
            holders.append({
                "job_id": job.id, "status": job.status.value, "priority": job.priority, "tenant": job.tenant,
                "world_size": job.world_size,
                "cpus": _round(sum(r.get("CPU", 0.0) for r in held.values())),
                "gpus": _round(sum(r.get("GPU", 0.0) for r in held.values())),
                "nodes": [{"node_id": node, "cpus": _round(r.get("CPU", 0.0)), "gpus": _round(r.get("GPU", 0.0))}
                          for node, r in sorted(held.items())],
            })
        queue = [{"job_id": wait.job_id, "priority": visible[wait.job_id].priority, "position": wait.position,
                  "reason": wait.reason, "submitted_at": visible[wait.job_id].created_at}
                 for wait in plan.wait if wait.job_id in visible]
        return {
            "nodes": [{"node_id": node.id, "alive": node.alive,
                       "cpus": _round(node.total.get("CPU", 0.0)), "gpus": _round(node.total.get("GPU", 0.0)),
                       "free_cpus": _round(node.free.get("CPU", 0.0)), "free_gpus": _round(node.free.get("GPU", 0.0))}
                      for node in view.nodes],
            "totals": {"nodes": len(view.nodes), "alive_nodes": len(alive),
                       "cpus": _round(total["CPU"]), "gpus": _round(total["GPU"]),
                       "free_cpus": _round(free.get("CPU", 0.0)), "free_gpus": _round(free.get("GPU", 0.0)),
                       "running_jobs": len(active) - len(queued), "queued_jobs": len(queued)},
            "jobs": holders,
            "queue": queue,
            "observed_at": time.time() - (time.monotonic() - self._view_at),
        }

def gang_for(spec: JobSpec) -> admission.Gang:
    """What a (validated, explicit-layout) job must get at once to start: its legal dps up to the planned
    one (the first is the elastic minimum), tp groups of ranks of the worker resources."""
    layout = spec.layout
    legal = ElasticPolicy(global_batch=spec.training.global_batch, micro_batch=spec.training.micro_batch,
                          min_dp=spec.min_dp, max_dp=spec.max_dp, dp_multiple=layout.dp_replicate).legal_sizes()
    sizes = tuple(dp for dp in legal if dp <= layout.dp) or (layout.dp,)
    return admission.Gang(per_rank=policy_for(spec).resources_per_rank, dp_sizes=sizes, tp=layout.tp, pp=layout.pp,
                          strategy=spec.resources.placement_strategy,
                          dp_field="resources.min_dp" if spec.resources.min_dp else "parallelism.dp")


def _round(amount: float) -> float:
    """Resource amounts for display: float dust (3 x 0.1 CPU) rounded away."""
    return round(amount, 4) + 0.0


def policy_for(spec: JobSpec) -> JobPolicy:
    """The supervisor's policy values from a (validated, explicit-layout) spec."""
    resources: dict[str, float] = {"CPU": spec.resources.cpus_per_worker}
    if spec.resources.gpus_per_worker:
        resources["GPU"] = spec.resources.gpus_per_worker
    stragglers = spec.stragglers
    return JobPolicy(
        min_dp=spec.min_dp,
        max_dp=spec.max_dp,
        max_restarts=spec.fault_tolerance.max_restarts,
        heartbeat_timeout_s=spec.fault_tolerance.heartbeat_timeout_s,
        backoff_base_s=spec.fault_tolerance.backoff_base_s,
        backoff_max_s=spec.fault_tolerance.backoff_max_s,
        in_place=spec.fault_tolerance.in_place,
        elastic_check_interval_s=spec.elastic.check_interval_s,
        stragglers=StragglerConfig(
            enabled=stragglers.enabled,
            window=stragglers.window,
            threshold=stragglers.threshold,
            patience=stragglers.patience,
        ),
        straggler_action=stragglers.action,
        resources_per_rank=resources,
        placement_strategy=spec.resources.placement_strategy,
        export=spec.export_format == "hf",
    )


def _committed_step(job_id: str, root: str, step: int | None, *, key: bytes) -> tuple[int, str]:
    """``(step, step_dir)`` of a committed checkpoint of the job (signature and sizes checked here; the
    export task verifies the checksums as it reads), or JobConflict naming the committed steps there are."""
    if step is None:
        found = latest_committed(root, checksums=False, key=key)
        if found is not None:
            return found
    else:
        directory = step_dir(root, step)
        try:
            verify(directory, checksums=False, key=key)
            return step, directory
        except CheckpointError:
            pass
    committed = []
    for number, directory in list_steps(root):
        try:
            verify(directory, checksums=False, key=key)
        except CheckpointError:
            continue
        committed.append(number)
    what = "no committed checkpoint" if step is None else f"no committed checkpoint at step {step}"
    listing = f"committed steps: {committed}" if committed else "nothing is committed yet"
    raise JobConflict(
        f"job {job_id} has {what} under {root} ({listing}).",
        job_id=job_id, field="step",
        fix=(f"pass one of the committed steps ({committed[-1]} is the newest)" if committed
             else "wait for the job's first checkpoint (checkpoint.every_steps, or its end)"),
    )
