"""Atomic checkpoint commits (invariant 4): what counts as a checkpoint, and what is skipped.

Pure: fake "DCP" files in temporary directories, no torch. Each test reads as one rule of
``workers/manifest.py``.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest

from workers.errors import CheckpointError
from workers.manifest import (
    MANIFEST_NAME,
    FileEntry,
    ShardReport,
    checkpoint_files,
    commit,
    file_entry,
    latest_committed,
    list_steps,
    prune,
    resolve_latest,
    step_dir,
    verify,
)

WORLD = 2


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as stream:
        stream.write(data)


def _fake_save(root, step: int, world_size: int = WORLD) -> tuple[str, list[ShardReport]]:
    """What ``save_checkpoint`` leaves behind: one shard per rank, rank 0 also .metadata and extra."""
    directory = step_dir(root, step)
    reports = []
    for rank in range(world_size):
        names = [f"__{rank}_0.distcp"]
        if rank == 0:
            names += [".metadata", "extra.pt"]
        for name in names:
            _write(os.path.join(directory, name), f"{name} of step {step} ".encode() * (10 + rank))
        reports.append(
            ShardReport(
                rank=rank,
                world_size=world_size,
                directory=os.path.basename(directory),
                files=tuple(file_entry(directory, name) for name in names),
            )
        )
    return directory, reports


def _save_and_commit(root, step: int) -> str:
    directory, reports = _fake_save(root, step)
    commit(directory, step, "pp1·dp2·tp1 zero=3", WORLD, reports, created_at=1000.0 + step)
    return directory


def _flip_byte(path: str, offset: int = 3) -> None:
    with open(path, "r+b") as stream:
        stream.seek(offset)
        byte = stream.read(1)
        stream.seek(offset)
        stream.write(bytes([byte[0] ^ 0x01]))


# ------------------------------------------------------------------------------------------------


def test_step_dir_is_zero_padded_and_listed_in_step_order(tmp_path):
    for step in (100, 7, 20):
        os.makedirs(step_dir(tmp_path, step))
    os.makedirs(tmp_path / "not_a_step")
    (tmp_path / "step_00000050").write_text("a file, not a directory")
    assert os.path.basename(step_dir(tmp_path, 7)) == "step_00000007"
    assert [s for s, _ in list_steps(tmp_path)] == [7, 20, 100]
    assert list_steps(tmp_path / "missing") == []


def test_commit_then_verify_round_trip(tmp_path):
    directory, reports = _fake_save(tmp_path, 100)
    written = commit(directory, 100, "pp1·dp2·tp1 zero=3", WORLD, reports, created_at=1234.5)
    read = verify(directory)
    assert read == written
    assert read.step == 100 and read.world_size == 2 and read.layout == "pp1·dp2·tp1 zero=3"
    assert read.created_at == 1234.5
    assert [f.path for f in read.files] == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"]
    assert read.num_bytes == sum(os.path.getsize(os.path.join(directory, f.path)) for f in read.files)
    assert checkpoint_files(directory) == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"]
    assert not os.path.exists(os.path.join(directory, MANIFEST_NAME + ".tmp"))


def test_reports_pickle_with_plain_types():
    report = ShardReport(rank=1, world_size=2, directory="step_00000001",
                         files=(FileEntry(path="__1_0.distcp", size=3, sha256="ab"),))
    assert pickle.loads(pickle.dumps(report)) == report


def test_commit_refuses_when_a_rank_did_not_report(tmp_path):
    directory, reports = _fake_save(tmp_path, 100)
    with pytest.raises(CheckpointError, match=r"ranks \[1\] of 2 did not report"):
        commit(directory, 100, "dp2", WORLD, reports[:1])
    assert not os.path.exists(os.path.join(directory, MANIFEST_NAME))
    with pytest.raises(CheckpointError):
        verify(directory)


def test_commit_refuses_duplicate_foreign_or_wrong_world_reports(tmp_path):
    directory, reports = _fake_save(tmp_path, 100)
    with pytest.raises(CheckpointError, match="reported twice"):
        commit(directory, 100, "dp2", WORLD, [reports[0], reports[0], reports[1]])
    other = ShardReport(rank=1, world_size=2, directory="step_00000050", files=reports[1].files)
    with pytest.raises(CheckpointError, match="step_00000050"):
        commit(directory, 100, "dp2", WORLD, [reports[0], other])
    with pytest.raises(CheckpointError, match="world_size=2, expected 4"):
        commit(directory, 100, "dp4", 4, reports)
    assert not os.path.exists(os.path.join(directory, MANIFEST_NAME))


def test_commit_refuses_a_reported_file_that_is_not_on_disk(tmp_path):
    directory, reports = _fake_save(tmp_path, 100)
    os.remove(os.path.join(directory, "__1_0.distcp"))
    with pytest.raises(CheckpointError, match="__1_0.distcp is missing"):
        commit(directory, 100, "dp2", WORLD, reports)
    assert not os.path.exists(os.path.join(directory, MANIFEST_NAME))


def test_commit_refuses_paths_outside_the_step_directory(tmp_path):
    directory, reports = _fake_save(tmp_path, 100)
    evil = ShardReport(rank=1, world_size=2, directory=reports[1].directory,
                       files=(FileEntry(path="../step_00000050/x", size=1, sha256="00"),))
    with pytest.raises(CheckpointError, match="not a plain relative path"):
        commit(directory, 100, "dp2", WORLD, [reports[0], evil])


def test_missing_file_fails_verification(tmp_path):
    directory = _save_and_commit(tmp_path, 100)
    os.remove(os.path.join(directory, "__1_0.distcp"))
    with pytest.raises(CheckpointError, match="__1_0.distcp is missing"):
        verify(directory)


def test_truncated_file_fails_verification_even_without_checksums(tmp_path):
    directory = _save_and_commit(tmp_path, 100)
    path = os.path.join(directory, "__0_0.distcp")
    os.truncate(path, os.path.getsize(path) // 2)
    for checksums in (True, False):
        with pytest.raises(CheckpointError, match="truncated"):
            verify(directory, checksums=checksums)


def test_flipped_byte_fails_verification_only_with_checksums(tmp_path):
    directory = _save_and_commit(tmp_path, 100)
    _flip_byte(os.path.join(directory, ".metadata"))
    with pytest.raises(CheckpointError, match=r"\.metadata sha256 mismatch"):
        verify(directory)
    assert verify(directory, checksums=False).step == 100  # same size: only the hash can tell


def test_shares_of_the_hashing_together_cover_every_file(tmp_path):
    """Ranks split the hashing (``share``); exactly the rank whose share holds the flipped file fails."""
    directory = _save_and_commit(tmp_path, 100)
    _flip_byte(os.path.join(directory, "__1_0.distcp"))  # third of four files in manifest order
    outcomes = []
    for index in range(3):
        try:
            verify(directory, share=(index, 3))
            outcomes.append("ok")
        except CheckpointError as exc:
            outcomes.append("sha256 mismatch" in str(exc))
    assert outcomes == ["ok", "ok", True]
    os.remove(os.path.join(directory, "extra.pt"))  # sizes are checked by every share
    for index in range(3):
        with pytest.raises(CheckpointError, match="extra.pt is missing"):
            verify(directory, share=(index, 3))


def test_corrupt_manifest_fails_verification(tmp_path):
    directory = _save_and_commit(tmp_path, 100)
    path = os.path.join(directory, MANIFEST_NAME)
    document = json.loads(open(path).read())
    document["step"] = 99  # a plausible edit that still parses
    with open(path, "w") as stream:
        json.dump(document, stream)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        verify(directory)
    with open(path, "w") as stream:
        stream.write('{"format": "etrain.checkpoint/1", "step": 1')  # half a document
    with pytest.raises(CheckpointError, match="unreadable"):
        verify(directory)


def test_manifest_step_must_match_directory_name(tmp_path):
    directory = _save_and_commit(tmp_path, 100)
    moved = step_dir(tmp_path, 200)
    os.rename(directory, moved)
    with pytest.raises(CheckpointError, match="manifest says step 100"):
        verify(moved)


def test_interrupted_commit_leaves_no_checkpoint(tmp_path):
    """A crash between writing manifest.json.tmp and the rename: the directory is not committed."""
    good = _save_and_commit(tmp_path, 100)
    directory, _reports = _fake_save(tmp_path, 200)
    _write(os.path.join(directory, MANIFEST_NAME + ".tmp"), b'{"format": "etrain.chec')
    with pytest.raises(CheckpointError, match="commit was interrupted"):
        verify(directory)
    resolution = resolve_latest(tmp_path)
    assert (resolution.step, resolution.step_dir) == (100, good)
    assert checkpoint_files(directory) == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"]


def test_commit_replaces_a_stale_tmp_and_leaves_none(tmp_path):
    directory, reports = _fake_save(tmp_path, 100)
    _write(os.path.join(directory, MANIFEST_NAME + ".tmp"), b"garbage from a crashed commit")
    commit(directory, 100, "dp2", WORLD, reports)
    assert verify(directory).step == 100
    assert not os.path.exists(os.path.join(directory, MANIFEST_NAME + ".tmp"))


def test_latest_skips_partial_directory_without_manifest(tmp_path):
    _save_and_commit(tmp_path, 100)
    second = _save_and_commit(tmp_path, 200)
    _fake_save(tmp_path, 300)  # every rank wrote, the supervisor never committed
    os.makedirs(step_dir(tmp_path, 400))  # a save that died before writing anything
    assert latest_committed(tmp_path) == (200, second)
    resolution = resolve_latest(tmp_path)
    assert [s.step for s in resolution.skipped] == [400, 300]
    assert all("not committed" in s.reason for s in resolution.skipped)


def test_latest_falls_back_to_previous_when_newest_is_corrupt(tmp_path):
    first = _save_and_commit(tmp_path, 100)
    second = _save_and_commit(tmp_path, 200)
    _flip_byte(os.path.join(second, "__1_0.distcp"))
    assert latest_committed(tmp_path) == (100, first)
    resolution = resolve_latest(tmp_path)
    assert resolution.manifest.step == 100
    assert len(resolution.skipped) == 1 and "__1_0.distcp sha256 mismatch" in resolution.skipped[0].reason


def test_latest_is_none_when_nothing_verifies(tmp_path):
    assert latest_committed(tmp_path) is None
    directory = _save_and_commit(tmp_path, 100)
    os.remove(os.path.join(directory, ".metadata"))
    resolution = resolve_latest(tmp_path)
    assert resolution.step is None and resolution.step_dir is None
    assert [s.step for s in resolution.skipped] == [100]


def test_prune_keeps_last_n_and_in_flight_newer_dirs(tmp_path):
    for step in (100, 200, 300, 400):
        _save_and_commit(tmp_path, step)
    _fake_save(tmp_path, 150)  # stale: older than the newest commit, never committed
    _fake_save(tmp_path, 500)  # possibly in flight: newer than the newest commit
    deleted = prune(tmp_path, keep_last=2)
    assert sorted(os.path.basename(d) for d in deleted) == ["step_00000100", "step_00000150", "step_00000200"]
    assert [s for s, _ in list_steps(tmp_path)] == [300, 400, 500]
    assert latest_committed(tmp_path)[0] == 400


def test_prune_never_deletes_the_newest_usable_checkpoint(tmp_path):
    _save_and_commit(tmp_path, 100)
    newest_good = _save_and_commit(tmp_path, 200)
    corrupt = _save_and_commit(tmp_path, 300)
    _flip_byte(os.path.join(corrupt, "__0_0.distcp"))
    deleted = prune(tmp_path, keep_last=1)
    assert [os.path.basename(d) for d in deleted] == ["step_00000100"]
    assert latest_committed(tmp_path) == (200, newest_good)
    assert os.path.isdir(corrupt)  # newer than the newest usable one: left for inspection


def test_prune_with_nothing_committed_deletes_nothing(tmp_path):
    _fake_save(tmp_path, 100)
    assert prune(tmp_path, keep_last=1) == []
    assert [s for s, _ in list_steps(tmp_path)] == [100]
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        prune(tmp_path, keep_last=0)
