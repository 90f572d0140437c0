"""Where the planner's memory per rank comes from: the cluster's GPUs (measured by the runtime), the
operator (``ETRAIN_DEVICE_MEMORY_GB``), or the default; a job may only lower it.

The real ``JobManager`` with Ray replaced by ``FakeRuntime`` (whose ``accelerator_memory_gb`` answers
what a real cluster's probe task would measure)."""

from __future__ import annotations

import pytest

from etrain.service.errors import SettingsError, SpecRejected
from etrain.service.planning.spec import JobSpec
from etrain.service.settings import Settings
from tests.fakes import FakeRuntime


def spec(device: str = "cuda", **resources) -> JobSpec:
    gpus = {"gpus_per_worker": 1} if device == "cuda" else {}
    return JobSpec.model_validate(
        {
            "name": "mem",
            "model": {"preset": "llama-tiny"},
            "parallelism": {"dp": 2},
            "resources": {"device": device, **gpus, **resources},
            "training": {"steps": 2, "global_batch": 4, "micro_batch": 2},
        }
    )


@pytest.fixture
def make_manager(tmp_path):
    manager_module = pytest.importorskip("etrain.service.manager")  # imports Ray (not started)
    made = []

    def make(gpu_memory_gb: float | None = None, **settings):
        runtime = FakeRuntime()
        runtime.gpu_memory_gb = gpu_memory_gb
        manager = manager_module.JobManager(
            Settings(data_dir=tmp_path, **settings), runtime=runtime, base_dir=str(tmp_path)
        )
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.close()


def test_the_detected_gpu_memory_is_the_budget(make_manager):
    manager = make_manager(gpu_memory_gb=39.4)
    report = manager.plan(spec())
    assert report["feasible"] and report["estimate"]["memory"]["device_gib"] == 39.4
    assert ("accelerator_memory_gb",) in manager.runtime.calls
    # A job may lower it...
    assert manager.plan(spec(device_memory_gb=20))["estimate"]["memory"]["device_gib"] == 20.0


def test_a_job_may_not_raise_it(make_manager):
    manager = make_manager(gpu_memory_gb=39.4)
    report = manager.plan(spec(device_memory_gb=80))
    assert report["feasible"] is False
    assert [p["field"] for p in report["problems"]] == ["resources.device_memory_gb"]
    assert "80 GiB exceeds the 39.4 GiB per GPU" in report["problems"][0]["message"]
    with pytest.raises(SpecRejected) as rejected:
        manager.submit(spec(device_memory_gb=80))
    assert [p.field for p in rejected.value.problems] == ["resources.device_memory_gb"]
    assert manager.runtime.jobs == {}


def test_the_operator_setting_overrides_detection(make_manager):
    manager = make_manager(gpu_memory_gb=39.4, device_memory_gb=24.0)
    assert manager.plan(spec())["estimate"]["memory"]["device_gib"] == 24.0
    assert manager.plan(spec("cpu"))["estimate"]["memory"]["device_gib"] == 24.0
    assert ("accelerator_memory_gb",) not in manager.runtime.calls


def test_cpu_workers_keep_the_default_and_nothing_is_probed(make_manager):
    manager = make_manager(gpu_memory_gb=39.4)
    assert manager.plan(spec("cpu"))["estimate"]["memory"]["device_gib"] == 8.0
    assert ("accelerator_memory_gb",) not in manager.runtime.calls
    # No GPUs detected (or none free to probe): the cuda default, which a job may lower but not raise
    # (the operator raises it with ETRAIN_DEVICE_MEMORY_GB).
    unknown = make_manager(gpu_memory_gb=None)
    assert unknown.plan(spec())["estimate"]["memory"]["device_gib"] == 80.0
    assert unknown.plan(spec(device_memory_gb=40))["estimate"]["memory"]["device_gib"] == 40.0
    raised = unknown.plan(spec(device_memory_gb=141))
    assert raised["feasible"] is False and [p["field"] for p in raised["problems"]] == ["resources.device_memory_gb"]
    assert "141 GiB exceeds the 80 GiB per GPU" in raised["problems"][0]["message"]
    assert make_manager(gpu_memory_gb=None, device_memory_gb=141.0).plan(spec(device_memory_gb=141))["feasible"]


def test_the_setting_comes_from_the_environment():
    assert Settings.from_env({"ETRAIN_DEVICE_MEMORY_GB": "79.5"}).device_memory_gb == 79.5
    assert Settings.from_env({}).device_memory_gb is None
    with pytest.raises(SettingsError) as bad:
        Settings.from_env({"ETRAIN_DEVICE_MEMORY_GB": "lots"})
    assert bad.value.field == "ETRAIN_DEVICE_MEMORY_GB"
    with pytest.raises(SettingsError) as negative:
        Settings.from_env({"ETRAIN_DEVICE_MEMORY_GB": "-1"})
    assert negative.value.field == "device_memory_gb"
