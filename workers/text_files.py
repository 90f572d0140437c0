"""Which files of ``data.path`` are text, read in one fixed order: shared by both text readers.

``data.kind: text`` trains on bytes (``workers/data.py``) or, with ``data.tokenizer``, on token ids
(``workers/tokenized.py``); both must see the same documents in the same order, skip the same binary
files and tooling folders, and refuse an empty or missing path with the same error. Torch-free (the
service runs the tokenizer at submit).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from etrain.workers.protocol.errors import DataError

__all__ = [
    "SKIPPED_DIRS",
    "TEXT_NAMES",
    "TEXT_SUFFIXES",
    "no_text_error",
    "not_utf8_error",
    "read_text_file",
    "text_documents",
    "walk_text_files",
]

TEXT_SUFFIXES = frozenset({".py", ".md", ".txt", ".yaml", ".yml", ".toml", ".json", ".cfg", ".sh"})
TEXT_NAMES = frozenset({"Makefile"})
SKIPPED_DIRS = frozenset({".venv", "venv", "__pycache__", ".git", "node_modules"})
_BINARY_PROBE_BYTES = 8192


def _is_text_candidate(path: Path) -> bool:
    return path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES


def read_text_file(path: Path) -> bytes | None:
    """The file's bytes if it is UTF-8 text, else ``None`` (binary files are skipped)."""
    data = path.read_bytes()
    if b"\x00" in data[:_BINARY_PROBE_BYTES]:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


def walk_text_files(root: Path) -> Iterator[Path]:
    """Text-like files under ``root`` in sorted order, skipping hidden and tooling folders."""
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and d not in SKIPPED_DIRS)
        for name in sorted(files):
            path = Path(directory) / name
            if not name.startswith(".") and _is_text_candidate(path) and path.is_file():
                yield path


def text_documents(path: str | os.PathLike) -> list[Path]:
    """The candidate documents of ``data.path``: the file itself, or the text files of a folder in order."""
    root = Path(path)
    if not root.exists():
        raise DataError(f"data.path={str(path)!r} does not exist.", field="data.path",
                        fix="point data.path at a UTF-8 text file or a folder of text files")
    return [root] if root.is_file() else list(walk_text_files(root))


def not_utf8_error(data_path: str) -> DataError:
    """``data.path`` is one file, and not UTF-8 text."""
    return DataError(f"data.path={data_path!r} is not UTF-8 text.", field="data.path",
                     fix="use a UTF-8 text file, or data.kind='tokens' for a .bin of token ids")


def no_text_error(data_path: str) -> DataError:
    """``data.path`` holds no non-empty text document."""
    return DataError(
        f"data.path={data_path!r} holds no text (looked for {', '.join(sorted(TEXT_SUFFIXES))}, Makefile).",
        field="data.path",
        fix="point data.path at a non-empty UTF-8 file or a folder containing text files",
    )
