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
