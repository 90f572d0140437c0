"""Per-tenant quotas, checked when a tenant submits: unfinished jobs and the workers they hold.

``ETRAIN_TENANT_MAX_JOBS`` caps a tenant's non-terminal jobs (queued ones included) and
``ETRAIN_TENANT_MAX_WORKERS`` the ranks (world size) those jobs hold plus the new job's; the admin is
exempt. Over a quota the submit is refused with :class:`~etrain.service.errors.QuotaExceeded` (HTTP 429) and
nothing is created.

The check and the job's row are not one database transaction, so the gate also counts submits it
admitted whose row is not written yet: two concurrent requests cannot both take the last slot. Such a
reservation ends when the row appears, or after ``RESERVATION_S`` (a submit that failed after the
check never writes one; the row follows the check within milliseconds otherwise).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from etrain.service.errors import QuotaExceeded
from etrain.service.store.job_store import JobStore
from etrain.service.access.tenancy import Principal

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

    def admit(self, principal: Principal, job_id: str, workers: int, store: JobStore) -> None:
        """Admit ``job_id`` (``workers`` ranks) for ``principal`` or raise QuotaExceeded; call it right
        before the job's row is written."""
        if principal.admin or (self.max_jobs is None and self.max_workers is None):
            return
        tenant = principal.tenant
        with self._lock:
            now = time.monotonic()
            held = [job for job in store.active_jobs() if job.tenant == tenant]
            stored = {job.id for job in held}
            self._reserved = {
                other: seat for other, seat in self._reserved.items()
                if seat.expires > now and other not in stored and store.get_job(other) is None
            }
            pending = [seat for seat in self._reserved.values() if seat.tenant == tenant]
            jobs = len(held) + len(pending)
            used = sum(job.world_size for job in held) + sum(seat.workers for seat in pending)
            if self.max_jobs is not None and jobs + 1 > self.max_jobs:
                raise QuotaExceeded("max_jobs", tenant=tenant, limit=self.max_jobs, used=jobs, requested=1)
            if self.max_workers is not None and used + workers > self.max_workers:
                raise QuotaExceeded("max_workers", tenant=tenant, limit=self.max_workers, used=used,
                                    requested=workers)
            self._reserved[job_id] = _Reservation(tenant, workers, now + RESERVATION_S)

    def release(self, job_id: str) -> None:
        """``job_id``'s row will never come (its submit lost a checkpoint-directory claim or an idempotency
        race): its reservation ends now instead of after ``RESERVATION_S``."""
        with self._lock:
            self._reserved.pop(job_id, None)
