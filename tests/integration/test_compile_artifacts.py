"""A rank loads a job's shared compiled code only if it is the very set its writer reported
(``workers/engine/compile_artifacts.py``): a changed, missing, planted or foreign file costs a compile,
never runs, and never fails the attempt. Real files and torch's real loader; the sharing itself, with
real inductor code on two "nodes", is in tests/integration/test_throughput_options.py."""

from __future__ import annotations

import hashlib
import os

from etrain.workers.engine import compile_artifacts
from etrain.workers.protocol import compile_sharing
from etrain.workers.protocol.compile_sharing import CompileArtifacts
from tests.rank_stubs import LogLines, SupervisorRecorder


def _set_in(checkpoint, data: bytes, *, reported: bytes | None = None) -> CompileArtifacts:
    """``data`` written where the set reported for ``reported`` (default: ``data`` itself) lives."""
    digest = hashlib.sha256(data if reported is None else reported).hexdigest()
    folder = checkpoint / "compile-cache"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{digest}.bin").write_bytes(data)
    return CompileArtifacts(stage=0, sha256=digest, size=len(data))


def _markers(cache) -> list[str]:
    folder = cache / "etrain-artifacts"
    return sorted(os.listdir(folder)) if folder.exists() else []


def test_a_set_changed_after_it_was_written_is_refused_before_torch_sees_it(tmp_path, monkeypatch):
    import torch

    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data))  # must not run
    record = _set_in(tmp_path / "ckpt", b"code the tenant put there", reported=b"the set the rank wrote")
    line = compile_artifacts.load(str(tmp_path / "ckpt"), record, cache_dir=str(tmp_path / "cache"))
    assert "not loaded (compiling instead)" in line and "not the set its writer reported" in line, line
    assert record.sha256[:12] in line and loaded == [] and _markers(tmp_path / "cache") == []


def test_a_missing_set_or_a_link_in_its_place_costs_a_compile(tmp_path):
    record = CompileArtifacts(stage=0, sha256="c" * 64, size=10)
    line = compile_artifacts.load(str(tmp_path / "ckpt"), record, cache_dir=str(tmp_path / "cache"))
    assert "not loaded (compiling instead): reading" in line and "FileNotFoundError" in line, line

    target = tmp_path / "another-job.bin"
    target.write_bytes(b"x" * 10)
    (tmp_path / "ckpt" / "compile-cache").mkdir(parents=True)
    (tmp_path / "ckpt" / "compile-cache" / f"{record.sha256}.bin").symlink_to(target)
    line = compile_artifacts.load(str(tmp_path / "ckpt"), record, cache_dir=str(tmp_path / "cache"))
    assert "not loaded (compiling instead)" in line and "UnsafePathError" in line, line
    assert _markers(tmp_path / "cache") == []


def test_bytes_torch_cannot_load_cost_a_compile_and_leave_no_marker(tmp_path):
    record = _set_in(tmp_path / "ckpt", b"not a cache-artifacts payload")  # the digest matches: torch judges it
    line = compile_artifacts.load(str(tmp_path / "ckpt"), record, cache_dir=str(tmp_path / "cache"))
    assert line.startswith("compile cache not loaded (compiling instead): torch read no entries"), line
    assert _markers(tmp_path / "cache") == []


def test_a_node_that_holds_the_set_does_not_read_it_again(tmp_path):
    record = CompileArtifacts(stage=1, sha256="d" * 64, size=10)  # no file at all: only the marker is read
    (tmp_path / "cache" / "etrain-artifacts").mkdir(parents=True)
    (tmp_path / "cache" / "etrain-artifacts" / record.sha256).touch()
    line = compile_artifacts.load(str(tmp_path / "ckpt"), record, cache_dir=str(tmp_path / "cache"))
    assert line == f"compile cache: stage 1's set ({'d' * 12}) is on this node already"


def test_a_set_over_the_bound_is_not_read(tmp_path):
    record = CompileArtifacts(stage=0, sha256="e" * 64, size=10)
    folder = tmp_path / "ckpt" / "compile-cache"
    folder.mkdir(parents=True)
    with open(folder / f"{record.sha256}.bin", "wb") as sparse:  # a sparse file: no disk, any size
        sparse.truncate(compile_sharing.MAX_BYTES + 1)
    line = compile_artifacts.load(str(tmp_path / "ckpt"), record, cache_dir=str(tmp_path / "cache"))
    assert "not loaded (compiling instead)" in line and "larger than" in line, line


def _code(tmp_path, *, compile=True, path=True, records=(), coords=None):
    import dataclasses

    from etrain.workers.protocol.messages import LaunchPlan
    from etrain.workers.protocol.topology import Coords
    from etrain.workers.rank.compiled_code import CompiledCode
    from tests.equivalence_utils import small_config

    config = small_config(steps=2)
    config = dataclasses.replace(
        config,
        training=dataclasses.replace(config.training, compile=compile),
        checkpoint=dataclasses.replace(config.checkpoint, path=str(tmp_path / "ckpt") if path else None),
    )
    plan = LaunchPlan(attempt=3, config=config, start_step=0, resume_dir=None, compile_artifacts=tuple(records))
    log = LogLines()
    code = CompiledCode(
        plan, rank=0, coords=coords or Coords(pp=0, dp=0, tp=0), supervisor=SupervisorRecorder(), log=log
    )
    return code, log


def test_who_shares_after_the_first_step(tmp_path):
    """Only a stage's first rank, only with compile on and a checkpoint folder, and only when the plan lacks
    its stage's set or the first step still compiled something the set did not hold."""
    from etrain.workers.protocol.topology import Coords

    own = CompileArtifacts(stage=0, sha256="a" * 64, size=10)
    other_stage = CompileArtifacts(stage=1, sha256="b" * 64, size=10)
    cases = {
        "no set for its stage": (dict(records=[other_stage]), False, True),
        "its stage's set, nothing compiled": (dict(records=[own]), False, False),
        "its stage's set, but the step compiled": (dict(records=[own]), True, True),
        "not its stage's first rank": (dict(coords=Coords(pp=0, dp=1, tp=0)), True, False),
        "a tensor-parallel peer": (dict(coords=Coords(pp=0, dp=0, tp=1)), True, False),
        "compile off": (dict(compile=False), True, False),
        "no checkpoint folder": (dict(path=False), True, False),
    }
    for what, (settings, compiled_anything, shares) in cases.items():
        code, log = _code(tmp_path, **settings)
        code.after_first_step(compiled_anything)
        assert (code.thread is not None) == shares, what
        if code.thread is not None:
            code.thread.join(30)
            assert len(log.lines) == 1 and log.lines[0].startswith("attempt 3: compile cache "), (what, log.lines)


def test_a_rank_loads_its_stages_set_and_says_so(tmp_path):
    from etrain.workers.protocol.topology import Coords

    first = CompileArtifacts(stage=0, sha256="a" * 64, size=10)
    code, log = _code(tmp_path, records=[first], coords=Coords(pp=1, dp=0, tp=0))
    assert code.load() is True  # stage 1 has no set of its own: the first stage's blocks are the same graphs
    assert log.lines[0].startswith("attempt 3: compile cache not loaded (compiling instead): reading"), log.lines
    assert _code(tmp_path, records=[])[0].load() is False
    assert _code(tmp_path, records=[first], compile=False)[0].load() is False
