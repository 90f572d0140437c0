"""Storage roots: the only directories a job may read from or write to (pure: standard library only).

A job spec names files the service then opens with its own rights: ``data.path``,
``data.tokenizer`` and ``model.hf`` are read, ``checkpoint.path`` (and an export's ``out``) are
written, pruned and later loaded. Without a fence anyone who can submit a job reads any file the
server can read and writes anywhere it can write. The fence is a list of directories, the
*storage roots* (``ETRAIN_STORAGE_ROOTS``, default: the data directory):

* a path is joined with the server's base directory and resolved with :func:`os.path.realpath`
  (``~``, ``..`` and every symlink followed) and must then lie inside one root. The comparison is by
  path components, so ``/data-evil`` is not inside ``/data``;
* the verdict depends only on the given string and the resolved path, never on whether the file
  exists, and the message echoes the *given* value (not where a symlink points): an attacker learns
  nothing about files outside the roots from the answer. Callers must check the roots before any
  existence check (:func:`etrain.service.planning.spec_paths.pin_paths` does);
* the service's own files in the data directory (database, API token, checkpoint key) are never a
  job's input or output, even though the data directory is a root. A folder that contains them is
  fine: the text walk reads text suffixes only, and these files have none.

The pinned (resolved) path is what the job then uses. It is a realpath, so it has no symbolic link on
it; but it is a string, which the OS resolves again at every open, so a folder swapped for a link after
submission, or a link planted inside a folder that passed, would be followed. Hence the second half of
the fence: every file the service or a rank opens, copies or deletes under a pinned path is opened one
component at a time without following links (``workers/protocol/safe_paths.py``), and a link met then is refused
(``UnsafePathError`` naming the field). This module judges the spec's paths; that one every file below them.

Object storage: a root may also be an ``s3://bucket/prefix`` URL. Only ``checkpoint.path``
(:data:`URL_FIELDS`) may name one (the data, the tokenizer and ``model.hf`` are read with local file
APIs, and an export's ``out`` is a local folder); it must lie inside an ``s3://`` root by key
components, exactly like a path (``s3://bucket/prefix-evil`` is not inside ``s3://bucket/prefix``). A URL
is taken literally (no ``..``, ``.`` or empty components, no trailing ``/``) and is never looked up
before this check, and the service must have the backend installed (``pip install 'etrain[s3]'``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from etrain.workers.checkpoints.storage import is_url, missing_backend, normalize_url, url_problem

__all__ = [
    "PRIVATE_FILE_NAMES",
    "URL_FIELDS",
    "RootProblem",
    "StorageRoots",
    "inside",
    "parse_root",
    "resolve",
    "parse_roots",
    "pin",
    "split_roots",
]

#: Files of the data directory no job may read or write: SQLite and its journals, the API token
#: (``api/``), the tenants' token file, and the checkpoint signing key (``service/access/checkpoint_key.py``).
PRIVATE_FILE_NAMES = (
    "etrain.db",
    "etrain.db-wal",
    "etrain.db-shm",
    "etrain.db-journal",
    "api-token",
    "api-tokens",
    "checkpoint-key",
)
#: The only spec fields that may name object storage (``s3://...``); every other path is local-only.
URL_FIELDS = frozenset({"checkpoint.path"})
#: ETRAIN_STORAGE_ROOTS separators: ',' anywhere, and ':' (``os.pathsep``) except where it opens ``://``.
_SEPARATOR = re.compile(r",|:(?!//)") if os.pathsep == ":" else re.compile(r",|" + re.escape(os.pathsep))


def pin(raw: str, base_dir: str | os.PathLike) -> str:
    """``raw`` as the job will use it: ``~`` expanded, joined with ``base_dir`` when relative, then
    :func:`os.path.realpath` (symlinks and ``..`` resolved; a missing tail is kept as written). The result has
    no link on it, and is re-checked at every open: :mod:`etrain.workers.protocol.safe_paths` refuses a link that
    appears on it later (a folder swapped after submit) instead of resolving the string again.
    A value with a NUL byte names no file; it is returned as given, and :meth:`StorageRoots.check` refuses it.
    A URL (``s3://...``) is pinned without its trailing ``/``; a malformed one is returned as given (refused
    by :meth:`StorageRoots.check`)."""
    if "\x00" in raw:
        return raw
    if is_url(raw):
        return raw if url_problem(raw) else normalize_url(raw)
    return os.path.realpath(os.path.join(os.fspath(base_dir), os.path.expanduser(raw)))


def inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it, by whole components (both already resolved)."""
    return path == root or path.startswith(root if root.endswith(os.sep) else root + os.sep)


def parse_roots(raw: str) -> tuple[Path | str, ...]:
    """``ETRAIN_STORAGE_ROOTS``: absolute directories and ``s3://bucket/prefix`` URLs, separated by commas
    or by ``:`` (``os.pathsep``). A ``:`` that opens ``://`` separates nothing, so the old ``/a:/b`` form
    still reads as two roots and ``/data:s3://bucket/ckpt`` or ``/data,s3://bucket/ckpt`` as a folder
    and a URL. Folders come back as :class:`~pathlib.Path`, URLs as strings (without a trailing ``/``).

    ``ValueError`` names a relative entry (a root relative to wherever the server happens to start
    would silently change meaning) or a malformed URL.
    """
    return tuple(parse_root(entry) for entry in split_roots(raw))


def split_roots(raw: str) -> list[str]:
    """The entries of ``ETRAIN_STORAGE_ROOTS`` as written (separated as :func:`parse_roots` says; spaces around
    them and empty ones dropped), tenant marks (``alice=/data/alice``, service/access/reach.py) included."""
    return [entry for part in _SEPARATOR.split(raw) if (entry := part.strip())]


def parse_root(entry: str | os.PathLike) -> Path | str:
    """One storage root (from the environment or given to ``Settings``): a folder (``~`` expanded) as a
    :class:`~pathlib.Path`, a URL normalised; ``ValueError`` for a relative folder or a malformed URL."""
    if is_url(entry):
        problem = url_problem(entry)
        if problem:
            raise ValueError(f"storage root {problem}")
        return normalize_url(entry)
    expanded = os.path.expanduser(os.fspath(entry))
    if not os.path.isabs(expanded):
        raise ValueError(f"storage root {os.fspath(entry)!r} is not an absolute path")
    return Path(expanded)


def resolve(path: str | os.PathLike) -> str:
    """A local path with symlinks and ``..`` resolved (relative to the current directory); a URL as
    given, without a trailing ``/``. How roots, checkpoint trees and checkpoint paths are compared."""
    return normalize_url(path) if is_url(path) else os.path.realpath(os.fspath(path))


@dataclass(frozen=True, kw_only=True)
class RootProblem:
    """Why a path is refused: a message naming the field, the given value and the roots, and the fix."""

    field: str
    message: str
    fix: str


@dataclass(frozen=True)
class StorageRoots:
    """The resolved roots, and the service's private files inside them.

    Build with :meth:`of`; ``roots`` and ``private`` hold realpaths, so :meth:`check` is a lexical
    comparison of a pinned path with them.
    """

    roots: tuple[str, ...]
    private: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        roots: tuple[str | os.PathLike, ...] | list[str | os.PathLike],
        *,
        data_dir: str | os.PathLike | None = None,
    ) -> StorageRoots:
        """Roots resolved now (relative ones against the current directory; URLs as given, without a
        trailing ``/``); with ``data_dir``, its private files (:data:`PRIVATE_FILE_NAMES`) are fenced off,
        and it is the root when none is given."""
        chosen = list(roots) or ([data_dir] if data_dir is not None else [])
        if not chosen:
            raise ValueError("at least one storage root (or the data directory) is needed")
        resolved = tuple(dict.fromkeys(resolve(root) for root in chosen))
        private = ()
        if data_dir is not None:
            base = os.path.realpath(os.fspath(data_dir))
            private = tuple(os.path.join(base, name) for name in PRIVATE_FILE_NAMES)
        return cls(roots=resolved, private=private)

    def describe(self, shown: tuple[str, ...] | None = None) -> str:
        return ", ".join(self.roots if shown is None else shown) or "none you may use"

    def check(self, field: str, raw: str, pinned: str, *, shown: tuple[str, ...] | None = None) -> RootProblem | None:
        """``None`` when ``pinned`` (the :func:`pin` of ``raw``) may be used, else the problem.

        The answer is a function of ``raw`` and ``pinned`` alone (and, for a URL, of whether the
        service has the backend installed); the message shows ``raw``. ``shown``: the roots the message
        may name (default all): a tenant is told its own and the shared ones, never where another
        tenant's root is (``Reach.visible_roots``).
        """
        if "\x00" in raw:
            return RootProblem(
                field=field,
                message=f"{field} contains a NUL byte, which no file name can.",
                fix=f"give {field} as a plain path",
            )
        if is_url(raw):
            problem = self._url_problem(field, raw, pinned, shown)
            if problem is not None:
                return problem
        if not any(inside(pinned, root) for root in self.roots):
            return RootProblem(
                field=field,
                message=f"{field}={raw!r} is outside the storage roots ({self.describe(shown)}); paths are "
                "resolved (relative to the server's directory, symlinks and '..' followed) before this check.",
                fix=f"put it under one of the storage roots ({self.describe(shown)}), or ask the operator to add "
                "a root to ETRAIN_STORAGE_ROOTS",
            )
        if is_url(pinned):
            missing = missing_backend(pinned)
            if missing:
                return RootProblem(
                    field=field,
                    message=f"{field}={raw!r}: {missing}.",
                    fix="ask the operator to install the extra where the service and the ranks run "
                    "(pip install 'etrain[s3]'), or use a local checkpoint.path",
                )
            return None
        if any(inside(pinned, private) for private in self.private):
            return RootProblem(
                field=field,
                message=f"{field}={raw!r} is one of the service's own files (database, API token or "
                "checkpoint key), which no job may read or write.",
                fix=f"point {field} at your own files",
            )
        return None

    def _url_problem(self, field: str, raw: str, pinned: str, shown: tuple[str, ...] | None) -> RootProblem | None:
        """An object-store URL where the field must be local, or a URL that names no plain key prefix."""
        if field not in URL_FIELDS:
            return RootProblem(
                field=field,
                message=f"{field}={raw!r} is an object-store URL; {field} must be a local path (only "
                f"{', '.join(sorted(URL_FIELDS))} may name object storage).",
                fix=f"copy the files to a folder under the storage roots ({self.describe(shown)}) and give its path",
            )
        problem = url_problem(raw)
        if problem:
            return RootProblem(
                field=field,
                message=f"{field}: {problem}.",
                fix=f"give {field} as s3://bucket/prefix with plain key components",
            )
        return None
