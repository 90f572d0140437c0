"""Every event kind a supervisor records is in docs/rest-api.md's list, so a user reading a job's events
can look each one up (eight had drifted out of it: ``capacity_low``, ``scale_rejected``, ...).

The kinds are read from the source where a supervisor records them: ``RecordEvent(kind="...")`` in the
pure decisions, ``_record("...")`` in its runtime adapters, and the notes ranks send (``RANK_NOTES``).
"""

from __future__ import annotations

import re
from pathlib import Path

from etrain.service.runtime.supervisor_actor import RANK_NOTES

REPO = Path(__file__).resolve().parents[2]
RECORDED = re.compile(r"""(?:RecordEvent\(kind=|\b_?record\()"([a-z_]+)\"""")


def recorded_kinds() -> set[str]:
    kinds = set(RANK_NOTES)
    for path in (REPO / "service").rglob("*.py"):
        kinds.update(RECORDED.findall(path.read_text(encoding="utf-8")))
    return kinds


def test_the_scan_finds_the_kinds_it_is_meant_to():
    kinds = recorded_kinds()
    assert {"capacity_low", "checkpoint_committed", "chaos_armed", "checkpoint_interval", "scale_rejected"} <= kinds
    assert len(kinds) >= 30, sorted(kinds)


def test_every_recorded_event_kind_is_documented():
    documented = set(re.findall(r"`([a-z_]+)`", (REPO / "docs" / "rest-api.md").read_text(encoding="utf-8")))
    missing = sorted(recorded_kinds() - documented)
    assert not missing, f"event kinds missing from docs/rest-api.md's list: {missing}"
