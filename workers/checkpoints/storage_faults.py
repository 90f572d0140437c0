"""Storage faults during a checkpoint save, in words a user understands.

Why: a disk that fills during a save surfaced as DCP's ``CheckpointException ... unexpected pos 704 vs
598`` (the zip writer's view of a short write), and killed the job. A full disk, a quota, an I/O error
or a read-only mount is the storage's state, not the job's: the save is abandoned (nothing of it is
committed, the last committed step is untouched), the job is told why, training goes on, and the next
interval tries again. Only the job's *final* save failing fails the job (its weights would be lost),
with the same sentence as its error.

Two places find a fault: :func:`check_room` before a save writes anything (the free space against the
size of the last committed checkpoint plus a margin), and :func:`storage_fault` after a write failed
(the ``OSError`` inside DCP's per-rank failures, or, when the writer lost the errno as the zip writer
does, the free space that is left). No torch import: the exception types are matched by shape.
"""

from __future__ import annotations

import errno
import os
import shutil

from etrain.workers.checkpoints import storage
from etrain.workers.protocol import safe_paths
from etrain.workers.protocol.errors import CheckpointError

__all__ = ["MARGIN_BYTES", "MARGIN_FRACTION", "StorageFault", "check_room", "free_bytes", "storage_fault"]

#: The room a save needs beyond the size of the last checkpoint: a fraction of it plus a fixed amount
#: (``extra.pt``, ``.metadata``, a model that grew a little; small enough for a test's 4 MiB disk).
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 1 << 20

#: Errors that say the storage (not the job) is at fault, and how to say so.
STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EIO: "I/O error",
    errno.EFBIG: "file too large for the file system",
    errno.EROFS: "read-only file system",
}


class StorageFault(CheckpointError):
    """A save abandoned because of the storage (full, over quota, failing, read-only): survivable."""


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


def free_bytes(directory: str) -> int | None:
    """Bytes free to this process on the file system that holds ``directory`` (its nearest existing
    ancestor); None for an object store or when it cannot be read."""
    if storage.is_url(directory):
        return None
    path = os.path.abspath(directory)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def needed_bytes(last_checkpoint_bytes: int) -> int:
    """What a save needs free: the last checkpoint's size plus the margin."""
    return int(last_checkpoint_bytes * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


def _fix(directory: str) -> str:
    return (
        f"free space on the storage that holds {safe_paths.display(directory)} (or lower checkpoint.keep_last, or point "
        "checkpoint.path at a larger volume); the job keeps training and the next save tries again"
    )


def check_room(directory: str, last_checkpoint_bytes: int) -> None:
    """Raise :class:`StorageFault` when ``directory``'s file system has less room than a save needs."""
    free = free_bytes(directory)
    need = needed_bytes(last_checkpoint_bytes)
    if free is not None and free < need:
        raise StorageFault(
            f"no space left on device at {safe_paths.display(directory)}: need ~{_mib(need)}, {_mib(free)} free",
            fix=_fix(directory),
        )


def _os_errors(error: BaseException):
    """Every ``OSError`` inside ``error``: itself, its causes, and DCP's per-rank failures
    (``CheckpointException.failures``: rank -> (exception, traceback) or exception)."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            yield current
        for failure in (getattr(current, "failures", None) or {}).values():
            pending.append(failure[0] if isinstance(failure, tuple) else failure)
        pending += [current.__cause__, current.__context__]


def storage_fault(error: BaseException, directory: str, last_checkpoint_bytes: int) -> StorageFault | None:
    """The :class:`StorageFault` that explains a failed save, or None when the storage is not the cause.

    A write error with a storage errno names it; a failure without one (the zip writer reports a short
    write as "unexpected pos") is a storage fault when the disk is now too full for the checkpoint;
    any other failure of DCP's writes (``CheckpointException``) is still the storage's, said as is.
    """
    found = next((err for err in _os_errors(error) if err.errno in STORAGE_ERRNOS), None)
    shown = safe_paths.display(directory)  # a held folder's descriptor name is no name for a person
    free = free_bytes(directory)
    need = needed_bytes(last_checkpoint_bytes)
    room = f": need ~{_mib(need)}, {_mib(free)} free" if free is not None else ""
    if found is not None:
        return StorageFault(f"{STORAGE_ERRNOS[found.errno]} at {shown}{room}", fix=_fix(directory))
    if free is not None and free < need:
        return StorageFault(f"no space left on device at {shown}{room}", fix=_fix(directory))
    if type(error).__name__ == "CheckpointException":
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return StorageFault(
            f"writing the checkpoint to {shown} failed: {first.replace(directory, shown)[:300]}", fix=_fix(directory)
        )
    return None
