"""``workers/rank/leave_attempt.py``: what a rank drops when it leaves a failed attempt, and when. Its effect on
real gloo peers is tests/integration/test_peer_death.py's last test."""

from __future__ import annotations

from etrain.workers.protocol.errors import ConfigError, is_collective_failure
from etrain.workers.rank.leave_attempt import failure_text, release_failed_attempt


def _raised(error: BaseException, cause: BaseException | None = None) -> BaseException:
    def inner():
        if cause is None:
            raise error
        raise error from cause

    try:
        inner()
    except BaseException as caught:  # noqa: BLE001
        return caught
    raise AssertionError("unreachable")


def _chained_cause() -> BaseException:
    try:
        raise ValueError("the first")
    except ValueError as first:
        return first


def test_a_collective_failure_loses_its_tracebacks_after_its_text_was_taken():
    cause = _chained_cause()
    error = _raised(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"), cause)
    text = failure_text(error)
    assert "Connection closed by peer" in text and "in inner" in text and "the first" in text
    assert error.__traceback__ is not None and cause.__traceback__ is not None
    assert release_failed_attempt(error)
    assert error.__traceback__ is None and cause.__traceback__ is None


def test_a_jobs_own_error_keeps_its_traceback_for_the_supervisors_event():
    for error in (_raised(ConfigError("bad", field="model.n_layers")), _raised(ValueError("shape mismatch"))):
        assert not is_collective_failure(error)
        assert not release_failed_attempt(error) and error.__traceback__ is not None


def test_what_counts_as_a_collective_failure():
    class DistBackendError(RuntimeError):  # torch's, by name: the service does not import torch
        pass

    assert is_collective_failure(DistBackendError("NCCL error"))
    assert is_collective_failure(TimeoutError("whatever"))
    assert is_collective_failure(RuntimeError("Connection reset by peer"))
    assert not is_collective_failure(RuntimeError("CUDA out of memory"))
    assert not is_collective_failure(None)
