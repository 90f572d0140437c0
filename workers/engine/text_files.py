"""Which files of ``data.path`` are text, read in one fixed order: shared by both text readers.

``data.kind: text`` trains on bytes (``workers/engine/data.py``) or, with ``data.tokenizer``, on token ids
(``workers/engine/tokenized.py``); both must see the same documents in the same order, skip the same binary
files and tooling folders, and refuse an empty or missing path with the same error. Torch-free (the
service runs the tokenizer at submit).

Every file and folder is opened without following symbolic links (``workers/protocol/safe_paths.py``): a data
folder is usually writable by the tenant, and a ``notes.txt`` linked to a file outside the storage roots
would otherwise be trained on (and its bytes learned). A link the walk would read or enter is refused
(``UnsafePathError``, field ``data.path``) rather than skipped, so a job never silently trains on less
than its folder shows; hidden names and tooling folders are passed over as before, links among them too.
"""

from __future__ import annotations

import codecs
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from etrain.workers.protocol import safe_paths
from etrain.workers.protocol.errors import DataError

__all__ = [
    "NotText",
    "SKIPPED_DIRS",
    "TEXT_NAMES",
    "TEXT_SUFFIXES",
    "no_text_error",
    "not_utf8_error",
    "text_chunks",
    "text_documents",
    "text_size",
    "walk_text_files",
]

TEXT_SUFFIXES = frozenset({".py", ".md", ".txt", ".yaml", ".yml", ".toml", ".json", ".cfg", ".sh"})
TEXT_NAMES = frozenset({"Makefile"})
SKIPPED_DIRS = frozenset({".venv", "venv", "__pycache__", ".git", "node_modules"})
_BINARY_PROBE_BYTES = 8192
_CHECK_CHUNK_BYTES = 1 << 20  # text_chunks checks this much at a time: bounded memory for any file size


def _is_text_name(name: str) -> bool:
    return not name.startswith(".") and (os.path.splitext(name)[1] in TEXT_SUFFIXES or name in TEXT_NAMES)


def _is_walked_dir(name: str) -> bool:
    return not name.startswith(".") and name not in SKIPPED_DIRS


class NotText(Exception):
    """A file of ``data.path`` that is not UTF-8 text: both readers skip it (a folder) or refuse it (one file)."""


def text_chunks(stream: IO[bytes]) -> Iterator[bytes]:
    """The stream's bytes, checked as they are read: the first 8 KiB, then 1 MiB at a time. :class:`NotText` at
    a NUL in the first 8 KiB (a binary file) or at invalid UTF-8, a file ending inside a character included
    (raised after the last piece: read to the end before using what was read). The one rule of what is text."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    first = True
    while chunk := stream.read(_BINARY_PROBE_BYTES if first else _CHECK_CHUNK_BYTES):
        if first and b"\x00" in chunk:
            raise NotText
        first = False
        try:
            decoder.decode(chunk)
        except UnicodeDecodeError:
            raise NotText from None
        yield chunk
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise NotText from None


def text_size(path: Path) -> int | None:
    """The file's size in bytes if it is UTF-8 text, else ``None`` (binary files are skipped): checked 1 MiB at a
    time, never held (a multi-GB corpus). Opened without following links (a link on the way is
    ``UnsafePathError``)."""
    with safe_paths.open_file(path, field="data.path") as stream:
        try:
            return sum(len(chunk) for chunk in text_chunks(stream))
        except NotText:
            return None


def walk_text_files(root: Path) -> Iterator[Path]:
    """Text-like files under ``root`` in sorted order (a folder's files, then its sub-folders'), skipping
    hidden and tooling folders; never through a link (one the walk would read or enter is refused)."""
    for relative in safe_paths.walk_files(root, field="data.path", keep_dir=_is_walked_dir, keep_file=_is_text_name):
        yield Path(root) / relative


def text_documents(path: str | os.PathLike) -> list[Path]:
    """The candidate documents of ``data.path``: the file itself, or the text files of a folder in order."""
    root = Path(path)
    try:
        found = safe_paths.stat_path(root, field="data.path")
    except (FileNotFoundError, NotADirectoryError):
        raise DataError(
            f"data.path={str(path)!r} does not exist.",
            field="data.path",
            fix="point data.path at a UTF-8 text file or a folder of text files",
        ) from None
    return list(walk_text_files(root)) if stat.S_ISDIR(found.st_mode) else [root]


def not_utf8_error(data_path: str) -> DataError:
    """``data.path`` is one file, and not UTF-8 text."""
    return DataError(
        f"data.path={data_path!r} is not UTF-8 text.",
        field="data.path",
        fix="use a UTF-8 text file, or data.kind='tokens' for a .bin of token ids",
    )


def no_text_error(data_path: str) -> DataError:
    """``data.path`` holds no non-empty text document."""
    return DataError(
        f"data.path={data_path!r} holds no text (looked for {', '.join(sorted(TEXT_SUFFIXES))}, Makefile).",
        field="data.path",
        fix="point data.path at a non-empty UTF-8 file or a folder containing text files",
    )
