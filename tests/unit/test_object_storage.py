"""Object-store checkpoints, the pure and storage-level parts (issue #7): ``workers/checkpoints/storage.py`` against
a real S3-compatible server on loopback (moto's, ``tests/object_store.py``), the manifest rules on
``s3://`` roots, rank logs uploaded to and read from S3, and the settings / storage-roots grammar
(``ETRAIN_STORAGE_ROOTS`` with ``s3://`` entries, ``ETRAIN_CHECKPOINT_ROOT``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from etrain.service.access.storage_roots import StorageRoots, parse_roots, pin
from etrain.service.errors import SettingsError
from etrain.service.settings import Settings
from etrain.workers.checkpoints import storage
from etrain.workers.checkpoints.checkpoint_commit import (
    checkpoint_files,
    commit,
    file_entry,
    list_steps,
    prune,
    read_manifest,
    resolve_latest,
    step_dir,
    verify,
)
from etrain.workers.protocol.errors import CheckpointError, ConfigError
from etrain.workers.protocol.manifest import ShardReport
from etrain.workers.rank.rank_log import RankLog, rank_log_path, read_lines
from tests.object_store import s3_server

KEY = b"k" * 32


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture
def root(s3, request):
    """A fresh prefix per test: s3://etrain-test/<test name>."""
    return s3.url("unit", request.node.name.replace("[", "-").replace("]", ""))


# -- names and grammar (no server) ---------------------------------------------------------------


def test_urls_are_told_from_paths_and_taken_literally():
    assert storage.is_url("s3://b/p") and storage.is_url("S3://b") and not storage.is_url("/data/s3://x")
    assert not storage.is_url(Path("s3://b/p")) and not storage.is_url("s3:/b") and not storage.is_url("relative")
    assert storage.normalize_url("S3://bucket/a/b///") == "s3://bucket/a/b"
    assert storage.join("s3://b/p/", "step_00000001", "x.distcp") == "s3://b/p/step_00000001/x.distcp"
    assert storage.join("/d", "a") == "/d/a" and storage.basename("s3://b/p/step_00000003/") == "step_00000003"
    assert storage.parent("s3://b/p/step_00000003") == "s3://b/p"
    assert step_dir("s3://b/ckpt", 12) == "s3://b/ckpt/step_00000012"
    assert step_dir(Path("/x"), 5) == "/x/step_00000005"
    assert storage.url_problem("s3://bucket/ok/prefix") is None
    problems = {
        url: storage.url_problem(url)
        for url in ("gs://b/p", "s3:///p", "s3://b/../p", "s3://b/./p", "s3://b//p", "s3://b/p q", "s3://b/p*")
    }
    assert "scheme 'gs'" in problems["gs://b/p"] and "names no bucket" in problems["s3:///p"]
    for url in ("s3://b/../p", "s3://b/./p", "s3://b//p"):
        assert "empty, '.' or '..' path component" in problems[url], url
    assert "not a plain object key" in problems["s3://b/p q"] and "not a plain object key" in problems["s3://b/p*"]


def test_storage_roots_take_s3_entries_beside_the_old_colon_and_comma_forms():
    assert parse_roots("/a:/b") == (Path("/a"), Path("/b"))
    assert parse_roots("/a:s3://bucket/ckpt/:/b") == (Path("/a"), "s3://bucket/ckpt", Path("/b"))
    assert parse_roots("/data,s3://bucket/ckpt, s3://other ,/c") == (
        Path("/data"),
        "s3://bucket/ckpt",
        "s3://other",
        Path("/c"),
    )
    with pytest.raises(ValueError, match=r"'s3://b/\.\./x' has an empty, '\.' or '\.\.' path component"):
        parse_roots("/a,s3://b/../x")
    settings = Settings.from_env({"ETRAIN_STORAGE_ROOTS": "/data:s3://bucket/ckpt", "ETRAIN_DATA_DIR": "/state"})
    assert settings.storage_roots == (Path("/data"), "s3://bucket/ckpt")
    assert Settings(storage_roots=("s3://Bucket-x/p/",)).storage_roots == ("s3://Bucket-x/p",)
    with pytest.raises(SettingsError, match="ETRAIN_STORAGE_ROOTS: storage root 'gs://b' uses the scheme 'gs'"):
        Settings.from_env({"ETRAIN_STORAGE_ROOTS": "/data,gs://b"})


def test_the_checkpoint_root_setting_gives_each_job_its_own_folder_or_prefix(tmp_path):
    default = Settings(data_dir=tmp_path)
    assert default.checkpoint_root("j1") == tmp_path / "checkpoints" / "j1"
    assert default.checkpoint_location("j1") == str((tmp_path / "checkpoints" / "j1").resolve())
    assert default.checkpoint_tree == os.path.realpath(tmp_path / "checkpoints")
    on_s3 = Settings.from_env({"ETRAIN_CHECKPOINT_ROOT": "s3://bucket/etrain/", "ETRAIN_DATA_DIR": str(tmp_path)})
    assert on_s3.checkpoint_base == "s3://bucket/etrain"
    assert on_s3.checkpoint_root("j1") == on_s3.checkpoint_location("j1") == "s3://bucket/etrain/j1"
    assert on_s3.checkpoint_tree == "s3://bucket/etrain"
    shared = Settings.from_env({"ETRAIN_CHECKPOINT_ROOT": str(tmp_path / "shared"), "ETRAIN_DATA_DIR": str(tmp_path)})
    assert shared.checkpoint_root("j2") == tmp_path / "shared" / "j2"
    assert Settings.from_env({"ETRAIN_CHECKPOINT_ROOT": ""}).checkpoint_base is None
    with pytest.raises(SettingsError, match="ETRAIN_CHECKPOINT_ROOT='ckpt' is not an absolute path"):
        Settings.from_env({"ETRAIN_CHECKPOINT_ROOT": "ckpt"})
    with pytest.raises(SettingsError, match="names no bucket"):
        Settings(checkpoint_base="s3:///x")


def test_the_token_cache_lies_in_the_checkpoint_tree_or_where_the_operator_says(tmp_path):
    """Tokenized corpora are memory-mapped by every rank: a folder every node sees and only the service writes."""
    tree = os.path.realpath(tmp_path / "checkpoints")
    assert Settings(data_dir=tmp_path).token_cache_dir == os.path.join(tree, ".token-cache")
    shared = Settings.from_env({"ETRAIN_CHECKPOINT_ROOT": str(tmp_path / "shared"), "ETRAIN_DATA_DIR": str(tmp_path)})
    assert shared.token_cache_dir == os.path.join(os.path.realpath(tmp_path / "shared"), ".token-cache")
    on_s3 = Settings.from_env({"ETRAIN_CHECKPOINT_ROOT": "s3://bucket/etrain", "ETRAIN_DATA_DIR": str(tmp_path)})
    assert on_s3.token_cache_dir == os.path.realpath(tmp_path / "token-cache")  # tokens are mapped, not fetched
    given = Settings.from_env({"ETRAIN_TOKEN_CACHE_DIR": str(tmp_path / "tc"), "ETRAIN_CHECKPOINT_ROOT": "s3://b/e"})
    assert given.token_cache_dir == os.path.realpath(tmp_path / "tc")
    assert Settings.from_env({"ETRAIN_TOKEN_CACHE_DIR": " "}).token_cache_base is None
    for bad in ("tc", "s3://bucket/tokens"):
        with pytest.raises(SettingsError, match=f"ETRAIN_TOKEN_CACHE_DIR='{bad}' is not an absolute folder") as raised:
            Settings.from_env({"ETRAIN_TOKEN_CACHE_DIR": bad})
        assert "memory-map" in raised.value.fix
    # never where a tenant may write files: in (or holding) a storage root, unless inside the service's own folders
    roots = f"{tmp_path / 'datasets'}:{tmp_path}"
    for where, words in ((tmp_path / "datasets" / "tc", "is in"), (tmp_path.parent, "holds")):
        with pytest.raises(SettingsError, match=f"{words} the storage root") as raised:
            Settings.from_env({"ETRAIN_TOKEN_CACHE_DIR": str(where), "ETRAIN_STORAGE_ROOTS": roots})
        assert "outside every storage root" in raised.value.fix
    for own in (tmp_path / "state" / "tc", tmp_path / "ckpt" / "tc"):
        settings = Settings.from_env(
            {
                "ETRAIN_TOKEN_CACHE_DIR": str(own),
                "ETRAIN_STORAGE_ROOTS": roots,
                "ETRAIN_DATA_DIR": str(tmp_path / "state"),
                "ETRAIN_CHECKPOINT_ROOT": str(tmp_path / "ckpt"),
            }
        )
        assert settings.token_cache_dir == os.path.realpath(own)
    assert Settings().token_cache_max_gb == 100.0  # a bound by default
    assert Settings.from_env({"ETRAIN_TOKEN_CACHE_MAX_GB": "2.5"}).token_cache_max_gb == 2.5
    assert Settings.from_env({"ETRAIN_TOKEN_CACHE_MAX_GB": ""}).token_cache_max_gb is None  # no bound, said so
    for bad, why in (("-1", "must be 0 or more"), ("inf", "must be 0 or more"), ("lots", "is not a number")):
        with pytest.raises(SettingsError, match=f"ETRAIN_TOKEN_CACHE_MAX_GB.*{why}"):
            Settings.from_env({"ETRAIN_TOKEN_CACHE_MAX_GB": bad})


def test_a_missing_backend_is_named_with_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(storage.SUPPORTED_SCHEMES, "s3", ("etrain_no_such_backend", "s3"))
    message = (
        "s3:// storage needs the 'etrain_no_such_backend' package, which is not installed (pip install 'etrain[s3]')"
    )
    assert storage.missing_backend("s3://b/p") == message
    with pytest.raises(ConfigError) as raised:
        storage.exists("s3://b/p")
    assert raised.value.field == "checkpoint.path" and "pip install 'etrain[s3]'" in raised.value.fix
    with pytest.raises(SettingsError, match=r"pip install 'etrain\[s3\]'"):
        Settings(checkpoint_base="s3://b/p")
    roots = StorageRoots.of(["/data", "s3://b/jobs"])
    problem = roots.check("checkpoint.path", "s3://b/jobs/x", pin("s3://b/jobs/x", "/"))
    assert problem.field == "checkpoint.path" and message in problem.message and "etrain[s3]" in problem.fix


def test_only_checkpoint_path_may_name_object_storage_and_only_inside_an_s3_root():
    roots = StorageRoots.of(["/data", "s3://bucket/jobs/"])
    assert roots.roots == ("/data", "s3://bucket/jobs")
    assert pin("s3://bucket/jobs/x/", "/srv") == "s3://bucket/jobs/x"
    ok = ("s3://bucket/jobs", "s3://bucket/jobs/x", "s3://bucket/jobs/x/y/")
    for url in ok:
        assert roots.check("checkpoint.path", url, pin(url, "/srv")) is None, url
    for url in ("s3://bucket/jobs-evil/x", "s3://bucket/other", "s3://bucket2/jobs/x"):
        problem = roots.check("checkpoint.path", url, pin(url, "/srv"))
        assert problem.message.startswith(
            f"checkpoint.path={url!r} is outside the storage roots (/data, s3://bucket/jobs)"
        ), problem
    dotted = roots.check("checkpoint.path", "s3://bucket/jobs/../x", pin("s3://bucket/jobs/../x", "/srv"))
    assert "'..' path component" in dotted.message and dotted.field == "checkpoint.path"
    for field in ("data.path", "data.tokenizer", "model.hf", "out"):
        problem = roots.check(field, "s3://bucket/jobs/corpus", pin("s3://bucket/jobs/corpus", "/srv"))
        assert problem.field == field
        assert problem.message == (
            f"{field}='s3://bucket/jobs/corpus' is an object-store URL; {field} must be a "
            "local path (only checkpoint.path may name object storage)."
        )
        assert (
            problem.fix
            == "copy the files to a folder under the storage roots (/data, s3://bucket/jobs) and give its path"
        )
    # A local path never lies inside a URL root, nor a URL inside a local root.
    local = roots.check("checkpoint.path", "/s3:/bucket/jobs/x", "/s3:/bucket/jobs/x")
    assert local.message.startswith(
        "checkpoint.path='/s3:/bucket/jobs/x' is outside the storage roots (/data, s3://bucket/jobs)"
    ), local
    url = StorageRoots.of(["/data"]).check("checkpoint.path", "s3://bucket/jobs", "s3://bucket/jobs")
    assert url.message.startswith("checkpoint.path='s3://bucket/jobs' is outside the storage roots (/data)"), url


# -- the storage API on a real S3-compatible server ------------------------------------------------


def test_files_prefixes_and_atomic_writes_on_s3(s3, root):
    assert not storage.exists(root) and storage.walk_files(root) == [] and list_steps(root) == []
    with pytest.raises(FileNotFoundError):
        storage.listdir(root)
    storage.makedirs(root)  # a no-op: a prefix needs no creating
    storage.atomic_write_bytes(storage.join(root, "step_00000002", "a.bin"), b"x" * 10)
    storage.write_bytes(storage.join(root, "step_00000002", "sub", "b.bin"), b"yz")
    storage.write_bytes(storage.join(root, "step_00000010", "c.bin"), b"")
    storage.write_bytes(storage.join(root, "notes.txt"), b"n")
    storage.write_bytes(storage.join(root, "step_00000003.corrupt-1", "d.bin"), b"d")
    assert sorted(storage.listdir(root)) == ["notes.txt", "step_00000002", "step_00000003.corrupt-1", "step_00000010"]
    assert [step for step, _ in list_steps(root)] == [2, 10]  # files and aside copies are not steps
    assert list_steps(root)[0][1] == f"{root}/step_00000002"
    assert storage.file_sizes(storage.join(root, "step_00000002")) == {"a.bin": 10, "sub/b.bin": 2}
    assert checkpoint_files(storage.join(root, "step_00000002")) == ["a.bin", "sub/b.bin"]
    assert storage.getsize(storage.join(root, "step_00000010", "c.bin")) == 0
    assert storage.read_bytes(storage.join(root, "step_00000002", "a.bin")) == b"x" * 10
    assert storage.isdir(storage.join(root, "step_00000002")) and not storage.isdir(storage.join(root, "notes.txt"))
    storage.replace(storage.join(root, "step_00000002"), storage.join(root, "step_00000002.refused-9"))
    assert storage.file_sizes(storage.join(root, "step_00000002.refused-9")) == {"a.bin": 10, "sub/b.bin": 2}
    assert not storage.exists(storage.join(root, "step_00000002"))
    storage.rmtree(storage.join(root, "step_00000002.refused-9"))
    storage.rmtree(storage.join(root, "never-was"))  # absent is fine
    assert sorted(storage.listdir(root)) == ["notes.txt", "step_00000003.corrupt-1", "step_00000010"]
    assert (
        storage.sha256(storage.join(root, "notes.txt"))
        == "1b16b1df538ba12dc3f97edbb85caa7050d46c148134290feba80f8236c83db9"
    )  # sha256(b"n")


def _fake_step(root: str, step: int, *, world_size: int = 2) -> list[ShardReport]:
    """Files of a ``world_size``-rank checkpoint (bytes, not DCP: commit and verify do not unpickle)."""
    directory = step_dir(root, step)
    reports = []
    for rank in range(world_size):
        names = [f"__{rank}_0.distcp"] + ([".metadata", "extra.pt"] if rank == 0 else [])
        for name in names:
            storage.write_bytes(storage.join(directory, name), f"{name} of step {step} ".encode() * (rank + 3))
        reports.append(
            ShardReport(
                rank=rank,
                world_size=world_size,
                directory=f"step_{step:08d}",
                files=tuple(file_entry(directory, name) for name in names),
            )
        )
    return reports


def test_commit_verify_fallback_and_prune_on_an_s3_root(s3, root):
    for step in (10, 20, 30):
        manifest = commit(step_dir(root, step), step, "dp2", 2, _fake_step(root, step), key=KEY, job_id="job-a")
        assert manifest.step == step and manifest.job_id == "job-a" and len(manifest.hmac) == 64
    assert verify(step_dir(root, 30), key=KEY).digest == read_manifest(step_dir(root, 30), key=KEY).digest
    assert [s for s, _ in list_steps(root)] == [10, 20, 30]
    # An uncommitted step (no manifest object) is skipped, never loaded.
    _fake_step(root, 40)
    with pytest.raises(CheckpointError, match="step_00000040 is not committed: no manifest.json$"):
        verify(step_dir(root, 40), key=KEY)
    # A flipped byte in rank 1's shard of step 30: verification fails, step 20 is the one to resume.
    shard = storage.join(step_dir(root, 30), "__1_0.distcp")
    data = bytearray(storage.read_bytes(shard))
    data[5] ^= 0xFF
    storage.write_bytes(shard, bytes(data))
    found = resolve_latest(root, key=KEY)
    assert found.step == 20 and found.step_dir == step_dir(root, 20)
    assert [s.step for s in found.skipped] == [40, 30]
    assert "__1_0.distcp sha256 mismatch" in found.skipped[1].reason and not found.skipped[1].refused
    # A truncated shard is caught by size alone (one listing of the prefix).
    storage.write_bytes(storage.join(step_dir(root, 20), "__0_0.distcp"), b"short")
    with pytest.raises(CheckpointError, match="__0_0.distcp has 5 bytes, expected"):
        verify(step_dir(root, 20), key=KEY, checksums=False)
    # A missing shard refuses the commit: the manifest object is never written.
    reports = _fake_step(root, 50)
    storage.remove(storage.join(step_dir(root, 50), "__1_0.distcp"))
    with pytest.raises(CheckpointError, match="__1_0.distcp is missing"):
        commit(step_dir(root, 50), 50, "dp2", 2, reports, key=KEY, job_id="job-a")
    assert not storage.exists(storage.join(step_dir(root, 50), "manifest.json"))


def test_prune_keeps_keep_last_and_deletes_only_its_own_steps_on_s3(s3, root):
    for step, owner in ((10, "job-a"), (20, "job-b"), (30, "job-a"), (40, "job-a"), (50, "job-a")):
        commit(step_dir(root, step), step, "dp2", 2, _fake_step(root, step), key=KEY, job_id=owner)
    deleted = prune(root, keep_last=2, key=KEY, owner="job-a")
    assert deleted == [step_dir(root, 10), step_dir(root, 30)]  # job-b's step 20 is not job-a's to delete
    assert [s for s, _ in list_steps(root)] == [20, 40, 50]
    assert storage.walk_files(step_dir(root, 10)) == []  # every object of the step is gone, manifest first
    assert prune(root, keep_last=1, key=KEY) == [step_dir(root, 20), step_dir(root, 40)]
    assert [s for s, _ in list_steps(root)] == [50]


def test_rank_logs_are_uploaded_to_s3_and_read_back_by_range(s3, root):
    remote = rank_log_path(root, "job-1", 1)
    assert remote == f"{root}/logs/job-1/rank1.log"
    log = RankLog(remote)
    assert log.remote == remote and log.path != remote and log.path.endswith("rank1.log")
    for n in range(5):
        log.write(f"line {n}")
    assert not storage.exists(remote)  # nothing uploaded before the first checkpoint or the end
    log.sync()  # a checkpoint
    assert [line.split(" ", 1)[1] for line in read_lines(remote, tail=10).lines] == [f"line {n}" for n in range(5)]
    log.write("line 5")
    log.close()  # the end of the attempt
    assert not os.path.exists(log.path)  # the local copy is gone once uploaded
    # A second attempt of the same rank appends to what the first one uploaded.
    again = RankLog(remote)
    again.write("attempt 2")
    again.close()
    chunk = read_lines(remote, tail=3)
    assert [line.split(" ", 1)[1] for line in chunk.lines] == ["line 4", "line 5", "attempt 2"]
    assert chunk.offset == chunk.size == storage.getsize(remote)
    first = read_lines(remote, tail=2, offset=0)
    assert [line.split(" ", 1)[1] for line in first.lines] == ["line 0", "line 1"]
    assert [line.split(" ", 1)[1] for line in read_lines(remote, tail=100, offset=first.offset).lines] == [
        "line 2",
        "line 3",
        "line 4",
        "line 5",
        "attempt 2",
    ]
    assert read_lines(f"{root}/logs/job-1/rank7.log", tail=5).lines == []


def test_an_unreachable_store_never_breaks_the_rank_log(s3, root, monkeypatch, capfd):
    log = RankLog(rank_log_path(root, "job-2", 0))
    log.write("kept locally")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries: fail at once
    log.sync()
    assert "etrain: cannot upload the rank log to s3://" in capfd.readouterr().err
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    log.close()
    assert read_lines(rank_log_path(root, "job-2", 0), tail=5).lines[0].endswith("kept locally")
