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
  existence check (:func:`service.spec.pin_paths` does);
* the service's own files in the data directory (database, API token, checkpoint key) are never a
  job's input or output, even though the data directory is a root. A folder that contains them is
  fine: the text walk reads text suffixes only, and these files have none.

The pinned (resolved) path is what the job then uses, so a symlink swapped after submission cannot
move a job outside the roots through a component that was already resolved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PRIVATE_FILE_NAMES",
    "RootProblem",
    "StorageRoots",
    "inside",
    "parse_roots",
    "pin",
]

#: Files of the data directory no job may read or write: SQLite and its journals, the API token
#: (``api/``), the tenants' token file, and the checkpoint signing key (``service/checkpoint_key.py``).
PRIVATE_FILE_NAMES = (
    "etrain.db", "etrain.db-wal", "etrain.db-shm", "etrain.db-journal", "api-token", "api-tokens",
    "checkpoint-key",
)


def pin(raw: str, base_dir: str | os.PathLike) -> str:
    """``raw`` as the job will use it: ``~`` expanded, joined with ``base_dir`` when relative, then
    :func:`os.path.realpath` (symlinks and ``..`` resolved; a missing tail is kept as written).
    A value with a NUL byte names no file; it is returned as given, and :meth:`StorageRoots.check` refuses it."""
    if "\x00" in raw:
        return raw
    return os.path.realpath(os.path.join(os.fspath(base_dir), os.path.expanduser(raw)))


def inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it, by whole components (both already resolved)."""
    return path == root or path.startswith(root if root.endswith(os.sep) else root + os.sep)


def parse_roots(raw: str) -> tuple[Path, ...]:
    """``ETRAIN_STORAGE_ROOTS``: absolute directories separated by ``os.pathsep`` or commas.

    ``ValueError`` names a relative entry (a root relative to wherever the server happens to start
    would silently change meaning).
    """
    entries = [part.strip() for chunk in raw.split(os.pathsep) for part in chunk.split(",")]
    roots = []
    for entry in entries:
        if not entry:
            continue
        expanded = os.path.expanduser(entry)
        if not os.path.isabs(expanded):
            raise ValueError(f"storage root {entry!r} is not an absolute path")
        roots.append(Path(expanded))
    return tuple(roots)


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
    def of(cls, roots: tuple[str | os.PathLike, ...] | list[str | os.PathLike],
           *, data_dir: str | os.PathLike | None = None) -> "StorageRoots":
        """Roots resolved now (relative ones against the current directory); with ``data_dir``, its
        private files (:data:`PRIVATE_FILE_NAMES`) are fenced off, and it is the root when none is given."""
        chosen = list(roots) or ([data_dir] if data_dir is not None else [])
        if not chosen:
            raise ValueError("at least one storage root (or the data directory) is needed")
        resolved = tuple(dict.fromkeys(os.path.realpath(os.fspath(root)) for root in chosen))
        private = ()
        if data_dir is not None:
            base = os.path.realpath(os.fspath(data_dir))
            private = tuple(os.path.join(base, name) for name in PRIVATE_FILE_NAMES)
        return cls(roots=resolved, private=private)

    def describe(self) -> str:
        return ", ".join(self.roots)

    def check(self, field: str, raw: str, pinned: str) -> RootProblem | None:
        """``None`` when ``pinned`` (the :func:`pin` of ``raw``) may be used, else the problem.

        The answer is a function of ``raw`` and ``pinned`` alone; the message shows ``raw``.
        """
        if "\x00" in raw:
            return RootProblem(field=field, message=f"{field} contains a NUL byte, which no file name can.",
                               fix=f"give {field} as a plain path")
        if not any(inside(pinned, root) for root in self.roots):
            return RootProblem(
                field=field,
                message=f"{field}={raw!r} is outside the storage roots ({self.describe()}); paths are resolved "
                        "(relative to the server's directory, symlinks and '..' followed) before this check.",
                fix=f"put it under one of the storage roots ({self.describe()}), or ask the operator to add "
                    "a root to ETRAIN_STORAGE_ROOTS",
            )
        if any(inside(pinned, private) for private in self.private):
            return RootProblem(
                field=field,
                message=f"{field}={raw!r} is one of the service's own files (database, API token or "
                        "checkpoint key), which no job may read or write.",
                fix=f"point {field} at your own files",
            )
        return None
