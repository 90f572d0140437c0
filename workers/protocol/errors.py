"""The one family of user-facing errors, shared by workers and the service.

Every error a user can cause (a bad spec, unreadable data, a loss that turns NaN) derives from
:class:`EtrainError`. The message names the setting, the value and the fix. These classes are plain
``Exception`` subclasses whose constructor arguments survive pickling, so an error raised inside a
Ray worker reaches the supervisor (and the REST API) with its type and fields intact.

Internal invariants use ``assert``; they are bugs, never user errors.
"""

from __future__ import annotations


class EtrainError(Exception):
    """Base of every error a user can cause and fix.

    ``field`` is the dotted spec path the error is about (``training.global_batch``) when there is
    one; ``fix`` says what to change.
    """

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.fix = fix

    def __reduce__(self):  # keep keyword fields across pickling (Ray ships exceptions by pickle)
        return (_rebuild_error, (type(self), self.message, self.field, self.fix))

    def __str__(self) -> str:
        text = self.message
        if self.fix:
            text = f"{text} Fix: {self.fix}"
        return text

    def to_dict(self) -> dict[str, str | None]:
        return {"type": type(self).__name__, "field": self.field, "message": self.message, "fix": self.fix}


def _rebuild_error(cls, message, field, fix):
    return cls(message, field=field, fix=fix)


class ConfigError(EtrainError):
    """A run configuration that cannot train (degrees, divisibility, sizes)."""


class DataError(EtrainError):
    """The training data cannot be read or is too small for the requested run."""


class UnsafePathError(ConfigError, DataError):
    """A file a job names is reached through a symbolic link, or lies outside its folder: refused where
    it is opened (``workers/protocol/safe_paths.py``). Both a ConfigError and a DataError on purpose: the path can
    be ``model.hf`` or ``checkpoint.path`` (whose handlers catch ConfigError) or ``data.path`` /
    ``data.tokenizer`` (DataError), and every one of them must turn it into the same answer naming the field."""


class NonFiniteLossError(EtrainError):
    """The loss became NaN or infinite: the job itself is broken, restarting will not help."""


class UnhealthyRankError(EtrainError):
    """A rank failed the health check at the start of an attempt (``workers/protocol/health.py``); every
    rank of the attempt raises it, naming the same ``rank``. Not the job's fault: the supervisor excludes
    that rank's node and relaunches (RankUnhealthy), it does not fail the job."""

    def __init__(self, message: str, *, rank: int, field: str | None = None, fix: str | None = None):
        super().__init__(message, field=field, fix=fix)
        self.rank = rank

    def __reduce__(self):
        return (_rebuild_unhealthy, (self.message, self.rank))


def _rebuild_unhealthy(message, rank):
    return UnhealthyRankError(message, rank=rank)


class CheckpointError(EtrainError):
    """No usable checkpoint where one was required, or a checkpoint that fails verification."""
