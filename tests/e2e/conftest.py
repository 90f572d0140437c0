"""Fixtures for end-to-end tests: one local Ray instance per module and a real control plane on it."""

from __future__ import annotations

import pytest

from tests.service_harness import control_plane

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    """A 4-CPU local Ray instance owned by the test module (the control plane connects to it)."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="etrain", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def plane(local_ray, tmp_path_factory):
    """The real API server (uvicorn, JobManager, SQLite) on a free loopback port."""
    with control_plane(tmp_path_factory.mktemp("etrain")) as plane:
        yield plane
