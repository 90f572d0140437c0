"""Errors of the job service: what a caller of the manager (the REST API, the CLI) can be told.

All derive from :class:`etrain.workers.protocol.errors.EtrainError`, so ``api/errors.py`` maps the whole family to
HTTP in one place, and all survive pickling with their fields (a Supervisor actor may raise them
across a Ray call). Each message names the job, the value and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable

from etrain.service.planning.spec import SpecProblem
from etrain.workers.protocol.errors import EtrainError

__all__ = [
    "AdminOnly",
    "ChaosDisabled",
    "EtrainError",
    "JobConflict",
    "JobNotFound",
    "NotAuthenticated",
    "PriorityNotAllowed",
    "QuotaExceeded",
    "RankNotFound",
    "ServiceUnavailable",
    "SettingsError",
    "SpecRejected",
]


class SpecRejected(EtrainError):
    """The spec parsed but cannot run; ``problems`` lists every reason (field + message + fix)."""

    def __init__(self, problems: Iterable[SpecProblem]):
        self.problems: list[SpecProblem] = list(problems)
        assert self.problems, "SpecRejected needs at least one problem"
        first = self.problems[0]
        count = len(self.problems)
        summary = "; ".join(f"{p.field}: {p.message}" for p in self.problems)
        message = f"the job spec has {count} problem{'s' if count != 1 else ''}: {summary}"
        super().__init__(message, field=first.field, fix=first.fix)

    def __reduce__(self):
        return (SpecRejected, (self.problems,))


class JobNotFound(EtrainError):
    """No job with this id (never submitted, or a typo)."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        super().__init__(
            f"no job with id {job_id!r}.",
            field="job_id",
            fix="list the jobs with `etrain list` or GET /v1/jobs",
        )

    def __reduce__(self):
        return (JobNotFound, (self.job_id,))


class JobConflict(EtrainError):
    """The request does not fit the job's current state (cancel a finished job, scale a terminal one)."""

    def __init__(
        self,
        message: str,
        *,
        job_id: str | None = None,
        status: str | None = None,
        field: str | None = None,
        fix: str | None = None,
    ):
        self.job_id = job_id
        self.status = status
        super().__init__(message, field=field, fix=fix)

    def __reduce__(self):
        return (_rebuild_conflict, (self.message, self.job_id, self.status, self.field, self.fix))


def _rebuild_conflict(message, job_id, status, field, fix):
    return JobConflict(message, job_id=job_id, status=status, field=field, fix=fix)


class ChaosDisabled(EtrainError):
    """Fault injection was requested on a server that does not allow it."""

    def __init__(
        self,
        message: str = "fault injection (chaos) is disabled on this server.",
        *,
        field: str | None = None,
        fix: str | None = "start the server with ETRAIN_ENABLE_CHAOS=1 (or `etrain serve --enable-chaos`)",
    ):
        super().__init__(message, field=field, fix=fix)


class NotAuthenticated(EtrainError):
    """No bearer token, or one the server does not know (HTTP 401). Says nothing about which tokens exist."""

    def __init__(self, *, token_given: bool):
        self.token_given = token_given
        super().__init__(
            "the API token is not valid." if token_given else "this server requires an API token.",
            fix="send 'Authorization: Bearer <token>' (the CLI takes --token or ETRAIN_API_TOKEN, or reads "
            "the api-token file in a local server's data directory, ETRAIN_DATA_DIR)",
        )

    def __reduce__(self):
        return (_rebuild_not_authenticated, (self.token_given,))


def _rebuild_not_authenticated(token_given):
    return NotAuthenticated(token_given=token_given)


class AdminOnly(EtrainError):
    """An operator action (fault injection) asked for with a tenant's token (HTTP 403)."""

    def __init__(self, action: str, *, tenant: str):
        self.action = action
        self.tenant = tenant
        super().__init__(
            f"{action} is an operator action: only the admin token may use it, and this request comes "
            f"from tenant {tenant!r}.",
            fix="ask the operator, who holds ETRAIN_API_TOKEN (the server's admin token)",
        )

    def __reduce__(self):
        return (_rebuild_admin_only, (self.action, self.tenant))


def _rebuild_admin_only(action, tenant):
    return AdminOnly(action, tenant=tenant)


class QuotaExceeded(EtrainError):
    """A tenant's request would go over a per-tenant cap (HTTP 429 with ``Retry-After``): nothing was done.

    ``quota`` names the cap: ``max_jobs`` (unfinished jobs) and ``max_workers`` (ranks those jobs hold),
    checked at submit and, for workers, at scale; ``max_streams`` (open event streams) and ``max_plans``
    (plan computations running at once). ``limit`` is the operator's setting, ``used`` what the tenant holds
    now and ``requested`` what this request adds. ``job_id``, ``dp`` and ``dp_fits`` (the largest dp that
    fits now) are set when a scale was refused. ``retry_after_s`` is the hint the 429 carries in its
    ``Retry-After`` header.
    """

    SETTINGS = {
        "max_jobs": "ETRAIN_TENANT_MAX_JOBS",
        "max_workers": "ETRAIN_TENANT_MAX_WORKERS",
        "max_streams": "ETRAIN_TENANT_MAX_STREAMS",
        "max_plans": "ETRAIN_TENANT_MAX_PLANS",
    }
    #: Seconds a client should wait before trying again: a stream or a plan frees its slot within seconds,
    #: a job or its workers when it ends (the client cannot know when: it polls, every half minute at most).
    RETRY_AFTER_S = {"max_jobs": 30, "max_workers": 30, "max_streams": 5, "max_plans": 1}

    def __init__(
        self,
        quota: str,
        *,
        tenant: str,
        limit: int,
        used: int,
        requested: int,
        job_id: str | None = None,
        dp: int | None = None,
        dp_fits: int | None = None,
    ):
        assert quota in self.SETTINGS, quota
        self.quota, self.tenant, self.limit, self.used, self.requested = quota, tenant, limit, used, requested
        self.job_id, self.dp, self.dp_fits = job_id, dp, dp_fits
        setting = self.SETTINGS[quota]
        field = None
        if quota == "max_jobs":
            message = (
                f"tenant {tenant!r} may have at most {limit} unfinished jobs ({setting}={limit}) and has "
                f"{used}; this job would make {used + requested}."
            )
            fix = (
                f"wait for one of your jobs to finish or cancel one (`etrain list`, `etrain cancel ID`), "
                f"or ask the operator to raise {setting}"
            )
        elif quota == "max_workers" and job_id is not None:
            message = (
                f"tenant {tenant!r} may hold at most {limit} workers ({setting}={limit}); its unfinished jobs "
                f"hold {used} and dp={dp} adds {requested} ranks to job {job_id}, {used + requested} in all."
            )
            fix = (
                f"scale to at most dp={dp_fits} (what the quota leaves room for now), wait for or cancel another "
                f"of your jobs, or ask the operator to raise {setting}"
            )
            field = "dp"
        elif quota == "max_workers":
            message = (
                f"tenant {tenant!r} may hold at most {limit} workers ({setting}={limit}); its unfinished jobs "
                f"hold {used} and this job needs {requested}, {used + requested} in all."
            )
            fix = (
                f"submit with fewer workers (at most {max(limit - used, 0)} now: lower parallelism.dp, tp or pp), "
                f"wait for or cancel one of your jobs, or ask the operator to raise {setting}"
            )
            field = "parallelism"
        elif quota == "max_streams":
            message = (
                f"tenant {tenant!r} may follow at most {limit} event streams at once ({setting}={limit}) "
                f"and has {used} open."
            )
            fix = (
                f"close a stream you no longer read (one `etrain watch` per job is enough), poll "
                f"GET /v1/jobs/{{id}}/events?since=N instead, retry after {self.RETRY_AFTER_S[quota]} s, or ask "
                f"the operator to raise {setting}"
            )
        else:
            message = (
                f"tenant {tenant!r} may have at most {limit} plans computed at once ({setting}={limit}) and "
                f"has {used} running."
            )
            fix = (
                f"send plans (and submits with parallelism auto) one after another: retry after "
                f"{self.RETRY_AFTER_S[quota]} s, or ask the operator to raise {setting}"
            )
        super().__init__(message, field=field, fix=fix)

    @property
    def setting(self) -> str:
        return self.SETTINGS[self.quota]

    @property
    def retry_after_s(self) -> int:
        return self.RETRY_AFTER_S[self.quota]

    def to_dict(self) -> dict[str, int | str]:
        """The numbers, for the 429 body's ``quota`` object."""
        return {
            "name": self.quota,
            "setting": self.setting,
            "tenant": self.tenant,
            "limit": self.limit,
            "used": self.used,
            "requested": self.requested,
        }

    def __reduce__(self):
        return (
            _rebuild_quota,
            (self.quota, self.tenant, self.limit, self.used, self.requested, self.job_id, self.dp, self.dp_fits),
        )


def _rebuild_quota(quota, tenant, limit, used, requested, job_id=None, dp=None, dp_fits=None):
    return QuotaExceeded(
        quota, tenant=tenant, limit=limit, used=used, requested=requested, job_id=job_id, dp=dp, dp_fits=dp_fits
    )


class PriorityNotAllowed(EtrainError):
    """A tenant asked for a job ``priority`` outside the range the operator allows it (HTTP 403): nothing was
    created. The admin may use any priority the spec allows."""

    def __init__(self, *, tenant: str, priority: int, low: int, high: int, setting: str):
        self.tenant, self.priority, self.low, self.high, self.setting = tenant, priority, low, high, setting
        super().__init__(
            f"priority={priority} is outside the range tenant {tenant!r} may use: {low}..{high} ({setting}).",
            field="priority",
            fix=f"submit with a priority in {low}..{high} (omitted: 0), or ask the operator to widen the range "
            f"(ETRAIN_TENANT_PRIORITIES={tenant}=MIN..MAX)",
        )

    def to_dict(self) -> dict[str, int | str]:
        """For the 403 body's ``priority`` object."""
        return {
            "tenant": self.tenant,
            "requested": self.priority,
            "min": self.low,
            "max": self.high,
            "setting": self.setting,
        }

    def __reduce__(self):
        return (_rebuild_priority, (self.tenant, self.priority, self.low, self.high, self.setting))


def _rebuild_priority(tenant, priority, low, high, setting):
    return PriorityNotAllowed(tenant=tenant, priority=priority, low=low, high=high, setting=setting)


class ServiceUnavailable(EtrainError):
    """A backing service (the Ray cluster, the database) cannot be reached right now; retry later."""


class SettingsError(EtrainError):
    """A server setting (environment variable or flag) has a value the server cannot use."""


class RankNotFound(EtrainError):
    """A job has no rank ``rank`` (HTTP 404): outside its world and no log of it was ever written."""

    def __init__(self, job_id: str, rank: int, world_size: int):
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        super().__init__(
            f"job {job_id} has no rank {rank}: its world has {world_size} rank(s).",
            field="rank",
            fix=f"ask for a rank in 0..{world_size - 1}",
        )

    def __reduce__(self):
        return (RankNotFound, (self.job_id, self.rank, self.world_size))
