"""How `make test` spreads the suite over the machine's cores (pytest-xdist), and what it keeps apart.

`make test` runs two pytest passes (see the Makefile):

1. ``-n 2 --dist loadgroup -m "not timing"``: two workers. Every test that starts Ray (``tests/e2e``,
   ``tests/chaos``) is in one xdist group, ``ray``, so one worker runs them one after another: two Ray
   clusters on one 2-core machine starve each other's control calls, and they would also contend for
   Ray's fixed ports. The other worker takes the rest (unit, API, chart, multi-process gloo). A Ray
   test spends most of its time waiting (node-death detection, heartbeats, back-offs, Ray's start),
   which is what the second worker fills.
2. ``-m timing``, alone: tests whose assertion is a measured time ratio (the pipeline bubble, straggler
   compute times, bounds in milliseconds). They mark themselves ``pytest.mark.timing`` and run with
   nothing beside them.

Without ``-n`` (one test, one file, ``make test-fast``) the groups mean nothing and every test runs in
this process as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

RAY_DIRECTORIES = ("e2e", "chaos")
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        relative = Path(str(item.fspath)).resolve().relative_to(_TESTS)
        if relative.parts and relative.parts[0] in RAY_DIRECTORIES:
            item.add_marker(pytest.mark.xdist_group(name="ray"))
