"""Atomic checkpoint commits (invariant 4): what counts as a checkpoint, and what is skipped.

Pure: fake "DCP" files in temporary directories, no torch. Each test reads as one rule of
``workers/protocol/manifest.py`` (the format) and ``workers/checkpoints/checkpoint_commit.py`` (commit,
verify, resolve, prune).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle

import pytest

from etrain.workers.checkpoints import storage
from etrain.workers.checkpoints.checkpoint_commit import (
    checkpoint_files,
    commit,
    file_entry,
    latest_committed,
    list_steps,
    prune,
    read_manifest,
    resolve_latest,
    step_dir,
    verify,
)
from etrain.workers.protocol.errors import CheckpointError
from etrain.workers.protocol.manifest import (
    MANIFEST_NAME,
    WRITER_NAME,
    FileEntry,
    ManifestSignatureError,
    ShardReport,
    _canonical,  # the one canonical encoding the signature is over
    encode_writer,
    writer_of,
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
    report = ShardReport(
        rank=1, world_size=2, directory="step_00000001", files=(FileEntry(path="__1_0.distcp", size=3, sha256="ab"),)
    )
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
    evil = ShardReport(
        rank=1,
        world_size=2,
        directory=reports[1].directory,
        files=(FileEntry(path="../step_00000050/x", size=1, sha256="00"),),
    )
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


@pytest.fixture
def hashed_files(monkeypatch) -> list[str]:
    """The paths ``storage.sha256_many`` reads, in order (it still hashes them)."""
    seen: list[str] = []
    real = storage.sha256_many

    def counting(paths):
        seen.extend(os.path.basename(os.path.dirname(path)) for path in paths)
        return real(paths)

    monkeypatch.setattr(storage, "sha256_many", counting)
    return seen


def test_prune_with_a_memo_hashes_each_checkpoint_once_not_every_kept_one_after_every_commit(tmp_path, hashed_files):
    memo: dict[str, str] = {}
    for step in (100, 200, 300, 400):
        _save_and_commit(tmp_path, step)
        hashed_files.clear()
        deleted = prune(tmp_path, keep_last=3, hashed=memo)
        # Only the new step is read (its 4 files); the kept older ones are checked by signature and size.
        assert hashed_files == [f"step_{step:08d}"] * 4, hashed_files
    assert [os.path.basename(d) for d in deleted] == ["step_00000100"]
    assert sorted(os.path.basename(d) for d in memo) == ["step_00000200", "step_00000300", "step_00000400"]

    hashed_files.clear()
    prune(tmp_path, keep_last=3)  # without the memo every kept checkpoint is read again
    assert len(hashed_files) == 3 * 4


def test_prune_with_a_memo_still_never_trades_the_good_step_for_a_corrupt_new_one(tmp_path):
    memo: dict[str, str] = {}
    good = _save_and_commit(tmp_path, 100)
    prune(tmp_path, keep_last=1, hashed=memo)
    corrupt = _save_and_commit(tmp_path, 200)
    _flip_byte(os.path.join(corrupt, "__1_0.distcp"))
    assert prune(tmp_path, keep_last=1, hashed=memo) == []
    assert latest_committed(tmp_path) == (100, good)
    assert list(memo) == [good]  # the corrupt step never enters it


def test_prune_with_a_memo_hashes_again_when_the_manifest_changed_and_a_load_still_checks_everything(
    tmp_path, hashed_files
):
    memo: dict[str, str] = {}
    directory = _save_and_commit(tmp_path, 100)
    prune(tmp_path, keep_last=2, hashed=memo)
    # The same step saved and committed again (a new manifest: another commit time): hashed against it.
    _directory, reports = _fake_save(tmp_path, 100)
    commit(directory, 100, "pp1·dp2·tp1 zero=3", WORLD, reports, created_at=5000.0)
    hashed_files.clear()
    prune(tmp_path, keep_last=2, hashed=memo)
    assert hashed_files == ["step_00000100"] * 4
    # Rot after the one hash, same size: prune trusts its memo; the full check before a load does not.
    _flip_byte(os.path.join(directory, ".metadata"))
    assert prune(tmp_path, keep_last=2, hashed=memo) == []
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        verify(directory)


# -- signed manifests (issue #8): the key holder loads only what it committed --------------------------

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def _signed(root, step: int, *, job_id: str = "job-a", key: bytes = KEY) -> str:
    directory, reports = _fake_save(root, step)
    commit(directory, step, "pp1·dp2·tp1 zero=3", WORLD, reports, key=key, job_id=job_id, created_at=1000.0 + step)
    return directory


def _document(directory: str) -> dict:
    with open(os.path.join(directory, MANIFEST_NAME), "rb") as stream:
        return json.loads(stream.read())


def _rewrite(directory: str, document: dict) -> None:
    """Write a manifest as an attacker would: valid JSON, its checksum recomputed, the hmac kept."""
    body = {name: value for name, value in document.items() if name not in ("checksum", "hmac")}
    document = dict(document, checksum=hashlib.sha256(_canonical(body)).hexdigest())
    _write(os.path.join(directory, MANIFEST_NAME), json.dumps(document, sort_keys=True, indent=1).encode())


def test_a_signed_manifest_carries_an_hmac_over_everything_else_and_verifies_with_the_key(tmp_path):
    directory = _signed(tmp_path, 100)
    document = _document(directory)
    assert document["format"] == "etrain.checkpoint/2" and document["job_id"] == "job-a"
    unsigned = {name: value for name, value in document.items() if name != "hmac"}
    assert document["hmac"] == hmac.new(KEY, _canonical(unsigned), hashlib.sha256).hexdigest()
    manifest = verify(directory, key=KEY)
    assert (manifest.step, manifest.job_id, manifest.hmac) == (100, "job-a", document["hmac"])
    assert read_manifest(directory, key=KEY).job_id == "job-a"


@pytest.mark.parametrize("where", [b'"layout": "', b'"world_size": ', b'"job_id": "', b'"size": ', b'"step": '])
def test_a_tampered_byte_of_the_manifest_is_a_signature_error(tmp_path, where):
    """One byte of a value changed (the JSON stays valid): the signature, checked first, refuses it."""
    directory = _signed(tmp_path, 100)
    path = os.path.join(directory, MANIFEST_NAME)
    raw = bytearray(open(path, "rb").read())
    at = raw.index(where) + len(where)
    raw[at] = ord("3") if raw[at] != ord("3") else ord("4")
    _write(path, bytes(raw))
    with pytest.raises(ManifestSignatureError, match="signature does not verify"):
        verify(directory, key=KEY, checksums=False)
    with pytest.raises(CheckpointError, match="checksum mismatch"):  # without a key: integrity only
        verify(directory, checksums=False)


def test_an_edited_manifest_with_a_recomputed_checksum_passes_integrity_but_not_the_signature(tmp_path):
    """The forgery the checksum cannot catch: a shard swapped for the attacker's, its sha256 and size
    written into the manifest and the checksum recomputed."""
    directory = _signed(tmp_path, 100)
    _write(os.path.join(directory, ".metadata"), b"cos\nsystem\n(S'echo pwned'\ntR.")  # a pickle payload
    document = _document(directory)
    for entry in document["files"]:
        if entry["path"] == ".metadata":
            entry.update(file_entry(directory, ".metadata").__dict__)
    _rewrite(directory, document)
    assert verify(directory).step == 100  # keyless: a self-consistent directory
    with pytest.raises(ManifestSignatureError, match="signature does not verify"):
        verify(directory, key=KEY)
    resolution = resolve_latest(tmp_path, key=KEY)
    assert resolution.step is None and [s.refused for s in resolution.skipped] == [True]


def test_a_manifest_signed_with_another_key_is_refused(tmp_path):
    directory = _signed(tmp_path, 100, key=OTHER_KEY)
    assert verify(directory, key=OTHER_KEY).step == 100
    with pytest.raises(ManifestSignatureError, match="signature does not verify"):
        verify(directory, key=KEY)
    with pytest.raises(ManifestSignatureError):
        read_manifest(directory, key=KEY)


def test_a_manifest_without_an_hmac_is_refused_as_unsigned(tmp_path):
    unsigned = _save_and_commit(tmp_path, 100)  # committed without a key: hmac null
    assert _document(unsigned)["hmac"] is None
    with pytest.raises(ManifestSignatureError, match="unsigned"):
        verify(unsigned, key=KEY)
    removed = _signed(tmp_path, 200)
    document = _document(removed)
    del document["hmac"]
    _rewrite(removed, document)
    with pytest.raises(ManifestSignatureError, match="unsigned"):
        verify(removed, key=KEY)
    assert latest_committed(tmp_path) == (200, removed)  # both pass the keyless integrity check
    assert latest_committed(tmp_path, key=KEY) is None


def test_an_old_format_manifest_is_refused_with_a_clear_error(tmp_path):
    """Format 1 (before signing) is readable without a key, refused with one, and says why."""
    directory = _signed(tmp_path, 100)
    document = _document(directory)
    del document["hmac"], document["job_id"]
    document["format"] = "etrain.checkpoint/1"
    _rewrite(directory, document)
    assert verify(directory).step == 100
    with pytest.raises(ManifestSignatureError, match="'etrain.checkpoint/1', written before checkpoints were signed"):
        verify(directory, key=KEY)


def test_ranks_without_the_key_load_only_the_manifest_the_supervisor_verified(tmp_path):
    directory = _signed(tmp_path, 100)
    verified = verify(directory, key=KEY)
    assert verified.digest == commit_digest(directory)
    assert verify(directory, checksums=False, expect_digest=verified.digest).step == 100
    replaced = _signed(tmp_path / "elsewhere", 100, job_id="job-b")  # another valid manifest, other contents
    os.replace(os.path.join(replaced, MANIFEST_NAME), os.path.join(directory, MANIFEST_NAME))
    with pytest.raises(CheckpointError, match="not the one the supervisor verified"):
        verify(directory, checksums=False, expect_digest=verified.digest)


def test_a_rank_catches_an_edit_that_keeps_the_verified_signature(tmp_path):
    """The rank cannot check the HMAC, so it compares the whole manifest: the signed body changed under
    a copied (now wrong) hmac field is still a different manifest."""
    directory = _signed(tmp_path, 100)
    verified = verify(directory, key=KEY)
    document = _document(directory)
    document["layout"] = "forged"
    _rewrite(directory, document)  # the hmac field is kept as it was
    assert _document(directory)["hmac"] == verified.hmac
    with pytest.raises(CheckpointError, match="not the one the supervisor verified"):
        verify(directory, checksums=False, expect_digest=verified.digest)


def test_with_an_expected_digest_every_rank_hashes_the_metadata_it_will_unpickle(tmp_path):
    """checksums=False skips hashing the shards, never .metadata when a digest is expected: a file
    swapped after the supervisor's check (same size) is caught on the rank, before DCP reads it."""
    directory = _signed(tmp_path, 100)
    verified = verify(directory, key=KEY).digest
    _flip_byte(os.path.join(directory, ".metadata"))
    assert verify(directory, checksums=False).step == 100  # the size is unchanged
    for rank in range(3):
        with pytest.raises(CheckpointError, match=r"\.metadata sha256 mismatch"):
            verify(directory, checksums=False, share=(rank, 3), expect_digest=verified)


def commit_digest(directory: str) -> str:
    return hashlib.sha256(_canonical(_document(directory))).hexdigest()


def test_prune_with_an_owner_deletes_only_that_jobs_signed_checkpoints(tmp_path):
    """A job never deletes what it did not commit: another job's steps, forgeries, partial saves."""
    mine = {step: _signed(tmp_path, step, job_id="job-a") for step in (100, 300, 500, 600)}
    theirs = _signed(tmp_path, 200, job_id="job-b")
    foreign = _signed(tmp_path, 400, key=OTHER_KEY, job_id="job-a")  # claims job-a, wrong key
    partial, _reports = _fake_save(tmp_path, 50)  # never committed

    deleted = prune(tmp_path, keep_last=2, key=KEY, owner="job-a")

    assert deleted == [mine[100], mine[300]]
    assert [step for step, _ in list_steps(tmp_path)] == [50, 200, 400, 500, 600]
    assert all(os.path.isdir(path) for path in (theirs, foreign, partial))
    with pytest.raises(ValueError, match="needs the key"):
        prune(tmp_path, keep_last=1, owner="job-a")


def test_prune_keeps_by_signature_so_a_forged_newest_step_never_evicts_the_good_one(tmp_path):
    good = _signed(tmp_path, 100)
    forged = _signed(tmp_path, 200, key=OTHER_KEY)
    assert prune(tmp_path, keep_last=1, key=KEY, owner="job-a") == []
    assert os.path.isdir(good) and os.path.isdir(forged)


def _partial(root, step: int, writer: bytes | None) -> str:
    """A save that never committed (a kill mid-write), with ``writer.json`` as rank 0 writes it first."""
    directory, _reports = _fake_save(root, step)
    if writer is not None:
        _write(os.path.join(directory, WRITER_NAME), writer)
    return directory


def test_prune_with_an_owner_deletes_the_partial_saves_its_own_ranks_wrote_below_the_newest_commit(tmp_path):
    """A save a kill interrupted leaves a directory without a manifest; a resume from memory past it (or a
    changed cadence) never saves that step again, so only pruning can clear it: it is the job's own when its
    ``writer.json`` names the job. Another job's, an unattributed one and one newer than the newest commit
    (an in-flight write) stay."""
    kept = [_signed(tmp_path, step, job_id="job-a") for step in (100, 300)]
    own = [_partial(tmp_path, step, encode_writer("job-a")) for step in (120, 250)]
    theirs = _partial(tmp_path, 150, encode_writer("job-b"))
    unattributed = _partial(tmp_path, 160, None)
    not_a_writer = _partial(tmp_path, 170, b'{"job_id": "job-a"}')  # no format: not a writer file
    in_flight = _partial(tmp_path, 400, encode_writer("job-a"))

    deleted = prune(tmp_path, keep_last=2, key=KEY, owner="job-a")

    assert deleted == own
    assert [step for step, _ in list_steps(tmp_path)] == [100, 150, 160, 170, 300, 400]
    assert all(os.path.isdir(path) for path in [*kept, theirs, unattributed, not_a_writer, in_flight])


def test_a_committed_directory_is_never_deleted_for_its_writer_file_alone(tmp_path):
    """``writer.json`` is unsigned: it attributes only directories with no manifest. One of another job's
    committed steps (or a forgery) carrying a writer file naming this job stays."""
    _signed(tmp_path, 300, job_id="job-a")
    theirs = _signed(tmp_path, 200, job_id="job-b")
    forged = _signed(tmp_path, 100, key=OTHER_KEY, job_id="job-a")
    for directory in (theirs, forged):
        _write(os.path.join(directory, WRITER_NAME), encode_writer("job-a"))
    assert prune(tmp_path, keep_last=1, key=KEY, owner="job-a") == []
    assert os.path.isdir(theirs) and os.path.isdir(forged)


def test_a_writer_file_that_is_a_link_a_fifo_or_too_large_attributes_nothing(tmp_path):
    """Read without following links, a regular file of a few KiB at most: a planted link or FIFO is never
    opened (a FIFO would block the supervisor's prune), and a huge file is not read."""
    _signed(tmp_path, 300, job_id="job-a")
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere.json"
    elsewhere.write_bytes(encode_writer("job-a"))
    linked = _partial(tmp_path, 100, None)
    os.symlink(elsewhere, os.path.join(linked, WRITER_NAME))
    fifo = _partial(tmp_path, 110, None)
    os.mkfifo(os.path.join(fifo, WRITER_NAME))
    large = _partial(tmp_path, 120, encode_writer("job-a") + b" " * 8192)
    assert prune(tmp_path, keep_last=1, key=KEY, owner="job-a") == []
    assert all(os.path.isdir(path) for path in (linked, fifo, large))


def test_writer_files_round_trip_and_anything_else_names_no_job():
    assert writer_of(encode_writer("job-a")) == "job-a"
    for raw in (b"", b"not json", b"[]", b'{"format": "etrain.checkpoint-writer/1"}', b'{"job_id": "job-a"}', b"\xff"):
        assert writer_of(raw) is None, raw
