"""Tokenized text: a corpus encoded ONCE with a Hugging Face tokenizer into a nanoGPT token memmap.

``data: {kind: text, path: P, tokenizer: T}`` trains on the ids a ``tokenizer.json`` (the
``tokenizers`` library: fast, offline) gives for the text under ``P``. Tokenizing is slow next to
reading a memmap, so it happens once and the result is cached *by content*: the cache file is named
by the sha256 of the documents' bytes (in the same deterministic order the byte reader uses,
``workers/engine/text_files.py``), the tokenizer.json bytes, the EOS id and :data:`FORMAT_VERSION`. Any change
to the data or the tokenizer gives a new name, so a stale cache is never found by its hash (nor by a stamp, below); a copy of the same data shares its cache name.

Where the cache lives: in the service's token cache folder (``cache_dir``; the service's default is
``<checkpoint root>/.token-cache``, which every node sees, ``service/settings.py``), never beside the data. A
storage root may be a shared volume other tenants can write (``docs/operations.md``, threat model): a cache found
there would be trusted by its name, so a tenant could plant ``<sha256>.bin`` for another tenant's corpus, read-only
to it or not, and that tenant would train on the planted ids. Only the service writes its cache folder (tenants'
paths may not reach it, ``service/access/reach.py``), and a read-only dataset volume needs no write access at all.
Each ``<sha256>.bin`` (raw ``uint16`` ids when the tokenizer's id space fits, else ``uint32``: exactly what
``data.kind: tokens`` reads) has a JSON sidecar ``<sha256>.bin.json`` (token count, dtype, vocabulary, EOS,
tokenizer path). Both are written to a temporary name and renamed into place (sidecar first), so racing writers
(two submits, the ranks of one node) never leave a torn file and a reader that finds the ``.bin`` finds its
sidecar; and only one of them tokenizes: the others wait on its lock and find its cache (:func:`_one_writer`). ``out`` (``etrain prepare-data --out``) writes one file where its caller says instead, for
``data.kind: tokens``.

The stream: each document (one file) is ``Tokenizer.encode(text).ids`` — the tokenizer's own special
tokens included, e.g. a BOS its post-processor adds — and documents are joined with the tokenizer's
EOS token when it has one (``eos_token`` of a ``tokenizer_config.json`` beside the tokenizer, else a
conventional name such as ``<|endoftext|>`` or ``</s>``). Truncation and padding settings stored in
the tokenizer.json are switched off: training wants every token.

Finding the cache without reading the data: the content hash reads every byte (a 100 GB corpus: about a minute,
on every submit and in every rank at every start). So the cache folder also keeps, for the data it was made from,
the data's *stamp* (``<stamp>.stamp``, naming the cache; with ``out``, the sidecar keeps it): ``data.path``
itself, each document's name under it, size, inode, and modification and change times (ns), hashed with
the tokenizer's part of the name (each document is opened for it, without a link on the way: an open asks an NFS
server afresh). A call whose documents stamp the same reuses that cache without reading them; any write changes
a file's change time, which ``touch`` cannot set back, so changed data is hashed again. A stamp is recorded
only when the data settled (no document changed within :data:`SETTLED_S` of it) and stamps the same after it was
read, git's rule for "racily clean" files: on a filesystem with coarse timestamps a same-size rewrite in the
same tick could otherwise hide behind it. The hash itself reads 1 MiB at a time: never a whole document in
memory, and a submit's deadline is checked as it goes.

Bounded memory: a document longer than :data:`PIECE_CHARS` is encoded in pieces cut after a newline
between two non-space characters, which is a pre-token boundary for byte-level BPE tokenizers
(GPT-2, Llama 3, Qwen), so their ids equal a whole-document encode. Tokenizers that prepend a space
marker to every encode call (SentencePiece-style ``Metaspace``) can differ by a token at each cut:
at most one per :data:`PIECE_CHARS` characters.

Torch-free on purpose (numpy and tokenizers only): the service runs the same function at submit,
``etrain prepare-data`` runs it locally, and a worker runs it when the cache is missing.
"""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import hashlib
import json
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any

import numpy as np

from etrain.workers.engine.text_files import (
    NotText,
    no_text_error,
    not_utf8_error,
    text_chunks,
    text_documents,
    text_size,
)
from etrain.workers.protocol import safe_paths
from etrain.workers.protocol.errors import DataError, UnsafePathError

__all__ = [
    "FORMAT_VERSION",
    "TokenCache",
    "TokenizerInfo",
    "cache_file",
    "cached_corpora",
    "remove_caches",
    "remove_stale_temporaries",
    "load_tokenizer",
    "token_dtype_for",
    "tokenize_text",
    "tokenizer_info",
]

#: Bump when the stream a (data, tokenizer) pair produces changes (piece rule, EOS rule, layout).
FORMAT_VERSION = 1
#: A stamp's index file in the cache folder: ``<stamp>.stamp`` holds the content hash of the cache it names.
STAMP_SUFFIX = ".stamp"
#: ``.<sha256>.bin.lock``: the lock its writer holds (:func:`_one_writer`).
LOCK_SUFFIX = ".lock"
#: Longest piece of one document handed to the tokenizer at once (characters).
PIECE_CHARS = 1 << 20
#: Characters encoded per batch call: bounds memory (a tokenizers Encoding costs ~100 bytes a token).
BATCH_CHARS = 4 << 20
#: A document changed less than this before the data's stamp was taken leaves the stamp unrecorded (the cache is
#: found by its hash until the data settles): a filesystem with 1-second or coarser timestamps could otherwise
#: hide a same-size rewrite in the same tick.
SETTLED_S = 2.0
#: The largest sidecar read (a few hundred bytes are written): anything bigger is not one.
_SIDECAR_MAX_BYTES = 1 << 16
#: Conventional EOS spellings, tried in order when no tokenizer_config.json names one.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")

#: ``progress(stage, done_bytes, total_bytes, tokens)``; stage is "hashing" or "tokenizing".
Progress = Callable[[str, int, int, int], None]


# -- the tokenizer ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizerInfo:
    """What the cache and the spec check need to know about a tokenizer.json."""

    path: str  # the tokenizer.json file itself (a folder given as data.tokenizer resolves to its file)
    vocab_size: int  # the id space: every id the tokenizer can emit is < vocab_size
    eos_id: int | None
    eos_token: str | None
    sha256: str  # of the tokenizer.json bytes


def _tokenizer_file(path: str | os.PathLike) -> Path:
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise DataError(
            f"data.tokenizer={str(path)!r} is not a file"
            + (" (the folder holds no tokenizer.json)" if Path(path).is_dir() else "")
            + ".",
            field="data.tokenizer",
            fix="point data.tokenizer at a Hugging Face tokenizer.json, or at the folder holding one "
            "(relative paths are relative to the server's directory)",
        )
    return file


def _eos(tokenizer: Any, file: Path) -> tuple[int | None, str | None]:
    """The EOS token: ``eos_token`` of a tokenizer_config.json beside the file, else a conventional name."""
    names: list[str] = []
    try:  # read without following links, like every file of a job (a link is refused, not skipped)
        raw = safe_paths.read_file(file.parent / "tokenizer_config.json", field="data.tokenizer")
        named = json.loads(raw.decode("utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):  # none (or unreadable): the conventional names
        named = None
    if isinstance(named, dict):
        named = named.get("content")
    if isinstance(named, str):
        names.append(named)
    for name in (*names, *EOS_NAMES):
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return int(token_id), name
    return None, None


def load_tokenizer(path: str | os.PathLike) -> tuple[Any, TokenizerInfo]:
    """A ``tokenizers.Tokenizer`` ready to encode whole documents (no truncation, no padding) and its info.

    Errors are :class:`DataError` naming ``data.tokenizer``: missing, unreadable or not a tokenizer.json.
    """
    from tokenizers import Tokenizer

    file = _tokenizer_file(path)
    try:
        raw = safe_paths.read_file(file, field="data.tokenizer")  # no link on the way (workers/protocol/safe_paths.py)
    except OSError as err:
        raise DataError(
            f"data.tokenizer={str(path)!r} cannot be read: {err.strerror or err}.",
            field="data.tokenizer",
            fix="make the file readable by the server and the workers",
        ) from err
    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # tokenizers raises plain Exception for a malformed file
        raise DataError(
            f"data.tokenizer={str(path)!r} is not a Hugging Face tokenizer.json: {str(err)[:200]}",
            field="data.tokenizer",
            fix="use the tokenizer.json of a Hugging Face model (the `tokenizers` format, not a "
            "sentencepiece .model or a vocab.txt)",
        ) from err
    tokenizer.no_truncation()
    tokenizer.no_padding()
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
    eos_id, eos_token = _eos(tokenizer, file)
    info = TokenizerInfo(
        path=str(file.resolve()),
        vocab_size=vocab_size,
        eos_id=eos_id,
        eos_token=eos_token,
        sha256=hashlib.sha256(raw).hexdigest(),
    )
    return tokenizer, info


def tokenizer_info(path: str | os.PathLike) -> TokenizerInfo:
    """Vocabulary size and EOS of a tokenizer.json (what ``check_spec`` compares with model.vocab_size)."""
    return load_tokenizer(path)[1]


def token_dtype_for(vocab_size: int) -> str:
    """``uint16`` when every id fits (vocab <= 65536), else ``uint32`` — nanoGPT's convention."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _special_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a single sequence (e.g. BOS; T5's EOS).

    Pieces are encoded without special tokens and a document gets ``prefix + ids + suffix``, which is
    what ``encode(text)`` gives for template post-processors, without a BOS at every piece.
    """
    for probe in ("a", "hello", "0", "x", " "):
        plain = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe).ids
        for start in range(len(full) - len(plain) + 1) if plain else ():
            if full[start : start + len(plain)] == plain:
                return full[:start], full[start + len(plain) :]
    return tokenizer.encode("").ids, []


def _cut(text: str, start: int, limit: int) -> int:
    """Where the piece starting at ``start`` ends (more than ``limit`` characters follow ``start``): right after
    the last newline within ``limit`` that sits between two non-space characters (a pre-token boundary for
    byte-level BPE regexes), else after any line end, else a hard cut. Reads only ``text[start:start+limit]``."""
    end = start + limit
    search_end = end
    while (newline := text.rfind("\n", start + 1, search_end)) >= 0:
        if not text[newline - 1].isspace() and not text[newline + 1].isspace():
            return newline + 1
        search_end = newline
    newline = text.rfind("\n", start + 1, end)
    return newline + 1 if newline >= 0 else end


def _pieces(text: str, limit: int) -> list[str]:
    """``text`` cut into pieces of at most ``limit`` characters (:func:`_cut`)."""
    pieces, start = [], 0
    while len(text) - start > limit:
        cut = _cut(text, start, limit)
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _hashed_chunks(path: Path, digest: Any, data_text: str) -> Iterator[bytes]:
    """One document's bytes as :func:`text_chunks` reads them (1 MiB at a time; :class:`NotText` where it is not
    text), its length and then its bytes going into ``digest`` as they are read: the one reading both the content
    hash and the tokenizer make (so both hash the same). A document that grew or shrank while read is
    :func:`_changed` (its length prefix would lie)."""
    with safe_paths.open_file(path, field="data.path") as stream:
        size = os.fstat(stream.fileno()).st_size
        digest.update(size.to_bytes(8, "little"))
        read = 0
        for chunk in text_chunks(stream):
            digest.update(chunk)
            read += len(chunk)
            yield chunk
    if read != size:
        raise _changed(data_text)


def _document_pieces(path: Path, digest: Any, data_text: str) -> Iterator[tuple[str, bool, bool]]:
    """One document's :func:`_pieces` at :data:`PIECE_CHARS` as ``(piece, first, last)``, read 1 MiB at a time
    (never the whole document in memory; :func:`_hashed_chunks`). A piece is held back until the next is cut, so
    that the last is known to be the last."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    held: str | None = None
    first, buffer = True, ""
    try:
        for chunk in _hashed_chunks(path, digest, data_text):
            buffer += decoder.decode(chunk)
            while len(buffer) > PIECE_CHARS:
                cut = _cut(buffer, 0, PIECE_CHARS)
                if held is not None:
                    yield held, first, False
                    first = False
                held, buffer = buffer[:cut], buffer[cut:]
    except NotText:  # it was text when hashed
        raise _changed(data_text) from None
    if held is None and not buffer:  # emptied since it was hashed
        raise _changed(data_text)
    if held is not None:
        yield held, first, False
        first = False
    yield buffer, first, True


# -- the cache ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenCache:
    """A tokenized corpus on disk: ``path`` is a raw ``dtype`` array of ``num_tokens`` ids."""

    path: str
    num_tokens: int
    dtype: str
    vocab_size: int
    sha256: str
    tokenizer: str
    data: str
    documents: int
    eos_id: int | None
    eos_token: str | None
    #: written by ``etrain prepare-data`` into the service's cache: its bound never removes it (the operator does)
    prepared: bool = False
    reused: bool = False  # found on disk instead of written by this call

    def sidecar(self) -> dict[str, Any]:
        body = asdict(self)
        body.pop("reused")
        return {"format": FORMAT_VERSION, **body}


def cache_file(cache_dir: str | os.PathLike, sha256: str) -> Path:
    """Where the cache with content hash ``sha256`` lives in the service's token cache folder ``cache_dir``."""
    return Path(cache_dir) / f"{sha256}.bin"


def _sidecar_path(target: Path) -> Path:
    return target.with_name(target.name + ".json")


def _sidecar(target: Path) -> dict[str, Any] | None:
    """The sidecar of the cache at ``target`` (its JSON), or None: missing, unreadable or another format."""
    try:
        raw = safe_paths.read_file(_sidecar_path(target), field="data.path", limit=_SIDECAR_MAX_BYTES)
        meta = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, UnsafePathError):  # a link where a sidecar should be: none (rewritten in place)
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT_VERSION else None


def _read_cache(target: Path, sha256: str, meta: dict[str, Any] | None = None) -> TokenCache | None:
    """The cache at ``target`` if it is complete and of this content hash, else ``None``."""
    meta = _sidecar(target) if meta is None else meta
    try:  # no link on the way: a .bin linked to a file outside the storage roots is no cache
        found = safe_paths.stat_path(target, field="data.path")
    except (OSError, UnsafePathError):
        return None
    if not stat.S_ISREG(found.st_mode):
        return None
    size = found.st_size
    if meta is None or meta.get("sha256") != sha256:
        return None
    fields = {name: meta.get(name) for name in TokenCache.__dataclass_fields__ if name not in ("reused", "prepared")}
    fields["prepared"] = meta.get("prepared") is True
    try:
        cache = TokenCache(**fields, reused=True)
        expected = int(cache.num_tokens) * np.dtype(cache.dtype).itemsize
    except (TypeError, ValueError):
        return None
    return cache if size == expected else None


@dataclass(frozen=True)
class _Stamp:
    value: str
    sizes: list[int]  # each document's bytes
    #: every document last changed at least SETTLED_S before the stamp was taken
    settled: bool


def _stamp(data_path: str | os.PathLike, documents: list[Path], info: TokenizerInfo) -> _Stamp:
    """The data's stamp (see the module's docstring), from one ``fstat`` a document. Each is opened (no link on the
    way, from the folder's descriptor): an open asks an NFS server afresh, where a ``stat`` may answer from the
    client's attribute cache (up to a minute old)."""
    root = Path(data_path)
    taken = time.time_ns()
    digest = _new_digest(info)
    # the data's own path too: the stamps of every corpus of every job share one cache folder, and each names one
    # corpus where it is. No device number: a network filesystem's is chosen by each machine when it mounts it, and
    # a stamp taken by the server (or prepare-data) must match in every rank on every node.
    digest.update(b"stamp\0" + os.fsencode(os.path.abspath(root)) + b"\0")
    sizes: list[int] = []
    newest = 0
    folder = None if root.is_file() else safe_paths.open_dir(root, field="data.path")
    try:
        for path in documents:
            name = os.fspath(path.relative_to(root)) if folder is not None else None
            try:
                fd = safe_paths.open_regular(root if folder is None else folder, name, field="data.path")
            except OSError:  # gone since the walk
                raise _changed(str(data_path)) from None
            try:
                found = os.fstat(fd)
            finally:
                os.close(fd)
            digest.update(
                os.fsencode(name or path.name)
                + f"\0{found.st_size}\0{found.st_ino}\0{found.st_mtime_ns}\0{found.st_ctime_ns}\n".encode()
            )
            sizes.append(found.st_size)
            newest = max(newest, found.st_mtime_ns, found.st_ctime_ns)
    finally:
        if folder is not None:
            os.close(folder)
    return _Stamp(digest.hexdigest(), sizes, settled=newest < taken - int(SETTLED_S * 1e9))


def _stamp_to_keep(
    before: _Stamp, data_path: str | os.PathLike, documents: list[Path], info: TokenizerInfo
) -> str | None:
    """The stamp to record for a cache of the data just read, or None: only a settled one, and only when the data
    stamps the same after the read as before it (git's rule for "racily clean" files): on a filesystem whose
    timestamps are coarse, a same-size rewrite within one tick of the stamp would otherwise hide behind it."""
    if not before.settled:
        return None
    try:
        after = _stamp(data_path, documents, info)
    except DataError:
        return None
    return before.value if after.value == before.value else None


def _stamp_index(cache_dir: Path, stamp: str) -> Path:
    return cache_dir / f"{stamp}{STAMP_SUFFIX}"


def _cache_by_stamp(cache_dir: Path | None, out: Path | None, stamp: str) -> tuple[Path, TokenCache] | None:
    """The complete cache the data's ``stamp`` names, with where it is: in the cache folder, by its index file;
    for ``out``, when its sidecar keeps that stamp."""
    if out is not None:
        meta = _sidecar(out)
        found = _read_cache(out, str(meta.get("sha256")), meta) if meta and meta.get("stamp") == stamp else None
        return None if found is None else (out, found)
    assert cache_dir is not None
    try:
        index = json.loads(
            safe_paths.read_file(_stamp_index(cache_dir, stamp), field="data.path", limit=_SIDECAR_MAX_BYTES)
        )
        sha256 = str(index["sha256"])
    except (OSError, ValueError, KeyError, TypeError, UnsafePathError):
        return None
    if not _is_sha256(sha256):
        return None
    target = cache_file(cache_dir, sha256)
    found = _read_cache(target, sha256)
    return None if found is None else (target, found)


def _keep_stamp(target: Path, stamp: str | None, *, indexed: bool) -> None:
    """Record ``stamp`` for the cache just reused or written at ``target``, so the next call finds it without a
    hash: in the cache folder, ``<stamp>.stamp`` naming it (``indexed``); for ``out``, in its sidecar. Best effort
    (an unwritable place only means the next call hashes again), written like the cache itself: through the
    folder's descriptor, to a temporary name renamed into place, no link followed."""
    if stamp is None:
        return
    if not indexed:
        _update_sidecar(target, {"stamp": stamp})
        return
    body = (json.dumps({"format": FORMAT_VERSION, "sha256": target.name.removesuffix(".bin")}) + "\n").encode()
    _replace_file(target.parent, _stamp_index(target.parent, stamp).name, body)


def _update_sidecar(target: Path, changes: dict[str, Any]) -> None:
    """The sidecar of the cache at ``target`` with ``changes`` (best effort; nothing when they are there)."""
    meta = _sidecar(target)
    if meta is None or all(meta.get(key) == value for key, value in changes.items()):
        return
    body = (json.dumps({**meta, **changes}, indent=2) + "\n").encode()
    _replace_file(target.parent, _sidecar_path(target).name, body)


def _replace_file(parent: Path, name: str, body: bytes) -> None:
    """``parent/name`` replaced by ``body`` as the cache is written: through the folder's descriptor, to a
    temporary name renamed into place, no link followed. Best effort: an unwritable place is left as it is."""
    try:
        folder = safe_paths.open_dir(parent, field="data.path")
    except (OSError, UnsafePathError):
        return
    try:
        tmp = _write_temp(folder, name, lambda sink: sink.write(body))
        try:
            safe_paths.rename_inside(folder, tmp, name, field="data.path")
        except OSError:
            os.unlink(tmp, dir_fd=folder)
    except (OSError, UnsafePathError):
        pass
    finally:
        os.close(folder)


def _mark_used(target: Path) -> None:
    """Set the sidecar's modification time to now: the cache's last use, which the service's bound on its token
    cache removes least recently used first (``service/decisions/token_cache.py``). Best effort, no link followed."""
    try:
        fd = safe_paths.open_path(_sidecar_path(target), os.O_RDONLY, field="data.path")
    except (OSError, UnsafePathError):
        return
    try:
        os.utime(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_sha256(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def cached_corpora(cache_dir: str | os.PathLike) -> list[tuple[str, int, float, bool]]:
    """``(sha256, bytes of the ids and sidecar, last use in seconds since the epoch, written by prepare-data)`` of
    every complete cache in the service's token cache folder (none when it does not exist yet). Nothing followed:
    a link is no cache."""
    try:
        folder = safe_paths.open_dir(cache_dir, field="data.path")
    except FileNotFoundError:
        return []
    try:
        found = []
        for name in safe_paths.list_names(folder, field="data.path"):
            sha256 = name.removesuffix(".bin")
            if not (name.endswith(".bin") and _is_sha256(sha256)):
                continue
            try:
                ids = os.stat(name, dir_fd=folder, follow_symlinks=False)
                sidecar = os.stat(f"{name}.json", dir_fd=folder, follow_symlinks=False)
            except FileNotFoundError:  # being written (the sidecar comes first) or removed meanwhile
                continue
            if stat.S_ISREG(ids.st_mode) and stat.S_ISREG(sidecar.st_mode):
                meta = _sidecar(Path(cache_dir) / name)
                prepared = meta is not None and meta.get("prepared") is True
                found.append((sha256, ids.st_size + sidecar.st_size, sidecar.st_mtime, prepared))
        return found
    finally:
        os.close(folder)


def remove_caches(cache_dir: str | os.PathLike, sha256s: Collection[str]) -> None:
    """Remove these caches from the token cache folder: the ids first (then no reader finds a cache without its
    sidecar), the sidecar, and each ``<stamp>.stamp`` that names one of them. A rank that has the ids mapped keeps
    reading them (an unlinked file lives while it is open)."""
    doomed = {sha256 for sha256 in sha256s if _is_sha256(sha256)}
    if not doomed:
        return
    folder = safe_paths.open_dir(cache_dir, field="data.path")
    try:
        for sha256 in sorted(doomed):
            for name in (f"{sha256}.bin", f"{sha256}.bin.json"):  # not the lock: a writer may hold it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=folder)
        for name in safe_paths.list_names(folder, field="data.path"):
            if not name.endswith(STAMP_SUFFIX):
                continue
            try:
                index = json.loads(safe_paths.read_file(folder, name, field="data.path", limit=_SIDECAR_MAX_BYTES))
            except (OSError, ValueError, UnsafePathError):
                continue
            if isinstance(index, dict) and index.get("sha256") in doomed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=folder)
    finally:
        os.close(folder)


def remove_stale_temporaries(cache_dir: str | os.PathLike, *, older_than_s: float) -> None:
    """Remove the temporary files (:func:`_write_temp`'s ``.<name>.tmp-...``) unchanged for ``older_than_s``: a
    writer that died (a rank killed while it tokenized) leaves its partial ids, which no cache counts. Also the
    (empty) lock files unchanged as long whose cache is gone and which no writer holds."""
    try:
        folder = safe_paths.open_dir(cache_dir, field="data.path")
    except FileNotFoundError:
        return
    try:
        cutoff = time.time() - older_than_s
        names = safe_paths.list_names(folder, field="data.path")
        for name in names:
            temporary = name.startswith(".") and ".tmp-" in name
            orphan_lock = (
                name.startswith(".") and name.endswith(LOCK_SUFFIX) and name[1 : -len(LOCK_SUFFIX)] not in names
            )
            if not (temporary or orphan_lock):
                continue
            try:
                found = os.stat(name, dir_fd=folder, follow_symlinks=False)
                if found.st_mtime >= cutoff:
                    continue
                if temporary:
                    os.unlink(name, dir_fd=folder)
                else:
                    _remove_free_lock(folder, name)
            except FileNotFoundError:
                continue
    finally:
        os.close(folder)


def _remove_free_lock(folder: int, name: str) -> None:
    """Unlink the lock file ``name`` if no writer holds it (taken without waiting, unlinked while held: a writer
    that opened it meanwhile finds it no longer named so and opens the new one, :func:`_one_writer`)."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(name, dir_fd=folder)
    except OSError:  # held, or gone: left
        pass
    finally:
        os.close(fd)


class _Clock:
    """The optional deadline of a submit-time run: the HTTP request must not wait without bound."""

    def __init__(self, timeout_s: float | None, data_path: str, tokenizer_path: str):
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.data_path, self.tokenizer_path = data_path, tokenizer_path

    def check(self, stage: str, done: int, total: int) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise DataError(
                f"{stage} data.path={self.data_path!r} did not finish within {self.timeout_s:g} s "
                f"({_mib(done)} of {_mib(total)} done).",
                field="data.path",
                fix=_prepare_fix(self.data_path, self.tokenizer_path),
            )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _prepare_fix(data_path: str, tokenizer_path: str) -> str:
    return (
        f"tokenize it once ahead of the submit on a machine that mounts the service's token cache (the operator): "
        f"`etrain prepare-data --tokenizer {tokenizer_path} {data_path}`, then submit again; or write a token "
        f"file of your own with `etrain prepare-data --out FILE ...` and train on FILE with data.kind: tokens"
    )


def _new_digest(info: TokenizerInfo) -> Any:
    digest = hashlib.sha256()
    digest.update(f"etrain-tokens/{FORMAT_VERSION}\0{info.sha256}\0{info.eos_id}\0".encode())
    return digest


def _content_hash(
    documents: list[Path],
    sizes: list[int],
    info: TokenizerInfo,
    clock: _Clock,
    progress: Progress | None,
    data_text: str,
) -> tuple[str, list[Path]]:
    """sha256 over the format version, the tokenizer, the EOS id and every text document (length-prefixed,
    in order); also the documents that are UTF-8 text and not empty (the ones tokenized). Read 1 MiB at a time
    (a document is hashed on a copy of the running hash, kept only if it turns out to be text); ``sizes``: the
    documents' sizes as the stamp saw them, for the progress."""
    digest = _new_digest(info)
    total = sum(sizes)
    kept, done = [], 0
    for path, size in zip(documents, sizes):
        document, read = digest.copy(), 0
        try:
            for chunk in _hashed_chunks(path, document, data_text):
                read += len(chunk)
                if progress:
                    progress("hashing", done + read, total, 0)
                clock.check("hashing", done + read, total)
        except NotText:
            document = None
        done += size
        if document is not None and read:
            digest = document
            kept.append(path)
        if progress:
            progress("hashing", done, total, 0)
    return digest.hexdigest(), kept


def tokenize_text(
    data_path: str | os.PathLike,
    tokenizer_path: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    progress: Progress | None = None,
    max_bytes: int | None = None,
    timeout_s: float | None = None,
    model_vocab_size: int | None = None,
    prepared: bool = False,
) -> TokenCache:
    """The token cache of ``data_path`` under ``tokenizer_path``: reused when present, else written once.

    Exactly one of ``cache_dir`` (the service's token cache folder: ``<sha256>.bin`` there) and ``out`` (this
    one file, for ``data.kind: tokens``). ``max_bytes`` and ``timeout_s`` bound a run that someone waits on (a
    submit): more text than ``max_bytes`` to tokenize, or a run past ``timeout_s``, is a :class:`DataError` whose
    fix is ``etrain prepare-data``. ``model_vocab_size`` refuses (``data.tokenizer``) a tokenizer whose ids the
    model cannot embed. ``prepared``: ``etrain prepare-data`` is writing it (the cache's bound never removes it).
    """
    if (cache_dir is None) == (out is None):
        raise TypeError("tokenize_text takes exactly one of cache_dir and out")
    folder = None if cache_dir is None else Path(cache_dir).expanduser()
    out_file = None if out is None else Path(out).expanduser()
    data_text, tokenizer_text = str(data_path), str(tokenizer_path)
    tokenizer, info = load_tokenizer(tokenizer_path)
    if model_vocab_size is not None and info.vocab_size > model_vocab_size:
        raise DataError(
            f"data.tokenizer={tokenizer_text!r} has {info.vocab_size} token ids but model.vocab_size="
            f"{model_vocab_size}.",
            field="data.tokenizer",
            fix=f"set model.vocab_size >= {info.vocab_size}, or use a tokenizer with at most {model_vocab_size} ids",
        )
    clock = _Clock(timeout_s, data_text, tokenizer_text)
    listed = documents = text_documents(data_path)
    before = _stamp(data_path, listed, info)
    total = sum(before.sizes)
    found = _cache_by_stamp(folder, out_file, before.value)
    if found is not None:
        target, cached = found
    else:
        sha256, documents = _content_hash(documents, before.sizes, info, clock, progress, data_text)
        if not documents:
            if Path(data_path).is_file() and text_size(Path(data_path)) is None:
                raise not_utf8_error(data_text)
            raise no_text_error(data_text)
        target = out_file if out_file is not None else cache_file(folder, sha256)
        cached = _read_cache(target, sha256)
        if cached is not None:
            _keep_stamp(target, _stamp_to_keep(before, data_path, listed, info), indexed=folder is not None)
    if cached is not None:
        return _found(cached, target, folder is not None, prepared, info, data_text)
    if max_bytes is not None and total > max_bytes:
        raise DataError(
            f"data.path={data_text!r} holds {_mib(total)} of text to tokenize, more than the "
            f"{_mib(max_bytes)} tokenized while a submit waits.",
            field="data.path",
            fix=_prepare_fix(data_text, tokenizer_text),
        )
    with _one_writer(target, clock, total) if folder is not None else contextlib.nullcontext(lambda: None) as beat:
        cached = _read_cache(target, sha256)  # written meanwhile by the writer this call waited for
        if cached is None:
            cached = _write_cache(
                tokenizer, info, documents, sha256, target, data_text, clock, progress, total, prepared, beat
            )
    _keep_stamp(target, _stamp_to_keep(before, data_path, listed, info), indexed=folder is not None)
    if cached.reused:  # another writer's, found once it finished
        return _found(cached, target, folder is not None, prepared, info, data_text)
    return cached


def _found(
    cached: TokenCache, target: Path, in_cache_folder: bool, prepared: bool, info: TokenizerInfo, data_text: str
) -> TokenCache:
    """A cache found on disk as this call sees it: where it is now (an out file may have moved), this call's
    tokenizer and data; in the service's folder its use renewed and, for ``etrain prepare-data``, pinned."""
    if in_cache_folder:
        _mark_used(target)
        if prepared and not cached.prepared:
            _update_sidecar(target, {"prepared": True})
            cached = replace(cached, prepared=True)
    return replace(cached, path=os.path.abspath(target), tokenizer=info.path, data=str(Path(data_text).resolve()))


#: A waiter looks again after this long, growing by half each time up to WRITER_POLL_MAX_S (each look is a lock
#: request, which on NFS goes to the server).
WRITER_POLL_S = 0.2
WRITER_POLL_MAX_S = 5.0
#: A writer touches its lock file with every batch of ids (a few seconds apart); a lock file unchanged this long
#: has a holder that is stuck (stopped, hung, or on a node that crashed while the filesystem kept its lock), and a
#: waiter with no deadline goes ahead without it.
WRITER_STALE_S = 600.0


@contextlib.contextmanager
def _one_writer(target: Path, clock: _Clock, total: int) -> Iterator[Callable[[], None]]:
    """One writer of a cache at a time: the ranks of a node (and of nodes whose filesystem has working ``flock``)
    that miss the same cache would otherwise each tokenize the whole corpus; the first writes it, the others wait
    and then find it. An exclusive ``flock`` on ``.<name>.lock`` beside it, which the kernel releases when its holder
    dies. Yields the writer's heartbeat (touch the lock file: call it with every batch). A submit's wait is bounded
    by its deadline (``clock``); a rank's lasts while the holder beats, then it goes ahead (:data:`WRITER_STALE_S`).
    Without a lock (a filesystem without ``flock``, a lock file this process may not open) two writers only do the
    same work twice: the writes stay atomic."""
    try:
        folder = safe_paths.open_dir(target.parent, field="data.path", create=True)
    except OSError as err:
        raise _unwritable(target, err) from err
    name = f".{target.name}{LOCK_SUFFIX}"
    fd: int | None = None
    try:
        wait = WRITER_POLL_S
        while True:
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder)
            except OSError:  # another user's lock file, say: go ahead unlocked (the write reports a real problem)
                break
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                clock.check("waiting for another writer to tokenize", 0, total)
                if clock.deadline is None and time.time() - os.fstat(fd).st_mtime > WRITER_STALE_S:
                    break  # its holder stopped beating: write without the lock
                os.close(fd)
                fd = None
                time.sleep(wait)
                wait = min(wait * 1.5, WRITER_POLL_MAX_S)
                continue
            except OSError:  # no locks on this filesystem
                break
            # the lock of the file still named so (not one removed and made again meanwhile): else look again
            try:
                named = os.stat(name, dir_fd=folder, follow_symlinks=False)
            except FileNotFoundError:
                named = None
            held = os.fstat(fd)
            if named is not None and (named.st_ino, named.st_dev) == (held.st_ino, held.st_dev):
                break
            os.close(fd)
            fd = None

        def beat() -> None:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.utime(fd)

        beat()
        yield beat
    finally:
        os.close(folder)
        if fd is not None:
            os.close(fd)  # releases the lock


def _token_batches(
    tokenizer: Any, info: TokenizerInfo, documents: list[Path], sha256: str, data_text: str
) -> Iterator[tuple[np.ndarray, int]]:
    """The stream in order, one batch at a time: ``(ids, text bytes they cover)``.

    Each document is ``prefix + ids of its pieces + suffix`` (= ``encode(text).ids``); documents are
    joined with EOS (unless the post-processor already ends each with it). The documents are hashed
    again on the way: text that changed since :func:`_content_hash` must not be cached under its name.
    """
    prefix, suffix = _special_affixes(tokenizer)
    separator = [] if info.eos_id is None or (suffix and suffix[-1] == info.eos_id) else [info.eos_id]
    digest = _new_digest(info)
    pieces: list[str] = []
    marks: list[tuple[bool, bool, int]] = []  # per piece: first of its document, last of it, its bytes
    started = chars = 0

    def encode() -> tuple[np.ndarray, int]:
        nonlocal started, chars
        parts: list[list[int]] = []
        for encoding, (first, last, _) in zip(tokenizer.encode_batch_fast(pieces, add_special_tokens=False), marks):
            if first:
                parts.append((separator if started else []) + prefix)
                started += 1
            parts.append(encoding.ids)
            if last:
                parts.append(suffix)
        covered = sum(size for *_, size in marks)
        pieces.clear()
        marks.clear()
        chars = 0
        return np.concatenate([np.asarray(part, dtype=np.int64) for part in parts]), covered

    for path in documents:
        for piece, first, last in _document_pieces(path, digest, data_text):
            pieces.append(piece)
            marks.append((first, last, len(piece.encode())))
            chars += len(piece)
            if chars >= BATCH_CHARS:
                yield encode()
    if pieces:
        yield encode()
    if digest.hexdigest() != sha256:
        raise _changed(data_text)


def _write_temp(folder: int, name: str, write: Callable[[IO[bytes]], None]) -> str:
    """A new temporary file beside ``name`` in the open ``folder`` (created exclusively: nothing followed or
    overwritten), filled by ``write`` and synced; returns its name, for the caller to rename into place."""
    tmp = f".{name}.tmp-{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex[:8]}"
    fd = safe_paths.open_inside(folder, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, field="data.path", mode=0o644)
    try:
        with os.fdopen(fd, "wb") as sink:
            write(sink)
            sink.flush()
            os.fsync(sink.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise
    return tmp


def _write_cache(
    tokenizer: Any,
    info: TokenizerInfo,
    documents: list[Path],
    sha256: str,
    target: Path,
    data_text: str,
    clock: _Clock,
    progress: Progress | None,
    total: int,
    prepared: bool,
    beat: Callable[[], None],
) -> TokenCache:
    """Stream the ids into a temporary file beside ``target``, then rename sidecar and ``.bin`` into place. The
    folder is reached without links and written through its descriptor: no link on the way sends the writes
    elsewhere."""
    dtype = np.dtype(token_dtype_for(info.vocab_size))
    num_tokens = done = 0

    def write_ids(sink: IO[bytes]) -> None:
        nonlocal num_tokens, done
        for ids, covered in _token_batches(tokenizer, info, documents, sha256, data_text):
            ids.astype(dtype).tofile(sink)
            num_tokens, done = num_tokens + len(ids), done + covered
            beat()  # this writer is alive: the others keep waiting (_one_writer)
            if progress:
                progress("tokenizing", done, total, num_tokens)
            clock.check("tokenizing", done, total)

    written: list[str] = []
    try:
        folder = safe_paths.open_dir(target.parent, field="data.path", create=True)
    except OSError as err:
        raise _unwritable(target, err) from err
    try:
        written.append(_write_temp(folder, target.name, write_ids))
        if num_tokens == 0:
            raise DataError(
                f"tokenizing data.path={data_text!r} gave no tokens.",
                field="data.path",
                fix="check that data.tokenizer fits this text (a word-level vocabulary may drop it all)",
            )
        cache = TokenCache(
            path=os.path.abspath(target),  # never resolved: what is there now is the file just renamed in
            num_tokens=num_tokens,
            dtype=dtype.name,
            vocab_size=info.vocab_size,
            sha256=sha256,
            tokenizer=info.path,
            data=str(Path(data_text).resolve()),
            documents=len(documents),
            eos_id=info.eos_id,
            eos_token=info.eos_token,
            prepared=prepared,
        )
        body = (json.dumps(cache.sidecar(), indent=2) + "\n").encode()
        written.append(_write_temp(folder, _sidecar_path(target).name, lambda sink: sink.write(body)))
        # sidecar first: a visible .bin always has one (a rename moves a link itself, never what it points at)
        safe_paths.rename_inside(folder, written[1], _sidecar_path(target).name, field="data.path")
        safe_paths.rename_inside(folder, written[0], target.name, field="data.path")
        written.clear()
        return cache
    except OSError as err:
        raise _unwritable(target, err) from err
    finally:
        for leftover in written:
            with contextlib.suppress(OSError):
                os.unlink(leftover, dir_fd=folder)
        os.close(folder)


def _unwritable(target: Path, err: OSError) -> DataError:
    return DataError(
        f"cannot write the token cache {str(target)!r}: {err.strerror or err}.",
        field="data.path",
        fix="free space where it is (the service's token cache: ETRAIN_TOKEN_CACHE_DIR, or `--out`), or run "
        "`etrain prepare-data --out FILE` elsewhere and train on FILE with data.kind: tokens",
    )


def _changed(data_text: str) -> DataError:
    return DataError(
        f"data.path={data_text!r} changed while it was being tokenized.",
        field="data.path",
        fix="tokenize again once the data no longer changes",
    )
