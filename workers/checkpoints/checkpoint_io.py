"""A checkpoint's files on storage, as a rank sees them: DCP's writers and readers, the rank's report of
what it wrote, ``extra.pt``, and the checks every rank agrees on before it writes or reads a shard.

``workers/checkpoints/checkpoint.py`` drives a save or a load; this module is everything it does to storage.
Why it is built this way:

* **A rank reports, the supervisor commits.** Every rank returns a ``ShardReport`` (the files it
  wrote, with size and SHA-256, :func:`shard_report`); ``etrain.workers.checkpoints.checkpoint_commit.commit``
  writes ``manifest.json`` last once all ranks reported. Loading verifies the manifest first
  (:func:`verify_together`, each rank hashing a share of the files): a step directory that never
  committed, or was corrupted afterwards, is never read (invariant 4).
* **Local folders or object storage.** A step directory may be an ``s3://`` URL: shards and
  ``.metadata`` then go through DCP's fsspec storage (``FsspecWriter``/``FsspecReader``, async saves
  included), hashed on the way up, and ``extra.pt`` and the rank's file listing through
  ``workers/checkpoints/storage.py``.
* **Non-tensor state** (step, data position, RNG) goes to ``extra.pt``, written by rank 0 and
  readable with ``torch.load(weights_only=True)``; it is global, not per rank.
* **Every rank hears rank 0's verdict** (:func:`start_checkpoint`) before any rank writes a shard,
  so nobody enters DCP's collectives when a peer has already given up.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from etrain.workers.checkpoints import storage
from etrain.workers.checkpoints.checkpoint_commit import file_entries, list_steps, verify
from etrain.workers.checkpoints.storage_faults import check_room, storage_fault
from etrain.workers.protocol import safe_paths
from etrain.workers.protocol.errors import CheckpointError, EtrainError
from etrain.workers.protocol.manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    WRITER_NAME,
    FileEntry,
    ShardReport,
    encode_writer,
)

__all__ = [
    "EXTRA_NAME",
    "abandon",
    "last_checkpoint_bytes",
    "new_plan_cache",
    "read_extra",
    "save_planner",
    "shard_report",
    "start_checkpoint",
    "storage_reader",
    "verify_together",
    "dcp_writer",
]

EXTRA_NAME = "extra.pt"


# -- writers and readers ---------------------------------------------------------------------------


class _Recording:
    """Remembers this rank's file-name prefix (``__<rank>_``) as DCP's writer plans it, so the rank
    can report exactly the files it wrote, an empty shard file included."""

    prefix: str | None = None

    def write_data(self, plan, planner):
        self.prefix = plan.storage_data.prefix
        return super().write_data(plan, planner)


class _RecordingWriter(_Recording, dcp.FileSystemWriter):
    """DCP's local file writer, recording."""


class _HashingStream:
    """A write stream that hashes and counts what passes through it to the file or upload it wraps."""

    def __init__(self, raw):
        self._raw = raw
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self._digest.update(data)
        self.size += memoryview(data).nbytes
        return self._raw.write(data)

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def __getattr__(self, name: str):  # tell, flush, fileno, ...: the stream's own
        return getattr(self._raw, name)


def _hashing(file_system: type) -> type:
    """``file_system`` (a DCP ``FileSystem``) that records ``(size, sha256)`` of every file it writes, as
    the file is closed, under its final name after DCP's rename (``.metadata``).

    Why: a rank then reports its shards without reading back what it has just written. Local files
    were read back for their hashes: for a 1B model's 15.9 GB a second pass over the data at the end of
    every save (the final one's 15-17 s on an H100 included it). DCP writes each file in order (offsets
    from ``tell()``, no seek), so the hash of the stream is the hash of the file. What the supervisor
    verifies before a load is still the files themselves.
    """

    class Hashing(file_system):
        def __init__(self) -> None:
            super().__init__()
            self.written: dict[str, tuple[int, str]] = {}

        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                hashing = _HashingStream(stream)
                yield hashing
            self.written[os.fspath(path)] = (hashing.size, hashing.sha256)  # the file is closed, or uploaded

        def rename(self, path, new_path) -> None:
            super().rename(path, new_path)
            if os.fspath(path) in self.written:
                self.written[os.fspath(new_path)] = self.written.pop(os.fspath(path))

    Hashing.__name__ = Hashing.__qualname__ = f"_Hashing{file_system.__name__}"
    return Hashing


_fsspec_classes: tuple[type, type] | None = None
_local_file_system: type | None = None


def _fsspec_writer_classes() -> tuple[type, type]:
    """(recording ``FsspecWriter``, hashing fsspec ``FileSystem``), built on first use (fsspec imported then).

    The file system records ``(size, sha256)`` of every file as its upload completes (:func:`_hashing`).
    """
    global _fsspec_classes
    if _fsspec_classes is None:
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

        _fsspec_classes = (type("_RecordingFsspecWriter", (_Recording, FsspecWriter), {}), _hashing(FileSystem))
    return _fsspec_classes


def _hashing_local_file_system() -> Any:
    """A hashing DCP local ``FileSystem`` (:func:`_hashing`), for one writer."""
    global _local_file_system
    if _local_file_system is None:
        from torch.distributed.checkpoint.filesystem import FileSystem

        _local_file_system = _hashing(FileSystem)
    return _local_file_system()


def save_planner(cache: str) -> Any:
    """DCP's default save planner with its plan cache on, for the saves of one group of ranks.

    Why: without the cache every save exchanges every rank's full plan (a pickled entry per tensor,
    gathered on rank 0, deduplicated and scattered back) before writing a byte. Measured on two
    gloo ranks with the gpt-tiny DP2 state (about 500 tensors with AdamW), a save took 0.37 s
    (median of 12) without the cache and 0.20 s with it. With the cache a rank whose plan did not
    change since its last save sends an empty one, and rank 0 reuses the global plan
    (``enable_plan_caching``, DCP's own feature).

    DCP keeps the cache per process under a key, and rank 0 skips sending a rank the plan it
    believes that rank has cached. So every rank of the group must start its cache together: a
    process that joins later (the replacement of an in-place repair, beside survivors that saved
    before) has none, and DCP fails it with a ``KeyError`` (measured). ``cache`` (from
    :func:`new_plan_cache`) is the key: the caller makes one per group of ranks and state
    (``Trainer`` and ``AsyncCheckpointer`` per instance, i.e. per attempt, on every rank), so the first
    save of an attempt plans in full everywhere.
    """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = cache  # the key DCP caches under (its class name by default)
    return planner


def new_plan_cache() -> str:
    """A fresh plan-cache key for :func:`save_planner` (one per group of ranks and state)."""
    import uuid

    return f"etrain:{uuid.uuid4().hex}"


def dcp_writer(directory: str, *, threads: int = 1) -> _Recording:
    """DCP's writer for ``directory``: the local file writer, or for a URL DCP's fsspec writer
    (``FsspecWriter``: a ``FileSystemWriter`` over fsspec, so async staging works the same), each over
    a hashing file system (:func:`_hashing`: the shard report needs no read-back). On an object store ``sync_files`` is off: an upload is durable once its PUT
    returns, and the file objects have no descriptor to fsync (DCP would fall back to a machine-wide
    ``os.sync()`` per file)."""
    if not storage.is_url(directory):
        writer = _RecordingWriter(directory, thread_count=max(1, threads))
        writer.fs = _hashing_local_file_system()  # the same paths (pathlib), each file hashed as written
        return writer
    storage.filesystem(directory)  # ConfigError naming the extra to install, before DCP's ImportError
    writer_class, filesystem_class = _fsspec_writer_classes()
    options = storage.storage_options(directory)
    writer = writer_class(directory, sync_files=False, thread_count=max(1, threads), **options)
    writer.fs = filesystem_class()
    writer.path = writer.fs.init_path(directory, **options)
    return writer


def storage_reader(directory: str):
    """DCP's reader for ``directory`` (a local path or a URL: ``FsspecReader``); ``workers/checkpoints/hf_io.py`` uses
    it to export a checkpoint from either."""
    if not storage.is_url(directory):
        return dcp.FileSystemReader(directory)
    storage.filesystem(directory)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(directory, **storage.storage_options(directory))


def shard_report(directory: str, writer: _Recording, group: dist.ProcessGroup | None) -> ShardReport:
    """What this rank wrote into ``directory`` (its ``.distcp`` files; rank 0 also ``.metadata``,
    ``extra.pt`` and ``writer.json``), each with size and SHA-256: the report the supervisor commits."""
    rank, world_size = _rank(group), _world_size(group)
    assert writer.prefix is not None, "DCP finished without planning this rank's writes"
    listing = storage.listdir(directory)
    names = sorted(n for n in listing if n.startswith(writer.prefix) and n.endswith(".distcp"))
    if rank == 0:
        names += [METADATA_NAME, EXTRA_NAME] + ([WRITER_NAME] if WRITER_NAME in listing else [])
    uploaded = getattr(writer.fs, "written", {})  # hashed on the way to storage (:func:`_hashing`)
    return ShardReport(
        rank=rank,
        world_size=world_size,
        directory=storage.basename(safe_paths.display(directory)),  # step_N, also when written by descriptor
        files=_reported(directory, names, uploaded),
    )


def _reported(directory: str, names: list[str], uploaded: dict[str, tuple[int, str]]) -> tuple[FileEntry, ...]:
    """Each file's entry: as hashed on the way to storage (the writer's files), else read back from
    storage (``extra.pt``, written before DCP's writer), several files at a time."""
    unknown = [name for name in names if os.path.join(directory, name) not in uploaded]
    read_back = dict(zip(unknown, file_entries(directory, unknown)))
    return tuple(
        read_back[name]
        if name in read_back
        else FileEntry(
            path=name,
            size=uploaded[os.path.join(directory, name)][0],
            sha256=uploaded[os.path.join(directory, name)][1],
        )
        for name in names
    )


def start_checkpoint(
    directory: str,
    extra: dict[str, Any],
    group: dist.ProcessGroup | None,
    state_bytes: int = 0,
    *,
    owner: str | None = None,
) -> int:
    """Rank 0 refuses a committed directory, clears a partial one, checks the room and writes ``extra.pt``;
    every rank hears the verdict before any rank writes a shard (stale shards of a crashed attempt must
    not mix with new ones, and nobody may start DCP's collectives if rank 0 cannot take part).

    ``owner`` (the job's id): rank 0 first writes ``writer.json`` naming it, so that if this save never
    commits (a kill mid-write), the job's later prunes can tell the partial directory is its own and delete
    it (``checkpoint_commit.prune``).

    The room check (``workers/checkpoints/storage_faults.py``): the file system must have the size of the last
    committed checkpoint free, plus a margin (``state_bytes``, this rank's state, stands in before the
    first commit); otherwise every rank raises ``StorageFault`` and nothing is written. Returns the
    checkpoint size the check used (what explains a write that fails later)."""
    expected = [state_bytes]

    def start() -> None:  # a local folder or (URL) an object-store prefix, through workers/checkpoints/storage.py
        if storage.exists(storage.join(directory, MANIFEST_NAME)):
            try:
                verify(directory)
            except CheckpointError:
                # A commit that no longer verifies (rot, a corruption drill) was passed over at
                # restore; the re-run of its step replaces it. Keep the bad one aside for inspection.
                storage.replace(directory, f"{directory}.corrupt-{int(time.time())}")
            else:
                raise CheckpointError(
                    f"{directory} already holds a committed checkpoint; refusing to overwrite it",
                    fix="save each step once; resume from the committed step instead of saving it again",
                )
        if storage.is_url(directory):
            storage.rmtree(directory)  # every object under the prefix (a prefix needs no creating)
        else:  # strict locally: a folder that cannot be cleared fails the save, never mixes old shards in;
            # a link at the step's name is refused (UnsafePathError), never cleared or written through
            os.close(safe_paths.open_dir(storage.parent(directory), field="checkpoint.path", create=True))
            safe_paths.remove_tree(directory, field="checkpoint.path")
            expected[0] = last_checkpoint_bytes(storage.parent(directory)) or state_bytes
            check_room(storage.parent(directory), expected[0])
            os.close(safe_paths.open_dir(directory, field="checkpoint.path", create=True))
        try:
            if owner is not None:
                storage.atomic_write_bytes(storage.join(directory, WRITER_NAME), encode_writer(owner))
            storage.atomic_write_bytes(storage.join(directory, EXTRA_NAME), _encode_extra(extra))
        except OSError as exc:
            raise (storage_fault(exc, directory, expected[0]) or exc) from None

    _agree(start, group, f"cannot save into {safe_paths.display(directory)}")
    return expected[0]


def last_checkpoint_bytes(root: str) -> int:
    """The size of the newest committed checkpoint under ``root`` (0 when there is none)."""
    for _, directory in reversed(list_steps(root)):
        sizes = storage.file_sizes(directory)
        if MANIFEST_NAME in sizes:
            return sum(sizes.values())
    return 0


def abandon(directory: str, group: dist.ProcessGroup | None) -> None:
    """After a failed save (every rank is past its writes): rank 0 removes the step's files, so a
    failed save leaves no partial step behind to fill the disk further. Never a committed step."""
    if _rank(group) != 0 or storage.exists(storage.join(directory, MANIFEST_NAME)):
        return
    try:
        storage.rmtree(directory)
    except Exception:  # noqa: BLE001 - best effort: an uncommitted step is never read, a later save clears it
        pass


def _encode_extra(extra: dict[str, Any]) -> bytes:
    """``extra`` serialised, after checking it will load back with ``weights_only=True`` (found out
    now, at save time, rather than at the restart that needs it)."""
    buffer = io.BytesIO()
    torch.save({"format": 1, "extra": extra}, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint extra state cannot be restored safely: {exc}",
            fix="keep extra to tensors and plain Python values (dict, list, tuple, str, int, float, bool, None)",
        ) from None
    return data


def read_extra(directory: str) -> dict[str, Any]:
    """The ``extra`` dict a save stored in ``extra.pt`` (loaded with ``weights_only=True``)."""
    try:
        payload = torch.load(io.BytesIO(storage.read_bytes(storage.join(directory, EXTRA_NAME))), weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read {EXTRA_NAME} of {directory}: {exc}") from exc
    return payload["extra"]


# -- agreeing across ranks ---------------------------------------------------------------------------


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _world_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def verify_together(
    directory: str, checksums: bool, group: dist.ProcessGroup | None, expect_digest: str | None = None
) -> None:
    """Every rank checks sizes and hashes its share of the files; all raise the first rank's error."""
    rank, world_size = _rank(group), _world_size(group)
    error: CheckpointError | None = None
    try:
        verify(directory, checksums=checksums, share=(rank, world_size), expect_digest=expect_digest)
    except CheckpointError as exc:
        error = exc
    except EtrainError as exc:  # e.g. the object-store backend is not installed on this node
        error = CheckpointError(f"cannot load {directory}: {exc}")
    except OSError as exc:  # unreadable file: still a verdict, so no peer is left waiting below
        error = CheckpointError(f"cannot load {directory}: {exc}")
    if world_size > 1:
        errors: list[CheckpointError | None] = [None] * world_size
        dist.all_gather_object(errors, error, group=group)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error


def _agree(action, group: dist.ProcessGroup | None, context: str) -> None:
    """Run ``action`` on rank 0 and raise its error on every rank, so no rank goes on into a
    collective that a peer has already abandoned."""
    error: CheckpointError | None = None
    if _rank(group) == 0:
        try:
            action()
        except CheckpointError as exc:
            error = exc
        except (EtrainError, OSError) as exc:  # EtrainError: e.g. no object-store backend on this node
            error = CheckpointError(f"{context}: {exc}")
    if dist.is_initialized() and _world_size(group) > 1:
        box = [error]
        dist.broadcast_object_list(box, group=group, group_src=0)
        error = box[0]
    if error is not None:
        raise error
