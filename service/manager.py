"""JobManager: the control plane's one entry point (the API calls nothing else).

``submit`` validates (spec rules, then the planner's layout and memory rules; a job the cluster can
never hold is refused) and stores the job ``QUEUED``. The scheduler (service/jobs/scheduler.py, run at
submit and by the ``etrain-scheduler`` thread) admits a queued job only when
:mod:`etrain.service.decisions.admission` says its whole minimum layout fits now, by priority then FIFO,
and this manager then starts its supervisor. The poller (service/jobs/poller.py, the ``etrain-poller``
thread) pulls each live supervisor's updates into SQLite, so REST reads never touch Ray. On start-up
the manager reattaches to supervisors that outlived a previous control plane, and the queue (rows in
SQLite) is admitted in the same order; a started job whose supervisor is gone is queued again and
resumes from its last committed checkpoint.

This module keeps what the API calls (submit and its checks, reads, cancel/scale, logs, export) and the
wiring; the queue, the poller and the spec -> runtime values live in service/jobs/.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from etrain.service.access.checkpoint_dirs import CheckpointDirectories, taken_conflict
from etrain.service.access.checkpoint_key import load_or_create_key
from etrain.service.access.quotas import TenantQuotas, check_priority
from etrain.service.access.reach import Reach
from etrain.service.access.storage_roots import StorageRoots, pin
from etrain.service.access.tenancy import ADMIN, DEFAULT_TENANT, Principal
from etrain.service.decisions.admission import Admit
from etrain.service.decisions.elastic import ElasticPolicy, ResizeError
from etrain.service.decisions.job_policy import policy_for
from etrain.service.errors import (
    ChaosDisabled,
    JobConflict,
    JobNotFound,
    RankNotFound,
    ServiceUnavailable,
    SpecRejected,
)
from etrain.service.jobs.checkpoints import committed_step
from etrain.service.jobs.poller import SupervisorPoller
from etrain.service.jobs.scheduler import Scheduler
from etrain.service.planning import planner
from etrain.service.planning.spec import ExportDtype, JobSpec, SpecProblem
from etrain.service.planning.spec_checks import check_spec
from etrain.service.planning.spec_paths import pin_paths
from etrain.service.runtime.cluster import CALL_TIMEOUT_S, Runtime
from etrain.service.runtime.control import ChaosHandOver, ControlQueue, ControlRequest, NotYet
from etrain.service.settings import Settings
from etrain.service.store import idempotency
from etrain.service.store.claims import DirectoryTaken
from etrain.service.store.job_store import JobStore
from etrain.service.store.records import EventRecord, JobRecord, JobStatus, StepRecord
from etrain.workers import families
from etrain.workers.checkpoints import storage
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.messages import RANK_CHAOS_ACTIONS
from etrain.workers.protocol.run_config import RunConfig
from etrain.workers.rank.rank_log import rank_log_path, read_lines

log = logging.getLogger(__name__)

#: How long POST /v1/jobs/{id}/export waits for its export task (a 70B model is ~280 GB of fp32 to write).
EXPORT_TIMEOUT_S = 3600.0
#: How long a request waits for the planner's process (a search within the spec's bounds takes well under this).
PLAN_TIMEOUT_S = 120.0

_T = TypeVar("_T")


class PlannerProcesses:
    """The planner's searches (``plan_report``, ``resolve_auto``) in worker processes, off the API's process.

    The planner is pure Python: run on the API's threads, a few concurrent auto plans hold the GIL and every
    other request waits for it (issue #17: 30 plans stalled another tenant's GET for 6.5 s). In a process of
    its own a plan takes a core, not the API's interpreter. ``ETRAIN_PLAN_WORKERS`` processes (default 1;
    0: on the calling thread, as before), started on the first plan ("spawn": the API's process has
    threads, and a fork would copy their locks) and shared by every manager of the process; a pool whose
    worker died is replaced, and that one call runs here. A worker runs at a lower CPU priority than the API
    (nice +10) and ends with the process that started it (``planner.worker_init``).
    """

    _pools: dict[int, ProcessPoolExecutor] = {}
    _users = 0  # open managers: the last one to close stops the workers
    _lock = threading.Lock()

    def __init__(self, workers: int):
        self.workers = workers
        with self._lock:
            PlannerProcesses._users += 1
        self._closed = False

    def warm(self) -> None:
        """Start the worker processes now, without waiting for them: the first plan then does not wait the
        second or so a new interpreter takes to import the planner."""
        if self.workers:
            self._pool().submit(os.getpid)

    def close(self) -> None:
        """This user is done; the last one stops the worker processes (a later plan starts them again)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            PlannerProcesses._users -= 1
            last = PlannerProcesses._users == 0
        if last:
            self._close_all()

    def run(self, function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        if self.workers == 0:
            return function(*args, **kwargs)
        pool = self._pool()
        try:
            return pool.submit(function, *args, **kwargs).result(timeout=PLAN_TIMEOUT_S)
        except BrokenProcessPool:
            log.warning("the planner's worker process died; starting another")
            with self._lock:
                if self._pools.get(self.workers) is pool:
                    del self._pools[self.workers]
            return function(*args, **kwargs)
        except FutureTimeout:
            raise ServiceUnavailable(
                f"the planner did not answer within {PLAN_TIMEOUT_S:.0f} s.",
                fix="retry; a plan that keeps timing out is a bug worth reporting",
            ) from None

    def _pool(self) -> ProcessPoolExecutor:
        with self._lock:
            pool = self._pools.get(self.workers)
            if pool is None:
                if not self._pools:
                    atexit.register(PlannerProcesses._close_all)
                pool = ProcessPoolExecutor(
                    max_workers=self.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=planner.worker_init,
                )
                self._pools[self.workers] = pool
            return pool

    @classmethod
    def _close_all(cls) -> None:
        """Stop the workers and drop the pools (also at exit), so their queues' semaphores are released (the
        multiprocessing resource tracker warns of leaked ones otherwise)."""
        with cls._lock:
            pools, cls._pools = list(cls._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)


#: A cache found this recently is kept, in use or not: a submit that found it may not have recorded its job yet.
TOKEN_CACHE_MIN_IDLE_S = 600
#: A temporary file in the token cache unchanged this long was left by a writer that died (a writer appends a batch
#: of ids every few seconds).
TOKEN_CACHE_STALE_TEMPORARY_S = 3600


@dataclasses.dataclass(frozen=True)
class Tokenized:
    """What a submit did with ``data.tokenizer`` text: the event's line, the cache's content hash, whether it
    wrote the cache (else it reused one)."""

    message: str
    sha256: str
    written: bool


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
            key=self._checkpoint_key,
            default_root=lambda job_id: self.settings.checkpoint_location(job_id),
        )
        #: Which paths a tenant may reach: shared and own roots, own job directories (service/access/reach.py).
        self._reach = Reach(
            tree=settings.checkpoint_tree, owners=settings.tenant_roots, token_cache=settings.token_cache_dir
        )
        self.store.record_checkpoint_dirs(self._directories.root_of)  # jobs stored before directories were
        self._submitting: set[str] = set()  # jobs whose supervisor is being created: not "lost", not queued
        self._quotas = TenantQuotas(max_jobs=settings.tenant_max_jobs, max_workers=settings.tenant_max_workers)
        self._planner = PlannerProcesses(settings.plan_workers)
        self._scheduler = Scheduler(
            store=self.store, runtime=runtime, settings=settings, starting=self._submitting, start=self._start_admitted
        )
        self._poller = SupervisorPoller(
            store=self.store, runtime=runtime, settings=settings, starting=self._submitting, scheduler=self._scheduler
        )
        self._scheduler.start()
        self._poller.start()
        self._control = ControlQueue(self._deliver_control, on_give_up=self._control_failed)
        #: Chaos orders for jobs whose supervisor has not started, handed to it with its start (_start_admitted).
        self._chaos = ChaosHandOver(wait_s=2 * CALL_TIMEOUT_S)

    # --- jobs ------------------------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> JobSpec:
        """The spec as it will run (auto layout and auto loss chunking resolved, the host memory Ray reserves per
        rank filled in), or SpecRejected with every problem. ``spec`` is :meth:`_check_reach`'s, its paths pinned
        once: resolved again here, a link a tenant swapped meanwhile would store a path the reach rule never saw
        (another tenant's job directory, the service's token cache)."""
        problems: list[SpecProblem] = list(check_spec(spec))
        available = self.device_memory_gb(spec.resources.device) if not problems else None
        if not problems and spec.is_auto:
            spec = spec.with_layout(self._planner.run(planner.resolve_auto, spec, available_gb=available).layout)
            problems += check_spec(spec)
        if not problems:
            problems += planner.check_plan(spec, available_gb=available)
        if problems:
            raise SpecRejected(problems)
        spec = planner.resolve_loss_chunk(spec, available_gb=available)
        return planner.resolve_host_memory(spec, available_gb=available)

    def submit(self, spec: JobSpec, *, principal: Principal = ADMIN, idempotency_key: str | None = None) -> JobRecord:
        """``idempotency_key``: a retry with the same key and spec returns the job the first request created
        (an :class:`~etrain.service.store.idempotency.ReplayedJob`), the same key with another spec is JobConflict."""
        digest = idempotency.request_hash(spec) if idempotency_key is not None else None
        if idempotency_key is not None:
            replayed = idempotency.replay(
                self.store,
                principal.tenant,
                idempotency.check_key(idempotency_key),
                digest,
                earlier=idempotency.earlier_hashes(spec),
            )
            if replayed is not None:
                return replayed
        check_priority(self.settings, principal, spec.priority)  # PriorityNotAllowed: 403
        self._quotas.precheck(principal, self.store)  # a tenant at its job cap costs no planning: 429
        spec = self.validate(self._check_reach(spec, principal))
        self._scheduler.refuse_beyond_cluster(spec)
        tokenized = self._prepare_data(spec)
        job_id = f"{spec.name.lower()}-{uuid.uuid4().hex[:8]}"
        self._directories.check_resume(spec, principal, tenant_of=self._tenant_of)
        config = self._run_config(spec, job_id)
        self._quotas.admit(principal, job_id, config.parallel.world_size, self.store)  # QuotaExceeded: 429
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
                checkpoint_dir=self._directories.root_of(job_id, spec),  # claimed in the same transaction
                granted_workers=config.parallel.world_size,  # what the tenant's worker quota admitted
            )
        except DirectoryTaken as taken:  # an unfinished job holds an overlapping directory: 409, nothing stored
            self._submitting.discard(job_id)
            self._quotas.release(job_id)
            raise taken_conflict(
                taken.path, holder=taken.holder, holder_tenant=taken.tenant, held=taken.held, principal=principal
            ) from None
        except JobConflict:
            # A concurrent request with the same key won the unique index: answer with its job.
            self._submitting.discard(job_id)
            self._quotas.release(job_id)
            replayed = None
            if idempotency_key is not None:
                replayed = idempotency.replay(
                    self.store, principal.tenant, idempotency_key, digest, earlier=idempotency.earlier_hashes(spec)
                )
            if replayed is None:
                raise
            return replayed
        self.store.add_events(job_id, [(time.time(), "submitted", {"message": f"layout {config.parallel.describe()}"})])
        if tokenized is not None:
            detail = {"message": tokenized.message, "cache_sha256": tokenized.sha256}
            self.store.add_events(job_id, [(time.time(), "data_tokenized", detail)])
        self._submitting.discard(job_id)
        self._scheduler.announce(job_id)
        self._scheduler.schedule(submitted=job_id)  # it starts before we answer when it fits now, else waits QUEUED
        if tokenized is not None and tokenized.written:  # the folder grew: back under its bound, its use recorded
            self._prune_token_cache()
        return self.store.get_job(job_id) or record

    def _check_reach(self, spec: JobSpec, principal: Principal) -> JobSpec:
        """The spec with its paths pinned, after the storage roots and the reach rule (no other tenant's roots
        or job directories): both before anything looks at the files (validate's checks say what is
        missing), so neither answer depends on what exists. Submit and /v1/plan alike."""
        pinned, outside = pin_paths(
            spec, self._base_dir, self.storage, shown_roots=self._reach.visible_roots(self.storage.roots, principal)
        )
        if outside:
            raise SpecRejected(outside)
        problems = self._reach.spec_problems(
            pinned, spec, principal, job_dirs=self._job_dirs(principal), tenant_of=self._tenant_of
        )
        if problems:
            raise SpecRejected(problems)
        return pinned

    def _job_dirs(self, principal: Principal):
        """The recorded job directories near a path that ``principal``'s paths must stay out of."""
        return lambda path: self.store.job_dirs(path, other_than=principal.tenant)

    def _tenant_of(self, job_id: str) -> str | None:
        record = self.store.get_job(job_id)
        return None if record is None else record.tenant

    def _run_config(self, spec: JobSpec, job_id: str) -> RunConfig:
        """The job's run config as this service runs it: its checkpoint root and the service's token cache."""
        return spec.to_run_config(
            job_id=job_id,
            checkpoint_root=self.settings.checkpoint_location(job_id),
            token_cache_dir=self.settings.token_cache_dir,
        )

    def _prepare_data(self, spec: JobSpec) -> Tokenized | None:
        """Tokenize ``data.tokenizer`` text now, once (a cache hit costs a ``stat`` a file, or one hash of data that
        changed), so the ranks only memory-map it; what the job's events say of it, or SpecRejected naming the field
        and the fix."""
        data = spec.data
        if data.kind != "text" or not data.tokenizer or not data.path:
            return None
        from etrain.workers.engine.tokenized import tokenize_text
        from etrain.workers.protocol.errors import DataError

        try:
            cache = tokenize_text(
                data.path,
                data.tokenizer,
                cache_dir=self.settings.token_cache_dir,
                max_bytes=self.submit_tokenize_max_bytes,
                timeout_s=self.submit_tokenize_timeout_s,
            )
        except DataError as err:
            raise SpecRejected([SpecProblem(field=err.field or "data.path", message=err.message, fix=err.fix)]) from err
        return Tokenized(
            message=f"{cache.num_tokens} tokens ({cache.dtype}) "
            f"{'reused from' if cache.reused else 'written to'} {cache.path}",
            sha256=cache.sha256,
            written=not cache.reused,
        )

    def _prune_token_cache(self) -> None:
        """Bring the service's token cache back under ``ETRAIN_TOKEN_CACHE_MAX_GB``: least recently used first,
        never a cache an unfinished job uses or ``etrain prepare-data`` wrote (service/decisions/token_cache.py), and
        temporaries left by writers that died. Logged; any failure is only logged: the job is stored and scheduled
        already, and a cache left over the bound costs disk, not a job."""
        if self.settings.token_cache_max_gb is None:
            return
        from etrain.service.decisions.token_cache import CachedCorpus, to_prune
        from etrain.workers.engine.tokenized import cached_corpora, remove_caches, remove_stale_temporaries

        folder = self.settings.token_cache_dir
        try:
            in_use = self._token_caches_in_use()
            if in_use is None:
                return
            remove_stale_temporaries(folder, older_than_s=TOKEN_CACHE_STALE_TEMPORARY_S)
            pruning = to_prune(
                (CachedCorpus(*found) for found in cached_corpora(folder)),
                max_bytes=int(self.settings.token_cache_max_gb * 1e9),
                in_use=in_use,
                now=time.time(),
                min_idle_s=TOKEN_CACHE_MIN_IDLE_S,
            )
            remove_caches(folder, pruning.remove)
        except Exception:  # noqa: BLE001 - see the docstring: never the submit's failure
            log.warning("token cache %s: could not prune", folder, exc_info=True)
            return
        if pruning.remove:
            log.info(
                "token cache %s: removed %d least recently used caches (%.2f GB) to stay under %g GB",
                folder,
                len(pruning.remove),
                pruning.freed_bytes / 1e9,
                self.settings.token_cache_max_gb,
            )
        if pruning.over_bytes:
            log.warning(
                "token cache %s: %.2f GB over its %g GB bound, every cache left in use by an unfinished job or "
                "used in the last %d s (ETRAIN_TOKEN_CACHE_MAX_GB)",
                folder,
                pruning.over_bytes / 1e9,
                self.settings.token_cache_max_gb,
                TOKEN_CACHE_MIN_IDLE_S,
            )

    def _token_caches_in_use(self) -> set[str] | None:
        """The caches the unfinished jobs train on (their ``data_tokenized`` events say which), or None when one
        of them does not say (a job submitted before the events did): then nothing is pruned."""
        in_use: set[str] = set()
        for record in self.store.active_jobs():
            if not (record.spec.get("data") or {}).get("tokenizer"):
                continue
            said = [e.detail for e in self.store.events(record.id, limit=8) if e.kind == "data_tokenized"]
            if not said or not said[0].get("cache_sha256"):
                log.info("token cache: job %s does not say which cache it uses; nothing pruned", record.id)
                return None
            in_use.add(str(said[0]["cache_sha256"]))
        return in_use

    def get(self, job_id: str, *, principal: Principal = ADMIN) -> JobRecord:
        """The job, if it exists *for this caller*: another tenant's job is JobNotFound, like a missing one."""
        record = self.store.get_job(job_id)
        if record is None or not principal.can_see(record.tenant):
            raise JobNotFound(job_id)
        return record

    def list(
        self, status: str | None = None, limit: int = 100, offset: int = 0, *, principal: Principal = ADMIN
    ) -> list[JobRecord]:
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
            raise JobConflict(f"job {job_id} is already {record.status.value}.", job_id=job_id, fix="nothing to cancel")
        if record.status is JobStatus.QUEUED and self._scheduler.cancel_queued(job_id):
            self._poller.forget(job_id)
            self._chaos.drop(job_id)
            return self.get(job_id)  # it had no supervisor: nothing to stop
        self.store.add_events(job_id, [(time.time(), "cancel_requested", {"message": "cancel requested via API"})])
        self._control.put(ControlRequest(job_id=job_id, action="cancel"))
        return self.get(job_id)

    def scale(self, job_id: str, dp: int, *, principal: Principal = ADMIN) -> JobRecord:
        """Ask for ``dp`` (JobConflict once terminal, SpecRejected outside min_dp..max_dp, QuotaExceeded when the
        larger world would take the tenant over ``ETRAIN_TENANT_MAX_WORKERS``) and return at once."""
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
                dp_multiple=math.lcm(spec.layout.dp_replicate, spec.layout.ep),  # HSDP groups, expert parallelism
            ).check(dp)
        except ResizeError as err:
            raise SpecRejected(
                [
                    SpecProblem(
                        field="dp",
                        message=str(err),
                        fix=f"choose dp between resources.min_dp={spec.min_dp} and "
                        f"resources.max_dp={spec.max_dp} that divides the global batch",
                    )
                ]
            ) from None
        layout = spec.layout
        per_replica = layout.tp * layout.pp * layout.cp
        self._quotas.admit_scale(principal, record, dp, per_replica, self.store)  # QuotaExceeded: 429
        self.store.update_job(job_id, granted_workers=dp * per_replica)  # what the quota counts it at
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
            self._poller.poll_once(job_id)  # the supervisor is CANCELLED now: persist it without waiting a poll
            return
        self._poller.cancel_orphan(job_id)  # no supervisor (never started, or lost): nothing to stop

    def _control_failed(self, request: ControlRequest, err: BaseException) -> None:
        """The ControlQueue gave up on a request: say so in the job's events (the user asked for it)."""
        if self.store.get_job(request.job_id) is None:
            return
        what = "cancel" if request.action == "cancel" else f"scale to dp={request.dp}"
        self.store.add_events(
            request.job_id,
            [
                (
                    time.time(),
                    f"{request.action}_failed",
                    {
                        "message": f"{what} could not be delivered to the job's supervisor: {err}; send it again "
                        "(`etrain cancel` / `etrain scale`) once `etrain status` shows the job running"
                    },
                )
            ],
        )

    def logs(
        self, job_id: str, rank: int, tail: int = 200, offset: int | None = None, *, principal: Principal = ADMIN
    ) -> dict[str, Any]:
        """Recent lines of rank ``rank``'s log file (``workers/rank/rank_log.py``: in the job's checkpoint folder,
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
                    job_id=job_id,
                    status=record.status.value,
                    field="rank",
                    fix=f"wait until it runs (`etrain watch {job_id}`)",
                )
        chunk = read_lines(path, tail=tail, offset=offset)
        return {"job_id": job_id, "rank": rank, "lines": chunk.lines, "next_offset": chunk.offset}

    def _checkpoint_path(self, record: JobRecord) -> str:
        """The job's checkpoint root as its ranks see it (the run config the supervisor was given)."""
        return self._run_config(JobSpec.model_validate(record.spec), record.id).checkpoint.path

    def chaos(self, job_id: str, request: dict[str, Any], *, principal: Principal = ADMIN) -> dict[str, Any]:
        """Deliver a drill to the job's supervisor, or, before it exists (QUEUED, or STARTING before the actor
        is made), keep it for its start: the answer then says ``pending`` and the supervisor arms it (a
        ``chaos_armed`` event) before its first launch. Never a 503 for a job that has not started yet."""
        if not self.settings.enable_chaos:
            raise ChaosDisabled()
        self._check_chaos(self.get(job_id, principal=principal), request)
        with self._chaos.settled(job_id) as kept:
            if not self.runtime.exists(job_id):
                self._check_chaos(self.get(job_id), request)  # read again: it may have ended (or failed to start)
                kept.append(dict(request))
                return {
                    **request,
                    "armed": True,
                    "pending": True,
                    "message": "kept until the job's supervisor starts; armed before its first launch",
                }
        return self.runtime.chaos(job_id, request)

    @staticmethod
    def _check_chaos(record: JobRecord, request: dict[str, Any]) -> None:
        """JobConflict for an ended job, SpecRejected (field ``rank``) for a rank the job does not have."""
        job_id = record.id
        if record.is_terminal:
            raise JobConflict(f"job {job_id} is {record.status.value}; nothing to inject into.", job_id=job_id)
        if request.get("action") in RANK_CHAOS_ACTIONS and not 0 <= int(request.get("rank", -1)) < record.world_size:
            raise SpecRejected(
                [
                    SpecProblem(
                        field="rank",
                        message=f"rank {request.get('rank')} is outside the job's {record.world_size} ranks.",
                        fix=f"use 0..{record.world_size - 1}",
                    )
                ]
            )

    def export(
        self,
        job_id: str,
        step: int | None,
        out: str,
        *,
        dtype: ExportDtype | None = None,
        principal: Principal = ADMIN,
    ) -> dict[str, Any]:
        """Write committed checkpoint ``step`` (default: the newest) of ``job_id`` as a Hugging Face folder
        at ``out`` with the same Ray task a job runs at its end, its weights in ``dtype`` (default: the job's
        ``checkpoint.export_dtype``); returns ``{"hf": path, "step": step, "dtype": dtype}``.

        Any committed checkpoint qualifies, of a running job too (committed steps never change; a
        checkpoint pruned by ``keep_last`` mid-export fails the export, not the job).
        """
        record = self.get(job_id, principal=principal)
        spec = JobSpec.model_validate(record.spec)
        config = self._run_config(spec, job_id)
        model = config.model
        found = families.family(model.arch)
        if not found.has_hf_format:
            raise ConfigError(
                f"job {job_id} trains {found.summary.split(':')[0]} (model.kind={model.arch!r}), which has no "
                "Hugging Face format; only models of a Hugging Face family (model.hf or one of their presets) export.",
                field="model.kind",
                fix="export a job that trains a model of a Hugging Face family",
            )
        out_dir = pin(out, self._base_dir)
        refused = self.storage.check(
            "out", out, out_dir, shown=self._reach.visible_roots(self.storage.roots, principal)
        )
        if refused is not None:  # before the existence check below: the answer must not depend on it
            raise SpecRejected([SpecProblem(field=refused.field, message=refused.message, fix=refused.fix)])
        unreachable = self._reach.problem(
            "out", out_dir, principal, shown=out, job_dirs=self._job_dirs(principal), tenant_of=self._tenant_of
        )
        if unreachable is not None:  # another tenant's root or job directory
            raise SpecRejected([unreachable])
        if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
            raise JobConflict(
                f"out {out_dir} already exists and is not empty.",
                job_id=job_id,
                field="out",
                fix="give a new or empty folder; exports never overwrite",
            )
        root = config.checkpoint.path
        step, directory, digest = committed_step(job_id, root, step, key=self._checkpoint_key)
        dtype = dtype or spec.checkpoint.export_dtype
        path = self.runtime.export(
            step_dir=directory,
            out_dir=out_dir,
            model=model,
            source_dir=model.hf_path,
            expect_digest=digest,
            timeout_s=EXPORT_TIMEOUT_S,
            dtype=dtype,
        )
        self.store.add_events(
            job_id, [(time.time(), "exported", {"message": f"step {step} -> {path} ({dtype}; requested via API)"})]
        )
        return {"hf": path, "step": step, "dtype": dtype}

    def plan(self, spec: JobSpec, *, principal: Principal = ADMIN) -> dict[str, Any]:
        # The same 422 as a submit: a plan must not probe files outside the roots, or another tenant's, either.
        pinned = self._check_reach(spec, principal)
        return self._planner.run(planner.plan_report, pinned, available_gb=self.device_memory_gb(spec.resources.device))

    def warm_planner(self) -> None:
        """Start the planner's worker processes in the background (``etrain serve`` does, at start-up)."""
        self._planner.warm()

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

    def cluster(self, *, principal: Principal = ADMIN) -> dict[str, Any]:
        """Nodes, totals, what each started job holds and the queue with its reasons (GET /v1/cluster)."""
        return self._scheduler.cluster(principal=principal)

    def close(self) -> None:
        self._planner.close()
        self._control.close(timeout_s=5)
        self._poller.close(timeout_s=5)
        self._scheduler.close(timeout_s=5)
        self.runtime.close()
        self.store.close()

    # --- starting an admitted job (the scheduler's ``start``) ---------------------------------------

    def _start_admitted(self, record: JobRecord, admit: Admit, *, raise_errors: bool) -> bool:
        """Start an admitted job's supervisor at the admitted dp (QUEUED -> STARTING first, so a cancel
        that wins the race leaves it cancelled and unstarted)."""
        job_id = record.id
        spec = JobSpec.model_validate(record.spec)
        config = self._run_config(spec, job_id).with_dp(admit.dp)
        # attempt_base: a supervisor recreated after a loss numbers its attempts on from the job's last one,
        # so its step rows replace the recomputed steps' old rows (service/store/job_store.py keeps the higher attempt).
        # The jobs whose signed steps it may resume from: those of its tenant that recorded the same directory.
        owners = self.store.jobs_in_dir(
            self._directories.root_of(job_id, spec), tenant=Principal.reader_of(record.tenant).tenant_filter
        )
        granted = record.granted_workers
        quota = self._quotas.max_workers is not None and record.tenant != DEFAULT_TENANT and granted
        policy = dataclasses.replace(
            policy_for(spec),
            grow_limit_dp=max(spec.min_dp, granted // (spec.layout.tp * spec.layout.pp * spec.layout.cp))
            if quota
            else None,
            restarts_used=record.restarts,
            attempt_base=record.attempt,
            checkpoint_key=self._checkpoint_key,
            chaos_enabled=self.settings.enable_chaos,
            resume_owners=frozenset(owners),
            tenant=record.tenant,
        )
        self._submitting.add(job_id)  # before the status change: the poller and cancel wait for the start
        try:
            try:
                self.store.update_job(
                    job_id,
                    status=JobStatus.STARTING,
                    world_size=config.parallel.world_size,
                    layout=config.parallel.describe(),
                    expect_status=[JobStatus.QUEUED],
                )
            except JobConflict:
                return False  # cancelled meanwhile
            self._scheduler.forget(job_id)
            where = ", ".join(f"{ranks} on {node}" for node, ranks in admit.placement.items())
            self.store.add_events(
                job_id,
                [
                    (
                        time.time(),
                        "admitted",
                        {
                            "message": f"{admit.ranks} rank(s) at dp={admit.dp} fit now ({where}); starting its supervisor"
                        },
                    )
                ],
            )
            self.store.set_cursor(job_id, 0)  # a new supervisor numbers its events from 1
            self._poller.restarted(job_id)
            try:
                with self._chaos.handing_over(job_id) as chaos_requests:  # orders posted before it existed
                    self.runtime.start(job_id, config, dataclasses.replace(policy, chaos_requests=chaos_requests))
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
