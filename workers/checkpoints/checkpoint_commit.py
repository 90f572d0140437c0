"""Checkpoint step directories on storage: commit them, verify them, find the newest usable one, prune.

A checkpoint is written by many ranks, in many files, over seconds or minutes; any of them can die
half-way. Rather than trying to make the writes themselves atomic, a step directory counts as a
checkpoint only once ``manifest.json`` exists in it *and verifies* (the format, its checksum and its
signature: ``workers/protocol/manifest.py``). The supervisor writes it last, after every rank has
reported its files (:func:`commit`), with write-tmp + fsync + ``os.replace`` + fsync-dir, so a crash at
any instant leaves either no manifest (the directory is ignored) or a complete one (invariant 4 of
``ARCHITECTURE.md``). Corruption after the fact (a flipped byte, a truncated file) makes :func:`verify`
fail and :func:`resolve_latest` falls back to the previous step.

Whatever will be *loaded* is first verified with the service's key; the ranks, which do not hold it,
get the verified manifest's digest from the supervisor and check that the manifest they read is that
one (``verify(expect_digest=...)``), and hash ``.metadata`` before DCP unpickles it.

Checkpoint roots may be local folders or object-store URLs (``s3://bucket/prefix``): every file
operation goes through ``workers/checkpoints/storage.py``. On an object store the manifest is written with one PUT,
which is atomic per object, so the same rule holds: the manifest object, written last after every
shard's size was checked, is the commit point.

Pure (standard library and ``workers/checkpoints/storage.py``): the supervisor, which must not import torch,
commits, verifies, resolves and prunes with this module; ``workers/checkpoints/checkpoint.py`` (the torch side)
produces the per-rank ``ShardReport`` objects it consumes and verifies before every load.
"""

from __future__ import annotations

import hmac
import os
import time
from dataclasses import dataclass

from etrain.workers.checkpoints import storage
from etrain.workers.protocol import safe_paths
from etrain.workers.protocol.errors import CheckpointError, EtrainError
from etrain.workers.protocol.manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    WRITER_MAX_BYTES,
    WRITER_NAME,
    FileEntry,
    Manifest,
    ManifestSignatureError,
    ShardReport,
    decode_manifest,
    encode_manifest,
    step_dir_name,
    step_of_dir_name,
    writer_of,
)

__all__ = [
    "Resolution",
    "SkippedStep",
    "checkpoint_files",
    "commit",
    "file_entries",
    "file_entry",
    "latest_committed",
    "list_steps",
    "prune",
    "read_manifest",
    "resolve_latest",
    "step_dir",
    "verify",
]


@dataclass(frozen=True, kw_only=True)
class SkippedStep:
    """A step directory :func:`resolve_latest` passed over, and why (for events and logs)."""

    step: int
    step_dir: str
    reason: str
    #: True when the manifest's signature did not verify (forged, unsigned): refused, not merely corrupt.
    refused: bool = False


@dataclass(frozen=True, kw_only=True)
class Resolution:
    """Outcome of looking for the newest usable checkpoint under a root.

    ``skipped`` lists the newer directories that were rejected, newest first, so a restart can say
    "restored step 100; step 200 skipped: __1_0.distcp sha256 mismatch".
    """

    step: int | None
    step_dir: str | None
    manifest: Manifest | None
    skipped: tuple[SkippedStep, ...]


# --------------------------------------------------------------------------------------------------
# Paths and files


def step_dir(root: str | os.PathLike, step: int) -> str:
    """``<root>/step_<8-digit step>`` (a local path or a URL)."""
    return storage.join(root, step_dir_name(step))


def list_steps(root: str | os.PathLike) -> list[tuple[int, str]]:
    """Every step directory under ``root`` (committed or not), ascending by step. ``root`` may be a URL
    (``s3://bucket/prefix``: a step "directory" is the prefix of its objects, ``workers/checkpoints/storage.py``)."""
    try:
        names = storage.subdirs(root)
    except FileNotFoundError:
        return []
    return sorted((step, storage.join(root, name)) for name in names if (step := step_of_dir_name(name)) is not None)


def checkpoint_files(step_dir: str | os.PathLike) -> list[str]:
    """Relative paths of the data files in a step directory (everything but the manifest and
    leftover ``*.tmp`` files), sorted. Chaos tests pick their victims from this list."""
    return [
        rel
        for rel in storage.walk_files(step_dir)
        if rel != MANIFEST_NAME and not rel.rsplit("/", 1)[-1].endswith(storage.TMP_SUFFIX)
    ]


def file_entry(step_dir: str | os.PathLike, relative_path: str) -> FileEntry:
    """:func:`file_entries` of one file."""
    return file_entries(step_dir, [relative_path])[0]


def file_entries(step_dir: str | os.PathLike, relative_paths: list[str]) -> list[FileEntry]:
    """Size and SHA-256 of each file as it is on disk (or in the object store) now (ranks call this after
    their writes), hashed several at a time (``storage.sha256_many``)."""
    paths = [storage.join(step_dir, relative) for relative in relative_paths]
    return [
        FileEntry(path=relative, size=storage.getsize(path), sha256=digest)
        for relative, path, digest in zip(relative_paths, paths, storage.sha256_many(paths))
    ]


# --------------------------------------------------------------------------------------------------
# Commit and verify


def commit(
    step_dir: str | os.PathLike,
    step: int,
    layout: str,
    world_size: int,
    reports: list[ShardReport] | tuple[ShardReport, ...],
    *,
    key: bytes | None = None,
    job_id: str | None = None,
    created_at: float | None = None,
) -> Manifest:
    """Merge every rank's report and write ``manifest.json`` last, atomically: the commit point.

    ``key`` signs it (the service always passes its key; ``None`` writes an unsigned manifest, which
    only keyless tools accept) and ``job_id`` records the committing job (pruning deletes only its own).

    Refuses (``CheckpointError``, nothing written) unless exactly ranks ``0..world_size-1`` reported
    for this directory, no file is claimed twice, DCP's ``.metadata`` is among the files, and every
    file is on disk with the reported size. Contents are not re-hashed here (the ranks hashed them in
    parallel right after writing; re-reading a large checkpoint on the supervisor would serialise
    that work); :func:`verify` does the full check before anything is loaded.
    """
    directory = os.fspath(step_dir)  # a URL string is returned as is
    name = storage.basename(directory)
    if world_size < 1:
        raise CheckpointError(f"cannot commit {directory}: world_size must be >= 1, got {world_size}")
    by_rank: dict[int, ShardReport] = {}
    for report in reports:
        if report.directory != name:
            raise CheckpointError(
                f"cannot commit {directory}: rank {report.rank} reported files for {report.directory!r}"
            )
        if report.world_size != world_size:
            raise CheckpointError(
                f"cannot commit {directory}: rank {report.rank} saved with world_size="
                f"{report.world_size}, expected {world_size}"
            )
        if report.rank in by_rank:
            raise CheckpointError(f"cannot commit {directory}: rank {report.rank} reported twice")
        by_rank[report.rank] = report
    missing = sorted(set(range(world_size)) - by_rank.keys())
    extra = sorted(by_rank.keys() - set(range(world_size)))
    if missing or extra:
        raise CheckpointError(
            f"cannot commit {directory}: ranks {missing} of {world_size} did not report"
            + (f", unexpected ranks {extra} did" if extra else "")
            + "; a checkpoint is complete only when every rank has written its shard"
        )

    files: dict[str, FileEntry] = {}
    for rank in range(world_size):
        for entry in by_rank[rank].files:
            _check_relative(entry.path, directory)
            if entry.path == MANIFEST_NAME:
                raise CheckpointError(f"cannot commit {directory}: rank {rank} reported {MANIFEST_NAME}")
            if entry.path in files:
                raise CheckpointError(f"cannot commit {directory}: {entry.path} reported by two ranks")
            files[entry.path] = entry
    if METADATA_NAME not in files:
        raise CheckpointError(f"cannot commit {directory}: no rank reported DCP's {METADATA_NAME} file")
    sizes = _listed_sizes(directory)
    for entry in files.values():
        problem = _size_problem(directory, entry, sizes)
        if problem:
            raise CheckpointError(f"cannot commit {directory}: {problem}")

    manifest, raw = encode_manifest(
        Manifest(
            step=step,
            layout=layout,
            world_size=world_size,
            created_at=time.time() if created_at is None else created_at,
            files=tuple(sorted(files.values(), key=lambda e: e.path)),
            job_id=job_id,
        ),
        key,
    )
    # On an object store this single PUT is the commit point (every shard's size was checked above).
    storage.atomic_write_bytes(storage.join(directory, MANIFEST_NAME), raw)
    # The step directory's own entry in the root must survive a power loss too.
    storage.fsync_dir(storage.parent(directory) or ".")
    return manifest


def verify(
    step_dir: str | os.PathLike,
    *,
    key: bytes | None = None,
    checksums: bool = True,
    share: tuple[int, int] | None = None,
    expect_digest: str | None = None,
) -> Manifest:
    """The manifest of a committed, intact checkpoint, or ``CheckpointError`` saying what is wrong.

    Checks: the manifest exists and parses, its signature verifies under ``key``
    (``ManifestSignatureError`` otherwise; ``key=None`` skips this, see the module docstring),
    its own checksum matches (a flipped byte in the manifest is caught too), its step matches the
    directory name, and every listed file is present with the recorded size and
    (``checksums=True``) SHA-256. ``checksums=False`` is the cheap check for housekeeping; anything
    about to be *loaded* must pass the full one, with the key.

    ``expect_digest``: the ``Manifest.digest`` of the manifest a key holder verified; the manifest
    read here must have exactly it (a keyless reader cannot check the signature, but it can check that
    every byte that was signed, the signature included, is the same), and ``.metadata`` (the file DCP
    unpickles) is hashed even with ``checksums=False``. This is how a rank, which has no key, makes sure
    it loads the checkpoint the supervisor verified.

    ``share=(index, count)`` hashes only files ``index, index + count, ...`` (sizes are still checked
    for all): ``count`` ranks each verify their share, so the hashing of a large checkpoint is
    spread instead of one rank reading everything while the others wait in a collective.
    """
    directory = os.fspath(step_dir)
    path = storage.join(directory, MANIFEST_NAME)
    try:
        raw = storage.read_bytes(path)
    except FileNotFoundError:
        interrupted = not storage.is_url(path) and os.path.exists(path + storage.TMP_SUFFIX)
        hint = " (a commit was interrupted)" if interrupted else ""
        raise CheckpointError(f"{directory} is not committed: no {MANIFEST_NAME}{hint}") from None
    manifest = decode_manifest(raw, directory, key)
    if expect_digest is not None and not hmac.compare_digest(manifest.digest or "", expect_digest):
        raise CheckpointError(
            f"{directory}: {MANIFEST_NAME} is not the one the supervisor verified (it changed since); "
            "refusing to load it"
        )
    named_step = step_of_dir_name(storage.basename(directory))
    if named_step is not None and named_step != manifest.step:
        raise CheckpointError(f"{directory}: manifest says step {manifest.step}, the directory name says {named_step}")
    index, count = share if share is not None else (0, 1)
    if not 0 <= index < count:
        raise ValueError(f"share must be (index, count) with 0 <= index < count, got {share}")
    sizes = _listed_sizes(directory)
    for entry in manifest.files:  # cheap checks for every file before any hashing
        _check_relative(entry.path, directory)
        problem = _size_problem(directory, entry, sizes)
        if problem:
            raise CheckpointError(f"{directory}: {problem}")
    hashed = list(manifest.files[index::count]) if checksums else []
    if expect_digest is not None:  # every rank unpickles .metadata: each hashes it itself
        hashed += [entry for entry in manifest.files if entry.path == METADATA_NAME and entry not in hashed]
    digests = storage.sha256_many([storage.join(directory, entry.path) for entry in hashed])
    for entry, actual in zip(hashed, digests):
        if actual != entry.sha256:
            raise CheckpointError(
                f"{directory}: {entry.path} sha256 mismatch (manifest {entry.sha256[:12]}…, "
                f"disk {actual[:12]}…): the file changed after commit"
            )
    return manifest


def read_manifest(step_dir: str | os.PathLike, *, key: bytes | None) -> Manifest:
    """The manifest of ``step_dir`` with its signature (and checksum) checked, but not its files:
    who committed a directory, cheaply (``CheckpointError`` / ``ManifestSignatureError``)."""
    directory = os.fspath(step_dir)
    try:
        raw = storage.read_bytes(storage.join(directory, MANIFEST_NAME))
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not committed: no {MANIFEST_NAME}") from None
    return decode_manifest(raw, directory, key)


def _listed_sizes(directory: str) -> dict[str, int] | None:
    """Every file's size from one listing, on an object store (one request instead of one per file);
    ``None`` locally, where each file is stat-ed as before."""
    return storage.file_sizes(directory) if storage.is_url(directory) else None


def _size_problem(directory: str, entry: FileEntry, sizes: dict[str, int] | None = None) -> str | None:
    if sizes is not None:
        size = sizes.get(entry.path)
    else:
        try:
            size = os.path.getsize(os.path.join(directory, entry.path))
        except OSError:
            size = None
    if size is None:
        return f"{entry.path} is missing"
    if size != entry.size:
        return f"{entry.path} has {size} bytes, expected {entry.size} (truncated or overwritten)"
    return None


def _check_relative(path: str, directory: str) -> None:
    """Manifest paths stay inside their step directory (a manifest is data, not trusted code)."""
    parts = path.replace("\\", "/").split("/")
    if not path or os.path.isabs(path) or ".." in parts:
        raise CheckpointError(f"{directory}: file path {path!r} is not a plain relative path")


# --------------------------------------------------------------------------------------------------
# Choosing and pruning


def resolve_latest(root: str | os.PathLike, *, checksums: bool = True, key: bytes | None = None) -> Resolution:
    """The newest step under ``root`` whose manifest verifies, with the reasons newer ones were skipped.

    Partial directories (a save that crashed, an interrupted commit), corrupted checkpoints and, with
    ``key``, unsigned or forged ones (``refused=True``) are passed over for the previous step, never loaded.
    """
    skipped: list[SkippedStep] = []
    for step, directory in reversed(list_steps(root)):
        try:
            manifest = verify(directory, key=key, checksums=checksums)
        except CheckpointError as exc:
            skipped.append(
                SkippedStep(
                    step=step, step_dir=directory, reason=str(exc), refused=isinstance(exc, ManifestSignatureError)
                )
            )
            continue
        return Resolution(step=step, step_dir=directory, manifest=manifest, skipped=tuple(skipped))
    return Resolution(step=None, step_dir=None, manifest=None, skipped=tuple(skipped))


def latest_committed(
    root: str | os.PathLike, *, checksums: bool = True, key: bytes | None = None
) -> tuple[int, str] | None:
    """``(step, step_dir)`` of the newest verifying checkpoint, or ``None``.

    See :func:`resolve_latest` for the same answer with the skipped directories and their reasons.
    """
    found = resolve_latest(root, checksums=checksums, key=key)
    return None if found.step is None else (found.step, found.step_dir)


def prune(
    root: str | os.PathLike,
    keep_last: int,
    *,
    checksums: bool = True,
    key: bytes | None = None,
    owner: str | None = None,
    hashed: dict[str, str] | None = None,
) -> list[str]:
    """Delete what no restart will need; return the deleted directories.

    Keeps the newest ``keep_last`` checkpoints that verify (so never the newest usable one) and any
    directory newer than the newest of them (an in-flight save, or a corrupt one left for
    inspection). Deletes older committed checkpoints beyond ``keep_last`` and stale directories older
    than the newest checkpoint that never committed or no longer verify. With no verifying
    checkpoint at all nothing is deleted.

    ``owner`` (with ``key``, as the supervisor calls it): only directories whose manifest carries this
    job id under a valid signature are deleted, and partial ones (no manifest at all) whose ``writer.json``
    names it (a save of this job's that a kill interrupted, or whose asynchronous write died with its rank:
    a resume from memory may never save that step again, so nothing else would ever clear it). A job never
    deletes what it did not write (another job's steps in a shared directory, forgeries, partial
    directories it cannot attribute); only checkpoints that verify under ``key`` count as kept.

    ``checksums=True`` (default) hashes the kept checkpoints: with size-only checks a bit-flipped
    newest step could be "kept" while the truly usable previous one is deleted.

    ``hashed``: the caller's memo, kept from one prune to the next, of the directories whose every file
    was hashed here and matched, by the digest of the manifest they matched. A kept checkpoint whose
    manifest still has that digest is checked by signature and sizes only, not hashed again, so each
    checkpoint is read once, in the first prune after its commit. Hashing every kept step after every
    commit read ``keep_last`` checkpoints per commit (48 GB for a 1B model's 16 GB state at the default
    ``keep_last: 3``); what changes on disk after its one hash without changing size is still caught by
    the full check before a load. Entries for directories gone or deleted are dropped, so it stays
    bounded by what is on disk.
    Each deletion removes ``manifest.json`` first, so a crash half-way through leaves an uncommitted
    directory rather than a "committed" one with missing files.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is never pruned), got {keep_last}")
    if owner is not None and key is None:
        raise ValueError("prune(owner=...) needs the key that proves the owner committed a directory")
    steps = list_steps(root)
    kept: list[int] = []
    for step, directory in reversed(steps):
        if len(kept) == keep_last:
            break
        try:
            _verify_kept(directory, key=key, checksums=checksums, hashed=hashed)
        except CheckpointError:
            continue
        kept.append(step)
    deleted = []
    if kept:
        newest = kept[0]
        for step, directory in steps:
            if step in kept or step > newest:
                continue
            if owner is not None and not (_committed_by(directory, owner, key) or _partial_of(directory, owner)):
                continue
            _delete_step_dir(directory)
            deleted.append(directory)
    if hashed is not None:
        present = {directory for _, directory in steps}.difference(deleted)
        for gone in [directory for directory in list(hashed) if directory not in present]:
            del hashed[gone]
    return deleted


def _verify_kept(directory: str, *, key: bytes | None, checksums: bool, hashed: dict[str, str] | None) -> None:
    """:func:`verify` for :func:`prune`: a directory ``hashed`` remembers under its current manifest is
    checked by signature and sizes only; any other is hashed in full, and remembered once it passes."""
    memo = hashed if checksums else None
    if memo is not None and directory in memo and verify(directory, key=key, checksums=False).digest == memo[directory]:
        return
    manifest = verify(directory, key=key, checksums=checksums)
    if memo is not None and manifest.digest is not None:
        memo[directory] = manifest.digest


def _committed_by(directory: str, owner: str, key: bytes) -> bool:
    try:
        return read_manifest(directory, key=key).job_id == owner
    except CheckpointError:
        return False


def _partial_of(directory: str, owner: str) -> bool:
    """Whether ``directory`` never committed (no manifest, not even one of another job's) and its
    ``writer.json`` names ``owner``. Locally the file is read without following links, a regular file of
    at most ``WRITER_MAX_BYTES`` (a FIFO or a link planted there is not read)."""
    if storage.exists(storage.join(directory, MANIFEST_NAME)):
        return False
    path = storage.join(directory, WRITER_NAME)
    try:
        if storage.is_url(directory):
            if storage.getsize(path) > WRITER_MAX_BYTES:
                return False
            raw = storage.read_bytes(path)
        else:
            raw = safe_paths.read_file(directory, WRITER_NAME, field="checkpoint.path", limit=WRITER_MAX_BYTES)
    except (OSError, ValueError, EtrainError):  # absent, a link (UnsafePathError), not a regular file, too large
        return False
    return writer_of(raw) == owner


def _delete_step_dir(directory: str) -> None:
    # A link at the step's name is refused (UnsafePathError), never deleted through: the folder is the tenant's.
    local = not storage.is_url(directory)
    if local:
        safe_paths.stat_path(directory, field="checkpoint.path")
    # The manifest first (made durable locally): never a "committed" directory with missing shards.
    try:
        storage.remove(storage.join(directory, MANIFEST_NAME))
    except FileNotFoundError:
        pass
    else:
        storage.fsync_dir(directory)  # a no-op for a URL
    if local:
        safe_paths.remove_tree(directory, field="checkpoint.path")
    else:
        storage.rmtree(directory)
