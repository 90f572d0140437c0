"""A save the storage fails is abandoned cleanly and said in words (issue #16 item 4), with real limits.

Two real file-system limits, no fakes: ``RLIMIT_FSIZE`` (the kernel refuses a write past it: ``EFBIG``,
which Python turns into an ``OSError`` since it ignores ``SIGXFSZ``) makes DCP's shard write itself fail
after the room check passed; a small ``tmpfs`` (root only: skipped elsewhere, the RLIMIT cases still
run) makes the room check refuse a save the disk cannot hold, and a disk that fills during the write
(``ENOSPC``) fail it. Each time: a ``StorageFault`` whose message names the cause and the folder, no
partial step left behind, the committed step untouched and still loadable, and a save once there is
room again works.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource

import pytest
import torch
from torch import nn

from etrain.workers.checkpoints.checkpoint import AsyncCheckpointer, load_checkpoint, save_checkpoint
from etrain.workers.checkpoints.checkpoint_commit import commit, step_dir, verify
from etrain.workers.checkpoints.storage_faults import StorageFault, needed_bytes, storage_fault
from tests.small_disk import tmpfs

KEY = b"k" * 32


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))  # ~130 KB of fp32 weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()  # AdamW state: ~390 KB in all with the weights
    return model, optimizer


def _save_and_commit(root, step: int, model, optimizer) -> str:
    directory = step_dir(root, step)
    report = save_checkpoint(directory, [model], [optimizer], {"step": step})
    commit(directory, step, "single", 1, [report], key=KEY, job_id="job")
    return directory


@contextlib.contextmanager
def _file_size_limit(limit: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (a real file system that fills up), or skip where mounting is not allowed."""
    with tmpfs(tmp_path / "disk", "2m") as mount:
        yield mount


def test_a_write_the_kernel_refuses_is_abandoned_and_explained_and_the_committed_step_stays(tmp_path):
    model, optimizer = _model()
    committed = _save_and_commit(tmp_path, 1, model, optimizer)
    failing = step_dir(tmp_path, 2)
    with _file_size_limit(64 * 1024), pytest.raises(StorageFault) as raised:  # the shard file is ~390 KB
        save_checkpoint(failing, [model], [optimizer], {"step": 2})
    message = str(raised.value)
    assert f"file too large for the file system at {failing}" in message
    assert "training continues" not in message and "next save tries again" in message  # the fix says so
    assert not os.path.exists(failing)  # nothing partial left behind
    verify(committed)  # the committed step is untouched
    fresh, fresh_optimizer = _model(seed=1)
    assert load_checkpoint(committed, [fresh], [fresh_optimizer])["step"] == 1
    for saved, loaded in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(saved, loaded)
    _save_and_commit(tmp_path, 2, model, optimizer)  # the limit is gone: the next save works
    verify(failing)


def test_an_async_write_the_kernel_refuses_fails_its_handle_not_the_next_save(tmp_path):
    model, optimizer = _model()
    checkpointer = AsyncCheckpointer()
    try:
        with _file_size_limit(64 * 1024):
            pending = checkpointer.save(step_dir(tmp_path, 1), [model], [optimizer], {"step": 1})
            with pytest.raises(StorageFault, match="file too large"):
                pending.wait(timeout_s=60)
        assert not os.path.exists(step_dir(tmp_path, 1))
        report = checkpointer.save(step_dir(tmp_path, 2), [model], [optimizer], {"step": 2}).wait(timeout_s=60)
        commit(step_dir(tmp_path, 2), 2, "single", 1, [report], key=KEY, job_id="job")
        verify(step_dir(tmp_path, 2))
    finally:
        checkpointer.close()


def test_the_room_check_refuses_a_save_a_full_disk_cannot_hold(small_disk):
    model, optimizer = _model()
    committed = _save_and_commit(small_disk, 1, model, optimizer)
    size = sum(os.path.getsize(os.path.join(committed, name)) for name in os.listdir(committed))
    filler = small_disk / "filler"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler.write_bytes(b"\0" * (free - needed_bytes(size) // 2))  # less room left than a save needs
    with pytest.raises(StorageFault) as raised:
        save_checkpoint(step_dir(small_disk, 2), [model], [optimizer], {"step": 2})
    message = str(raised.value)
    assert message.startswith(f"no space left on device at {small_disk}: need ~")
    assert " MiB free" in message
    assert not os.path.exists(step_dir(small_disk, 2))
    verify(committed)
    filler.unlink()
    _save_and_commit(small_disk, 2, model, optimizer)


def test_a_disk_that_fills_during_the_write_is_said_to_be_full(small_disk):
    """The first save has no committed size to check against (the room check uses this rank's state
    bytes): a disk with room for the estimate's margin but not the files fails in the write."""
    big = nn.Linear(512, 1024)  # 2 MiB of fp32 weights, more than the disk holds with its margin
    optimizer = torch.optim.SGD(big.parameters(), lr=0.1)
    with pytest.raises(StorageFault) as raised:
        save_checkpoint(step_dir(small_disk, 1), [big], [optimizer], {"step": 1})
    assert str(raised.value).startswith(f"no space left on device at {small_disk}")
    assert not os.path.exists(step_dir(small_disk, 1))


def test_storage_fault_names_each_errno_and_ignores_what_is_not_the_storage(tmp_path):
    for code, words in (
        (errno.ENOSPC, "no space left on device"),
        (errno.EDQUOT, "disk quota exceeded"),
        (errno.EIO, "I/O error"),
        (errno.EROFS, "read-only file system"),
    ):
        wrapped = RuntimeError("the writer failed")
        wrapped.__cause__ = OSError(code, os.strerror(code))
        fault = storage_fault(wrapped, str(tmp_path), 0)
        assert fault is not None and str(fault).startswith(f"{words} at {tmp_path}: need ~")
    assert storage_fault(ValueError("a bug"), str(tmp_path), 0) is None
    assert storage_fault(OSError(errno.ECONNRESET, "reset"), str(tmp_path), 0) is None


def test_a_save_that_starts_while_the_step_before_commits_is_not_failed_by_its_room_check(tmp_path, monkeypatch):
    """Seen in the chaos suite under ``checkpoint.async``: rank 0's room check for step 8 listed step 4's files
    while the supervisor committed step 4, whose ``manifest.json.tmp`` was renamed away before the check read
    its size, and the job FAILED with "No such file or directory: .../step_00000004/manifest.json.tmp".
    Here the supervisor's rename lands exactly there, between the listing and the sizes."""
    from etrain.workers.checkpoints import storage

    model, optimizer = _model()
    committing = _save_and_commit(tmp_path, 4, model, optimizer)
    manifest = os.path.join(committing, "manifest.json")
    os.replace(manifest, manifest + ".tmp")  # the commit half-way: written, not yet renamed into place
    listing = storage.walk_files

    def list_then_commit(directory):
        names = listing(directory)
        if os.path.exists(manifest + ".tmp"):
            os.replace(manifest + ".tmp", manifest)  # the supervisor's rename, right after this listing
        return names

    monkeypatch.setattr(storage, "walk_files", list_then_commit)
    directory = step_dir(tmp_path, 8)
    report = save_checkpoint(directory, [model], [optimizer], {"step": 8})
    monkeypatch.undo()
    commit(directory, 8, "single", 1, [report], key=KEY, job_id="job")
    assert verify(committing, key=KEY).step == 4 and verify(directory, key=KEY).step == 8
    other, other_optimizer = _model(seed=1)
    assert load_checkpoint(directory, [other], [other_optimizer])["step"] == 8
