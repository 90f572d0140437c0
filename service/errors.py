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
    """A tenant's submit would go over a per-tenant quota (HTTP 429): nothing was created.

    ``quota`` is ``max_jobs`` (unfinished jobs) or ``max_workers`` (ranks those jobs hold); ``limit`` is
    the operator's setting, ``used`` what the tenant holds now and ``requested`` what this job adds.
    """

    SETTINGS = {"max_jobs": "ETRAIN_TENANT_MAX_JOBS", "max_workers": "ETRAIN_TENANT_MAX_WORKERS"}

    def __init__(self, quota: str, *, tenant: str, limit: int, used: int, requested: int):
        assert quota in self.SETTINGS, quota
        self.quota, self.tenant, self.limit, self.used, self.requested = quota, tenant, limit, used, requested
        setting = self.SETTINGS[quota]
        if quota == "max_jobs":
            message = (f"tenant {tenant!r} may have at most {limit} unfinished jobs ({setting}={limit}) and has "
                       f"{used}; this job would make {used + requested}.")
            fix = (f"wait for one of your jobs to finish or cancel one (`etrain list`, `etrain cancel ID`), "
                   f"or ask the operator to raise {setting}")
            field = None
        else:
            message = (f"tenant {tenant!r} may hold at most {limit} workers ({setting}={limit}); its unfinished jobs "
                       f"hold {used} and this job needs {requested}, {used + requested} in all.")
            fix = (f"submit with fewer workers (at most {max(limit - used, 0)} now: lower parallelism.dp, tp or pp), "
                   f"wait for or cancel one of your jobs, or ask the operator to raise {setting}")
            field = "parallelism"
        super().__init__(message, field=field, fix=fix)

    @property
    def setting(self) -> str:
        return self.SETTINGS[self.quota]

    def to_dict(self) -> dict[str, int | str]:
        """The numbers, for the 429 body's ``quota`` object."""
        return {"name": self.quota, "setting": self.setting, "tenant": self.tenant, "limit": self.limit,
                "used": self.used, "requested": self.requested}

    def __reduce__(self):
        return (_rebuild_quota, (self.quota, self.tenant, self.limit, self.used, self.requested))


def _rebuild_quota(quota, tenant, limit, used, requested):
    return QuotaExceeded(quota, tenant=tenant, limit=limit, used=used, requested=requested)


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
