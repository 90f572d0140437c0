"""Fixtures for end-to-end tests: one local Ray instance shared by the modules that need nothing else of it,
and a real control plane per module on it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.service_harness import control_plane

ray = pytest.importorskip("ray")

#: The shared instance's CPUs (one node): room for a dp2·tp2 job.
SHARED_CPUS = 4


class _SharedRay:
    """The local Ray behind ``local_ray``, kept from one module to the next.

    A local Ray's start and stop (its GCS, raylet and agents), and on it each control plane's spare pool, its
    first spares and pre-started supervisor, cost 20-30 s of a core on the 2-core machine (sampled from
    ``/proc`` over the e2e and chaos tests: 23 instances), and the modules that share it change nothing in it
    that the next one could see: their jobs end before their tests do. The pool outlives control planes, so a
    module's first jobs also find ready spares, and the admin tenant's returned ranks, instead of starting
    them. Started by the first module to ask; shut down when the e2e tests end, or when a module needs a Ray
    of its own (``owned_ray``, a cluster of several nodes): a driver joins one at a time.
    """

    def __init__(self) -> None:
        self.up = False

    def get(self) -> None:
        if not self.up:
            _init_local(SHARED_CPUS)
            self.up = True

    def close(self) -> None:
        if self.up:
            self.up = False
            ray.shutdown()


_SHARED = _SharedRay()


def release_shared_ray() -> None:
    """Shut the shared instance down (if it is up) so that a module can start a Ray of its own."""
    _SHARED.close()


def _init_local(num_cpus: int, **resources) -> None:
    # ``address="local"``: never join another cluster running on this machine, nor the one a
    # ``ray_current_cluster`` file names (CI once had one).
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        namespace="etrain",
        log_to_driver=False,
        **resources,
    )


@contextmanager
def owned_ray(num_cpus: int, **resources) -> Iterator[None]:
    """A new local Ray instance of ``num_cpus`` for one module (the shared one is shut down first), shut down
    on exit. ``resources``: more ``ray.init`` arguments (``num_gpus``, ``resources``)."""
    release_shared_ray()
    _init_local(num_cpus, **resources)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="package", autouse=True)
def _shut_the_shared_ray_down() -> Iterator[None]:
    yield
    release_shared_ray()


@pytest.fixture(scope="module")
def local_ray() -> None:
    """The shared 4-CPU local Ray instance (the control plane connects to it)."""
    _SHARED.get()


@pytest.fixture(scope="module")
def plane(local_ray, tmp_path_factory):
    """The real API server (uvicorn, JobManager, SQLite) on a free loopback port."""
    with control_plane(tmp_path_factory.mktemp("etrain")) as plane:
        yield plane


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The e2e modules on the shared Ray first, then those with a Ray of their own, each group in its order, so
    the shared instance starts once. Only e2e items move, within the places they hold in the session."""
    places = [index for index, item in enumerate(items) if "/tests/e2e/" in str(item.path)]
    shared_modules = {str(items[i].path) for i in places if "local_ray" in getattr(items[i], "fixturenames", ())}
    ordered = sorted((items[i] for i in places), key=lambda item: str(item.path) not in shared_modules)
    for index, item in zip(places, ordered):
        items[index] = item
