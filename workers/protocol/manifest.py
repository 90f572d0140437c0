"""The checkpoint manifest format: what ``manifest.json`` says, and how it is encoded, checked and signed.

A step directory counts as a checkpoint only once ``manifest.json`` exists in it and verifies: it lists
every file with its size and SHA-256 and carries a checksum of itself. This module is the format both
sides share: the ranks build :class:`ShardReport` objects in it, the supervisor turns them into a
:class:`Manifest`, and whoever loads a checkpoint decodes one. The operations over storage (commit,
verify, resolve the newest, prune) are ``workers/checkpoints/checkpoint_commit.py``; this module touches no file.

Manifests are signed. DCP's ``.metadata`` is unpickled by every rank at restore, so a step directory
written by anyone but the service is code that runs on every rank. The supervisor commits with the
service's key (``service/access/checkpoint_key.py``): the manifest carries ``hmac``, HMAC-SHA256 over the
canonical (sorted-key, compact) JSON of everything else in it, including each file's SHA-256, and the job
that committed it. :func:`decode_manifest` with a key refuses an unsigned, edited or foreign manifest
(:class:`ManifestSignatureError`) before believing anything in it; ranks, which do not hold the key,
compare :attr:`Manifest.digest` with the one the supervisor verified. Decoding without a key checks
integrity only: fine for tools and housekeeping, never the gate before a load.

Pure: standard library only (the control plane, which never imports torch, commits and verifies).

On-disk layout::

    <root>/step_00000100/
        __0_0.distcp __1_0.distcp ...   DCP shards, one file per rank (named by the rank's prefix)
        .metadata                       DCP's global index (rank 0)
        extra.pt                        non-tensor state: step, data position, RNG (rank 0)
        writer.json                     the job whose ranks write the directory (rank 0, first)
        manifest.json                   written last, atomically; absent = not a checkpoint

``writer.json`` is what lets a job delete the partial step directories it left itself (a save that a
kill interrupted, an asynchronous write whose rank died): nothing in an uncommitted directory is
signed, so without it a directory with no manifest could not be told from another job's or the
tenant's own, and pruning kept it forever (:func:`encode_writer`, :func:`writer_of`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac as _hmac
import json
import re
from dataclasses import dataclass

from etrain.workers.protocol.errors import CheckpointError

__all__ = [
    "FORMAT",
    "MANIFEST_NAME",
    "METADATA_NAME",
    "FileEntry",
    "Manifest",
    "ManifestSignatureError",
    "ShardReport",
    "WRITER_NAME",
    "decode_manifest",
    "encode_manifest",
    "encode_writer",
    "step_dir_name",
    "step_of_dir_name",
    "writer_of",
]

MANIFEST_NAME = "manifest.json"
#: Version 2 added ``hmac`` and ``job_id``. Version 1 manifests are unsigned: still readable without a
#: key (tools), refused with a key.
FORMAT = "etrain.checkpoint/2"
WRITER_FORMAT = "etrain.checkpoint-writer/1"
_UNSIGNED_FORMAT = "etrain.checkpoint/1"
#: DCP's global index: the one file of a checkpoint that is unpickled (ranks hash it before loading).
METADATA_NAME = ".metadata"
#: Written by rank 0 when it opens a step directory for a save: the job that writes it (``encode_writer``).
WRITER_NAME = "writer.json"
#: A writer file is a few dozen bytes; anything larger is not one (read no further).
WRITER_MAX_BYTES = 4096
_STEP_DIR_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """``step_<8-digit step>``: zero-padded so names sort like steps in any file browser."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


def step_of_dir_name(name: str) -> int | None:
    """The step a step directory's base name stands for; ``None`` for any other name."""
    match = _STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def encode_writer(job_id: str) -> bytes:
    """``writer.json``'s bytes for a save by ``job_id``."""
    return json.dumps({"format": WRITER_FORMAT, "job_id": job_id}, sort_keys=True).encode()


def writer_of(raw: bytes) -> str | None:
    """The job named by a ``writer.json``'s bytes; None for anything that is not one.

    Unsigned (the ranks that write it hold no key): it attributes a directory *without* a manifest to
    the job whose ranks wrote it, for pruning only. A forged one can make a job delete an uncommitted
    directory in its own checkpoint directory, which no job holds but that one (``service/access/
    checkpoint_dirs.py``); it never makes anything load, and never deletes a committed step."""
    if len(raw) > WRITER_MAX_BYTES:
        return None
    try:
        document = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(document, dict) or document.get("format") != WRITER_FORMAT:
        return None
    job_id = document.get("job_id")
    return job_id if isinstance(job_id, str) and job_id else None


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
    ``directory`` is the step directory's base name: a commit rejects reports that belong to another
    step (a late report from an earlier save must never complete a later one).
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


# --------------------------------------------------------------------------------------------------
# Encoding: canonical JSON with a checksum over the body and an HMAC over everything else.


def encode_manifest(manifest: Manifest, key: bytes | None) -> tuple[Manifest, bytes]:
    """The bytes of ``manifest.json`` for ``manifest`` (signed with ``key``; ``None``: unsigned), and the
    manifest as a reader will decode it (its ``hmac`` and ``digest`` filled in)."""
    document = _document(manifest, key)
    digest = hashlib.sha256(_canonical(document)).hexdigest()
    raw = json.dumps(document, sort_keys=True, indent=1).encode() + b"\n"
    return dataclasses.replace(manifest, hmac=document["hmac"], digest=digest), raw


def decode_manifest(raw: bytes, directory: str, key: bytes | None = None) -> Manifest:
    """The manifest in ``raw`` (read from ``directory``, named in errors), its signature checked under
    ``key`` first (:class:`ManifestSignatureError`; ``None`` skips it), then its own checksum and format
    (``CheckpointError``). Its files are not looked at here."""
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
                FileEntry(path=str(f["path"]), size=int(f["size"]), sha256=str(f["sha256"])) for f in document["files"]
            ),
            job_id=None if job_id is None else str(job_id),
            hmac=None if signed is None else str(signed),
            digest=digest,
        )
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{directory}: {MANIFEST_NAME} is unreadable ({type(exc).__name__}: {exc})") from None


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
