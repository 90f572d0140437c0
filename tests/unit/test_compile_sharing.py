"""Who writes a job's compiled code, which set a rank loads, and what the supervisor accepts from a rank
(``workers/protocol/compile_sharing.py``)."""

from __future__ import annotations

import itertools

import pytest

from etrain.workers.protocol import compile_sharing
from etrain.workers.protocol.compile_sharing import CompileArtifacts
from etrain.workers.protocol.topology import Topology

SHA = "ab" * 32


def _record(stage: int, digest: str = SHA) -> CompileArtifacts:
    return CompileArtifacts(stage=stage, sha256=digest, size=10)


@pytest.mark.parametrize(("pp", "dp", "tp", "cp"), list(itertools.product([1, 2, 3], [1, 2, 4], [1, 2], [1, 2])))
def test_exactly_one_writer_per_pipeline_stage_and_it_is_the_stages_first_rank(pp, dp, tp, cp):
    topology = Topology(pp=pp, dp=dp, tp=tp, cp=cp)
    writers = [
        rank for rank in range(topology.world_size) if compile_sharing.writes_for_its_stage(topology.coords(rank))
    ]
    assert [topology.coords(rank).pp for rank in writers] == list(range(pp))
    assert writers == [stage * dp * tp * cp for stage in range(pp)]


def test_a_rank_loads_its_stages_set_else_the_first_stages_else_none():
    first, last = _record(0, "0" * 64), _record(2, "2" * 64)
    assert compile_sharing.for_stage([first, last], 2) == last
    assert compile_sharing.for_stage([first, last], 1) == first  # the same block graphs, less the loss
    assert compile_sharing.for_stage([last], 1) is None
    assert compile_sharing.for_stage([], 0) is None


def test_a_new_set_replaces_its_stages_and_keeps_the_others_in_stage_order():
    old = (_record(1, "1" * 64), _record(0, "0" * 64))
    new = _record(1, "f" * 64)
    assert compile_sharing.replace_stage(old, new) == (_record(0, "0" * 64), new)
    assert compile_sharing.replace_stage((), new) == (new,)


def test_the_file_is_named_by_its_content():
    assert compile_sharing.file_name(SHA) == f"{SHA}.bin"


def test_a_well_formed_report_is_kept():
    assert compile_sharing.parse_report({"stage": 1, "sha256": SHA, "size": 5}, stages=2) == CompileArtifacts(
        stage=1, sha256=SHA, size=5
    )


@pytest.mark.parametrize(
    ("report", "field"),
    [
        ({"stage": 2, "sha256": SHA, "size": 5}, "stage"),
        ({"stage": -1, "sha256": SHA, "size": 5}, "stage"),
        ({"stage": True, "sha256": SHA, "size": 5}, "stage"),
        ({"stage": "0", "sha256": SHA, "size": 5}, "stage"),
        ({"stage": 0, "sha256": SHA.upper(), "size": 5}, "sha256"),
        ({"stage": 0, "sha256": "../../other-job/x", "size": 5}, "sha256"),
        ({"stage": 0, "sha256": SHA[:-1], "size": 5}, "sha256"),
        ({"stage": 0, "sha256": SHA, "size": 0}, "size"),
        ({"stage": 0, "sha256": SHA, "size": compile_sharing.MAX_BYTES + 1}, "size"),
        ({"stage": 0, "sha256": SHA, "size": 5.0}, "size"),
        ({"stage": 0, "sha256": SHA}, "size"),
    ],
)
def test_a_malformed_report_is_refused_naming_its_field(report, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        compile_sharing.parse_report(report, stages=2)


def test_a_report_that_is_not_a_mapping_is_refused():
    with pytest.raises(ValueError, match="mapping"):
        compile_sharing.parse_report(["stage", 0], stages=1)  # type: ignore[arg-type]
