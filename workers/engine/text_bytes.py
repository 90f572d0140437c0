"""Byte-level text read from its files a sample at a time, never held whole in a rank's memory.

``data.kind: text`` without a tokenizer trains on the bytes of a UTF-8 file, or of a folder's text
files joined with a newline (``workers/engine/text_files.py`` picks them and their order). Reading them
whole put the corpus in every rank's anonymous memory, which the planner's host figure does not count
and the node cannot reclaim: a 700 MiB corpus made a one-rank job hold 1.12 GiB against the 0.28 it
reserved. Here the stream is a view: each file is checked once (UTF-8, in 1 MiB pieces) and its size
kept; a sample's bytes are read with ``pread`` from the files it spans, so what a rank holds is the
page cache's (shared by a node's ranks, reclaimable), as for memory-mapped token files.

Why not ``np.memmap``: a folder is many files (one mapping each would hold a descriptor each, and a
repository has thousands), and a mapped file that shrinks kills the reader with SIGBUS where a short
read is an error that names the file. The view holds one descriptor: the file itself, or the folder, under
which each read opens its file without following links (``safe_paths.open_regular``): a link swapped in after
the job started is refused, as at the start, and no read walks the path from ``/`` again.

The bytes are read while the job trains, not copied at its start: leave ``data.path`` unchanged while a job
trains on it (or train on a copy). A file that grows keeps its first bytes in the stream (what was checked);
one that shrinks below them, or is removed, is a :class:`DataError` naming it, and the next attempt reads the
folder as it is then. Torch-free.
"""

from __future__ import annotations

import bisect
import os
import weakref
from pathlib import Path

import numpy as np

from etrain.workers.engine.text_files import no_text_error, not_utf8_error, text_documents, text_size
from etrain.workers.protocol import safe_paths
from etrain.workers.protocol.errors import DataError

__all__ = ["SEPARATOR", "TextBytes", "text_bytes"]

SEPARATOR = ord("\n")  # between two documents of a folder, so one file's end does not run into the next


class TextBytes:
    """A 1-D ``uint8`` stream over text files: ``len()`` and ``view[a:b]`` (an ndarray) like an array.

    ``root`` is ``data.path``; ``documents`` its non-empty text documents in order, as (the path under ``root``,
    or None for ``root`` itself when it is the one file; size in bytes). Document ``i`` occupies
    ``[starts[i], starts[i] + sizes[i])``; the byte after it (before the next document) is :data:`SEPARATOR`.
    """

    ndim = 1
    dtype = np.dtype(np.uint8)

    def __init__(self, root: str, documents: list[tuple[str | None, int]]):
        if not documents or any(size <= 0 for _, size in documents):
            raise ValueError("TextBytes needs one or more non-empty documents")
        if documents[0][0] is None and len(documents) > 1:
            raise ValueError("a single file is the only document of its stream")
        self._root = root
        self._names = [name for name, _ in documents]
        self._sizes = [size for _, size in documents]
        self._starts = [0]
        for size in self._sizes[:-1]:
            self._starts.append(self._starts[-1] + size + 1)
        self._length = self._starts[-1] + self._sizes[-1]
        self._fd = (
            safe_paths.open_regular(root, field="data.path")
            if self._names[0] is None
            else safe_paths.open_dir(root, field="data.path")
        )
        weakref.finalize(self, os.close, self._fd)  # the view lives as long as its dataset (an attempt)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError(f"TextBytes takes a slice, not {type(key).__name__}")
        start, stop, step = key.indices(self._length)
        if step != 1:
            raise ValueError("TextBytes reads contiguous slices only")
        out = np.full(max(0, stop - start), SEPARATOR, dtype=np.uint8)
        first = bisect.bisect_right(self._starts, start) - 1
        for index in range(max(first, 0), len(self._names)):
            doc_start = self._starts[index]
            if doc_start >= stop:
                break
            lo, hi = max(start, doc_start), min(stop, doc_start + self._sizes[index])
            if lo < hi:
                out[lo - start : hi - start] = self._read(index, lo - doc_start, hi - lo)
        return out

    def _read(self, index: int, offset: int, count: int) -> np.ndarray:
        name = self._names[index]
        shown = self._root if name is None else os.path.join(self._root, name)
        try:
            if name is None:
                data = os.pread(self._fd, count, offset)
            else:
                fd = safe_paths.open_regular(self._fd, name, field="data.path")
                try:
                    data = os.pread(fd, count, offset)
                finally:
                    os.close(fd)
        except OSError as err:  # removed, or made a folder, since the job started
            raise self._changed(shown, index, f"cannot be read: {err.strerror or err}") from None
        if len(data) != count:
            raise self._changed(shown, index, f"now ends before byte {offset + count}")
        return np.frombuffer(data, dtype=np.uint8)

    def _changed(self, shown: str, index: int, what: str) -> DataError:
        return DataError(
            f"data.path file {shown!r} changed while the job read it: it held {self._sizes[index]} bytes when the "
            f"job started and {what}.",
            field="data.path",
            fix="leave the job's data unchanged while it trains (the next attempt reads it as it is then), or "
            "train on a copy",
        )


def text_bytes(path: str) -> TextBytes:
    """The byte stream of ``data.path``: one UTF-8 file, or every non-empty text file of a folder in order."""
    checked = [(doc, text_size(doc)) for doc in text_documents(path)]
    documents = [(doc, size) for doc, size in checked if size]
    one_file = Path(path).is_file()
    if not documents:
        if one_file and checked[0][1] is None:
            raise not_utf8_error(path)
        raise no_text_error(path)
    return TextBytes(
        str(path), [(None if one_file else os.fspath(doc.relative_to(path)), size) for doc, size in documents]
    )
