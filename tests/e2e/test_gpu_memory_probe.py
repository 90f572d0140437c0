"""The control plane's GPU-memory probe on a real local Ray: one task per accelerator type, scheduled
on a GPU node, reading ``torch.cuda.mem_get_info`` there.

This machine declares a GPU to Ray (``num_gpus=1``, type H100) whether or not it has one, so the
probe's scheduling is real everywhere; what the task reads is a GPU's memory on a CUDA machine and
"no GPU" (None) elsewhere, and the runtime answers accordingly (None: the planner's default).
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from tests.e2e.conftest import owned_ray  # noqa: E402


@pytest.fixture(scope="module")
def ray_with_a_gpu_node():
    with owned_ray(1, num_gpus=1, resources={"accelerator_type:H100": 1}):
        yield


def _expected_gib() -> float | None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info(0)[1] / 2**30


def test_the_probe_reads_the_gpu_of_its_type(ray_with_a_gpu_node):
    from etrain.service.runtime.cluster import RayRuntime, probe_gpu_memory_gib
    from etrain.service.settings import Settings

    expected = _expected_gib()
    measured = probe_gpu_memory_gib("H100", timeout_s=60)
    assert measured == (pytest.approx(expected) if expected is not None else None)
    runtime = RayRuntime(Settings())  # connects to the running instance
    assert runtime.accelerator_memory_gb() == measured


def test_a_probe_that_cannot_be_scheduled_answers_none_in_time(ray_with_a_gpu_node):
    import time

    from etrain.service.runtime.cluster import probe_gpu_memory_gib

    start = time.monotonic()
    assert probe_gpu_memory_gib("A100", timeout_s=2) is None  # no such accelerator in this cluster
    assert time.monotonic() - start < 10
