"""JobManager: the control plane's one entry point (the API calls nothing else).

``submit`` validates (spec rules, then the planner's layout and memory rules), stores the job and
starts its supervisor. A poller thread pulls each live supervisor's updates into SQLite, so REST
reads never touch Ray. On start-up the manager reattaches to supervisors that outlived a previous
control plane; a job whose supervisor is gone is restarted from its last committed checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any

from service import planner
from service.cluster import Runtime
from service.elastic import ElasticPolicy, ResizeError
from service.errors import ChaosDisabled, JobConflict, JobNotFound, SpecRejected
from service.runtime import JobPolicy
from service.settings import Settings
from service.spec import JobSpec, SpecProblem, check_spec, resolve_paths
from service.store import EventRecord, JobRecord, JobStatus, JobStore, StepRecord
from service.tenancy import ADMIN, Principal
from service.stragglers import StragglerConfig
from workers.errors import CheckpointError, ConfigError
from workers.manifest import latest_committed, list_steps, step_dir, verify

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 30.0
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
            from service.cluster import RayRuntime

            runtime = RayRuntime(settings)
        self.runtime = runtime
        self._base_dir = base_dir or os.getcwd()
        self._step_cursor: dict[str, int] = {}  # job -> seq of the supervisor's last step row stored
        self._submitting: set[str] = set()  # jobs whose supervisor is being created: not "lost"
        self._stop = threading.Event()
        self._poll_lock = threading.Lock()
        self._poller = threading.Thread(target=self._poll_forever, name="etrain-poller", daemon=True)
        self._poller.start()

    # --- jobs ------------------------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> JobSpec:
        """The spec as it will run (paths pinned, auto layout resolved), or SpecRejected with every problem."""
        spec = resolve_paths(spec, self._base_dir)
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

    def submit(self, spec: JobSpec, *, principal: Principal = ADMIN) -> JobRecord:
        spec = self.validate(spec)
        tokenized = self._prepare_data(spec)
        job_id = f"{spec.name.lower()}-{uuid.uuid4().hex[:8]}"
        config = spec.to_run_config(job_id=job_id, checkpoint_root=str(self.settings.checkpoint_root(job_id).resolve()))
        self._submitting.add(job_id)
        record = self.store.create_job(
            job_id=job_id,
            name=spec.name,
            spec=spec.model_dump(mode="json", by_alias=True),
            world_size=config.parallel.world_size,
            layout=config.parallel.describe(),
            tenant=principal.tenant,
            priority=spec.priority,
        )
        self.store.add_events(job_id, [(time.time(), "submitted", {"message": f"layout {config.parallel.describe()}"})])
        if tokenized is not None:
            self.store.add_events(job_id, [(time.time(), "data_tokenized", {"message": tokenized})])
        try:
            self.runtime.start(job_id, config, policy_for(spec))
        except Exception as err:
            self.store.update_job(job_id, status=JobStatus.FAILED, error=f"could not start the job: {err}")
            self.store.add_events(job_id, [(time.time(), "failed", {"message": str(err)})])
            raise
        finally:
            self._submitting.discard(job_id)
        return self.store.get_job(job_id) or record

    def _prepare_data(self, spec: JobSpec) -> str | None:
        """Tokenize ``data.tokenizer`` text now, once (a cache hit costs one hash of the data), so the ranks
        only memory-map it; a line for the job's events, or SpecRejected naming the field and the fix."""
        data = spec.data
        if data.kind != "text" or not data.tokenizer or not data.path:
            return None
        from workers.errors import DataError
        from workers.tokenized import tokenize_text

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
        record = self.get(job_id, principal=principal)
        if record.is_terminal:
            raise JobConflict(
                f"job {job_id} is already {record.status.value}.", job_id=job_id, fix="nothing to cancel"
            )
        if not self.runtime.exists(job_id):
            self.store.update_job(job_id, status=JobStatus.CANCELLED, error=None)
            self.store.add_events(job_id, [(time.time(), "cancelled", {"message": "cancelled (no live supervisor)"})])
            return self.get(job_id)
        self.runtime.cancel(job_id, "cancelled by user")
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            self.poll_once(job_id)
            record = self.get(job_id)
            if record.is_terminal:
                return record
            time.sleep(0.2)
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
        self.runtime.scale(job_id, dp)
        self.store.add_events(job_id, [(time.time(), "scale_requested", {"message": f"dp -> {dp} requested via API"})])
        return self.get(job_id)

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
        config = spec.to_run_config(job_id=job_id, checkpoint_root=str(self.settings.checkpoint_root(job_id).resolve()))
        model = config.model
        if model.arch != "llama":
            raise ConfigError(
                f"job {job_id} trains the built-in GPT (model.kind={spec.model.kind!r}), which has no Hugging Face "
                "format; only Llama-family models (model.hf or a llama preset) export.",
                field="model.kind", fix="export a job that trains a Llama-family model",
            )
        out_dir = os.path.expanduser(out)
        out_dir = out_dir if os.path.isabs(out_dir) else os.path.join(self._base_dir, out_dir)
        out_dir = os.path.abspath(out_dir)
        if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
            raise JobConflict(f"out {out_dir} already exists and is not empty.", job_id=job_id, field="out",
                              fix="give a new or empty folder; exports never overwrite")
        root = config.checkpoint.path
        step, directory = _committed_step(job_id, root, step)
        path = self.runtime.export(step_dir=directory, out_dir=out_dir, model=model, source_dir=model.hf_path,
                                   timeout_s=EXPORT_TIMEOUT_S)
        self.store.add_events(job_id, [(time.time(), "exported",
                                        {"message": f"step {step} -> {path} (requested via API)"})])
        return {"hf": path, "step": step}

    def plan(self, spec: JobSpec) -> dict[str, Any]:
        return planner.plan_report(resolve_paths(spec, self._base_dir),
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

    def metrics_text(self) -> str:
        from service.prometheus import render_job_metrics

        return render_job_metrics(self.store)

    def close(self) -> None:
        self._stop.set()
        self._poller.join(timeout=5)
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
            if record is None or record.is_terminal or job_id in self._submitting:
                return
            update = self.runtime.updates(job_id, self.store.get_cursor(job_id), self._step_cursor.get(job_id, 0))
            if update is None:
                self._supervisor_lost(record)
                return
            self._persist(record, update)

    def _persist(self, record: JobRecord, update: dict[str, Any]) -> None:
        job_id = record.id
        events = update.get("events", [])
        if events:
            self.store.add_events(job_id, [(e["ts"], e["kind"], {"message": e["detail"]}) for e in events])
            self.store.set_cursor(job_id, max(e["seq"] for e in events))
        steps = update.get("steps", [])
        if steps:
            self.store.add_steps(job_id, [
                StepRecord(job_id=job_id, step=row["step"], loss=row.get("loss"), tokens_per_s=row.get("tokens_per_s"),
                           step_s=row.get("step_s"), compute_s=row.get("compute_s"),
                           comm_wait_s=row.get("comm_wait_s"), ts=row["ts"], attempt=row.get("attempt", 0))
                for row in steps
            ])
            self._step_cursor[job_id] = max(row["seq"] for row in steps)
        fields = {key: update.get(key) for key in ("step", "loss", "tokens_per_s", "world_size", "restarts",
                                                   "last_checkpoint_step", "layout", "goodput", "attempt", "error")}
        fields["stragglers"] = update.get("stragglers", [])
        if update.get("artifacts"):
            fields["artifacts"] = update["artifacts"]
        fields["status"] = JobStatus(update["status"])
        fields = {key: value for key, value in fields.items() if value is not None or key == "error"}
        self.store.update_job(job_id, **fields)
        if fields["status"].is_terminal:
            self.runtime.release(job_id)
            self._step_cursor.pop(job_id, None)

    def _supervisor_lost(self, record: JobRecord) -> None:
        """A live job without a supervisor (its node died, or the cluster restarted): start a new one.

        It resumes from the newest committed checkpoint; the loss counts against the restart budget.
        """
        spec = JobSpec.model_validate(record.spec)
        policy = policy_for(spec)
        # A job that never got past QUEUED lost nothing: its supervisor is (re)created for free.
        spent = 0 if record.status == JobStatus.QUEUED else 1
        if spent and record.restarts >= spec.fault_tolerance.max_restarts:
            self.store.update_job(record.id, status=JobStatus.FAILED,
                                  error=f"supervisor lost and restarted {record.restarts} times, "
                                        f"max_restarts={spec.fault_tolerance.max_restarts}")
            self.store.add_events(record.id, [(time.time(), "failed", {"message": "supervisor lost; budget spent"})])
            return
        config = spec.to_run_config(job_id=record.id, checkpoint_root=str(self.settings.checkpoint_root(record.id).resolve()))
        policy = dataclasses.replace(policy, restarts_used=record.restarts + spent)
        self.store.add_events(record.id, [(time.time(), "supervisor_lost",
                                           {"message": "no live supervisor; starting a new one from the last checkpoint"})])
        self.store.set_cursor(record.id, 0)
        self._step_cursor.pop(record.id, None)
        self.runtime.start(record.id, config, policy)


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


def _committed_step(job_id: str, root: str, step: int | None) -> tuple[int, str]:
    """``(step, step_dir)`` of a committed checkpoint of the job (sizes checked here; the export task
    verifies the checksums as it reads), or JobConflict naming the committed steps there are."""
    if step is None:
        found = latest_committed(root, checksums=False)
        if found is not None:
            return found
    else:
        directory = step_dir(root, step)
        try:
            verify(directory, checksums=False)
            return step, directory
        except CheckpointError:
            pass
    committed = []
    for number, directory in list_steps(root):
        try:
            verify(directory, checksums=False)
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
