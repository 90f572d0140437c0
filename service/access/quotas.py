"""Per-tenant quotas and fair-use caps: what one tenant may hold, and how much of the server it may keep busy.

Holdings, checked by the manager (the admin is exempt from all of them):

* ``ETRAIN_TENANT_MAX_JOBS`` (default 20) caps a tenant's non-terminal jobs (queued ones included): checked
  once before the spec is validated (a tenant at its cap costs the server no planning) and again, with the
  reservation below, right before the row is written.
* ``ETRAIN_TENANT_MAX_WORKERS`` (default: none) caps the ranks (world size) those jobs hold plus the new
  job's, and a ``scale`` that grows a job: its new world size counts instead of the old one. A job counts
  at least at the size it was granted (at submit, then by each accepted ``scale``: ``granted_workers``),
  also while it runs smaller after losing capacity, and with this quota set its supervisor grows back only
  up to that size by itself (its initial ``scale`` target): so a tenant's jobs never hold more than the
  quota, whatever their elastic range; growing past the grant is a ``scale``, checked here.
* ``ETRAIN_TENANT_MIN_PRIORITY`` .. ``ETRAIN_TENANT_MAX_PRIORITY`` (default 0..100), or a tenant's own
  range in ``ETRAIN_TENANT_PRIORITIES``, bound the ``priority`` a tenant may give its jobs.

Concurrency, held by the API while a request runs (:class:`TenantSlots`, :class:`FairUse`):
``ETRAIN_TENANT_MAX_STREAMS`` (default 8) open event streams and ``ETRAIN_TENANT_MAX_PLANS`` (default 2)
plan computations at once. A slot is taken without waiting: over a cap the request is refused at once,
so a flood of one tenant never holds the server's threads or its CPU.

Over any cap the request is refused with :class:`~etrain.service.errors.QuotaExceeded` (HTTP 429 with
``Retry-After``) and nothing is created or changed; a priority out of range is
:class:`~etrain.service.errors.PriorityNotAllowed` (403).

The submit check and the job's row are not one database transaction, so the gate also counts submits it
admitted whose row is not written yet: two concurrent requests cannot both take the last slot. Such a
reservation ends when the row appears, or after ``RESERVATION_S`` (a submit that failed after the
check never writes one; the row follows the check within milliseconds otherwise). A scale that was let
through likewise counts at its new size until the job's row shows it, or ``RESERVATION_S`` passed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from etrain.service.access.tenancy import Principal
from etrain.service.errors import PriorityNotAllowed, QuotaExceeded
from etrain.service.store.job_store import JobStore
from etrain.service.store.records import JobRecord

if TYPE_CHECKING:
    from etrain.service.settings import Settings

RESERVATION_S = 30.0


@dataclass(frozen=True)
class _Reservation:
    tenant: str
    workers: int
    expires: float


class TenantQuotas:
    def __init__(self, *, max_jobs: int | None, max_workers: int | None):
        self.max_jobs = max_jobs
        self.max_workers = max_workers
        self._lock = threading.Lock()
        self._reserved: dict[str, _Reservation] = {}  # job id -> admitted, row not seen yet
        self._scaling: dict[str, _Reservation] = {}  # job id -> the world size a let-through scale asked for

    def precheck(self, principal: Principal, store: JobStore) -> None:
        """QuotaExceeded when ``principal`` already holds ``max_jobs`` unfinished jobs: checked before the
        spec is validated and planned, so a tenant at its cap cannot keep the planner busy with submits."""
        if principal.admin or self.max_jobs is None:
            return
        with self._lock:
            held, pending = self._holdings(principal.tenant, store, time.monotonic())
            jobs = len(held) + len(pending)
        if jobs + 1 > self.max_jobs:
            raise QuotaExceeded("max_jobs", tenant=principal.tenant, limit=self.max_jobs, used=jobs, requested=1)

    def admit(self, principal: Principal, job_id: str, workers: int, store: JobStore) -> None:
        """Admit ``job_id`` (``workers`` ranks) for ``principal`` or raise QuotaExceeded; call it right
        before the job's row is written."""
        if principal.admin or (self.max_jobs is None and self.max_workers is None):
            return
        tenant = principal.tenant
        with self._lock:
            now = time.monotonic()
            held, pending = self._holdings(tenant, store, now)
            jobs = len(held) + len(pending)
            used = self._workers(held) + sum(seat.workers for seat in pending)
            if self.max_jobs is not None and jobs + 1 > self.max_jobs:
                raise QuotaExceeded("max_jobs", tenant=tenant, limit=self.max_jobs, used=jobs, requested=1)
            if self.max_workers is not None and used + workers > self.max_workers:
                raise QuotaExceeded("max_workers", tenant=tenant, limit=self.max_workers, used=used, requested=workers)
            self._reserved[job_id] = _Reservation(tenant, workers, now + RESERVATION_S)

    def admit_scale(self, principal: Principal, record: JobRecord, dp: int, ranks_per_dp: int, store: JobStore) -> None:
        """Let job ``record`` grow to ``dp`` (``dp * ranks_per_dp`` ranks) or raise QuotaExceeded: a scale counts
        against ``max_workers`` like a submit. Shrinking is always allowed (even over a lowered quota)."""
        if principal.admin or self.max_workers is None:
            return
        tenant, world = principal.tenant, dp * ranks_per_dp
        with self._lock:
            now = time.monotonic()
            held, pending = self._holdings(tenant, store, now)
            current = next((self._size(job) for job in held if job.id == record.id), record.world_size)
            if world > current:
                used = self._workers(held) + sum(seat.workers for seat in pending)
                if used - current + world > self.max_workers:
                    room = self.max_workers - (used - current)
                    raise QuotaExceeded(
                        "max_workers",
                        tenant=tenant,
                        limit=self.max_workers,
                        used=used,
                        requested=world - current,
                        job_id=record.id,
                        dp=dp,
                        dp_fits=max(room // ranks_per_dp, 0),
                    )
            self._scaling[record.id] = _Reservation(tenant, world, now + RESERVATION_S)

    def release(self, job_id: str) -> None:
        """``job_id``'s row will never come (its submit lost a checkpoint-directory claim or an idempotency
        race): its reservation ends now instead of after ``RESERVATION_S``."""
        with self._lock:
            self._reserved.pop(job_id, None)

    def _holdings(self, tenant: str, store: JobStore, now: float) -> tuple[list[JobRecord], list[_Reservation]]:
        """The tenant's unfinished jobs and its admitted submits whose rows are not written yet (under the lock;
        expired reservations and scale targets that the rows caught up with are dropped here)."""
        held = [job for job in store.active_jobs() if job.tenant == tenant]
        stored = {job.id for job in held}
        self._reserved = {
            other: seat
            for other, seat in self._reserved.items()
            if seat.expires > now and other not in stored and store.get_job(other) is None
        }
        sizes = {job.id: job.world_size for job in held}
        self._scaling = {
            job_id: seat
            for job_id, seat in self._scaling.items()
            if seat.expires > now
            and (job_id in sizes or seat.tenant != tenant)
            and sizes.get(job_id, -1) != seat.workers
        }
        return held, [seat for seat in self._reserved.values() if seat.tenant == tenant]

    def _size(self, job: JobRecord) -> int:
        """A job's ranks as the quota counts them: its world size, never less than what it was granted (an
        elastic job that shrank grows back to that by itself), or the size a pending scale asked for."""
        seat = self._scaling.get(job.id)
        held = max(job.world_size, job.granted_workers or 0)
        return held if seat is None else max(held, seat.workers)

    def _workers(self, held: list[JobRecord]) -> int:
        return sum(self._size(job) for job in held)


def check_priority(settings: Settings, principal: Principal, priority: int) -> None:
    """PriorityNotAllowed (403) when a tenant asks for a priority outside its range; the admin may use any."""
    if principal.admin:
        return
    low, high, setting = settings.priority_range(principal.tenant)
    if not low <= priority <= high:
        raise PriorityNotAllowed(tenant=principal.tenant, priority=priority, low=low, high=high, setting=setting)


class TenantSlots:
    """At most ``limit`` concurrent holders per tenant (None: no limit; the admin is never counted).

    :meth:`slot` takes one without waiting, QuotaExceeded (``quota``) when the tenant holds ``limit``
    already, and gives it back when the block ends; :meth:`acquire` / the returned release function do
    the same for a holder whose end is not a block (a streaming response)."""

    def __init__(self, quota: str, limit: int | None):
        self.quota = quota
        self.limit = limit
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def acquire(self, principal: Principal):
        """Take a slot for ``principal`` (QuotaExceeded when none is free); returns the function that gives it
        back (idempotent: a second call does nothing)."""
        if principal.admin or self.limit is None:
            return lambda: None
        tenant = principal.tenant
        with self._lock:
            used = self._held.get(tenant, 0)
            if used >= self.limit:
                raise QuotaExceeded(self.quota, tenant=tenant, limit=self.limit, used=used, requested=1)
            self._held[tenant] = used + 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                left = self._held.get(tenant, 1) - 1
                if left > 0:
                    self._held[tenant] = left
                else:
                    self._held.pop(tenant, None)

        return release

    @contextmanager
    def slot(self, principal: Principal) -> Iterator[None]:
        release = self.acquire(principal)
        try:
            yield
        finally:
            release()

    def held(self, tenant: str) -> int:
        """How many slots ``tenant`` holds now."""
        with self._lock:
            return self._held.get(tenant, 0)


@dataclass(frozen=True)
class FairUse:
    """The API's concurrency caps per tenant: event streams and plan computations."""

    streams: TenantSlots
    plans: TenantSlots

    @classmethod
    def of(cls, settings: Settings) -> FairUse:
        return cls(
            streams=TenantSlots("max_streams", settings.tenant_max_streams),
            plans=TenantSlots("max_plans", settings.tenant_max_plans),
        )
