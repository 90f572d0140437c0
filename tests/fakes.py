"""Named fakes for tests above the unit level. Each one is real where it is cheap and fake where the
real thing needs a cluster:

* :class:`InMemoryManager` - the job service as the REST API sees it (``etrain.service.ports.JobManagerPort``)
  for API and CLI tests: the REAL ``JobStore`` (SQLite), the REAL spec checks (``check_spec`` and,
  once it exists, the planner), and simulated training instead of Ray. Deterministic: training
  advances only when a test calls :meth:`InMemoryManager.advance`, or by ``steps_per_poll`` steps on
  every ``get`` (so a polling client such as ``etrain watch`` sees a job run to the end).
* :class:`FakeRuntime` - the Ray side (``etrain.service.runtime.cluster.Runtime``) for the REAL
  ``etrain.service.manager.JobManager``: it answers ``updates`` in the supervisor's format with simulated
  progress, so the manager's own logic runs without Ray.

Neither imports Ray or torch.
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from typing import Any

from etrain.service.access.storage_roots import StorageRoots, pin
from etrain.service.access.tenancy import ADMIN, Principal
from etrain.service.errors import (
    ChaosDisabled,
    JobConflict,
    JobNotFound,
    RankNotFound,
    ServiceUnavailable,
    SpecRejected,
)
from etrain.service.planning.spec import JobSpec, SpecProblem
from etrain.service.planning.spec_checks import check_spec
from etrain.service.planning.spec_paths import pin_paths
from etrain.service.ports import ChaosRequest
from etrain.service.store import idempotency
from etrain.service.store.job_store import JobStore
from etrain.service.store.records import EventRecord, JobRecord, JobStatus, StepRecord
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.messages import RANK_CHAOS_ACTIONS

try:  # the planner is written alongside; until it lands the fake checks the spec rules only
    from etrain.service.planning import planner as _planner
except ImportError:  # pragma: no cover - depends on the tree's state
    _planner = None

LIVE = tuple(status for status in JobStatus if not status.is_terminal)


def simulated_loss(step: int) -> float:
    """A smooth, decreasing loss curve the tests can predict."""
    return round(0.5 + 5.0 * math.exp(-step / 20.0), 6)


def _layout_text(pp: int, dp: int, tp: int, zero: int) -> str:
    return f"pp{pp}·dp{dp}·tp{tp} zero={zero}"


class InMemoryManager:
    """Fake ``JobManagerPort``: real store and validation, simulated training. Not thread-safe
    beyond what the store gives; API tests drive it from one client at a time."""

    STEP_S = 0.1  # simulated seconds per step
    MFU: float | None = None  # simulated model FLOPs utilisation of each step (None: a CPU job's)

    def __init__(
        self,
        store: JobStore,
        *,
        enable_chaos: bool = False,
        base_dir: str | None = None,
        steps_per_poll: int = 0,
        checkpoint_every: int = 5,
        storage_roots: tuple[str, ...] = (),
    ):
        self.store = store
        self.enable_chaos = enable_chaos
        self.base_dir = base_dir or os.getcwd()
        self.steps_per_poll = steps_per_poll
        self.checkpoint_every = checkpoint_every
        self.storage = StorageRoots.of(storage_roots or (self.base_dir,))  # the real rule; default root: base_dir
        self.chaos_orders: list[tuple[str, dict[str, Any]]] = []
        self.exports: list[tuple[str, int, str]] = []  # (job, step, out) of simulated exports
        self.closed = False
        self._lock = threading.Lock()

    # -- the port -------------------------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> JobSpec:
        """Same order as the real manager: storage roots, spec rules, auto layout, planner rules."""
        spec, outside = pin_paths(spec, self.base_dir, self.storage)
        if outside:
            raise SpecRejected(outside)
        problems: list[SpecProblem] = list(check_spec(spec))
        if not problems and spec.is_auto:
            if _planner is None:
                max_workers = spec.parallelism.max_workers  # type: ignore[union-attr]
                from etrain.service.planning.spec import ParallelismSpec

                spec = spec.with_layout(ParallelismSpec(dp=max_workers))
            else:
                spec = spec.with_layout(_planner.resolve_auto(spec).layout)
            problems += check_spec(spec)
        if not problems and _planner is not None:
            problems += _planner.check_plan(spec)
        if problems:
            raise SpecRejected(problems)
        return spec

    def submit(self, spec: JobSpec, *, principal: Principal = ADMIN, idempotency_key: str | None = None) -> JobRecord:
        digest = idempotency.request_hash(spec) if idempotency_key is not None else None
        if idempotency_key is not None:  # the real manager's rules (service/store/idempotency.py)
            key = idempotency.check_key(idempotency_key)
            replayed = idempotency.replay(
                self.store, principal.tenant, key, digest, earlier=idempotency.earlier_hashes(spec)
            )
            if replayed is not None:
                return replayed
        spec = self.validate(spec)
        layout = spec.layout
        job_id = f"{spec.name.lower()}-{uuid.uuid4().hex[:8]}"
        now = time.time()
        try:
            self.store.create_job(
                job_id=job_id,
                name=spec.name,
                spec=spec.model_dump(mode="json", by_alias=True),
                world_size=layout.pp * layout.dp * layout.tp,
                layout=_layout_text(layout.pp, layout.dp, layout.tp, layout.zero),
                tenant=principal.tenant,
                priority=spec.priority,
                idempotency_key=idempotency_key,
                request_hash=digest,
            )
        except JobConflict:
            replayed = idempotency.replay(self.store, principal.tenant, idempotency_key, digest) if digest else None
            if replayed is None:
                raise
            return replayed
        self.store.add_events(job_id, [(now, "submitted", {"message": "accepted"})])
        self.store.update_job(job_id, status=JobStatus.RUNNING, attempt=1)
        self.store.add_events(job_id, [(now, "started", {"message": "attempt 1 running"})])
        return self._require(job_id)

    def get(self, job_id: str, *, principal: Principal = ADMIN) -> JobRecord:
        job = self._require(job_id, principal)
        if self.steps_per_poll and job.status == JobStatus.RUNNING:
            job = self.advance(job_id, self.steps_per_poll)
        return job

    def list(
        self, status: str | None = None, limit: int = 100, offset: int = 0, *, principal: Principal = ADMIN
    ) -> list[JobRecord]:
        return self.store.list_jobs(status=status, limit=limit, offset=offset, tenant=principal.tenant_filter)

    def events(self, job_id: str, since_seq: int = 0, *, principal: Principal = ADMIN) -> list[EventRecord]:
        self._require(job_id, principal)
        return self.store.events(job_id, since_seq=since_seq)

    def steps(self, job_id: str, since_step: int = -1, *, principal: Principal = ADMIN) -> list[StepRecord]:
        self._require(job_id, principal)
        return self.store.steps(job_id, since_step=since_step)

    def cancel(self, job_id: str, *, principal: Principal = ADMIN) -> JobRecord:
        job = self._require(job_id, principal)
        if job.is_terminal:
            raise JobConflict(
                f"job {job_id} is already {job.status.value}.",
                job_id=job_id,
                status=job.status,
                fix="nothing to cancel",
            )
        # Like the real manager, the request is an event; the simulated supervisor then stops at once.
        self.store.add_events(job_id, [(time.time(), "cancel_requested", {"message": "cancel requested via API"})])
        job = self.store.update_job(job_id, status=JobStatus.CANCELLED, expect_status=LIVE)
        self.store.add_events(job_id, [(time.time(), "cancelled", {"message": "cancelled by user"})])
        return job

    def scale(self, job_id: str, dp: int, *, principal: Principal = ADMIN) -> JobRecord:
        job = self._require(job_id, principal)
        if job.is_terminal:
            raise JobConflict(
                f"job {job_id} is {job.status.value}; it cannot be resized.", job_id=job_id, status=job.status
            )
        spec = JobSpec.model_validate(job.spec)
        layout = spec.layout
        per_step = dp * spec.training.micro_batch
        if not spec.min_dp <= dp <= spec.max_dp or spec.training.global_batch % per_step:
            raise SpecRejected(
                [
                    SpecProblem(
                        field="dp",
                        message=f"dp={dp} is outside resources.min_dp..max_dp = {spec.min_dp}..{spec.max_dp} or does not "
                        f"divide training.global_batch={spec.training.global_batch}.",
                        fix=f"choose dp between {spec.min_dp} and {spec.max_dp} that divides the global batch",
                    )
                ]
            )
        self.store.add_events(job_id, [(time.time(), "scale_requested", {"message": f"dp -> {dp}"})])
        job = self.store.update_job(
            job_id,
            world_size=layout.pp * dp * layout.tp,
            layout=_layout_text(layout.pp, dp, layout.tp, layout.zero),
        )
        self.store.add_events(job_id, [(time.time(), "resized", {"message": f"running at dp={dp}"})])
        return job

    def logs(
        self, job_id: str, rank: int, tail: int = 200, offset: int | None = None, *, principal: Principal = ADMIN
    ) -> dict[str, Any]:
        """Simulated like the training: rank ``rank``'s lines are a start line and one line per step
        trained so far (the real format of ``workers/rank/worker.py``); ``next_offset`` counts lines."""
        job = self._require(job_id, principal)
        if rank >= job.world_size:
            raise RankNotFound(job_id, rank, job.world_size)
        if job.attempt == 0:
            raise JobConflict(
                f"job {job_id} has not started yet ({job.status.value}): no rank has written a log.",
                job_id=job_id,
                field="rank",
                fix=f"wait until it runs (`etrain watch {job_id}`)",
            )
        total = JobSpec.model_validate(job.spec).training.steps
        lines = [f"attempt 1: rank {rank}/{job.world_size} on 127.0.0.1, layout {job.layout}, fresh start"]
        lines += [
            f"step {s}/{total} loss {simulated_loss(s):.4f} compute {0.8 * self.STEP_S:.3f}s "
            f"comm_wait {0.2 * self.STEP_S:.3f}s"
            for s in range(1, job.step + 1)
        ]
        if offset is None:
            return {"job_id": job_id, "rank": rank, "lines": lines[-tail:], "next_offset": len(lines)}
        start = 0 if offset > len(lines) else offset
        chunk = lines[start : start + tail]
        return {"job_id": job_id, "rank": rank, "lines": chunk, "next_offset": start + len(chunk)}

    def chaos(self, job_id: str, request: dict[str, Any], *, principal: Principal = ADMIN) -> dict[str, Any]:
        if not self.enable_chaos:
            raise ChaosDisabled()
        order = ChaosRequest.model_validate(request)  # the API sends a validated request as a dict
        job = self._require(job_id, principal)
        if job.is_terminal:
            raise JobConflict(f"job {job_id} is {job.status.value}; nothing to inject into.", job_id=job_id)
        if order.action in RANK_CHAOS_ACTIONS and not 0 <= (order.rank or 0) < job.world_size:
            raise SpecRejected(
                [
                    SpecProblem(
                        field="rank",
                        message=f"rank {order.rank} is outside the job's {job.world_size} ranks.",
                        fix=f"use 0..{job.world_size - 1}",
                    )
                ]
            )
        self.chaos_orders.append((job_id, dict(request)))
        self.store.add_events(job_id, [(time.time(), "chaos_armed", {"message": f"{order.action} armed"})])
        return {"id": len(self.chaos_orders), **request, "armed": True}

    def export(
        self, job_id: str, step: int | None, out: str, *, dtype: str | None = None, principal: Principal = ADMIN
    ) -> dict[str, Any]:
        """Simulated like the training: the same refusals as the real manager (unknown job, a GPT model,
        a non-empty ``out``, a step that was never checkpointed), then the export is only recorded in
        ``self.exports``; nothing is written (tests/e2e/test_rest_hf.py exports for real)."""
        job = self._require(job_id, principal)
        spec = JobSpec.model_validate(job.spec)
        if spec.model.kind != "llama":
            raise ConfigError(
                f"job {job_id} trains the built-in GPT, which has no Hugging Face format.",
                field="model.kind",
                fix="export a job that trains a Llama-family model",
            )
        out_dir = pin(out, self.base_dir)
        refused = self.storage.check("out", out, out_dir)
        if refused is not None:
            raise SpecRejected([SpecProblem(field=refused.field, message=refused.message, fix=refused.fix)])
        if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
            raise JobConflict(
                f"out {out_dir} already exists and is not empty.",
                job_id=job_id,
                field="out",
                fix="give a new or empty folder; exports never overwrite",
            )
        every = self.checkpoint_every
        committed = [s for s in range(1, job.step + 1) if every and s % every == 0]
        if (step is None and not committed) or (step is not None and step not in committed):
            raise JobConflict(
                f"job {job_id} has no committed checkpoint at step {step} (committed: {committed}).",
                job_id=job_id,
                field="step",
                fix="pass a committed step",
            )
        chosen = committed[-1] if step is None else step
        dtype = dtype or spec.checkpoint.export_dtype
        self.exports.append((job_id, chosen, out_dir))
        self.store.add_events(job_id, [(time.time(), "exported", {"message": f"step {chosen} -> {out_dir} ({dtype})"})])
        return {"hf": out_dir, "step": chosen, "dtype": dtype}

    def plan(self, spec: JobSpec, *, principal: Principal = ADMIN) -> dict[str, Any]:
        spec, outside = pin_paths(spec, self.base_dir, self.storage)
        if outside:
            raise SpecRejected(outside)
        if _planner is not None:
            return _planner.plan_report(spec)  # check_spec + planner rules in one answer
        problems = [p.to_dict() for p in check_spec(spec)]
        return {"feasible": not problems, "problems": problems, "layout": None, "estimate": None, "auto": None}

    #: The simulated cluster ``cluster()`` reports: one node, every job running on it at once.
    NODE = {"node_id": "fake-node-1", "alive": True, "cpus": 1024.0, "gpus": 64.0, "memory_gib": 1024.0}

    def cluster(self, *, principal: Principal = ADMIN) -> dict[str, Any]:
        """Jobs start at once here (no queue): each live job holds its world size x resources per worker."""
        live = [job for job in self.store.active_jobs() if not job.is_terminal]
        holders, used_cpus, used_gpus, used_memory = [], 0.0, 0.0, 0.0
        for job in live:
            resources = JobSpec.model_validate(job.spec).resources
            cpus, gpus = job.world_size * resources.cpus_per_worker, job.world_size * resources.gpus_per_worker
            memory = job.world_size * (resources.host_memory_gb or 0.0)
            used_cpus, used_gpus, used_memory = used_cpus + cpus, used_gpus + gpus, used_memory + memory
            if principal.can_see(job.tenant):
                holders.append(
                    {
                        "job_id": job.id,
                        "status": job.status.value,
                        "priority": job.priority,
                        "tenant": job.tenant,
                        "world_size": job.world_size,
                        "cpus": cpus,
                        "gpus": gpus,
                        "memory_gib": memory,
                        "nodes": [{"node_id": self.NODE["node_id"], "cpus": cpus, "gpus": gpus, "memory_gib": memory}],
                    }
                )
        node = {
            **self.NODE,
            "free_cpus": self.NODE["cpus"] - used_cpus,
            "free_gpus": self.NODE["gpus"] - used_gpus,
            "free_memory_gib": self.NODE["memory_gib"] - used_memory,
        }
        totals = {
            "nodes": 1,
            "alive_nodes": 1,
            "cpus": node["cpus"],
            "gpus": node["gpus"],
            "memory_gib": node["memory_gib"],
            "free_cpus": node["free_cpus"],
            "free_gpus": node["free_gpus"],
            "free_memory_gib": node["free_memory_gib"],
            "running_jobs": len(live),
            "queued_jobs": 0,
        }
        return {"nodes": [node], "totals": totals, "jobs": holders, "queue": [], "observed_at": time.time()}

    def health(self) -> dict[str, Any]:
        return {"db": "ok" if self.store.ping() else "error", "ray": "ok", "runtime": "fake"}

    def metrics_text(self, *, principal: Principal | None = None) -> str:
        from etrain.service.prometheus import render_job_metrics

        return render_job_metrics(self.store, principal)

    def close(self) -> None:
        self.closed = True

    # -- simulation controls (tests only) -----------------------------------------------------------

    def advance(self, job_id: str, num_steps: int) -> JobRecord:
        """Train ``num_steps`` more steps: step metrics, checkpoints, success at training.steps."""
        with self._lock:
            job = self._require(job_id)
            if job.is_terminal:
                return job
            spec = JobSpec.model_validate(job.spec)
            total = spec.training.steps
            tokens_per_s = spec.training.global_batch * spec.model.resolved()["seq_len"] / self.STEP_S
            first, last = job.step + 1, min(total, job.step + num_steps)
            now = time.time()
            records = [
                StepRecord(
                    job_id=job_id,
                    step=step,
                    loss=simulated_loss(step),
                    tokens_per_s=tokens_per_s,
                    step_s=self.STEP_S,
                    compute_s=0.8 * self.STEP_S,
                    comm_wait_s=0.2 * self.STEP_S,
                    ts=now,
                    attempt=job.attempt,
                    mfu=self.MFU,
                )
                for step in range(first, last + 1)
            ]
            self.store.add_steps(job_id, records)
            fields: dict[str, Any] = {}
            every = self.checkpoint_every
            checkpoints = [s for s in range(first, last + 1) if every and s % every == 0]
            if checkpoints:
                self.store.add_events(
                    job_id, [(now, "checkpoint", {"message": f"committed step {s}"}) for s in checkpoints]
                )
                fields["last_checkpoint_step"] = checkpoints[-1]
            if last >= total:
                fields["status"] = JobStatus.SUCCEEDED
            if records:
                fields.update(step=last, loss=records[-1].loss, tokens_per_s=tokens_per_s, goodput=0.9, mfu=self.MFU)
            job = self.store.update_job(job_id, **fields) if fields else job
            if job.status == JobStatus.SUCCEEDED:
                self.store.add_events(job_id, [(now, "succeeded", {"message": f"finished {total} steps"})])
            return job

    def fail(self, job_id: str, error: str) -> JobRecord:
        job = self.store.update_job(job_id, status=JobStatus.FAILED, error=error, expect_status=LIVE)
        self.store.add_events(job_id, [(time.time(), "failed", {"message": error})])
        return job

    def _require(self, job_id: str, principal: Principal = ADMIN) -> JobRecord:
        job = self.store.get_job(job_id)
        if job is None or not principal.can_see(job.tenant):
            raise JobNotFound(job_id)
        return job


class FakeRuntime:
    """Fake ``etrain.service.runtime.cluster.Runtime`` for the real ``JobManager``: no Ray, simulated supervisors.

    Each ``updates`` call of a running job advances it by ``steps_per_update`` steps and returns the
    supervisor's update dict (status, fields, new events and step rows past the caller's cursors).
    """

    #: The simulated cluster (``cluster()``): one node big enough that every test job fits at once.
    DEFAULT_NODES: dict[str, dict[str, float]] = {"fake-node-1": {"CPU": 1024.0, "GPU": 64.0}}
    NODE_MEMORY_BYTES = float(1024**4)  # 1 TiB of host memory per simulated node

    def __init__(
        self,
        *,
        steps_per_update: int = 1,
        step_s: float = 0.1,
        nodes: dict[str, dict[str, float]] | None = None,
        prune_updates: int = 0,
    ):
        """``prune_updates``: how many updates after its end a job still says it prunes old checkpoints (the
        supervisor's ``pruning``; -1: for ever)."""
        self.steps_per_update = steps_per_update
        self.prune_updates = prune_updates
        self.prune_left: dict[str, int] = {}
        self.step_s = step_s
        # Every Ray node reports host memory (its ``memory`` resource, which ranks' bundles ask for): a node given
        # without it has NODE_MEMORY_BYTES, as a real one has its RAM's share.
        self.nodes = {
            name: {"memory": self.NODE_MEMORY_BYTES, **total} for name, total in (nodes or self.DEFAULT_NODES).items()
        }
        self.capacity_requests: list[list[dict[str, float]]] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, ...]] = []
        self.closed = False
        #: While set, running jobs take no step (a test reads a job before its first step without racing the poller).
        self.hold = False
        self._lock = threading.Lock()

    def start(self, job_id: str, config: Any, policy: Any) -> None:
        with self._lock:
            self.calls.append(("start", job_id))
            self.jobs[job_id] = job = {
                "config": config,
                "policy": policy,
                "status": "RUNNING",
                "step": 0,
                "dp": config.parallel.dp,
                "attempt": 1,
                "events": [],
                "steps": [],
                "chaos": [],
                "error": None,
            }
            for request in getattr(policy, "chaos_requests", ()):  # armed before the launch, like the supervisor
                job["chaos"].append(dict(request))
                self._record(job_id, "chaos_armed", f"{request['action']} (order {len(job['chaos'])})")
            self._record(job_id, "started", "attempt 1 running")

    def exists(self, job_id: str) -> bool:
        return job_id in self.jobs

    def updates(self, job_id: str, since_seq: int, since_step: int) -> dict[str, Any] | None:
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None:
                return None
            config = job["config"]
            if job["status"] == "RUNNING" and not self.hold:
                for _ in range(self.steps_per_update):
                    if job["step"] >= config.training.steps:
                        break
                    job["step"] += 1
                    job["steps"].append(
                        {
                            "seq": len(job["steps"]) + 1,
                            "step": job["step"],
                            "loss": simulated_loss(job["step"]),
                            "tokens_per_s": config.tokens_per_step / self.step_s,
                            "step_s": self.step_s,
                            "compute_s": 0.8 * self.step_s,
                            "comm_wait_s": 0.2 * self.step_s,
                            "ts": time.time(),
                            # numbered on from the job's last attempt, like the real supervisor (JobPolicy.attempt_base)
                            "attempt": job["attempt"] + getattr(job["policy"], "attempt_base", 0),
                        }
                    )
                if job["step"] >= config.training.steps:
                    job["status"] = "SUCCEEDED"
                    if getattr(job["policy"], "export", False):  # the supervisor's export, simulated
                        job["artifacts"] = {"hf": os.path.join(config.checkpoint.path, "hf-export")}
                        self._record(job_id, "exported", f"step {job['step']} -> {job['artifacts']['hf']}")
                    self._record(job_id, "succeeded", f"finished {config.training.steps} steps")
            latest = job["steps"][-1] if job["steps"] else {}
            parallel = config.parallel
            pruning = False
            if job["status"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                left = self.prune_left.setdefault(job_id, self.prune_updates)
                pruning = left != 0
                self.prune_left[job_id] = left - 1 if left > 0 else left
            return {
                "status": job["status"],
                "attempt": job["attempt"] + getattr(job["policy"], "attempt_base", 0),
                "dp": job["dp"],
                "world_size": parallel.pp * job["dp"] * parallel.tp,
                "layout": _layout_text(parallel.pp, job["dp"], parallel.tp, parallel.zero),
                "restarts": getattr(job["policy"], "restarts_used", 0),
                "last_checkpoint_step": None,
                "error": job["error"],
                "step": job["step"],
                "loss": latest.get("loss"),
                "tokens_per_s": latest.get("tokens_per_s"),
                "stragglers": [],
                "artifacts": job.get("artifacts", {}),
                "events": [e for e in job["events"] if e["seq"] > since_seq],
                "steps": [row for row in job["steps"] if row["seq"] > since_step],
                "pruning": pruning,
            }

    def cancel(self, job_id: str, reason: str) -> None:
        with self._lock:
            self.calls.append(("cancel", job_id))
            job = self.jobs[job_id]
            if job["status"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                job["status"] = "CANCELLED"
                self._record(job_id, "cancelled", reason)

    def scale(self, job_id: str, dp: int) -> None:
        with self._lock:
            self.calls.append(("scale", job_id, str(dp)))
            self.jobs[job_id]["dp"] = dp
            self._record(job_id, "resized", f"dp -> {dp}")

    def chaos(self, job_id: str, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("chaos", job_id))
            job = self.jobs.get(job_id)
            if job is None:  # RayRuntime._require: no supervisor to deliver to
                raise ServiceUnavailable(f"the supervisor of job {job_id} is not running", fix="retry in a few seconds")
            job["chaos"].append(dict(request))
            return {"id": len(job["chaos"]), **request, "armed": True}

    def release(self, job_id: str) -> None:
        self.calls.append(("release", job_id))

    def export(
        self,
        *,
        step_dir: str,
        out_dir: str,
        model: Any,
        source_dir: str | None,
        expect_digest: str,
        timeout_s: float,
        dtype: str,
    ) -> str:
        """The real export, in this process instead of a Ray task (torch is imported only when called)."""
        self.calls.append(("export", step_dir, out_dir, dtype))
        from etrain.workers.checkpoints.hf_io import export_hf

        return export_hf(step_dir, out_dir, model, source_dir=source_dir, expect_digest=expect_digest, dtype=dtype)

    #: What ``accelerator_memory_gb`` answers: the GPU memory a real cluster's probe would measure.
    gpu_memory_gb: float | None = None

    def accelerator_memory_gb(self) -> float | None:
        self.calls.append(("accelerator_memory_gb",))
        return self.gpu_memory_gb

    def health(self) -> dict[str, Any]:
        return {"ray": "ok", "nodes": 1}

    def request_capacity(self, bundles: list[dict[str, float]]) -> None:
        """Recorded, as an autoscaler would receive it (``capacity_requests``: every request in order)."""
        self.calls.append(("request_capacity", str(len(bundles))))
        self.capacity_requests.append([dict(bundle) for bundle in bundles])

    def cluster(self) -> Any:
        """``self.nodes``, minus what each live simulated job holds (its ranks packed node by node)."""
        from etrain.service.decisions.admission import ClusterView, NodeView

        with self._lock:
            free = {name: dict(total) for name, total in self.nodes.items()}
            holdings: dict[str, dict[str, dict[str, float]]] = {}
            for job_id, job in self.jobs.items():
                if job["status"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    continue
                per_rank = job["policy"].resources_per_rank
                parallel = job["config"].parallel
                ranks = parallel.pp * job["dp"] * parallel.tp
                held: dict[str, dict[str, float]] = {}
                for name, left in free.items():
                    while ranks and all(left.get(key, 0.0) >= amount for key, amount in per_rank.items()):
                        for key, amount in per_rank.items():
                            left[key] = left.get(key, 0.0) - amount
                            held.setdefault(name, {})[key] = held.get(name, {}).get(key, 0.0) + amount
                        ranks -= 1
                holdings[job_id] = held
            nodes = tuple(NodeView(id=name, alive=True, total=dict(self.nodes[name]), free=free[name]) for name in free)
            return ClusterView(nodes=nodes, holdings=holdings)

    def close(self) -> None:
        self.closed = True

    def _record(self, job_id: str, kind: str, detail: str) -> None:
        events = self.jobs[job_id]["events"]
        events.append({"seq": len(events) + 1, "ts": time.time(), "kind": kind, "detail": detail})
