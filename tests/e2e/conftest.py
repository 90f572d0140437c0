"""Fixtures for end-to-end tests: one local Ray instance per module and a real control plane on it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.service_harness import control_plane

ray = pytest.importorskip("ray")


@contextmanager
def owned_ray(num_cpus: int, **resources) -> Iterator[None]:
    """A new local Ray instance of ``num_cpus`` (``address="local"``: never join another cluster running on
    this machine, nor the one a ``ray_current_cluster`` file names: CI once had one), shut down on exit.
    ``resources``: more ``ray.init`` arguments (``num_gpus``, ``resources``)."""
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        namespace="etrain",
        log_to_driver=False,
        **resources,
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def local_ray():
    """A 4-CPU local Ray instance owned by the test module (the control plane connects to it)."""
    with owned_ray(4):
        yield


@pytest.fixture(scope="module")
def plane(local_ray, tmp_path_factory):
    """The real API server (uvicorn, JobManager, SQLite) on a free loopback port."""
    with control_plane(tmp_path_factory.mktemp("etrain")) as plane:
        yield plane
