"""Errors of the job service: what a caller of the manager (the REST API, the CLI) can be told.

All derive from :class:`workers.errors.EtrainError`, so ``api/errors.py`` maps the whole family to
HTTP in one place, and all survive pickling with their fields (a Supervisor actor may raise them
across a Ray call). Each message names the job, the value and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable

from service.spec import SpecProblem
from workers.errors import EtrainError

__all__ = [
    "ChaosDisabled",
    "EtrainError",
    "JobConflict",
    "JobNotFound",
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


class ServiceUnavailable(EtrainError):
    """A backing service (the Ray cluster, the database) cannot be reached right now; retry later."""


class SettingsError(EtrainError):
    """A server setting (environment variable or flag) has a value the server cannot use."""
