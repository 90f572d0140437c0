"""An ended job's supervisor is released only once its last prune of old checkpoints is done: the real
``JobManager`` and poller, Ray replaced by ``FakeRuntime`` (whose jobs say ``pruning`` for a few updates
after their end, as the supervisor does while its prune thread hashes the checkpoints it keeps).

Releasing kills the supervisor, which used to wait at most 5 s for that prune inside ``updates`` (holding up
every other job's updates meanwhile): on a loaded machine a prune on S3 was cut short and the job kept
three committed steps with ``keep_last: 2`` (tests/e2e/test_s3_checkpoints.py, seen once).
"""

from __future__ import annotations

import logging
import time

import pytest

from etrain.service.planning.spec import JobSpec
from etrain.service.settings import Settings
from tests.fakes import FakeRuntime

manager_module = pytest.importorskip("etrain.service.manager")  # imports Ray (never started: FakeRuntime)
poller_module = pytest.importorskip("etrain.service.jobs.poller")

SPEC = {
    "name": "prunes",
    "model": {"preset": "gpt-tiny"},
    "training": {"steps": 3, "global_batch": 8, "micro_batch": 2},
}


def _manager(tmp_path, runtime: FakeRuntime):
    return manager_module.JobManager(
        Settings(data_dir=tmp_path, poll_interval_s=0.02), runtime=runtime, base_dir=str(tmp_path)
    )


def _wait(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_supervisor_is_released_after_its_last_prune_not_before(tmp_path):
    runtime = FakeRuntime(steps_per_update=3, prune_updates=5)
    manager = _manager(tmp_path, runtime)
    try:
        job = manager.submit(JobSpec.model_validate(SPEC))
        _wait(lambda: manager.get(job.id).status.value == "SUCCEEDED", "the job did not succeed")
        assert ("release", job.id) not in runtime.calls  # ended, stored, but its supervisor still prunes
        _wait(lambda: ("release", job.id) in runtime.calls, "the supervisor was never released")
        # Asked again after each of the five updates that said it still pruned; released after the sixth.
        assert runtime.prune_left[job.id] == 0, runtime.prune_left
        assert runtime.calls.count(("release", job.id)) == 1
    finally:
        manager.close()


def _released_at_the_cap(tmp_path, monkeypatch, caplog, runtime: FakeRuntime) -> tuple[str, float, list[str]]:
    """Run a job whose supervisor never says its prune is done, with a 0.3 s cap: (job id, seconds from its
    stored end to the release, the poller's warnings)."""
    monkeypatch.setattr(poller_module, "END_PRUNE_MAX_S", 0.3)
    manager = _manager(tmp_path, runtime)
    try:
        with caplog.at_level(logging.WARNING, logger=poller_module.__name__):
            job = manager.submit(JobSpec.model_validate(SPEC))
            _wait(lambda: manager.get(job.id).status.value == "SUCCEEDED", "the job did not succeed")
            ended = time.monotonic()
            _wait(lambda: ("release", job.id) in runtime.calls, "the supervisor was never released")
            kept_s = time.monotonic() - ended
    finally:
        manager.close()
    return job.id, kept_s, [record.getMessage() for record in caplog.records]


def test_a_prune_that_never_ends_is_given_up_at_the_cap_and_said(tmp_path, monkeypatch, caplog):
    job_id, kept_s, warnings = _released_at_the_cap(
        tmp_path, monkeypatch, caplog, FakeRuntime(steps_per_update=3, prune_updates=-1)
    )
    assert kept_s >= 0.2  # kept until the cap
    assert any(job_id in text and "ran past 0s" in text for text in warnings), warnings


def test_a_control_plane_that_stops_releases_what_it_kept(tmp_path):
    runtime = FakeRuntime(steps_per_update=3, prune_updates=-1)
    manager = _manager(tmp_path, runtime)
    job = manager.submit(JobSpec.model_validate(SPEC))
    _wait(lambda: manager.get(job.id).status.value == "SUCCEEDED", "the job did not succeed")
    assert ("release", job.id) not in runtime.calls
    manager.close()
    assert ("release", job.id) in runtime.calls


def test_a_supervisor_that_stops_answering_after_its_end_is_released_at_the_cap(tmp_path, monkeypatch, caplog):
    from etrain.service.errors import ServiceUnavailable

    class Silent(FakeRuntime):
        def updates(self, job_id, since_seq, since_step):
            if self.prune_left.get(job_id) is not None:  # it has answered once since its end: now it hangs
                raise ServiceUnavailable("Ray did not answer within 10s", fix="check the cluster")
            return super().updates(job_id, since_seq, since_step)

    job_id, kept_s, warnings = _released_at_the_cap(
        tmp_path, monkeypatch, caplog, Silent(steps_per_update=3, prune_updates=-1)
    )
    assert kept_s >= 0.2
    assert any(job_id in text and "last answer: ServiceUnavailable" in text for text in warnings), warnings
