"""Checkpoint manifests: the one atomic act that turns a step directory into a checkpoint.

A checkpoint is written by many ranks, in many files, over seconds or minutes; any of them can die
half-way. Rather than trying to make the writes themselves atomic, a step directory counts as a
checkpoint only once ``manifest.json`` exists in it *and verifies*: it lists every file with its
size and SHA-256 and carries a checksum of itself. The supervisor writes it last, after every rank
has reported its files, with write-tmp + fsync + ``os.replace`` + fsync-dir, so a crash at any
instant leaves either no manifest (the directory is ignored) or a complete one (invariant 4 of
``ARCHITECTURE.md``). Corruption after the fact (a flipped byte, a truncated file) makes
:func:`verify` fail and :func:`resolve_latest` falls back to the previous step.

Manifests are signed. DCP's ``.metadata`` is unpickled by every rank at restore, so a step directory
written by anyone but the service is code that runs on every rank. The supervisor commits with the
service's key (``service/access/checkpoint_key.py``): the manifest carries ``hmac``, HMAC-SHA256 over the
canonical (sorted-key, compact) JSON of everything else in it, including each file's SHA-256, and
the job that committed it. Whatever will be *loaded* is first verified with the key
(:class:`ManifestSignatureError` for an unsigned, edited or foreign manifest); the ranks, which do
not hold the key, get the verified manifest's :attr:`Manifest.digest` from the supervisor and check
that the manifest they read is that one (``expect_digest``), and hash ``.metadata`` before DCP
unpickles it. Verifying without
a key checks integrity only: fine for tools and housekeeping, never the gate before a load.

Pure: standard library only. The supervisor, which must not import torch, commits, verifies,
resolves and prunes with this module; ``workers/checkpoint.py`` (the torch side) produces the
per-rank :class:`ShardReport` objects it consumes.

Checkpoint roots may be local folders or object-store URLs (``s3://bucket/prefix``): every file
operation goes through ``workers/storage.py``. On an object store the manifest is written with one
PUT, which is atomic per object, so the same rule holds: the manifest object, written last after every
shard's size was checked, is the commit point.

On-disk layout::

    <root>/step_00000100/
        __0_0.distcp __1_0.distcp ...   DCP shards, one file per rank (named by the rank's prefix)
        .metadata                       DCP's global index (rank 0)
        extra.pt                        non-tensor state: step, data position, RNG (rank 0)
        manifest.json                   written last, atomically; absent = not a checkpoint
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac as _hmac
import json
import os
import re
import time
from dataclasses import dataclass

from etrain.workers import storage
from etrain.workers.protocol.errors import CheckpointError

__all__ = [
    "MANIFEST_NAME",
    "FileEntry",
    "Manifest",
    "ManifestSignatureError",
    "Resolution",
    "ShardReport",
    "SkippedStep",
    "checkpoint_files",
    "commit",
    "file_entry",
    "latest_committed",
    "list_steps",
    "prune",
    "read_manifest",
    "resolve_latest",
    "step_dir",
    "verify",
]

MANIFEST_NAME = "manifest.json"
#: Version 2 added ``hmac`` and ``job_id``. Version 1 manifests are unsigned: still readable without a
#: key (tools), refused with a key.
FORMAT = "etrain.checkpoint/2"
_UNSIGNED_FORMAT = "etrain.checkpoint/1"
#: DCP's global index: the one file of a checkpoint that is unpickled (ranks hash it before loading).
METADATA_NAME = ".metadata"
_TMP_SUFFIX = ".tmp"
_STEP_DIR_RE = re.compile(r"^step_(\d+)$")


class ManifestSignatureError(CheckpointError):
    """The manifest is not signed with the verifier's key: unsigned (an older format, or written
    outside the service), edited after commit, or signed by another service. Never loaded."""


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a checkpoint, relative to its step directory."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class ShardReport:
    """What one rank wrote for one checkpoint; it travels from the rank to the supervisor.

    Plain types only, so it pickles across Ray actors without torch on the receiving side.
    ``directory`` is the step directory's base name: :func:`commit` rejects reports that belong to
    another step (a late report from an earlier save must never complete a later one).
    """

    rank: int
    world_size: int
    directory: str
    files: tuple[FileEntry, ...]


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The committed description of one checkpoint; ``layout`` is the writer's compact layout string.

    ``job_id`` is the job that committed it (``None`` outside the service); ``hmac`` its signature
    (``None``: unsigned); ``digest`` the SHA-256 of the whole manifest as read (signature included),
    which lets a reader without the key check it reads the manifest a key holder verified.
    """

    step: int
    layout: str
    world_size: int
    created_at: float
    files: tuple[FileEntry, ...]
    job_id: str | None = None
    hmac: str | None = None
    digest: str | None = None

    @property
    def num_bytes(self) -> int:
        return sum(entry.size for entry in self.files)


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
# Paths


def step_dir(root: str | os.PathLike, step: int) -> str:
    """``<root>/step_<8-digit step>``: zero-padded so names sort like steps in any file browser."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return storage.join(root, f"step_{step:08d}")


def list_steps(root: str | os.PathLike) -> list[tuple[int, str]]:
    """Every step directory under ``root`` (committed or not), ascending by step. ``root`` may be a URL
    (``s3://bucket/prefix``: a step "directory" is the prefix of its objects, ``workers/storage.py``)."""
    try:
        names = storage.subdirs(root)
    except FileNotFoundError:
        return []
    return sorted((int(match.group(1)), storage.join(root, name))
                  for name in names if (match := _STEP_DIR_RE.match(name)))


def checkpoint_files(step_dir: str | os.PathLike) -> list[str]:
    """Relative paths of the data files in a step directory (everything but the manifest and
    leftover ``*.tmp`` files), sorted. Chaos tests pick their victims from this list."""
    return [rel for rel in storage.walk_files(step_dir)
            if rel != MANIFEST_NAME and not rel.rsplit("/", 1)[-1].endswith(_TMP_SUFFIX)]


# --------------------------------------------------------------------------------------------------
# Files and hashes


def sha256_file(path: str | os.PathLike) -> str:
    """SHA-256 of a file or (URL) object, streamed in 1 MiB chunks."""
    return storage.sha256(path)


def file_entry(step_dir: str | os.PathLike, relative_path: str) -> FileEntry:
    """Size and SHA-256 of one file as it is on disk (or in the object store) now (ranks call this after
    their writes)."""
    path = storage.join(step_dir, relative_path)
    return FileEntry(path=relative_path, size=storage.getsize(path), sha256=sha256_file(path))


#: Write-tmp + fsync + rename + fsync-dir locally, one PUT for a URL (see ``workers/storage.py``).
atomic_write_bytes = storage.atomic_write_bytes
#: Persist a directory's entries (a no-op for URLs and where directories cannot be opened).
fsync_dir = storage.fsync_dir


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
    if ".metadata" not in files:
        raise CheckpointError(f"cannot commit {directory}: no rank reported DCP's .metadata file")
    sizes = _listed_sizes(directory)
    for entry in files.values():
        problem = _size_problem(directory, entry, sizes)
        if problem:
            raise CheckpointError(f"cannot commit {directory}: {problem}")

    manifest = Manifest(
        step=step,
        layout=layout,
        world_size=world_size,
        created_at=time.time() if created_at is None else created_at,
        files=tuple(sorted(files.values(), key=lambda e: e.path)),
        job_id=job_id,
    )
    document = _document(manifest, key)
    digest = hashlib.sha256(_canonical(document)).hexdigest()
    manifest = dataclasses.replace(manifest, hmac=document["hmac"], digest=digest)
    # On an object store this single PUT is the commit point (every shard's size was checked above).
    atomic_write_bytes(storage.join(directory, MANIFEST_NAME), _encode(document))
    # The step directory's own entry in the root must survive a power loss too.
    fsync_dir(storage.parent(directory) or ".")
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
    (:class:`ManifestSignatureError` otherwise; ``key=None`` skips this, see the module docstring),
    its own checksum matches (a flipped byte in the manifest is caught too), its step matches the
    directory name, and every listed file is present with the recorded size and
    (``checksums=True``) SHA-256. ``checksums=False`` is the cheap check for housekeeping; anything
    about to be *loaded* must pass the full one, with the key.

    ``expect_digest``: the :attr:`Manifest.digest` of the manifest a key holder verified; the manifest
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
        hint = (" (a commit was interrupted)" if not storage.is_url(path) and os.path.exists(path + _TMP_SUFFIX)
                else "")
        raise CheckpointError(f"{directory} is not committed: no {MANIFEST_NAME}{hint}") from None
    manifest = _decode(raw, directory, key)
    if expect_digest is not None and not _hmac.compare_digest(manifest.digest or "", expect_digest):
        raise CheckpointError(
            f"{directory}: {MANIFEST_NAME} is not the one the supervisor verified (it changed since); "
            "refusing to load it"
        )
    match = _STEP_DIR_RE.match(storage.basename(directory))
    if match and int(match.group(1)) != manifest.step:
        raise CheckpointError(
            f"{directory}: manifest says step {manifest.step}, the directory name says {int(match.group(1))}"
        )
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
    for entry in hashed:
        actual = sha256_file(storage.join(directory, entry.path))
        if actual != entry.sha256:
            raise CheckpointError(
                f"{directory}: {entry.path} sha256 mismatch (manifest {entry.sha256[:12]}…, "
                f"disk {actual[:12]}…): the file changed after commit"
            )
    return manifest


def read_manifest(step_dir: str | os.PathLike, *, key: bytes | None) -> Manifest:
    """The manifest of ``step_dir`` with its signature (and checksum) checked, but not its files:
    who committed a directory, cheaply (``CheckpointError`` / :class:`ManifestSignatureError`)."""
    directory = os.fspath(step_dir)
    try:
        raw = storage.read_bytes(storage.join(directory, MANIFEST_NAME))
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not committed: no {MANIFEST_NAME}") from None
    return _decode(raw, directory, key)


def _listed_sizes(directory: str) -> dict[str, int] | None:
    """Every file's size from one listing, on an object store (one request instead of one per file);
    ``None`` locally, where each file is stat-ed as before."""
    return storage.file_sizes(directory) if storage.is_url(directory) else None


def _size_problem(directory: str, entry: FileEntry, sizes: dict[str, int] | None = None) -> str | None:
    if sizes is not None:
        size = sizes.get(entry.path)
        if size is None:
            return f"{entry.path} is missing"
        if size != entry.size:
            return f"{entry.path} has {size} bytes, expected {entry.size} (truncated or overwritten)"
        return None
    path = os.path.join(directory, entry.path)
    try:
        size = os.path.getsize(path)
    except OSError:
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
# Encoding: canonical JSON with a checksum over the body and an HMAC over everything else.


def _body(manifest: Manifest) -> dict:
    return {
        "format": FORMAT,
        "step": manifest.step,
        "layout": manifest.layout,
        "world_size": manifest.world_size,
        "created_at": manifest.created_at,
        "job_id": manifest.job_id,
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in manifest.files],
    }


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _signature(key: bytes, document: dict) -> str:
    """HMAC-SHA256 under ``key`` of the canonical JSON of ``document`` without its ``hmac`` field."""
    unsigned = {name: value for name, value in document.items() if name != "hmac"}
    return _hmac.new(key, _canonical(unsigned), hashlib.sha256).hexdigest()


def _document(manifest: Manifest, key: bytes | None) -> dict:
    """The manifest as written: body, its checksum, and (with ``key``) the signature over both."""
    body = _body(manifest)
    document = dict(body, checksum=hashlib.sha256(_canonical(body)).hexdigest())
    document["hmac"] = _signature(key, document) if key is not None else None
    return document


def _encode(document: dict) -> bytes:
    return json.dumps(document, sort_keys=True, indent=1).encode() + b"\n"


def _check_signature(document: dict, directory: str, key: bytes) -> None:
    """Before anything else in the document is believed: unsigned or forged is ManifestSignatureError."""
    given = document.get("hmac")
    if given is None:
        if document.get("format") == _UNSIGNED_FORMAT:
            raise ManifestSignatureError(
                f"{directory}: {MANIFEST_NAME} has format {_UNSIGNED_FORMAT!r}, written before checkpoints "
                "were signed; it carries no signature, so this service will not load it",
                fix="retrain from scratch (or from model.hf); checkpoints written from now on are signed",
            )
        raise ManifestSignatureError(
            f"{directory}: {MANIFEST_NAME} is unsigned (no hmac signature); only checkpoints this service "
            "committed are loaded",
            fix="resume only from checkpoint directories this service wrote",
        )
    if not isinstance(given, str) or not _hmac.compare_digest(_signature(key, document), given):
        raise ManifestSignatureError(
            f"{directory}: {MANIFEST_NAME} signature does not verify (edited after commit, or signed by "
            "another service's key); refusing to load it",
            fix="resume only from checkpoint directories this service wrote (its key is <data-dir>/checkpoint-key)",
        )


def _decode(raw: bytes, directory: str, key: bytes | None = None) -> Manifest:
    try:
        document = json.loads(raw)
        if not isinstance(document, dict):
            raise TypeError(f"a JSON object was expected, got {type(document).__name__}")
        if key is not None:
            _check_signature(document, directory, key)
        digest = hashlib.sha256(_canonical(document)).hexdigest()
        signed = document.pop("hmac", None)
        checksum = document.pop("checksum")
        if hashlib.sha256(_canonical(document)).hexdigest() != checksum:
            raise CheckpointError(f"{directory}: {MANIFEST_NAME} checksum mismatch (the manifest is corrupt)")
        if document["format"] not in (FORMAT, _UNSIGNED_FORMAT):
            raise CheckpointError(f"{directory}: unknown manifest format {document['format']!r}")
        job_id = document.get("job_id")
        return Manifest(
            step=int(document["step"]),
            layout=str(document["layout"]),
            world_size=int(document["world_size"]),
            created_at=float(document["created_at"]),
            files=tuple(
                FileEntry(path=str(f["path"]), size=int(f["size"]), sha256=str(f["sha256"]))
                for f in document["files"]
            ),
            job_id=None if job_id is None else str(job_id),
            hmac=None if signed is None else str(signed),
            digest=digest,
        )
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{directory}: {MANIFEST_NAME} is unreadable ({type(exc).__name__}: {exc})") from None


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
            skipped.append(SkippedStep(step=step, step_dir=directory, reason=str(exc),
                                       refused=isinstance(exc, ManifestSignatureError)))
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
) -> list[str]:
    """Delete what no restart will need; return the deleted directories.

    Keeps the newest ``keep_last`` checkpoints that verify (so never the newest usable one) and any
    directory newer than the newest of them (an in-flight save, or a corrupt one left for
    inspection). Deletes older committed checkpoints beyond ``keep_last`` and stale directories older
    than the newest checkpoint that never committed or no longer verify. With no verifying
    checkpoint at all nothing is deleted.

    ``owner`` (with ``key``, as the supervisor calls it): only directories whose manifest carries this
    job id under a valid signature are deleted, so a job never deletes what it did not commit (another
    job's steps in a shared directory, forgeries, partial directories it cannot attribute); only
    checkpoints that verify under ``key`` count as kept.

    ``checksums=True`` (default) hashes the kept checkpoints: with size-only checks a bit-flipped
    newest step could be "kept" while the truly usable previous one is deleted.
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
            verify(directory, key=key, checksums=checksums)
        except CheckpointError:
            continue
        kept.append(step)
    if not kept:
        return []
    newest = kept[0]
    deleted = []
    for step, directory in steps:
        if step in kept or step > newest:
            continue
        if owner is not None and not _committed_by(directory, owner, key):
            continue
        _delete_step_dir(directory)
        deleted.append(directory)
    return deleted


def _committed_by(directory: str, owner: str, key: bytes) -> bool:
    try:
        return read_manifest(directory, key=key).job_id == owner
    except CheckpointError:
        return False


def _delete_step_dir(directory: str) -> None:
    # The manifest first (made durable locally): never a "committed" directory with missing shards.
    try:
        storage.remove(storage.join(directory, MANIFEST_NAME))
    except FileNotFoundError:
        pass
    else:
        fsync_dir(directory)  # a no-op for a URL
    storage.rmtree(directory)
