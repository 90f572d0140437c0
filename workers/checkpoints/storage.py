"""Where checkpoints live: one small file API over local folders and object-store URLs (``s3://``).

Checkpoints, manifests and rank logs are written by ranks on many nodes and read by the supervisor
and the control plane, so they need storage every one of them reaches: a shared folder (NFS, a
ReadWriteMany volume) or an object store. Rather than two copies of the checkpoint code, the few
file operations it needs go through this module, which takes either a local path or a URL:

* **Local paths** use ``os`` exactly as before (``atomic_write_bytes`` is write-tmp + fsync +
  ``os.replace`` + fsync-dir), so a local checkpoint is byte-for-byte and call-for-call what it was.
* **URLs** go through fsspec (``s3fs`` for ``s3://``, the optional extra ``etrain[s3]``), imported
  only when a URL is used, so nothing changes for a service that never sees one. An object store has
  no directories and no rename, but a single PUT of an object is atomic (readers see the old object,
  none, or the whole new one; S3 is strongly read-after-write consistent). So :func:`atomic_write_bytes`
  is one PUT, and the manifest object *is* the commit point: it is written last, after every shard is
  checked (``workers/checkpoints/checkpoint_commit.py``). A "directory" is a key prefix: :func:`makedirs` is a no-op, a
  prefix exists while an object lies under it, and :func:`replace` of a prefix is copy-then-delete
  (used only to move a bad step aside, never on the commit path).

Credentials and endpoint come from the standard AWS environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, an instance role, ...), read by botocore. botocore
also honours ``AWS_ENDPOINT_URL`` (and ``AWS_ENDPOINT_URL_S3``, which wins) for S3-compatible stores
(MinIO, Ceph, a test's moto server); :func:`storage_options` passes the endpoint explicitly anyway, so
fsspec's cache of filesystem instances is keyed by it (a process that is pointed at another endpoint
never reuses a client of the old one). Listings are never cached (``use_listings_cache=False``): other
processes write the same prefixes, and a stale listing would hide a rank's shard or a new step.

Pure: standard library only at import (fsspec lazily); neither Ray nor torch. The control plane, the
supervisor and the ranks all use it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
from typing import IO, Any

from etrain.workers.protocol import safe_paths
from etrain.workers.protocol.errors import ConfigError

__all__ = [
    "SUPPORTED_SCHEMES",
    "TMP_SUFFIX",
    "atomic_write_bytes",
    "basename",
    "download",
    "exists",
    "file_sizes",
    "filesystem",
    "fsync_dir",
    "getsize",
    "hold_dir",
    "isdir",
    "is_url",
    "join",
    "listdir",
    "makedirs",
    "missing_backend",
    "normalize_url",
    "open_read",
    "parent",
    "read_bytes",
    "remove",
    "replace",
    "rmtree",
    "scheme",
    "sha256",
    "storage_options",
    "subdirs",
    "upload",
    "url_problem",
    "walk_files",
    "write_bytes",
]

#: URL schemes the service accepts (one fsspec backend each, an optional extra): scheme -> (module, extra).
SUPPORTED_SCHEMES = {"s3": ("s3fs", "s3")}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: What :func:`atomic_write_bytes` writes first locally (a leftover one marks an interrupted write).
TMP_SUFFIX = ".tmp"
_HASH_CHUNK = 1 << 20


# -- names ---------------------------------------------------------------------------------------


def is_url(path: str | os.PathLike) -> bool:
    """True for ``scheme://...`` (object storage); False for a local path (``os.PathLike`` always)."""
    return isinstance(path, str) and _URL.match(path) is not None


def scheme(url: str) -> str:
    return _URL.match(url).group(1).lower()


def normalize_url(url: str) -> str:
    """``url`` without trailing slashes (``s3://bucket/prefix/`` names the same prefix as ``s3://bucket/prefix``)."""
    head, rest = url.split("://", 1)
    return f"{head.lower()}://{rest.rstrip('/')}"


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot name checkpoint storage (``None``: it can): an unsupported scheme, no bucket,
    or empty, ``.`` or ``..`` components (an object key is taken literally; a URL that looks like it
    climbs out of a prefix must not be judged as if it did or did not)."""
    if not is_url(url):
        return f"{url!r} is not a URL"
    kind = scheme(url)
    if kind not in SUPPORTED_SCHEMES:
        return (
            f"{url!r} uses the scheme {kind!r}; object storage is supported through "
            f"{', '.join(f'{name}://' for name in SUPPORTED_SCHEMES)} only"
        )
    parts = url.split("://", 1)[1].rstrip("/").split("/")
    if not parts[0]:
        return f"{url!r} names no bucket (write {kind}://bucket/prefix)"
    if any(part in ("", ".", "..") for part in parts[1:]):
        return f"{url!r} has an empty, '.' or '..' path component"
    if any(ch.isspace() or ch in "\\?#*[]" for ch in url):
        return f"{url!r} contains a space, backslash or one of ?#*[] (not a plain object key)"
    return None


def missing_backend(url: str) -> str | None:
    """The message for a URL whose fsspec backend is not installed (``None`` when it is)."""
    module, extra = SUPPORTED_SCHEMES.get(scheme(url), (None, None))
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return (
        f"{scheme(url)}:// storage needs the '{module}' package, which is not installed (pip install 'etrain[{extra}]')"
    )


def join(base: str | os.PathLike, *names: str) -> str:
    """``base/name/...``: :func:`os.path.join` for local paths, '/'-joined for URLs."""
    if is_url(base):
        return "/".join([base.rstrip("/"), *(name.strip("/") for name in names)])
    return os.path.join(os.fspath(base), *names)


def basename(path: str | os.PathLike) -> str:
    """The last component (``step_00000010`` of ``.../step_00000010/``), for paths and URLs."""
    if is_url(path):
        return path.rstrip("/").rsplit("/", 1)[-1]
    return os.path.basename(os.path.normpath(os.fspath(path)))


def parent(path: str | os.PathLike) -> str:
    if is_url(path):
        return path.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(os.path.normpath(os.fspath(path)))


# -- the object-store side -----------------------------------------------------------------------


def storage_options(url: str) -> dict[str, Any]:
    """fsspec options for ``url``'s filesystem (also given to DCP's ``FsspecWriter``/``FsspecReader``, so
    they share this module's instance): no listings cache, and the endpoint from the environment."""
    if scheme(url) != "s3":
        return {}
    options: dict[str, Any] = {"use_listings_cache": False}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    return options


def filesystem(url: str):
    """``(fsspec filesystem, path without the scheme)`` for ``url``; ``ConfigError`` when the backend
    package is missing (the fix says which extra to install)."""
    problem = missing_backend(url)
    if problem is not None:
        raise ConfigError(
            problem + ".",
            field="checkpoint.path",
            fix=f"install it where the service and the ranks run: pip install "
            f"'etrain[{SUPPORTED_SCHEMES[scheme(url)][1]}]'",
        )
    from fsspec.core import url_to_fs

    return url_to_fs(url, **storage_options(url))


def _fs(path: str):
    fs, _ = filesystem(path)
    return fs, fs._strip_protocol(path)


# -- operations ----------------------------------------------------------------------------------


class _HeldUrl(safe_paths.HeldDir):
    """An object-store prefix "held" as :func:`hold_dir` holds a folder: it is its own name (an object
    store has no links to swap in), so there is no descriptor to open or close."""

    def __init__(self, url: str):
        self.given = self.path = url
        self._fd = None


def hold_dir(path: str, *, field: str = "checkpoint.path") -> safe_paths.HeldDir:
    """A job's checkpoint folder held open for a process's work on it (``safe_paths.HeldDir``: made if
    missing, no link on the way, named by its descriptor from then on), or a URL as it is. Every path
    under ``.path`` goes through the held folder; ``.given`` is the name to show and to send to others."""
    return _HeldUrl(path) if is_url(path) else safe_paths.HeldDir(path, field=field)


def exists(path: str | os.PathLike) -> bool:
    """A file, a folder, or (URL) a prefix with at least one object under it."""
    if not is_url(path):
        return os.path.exists(path)
    fs, key = _fs(path)
    return fs.exists(key)


def isdir(path: str | os.PathLike) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, key = _fs(path)
    return fs.isdir(key)


def listdir(path: str | os.PathLike) -> list[str]:
    """Names directly under ``path`` (files and sub-folders / sub-prefixes); ``FileNotFoundError`` if none."""
    if not is_url(path):
        return os.listdir(path)
    return [name for name, _is_dir in _entries(path)]


def subdirs(path: str | os.PathLike) -> list[str]:
    """Names of the folders (URL: common prefixes) directly under ``path``; ``FileNotFoundError`` if none."""
    if not is_url(path):
        return [name for name in os.listdir(path) if os.path.isdir(os.path.join(path, name))]
    return [name for name, is_dir in _entries(path) if is_dir]


def _entries(url: str) -> list[tuple[str, bool]]:
    fs, key = _fs(url)
    entries = fs.ls(key, detail=True)
    return [
        (entry["name"].rstrip("/").rsplit("/", 1)[-1], entry["type"] == "directory")
        for entry in entries
        if entry["name"].rstrip("/") != key.rstrip("/")
    ]


def getsize(path: str | os.PathLike) -> int:
    """Size in bytes; ``FileNotFoundError`` (an ``OSError``) when missing."""
    if not is_url(path):
        return os.path.getsize(path)
    fs, key = _fs(path)
    return int(fs.size(key))


def file_sizes(directory: str | os.PathLike) -> dict[str, int]:
    """``{relative path: size}`` of every file below ``directory`` (one listing on an object store).

    Locally a file removed between the listing and its ``stat`` is left out, as a listing an instant later
    would leave it out: a rank's room check reads the newest step while the supervisor commits it (its
    ``manifest.json.tmp`` renamed away) or prunes another, and that must not fail the save."""
    if not is_url(directory):
        root = os.fspath(directory)
        sizes = {}
        for rel in walk_files(root):
            try:
                sizes[rel] = os.path.getsize(os.path.join(root, rel))
            except FileNotFoundError:
                continue
        return sizes
    fs, key = _fs(directory)
    prefix = key.rstrip("/") + "/"
    try:
        found = fs.find(key, detail=True)
    except FileNotFoundError:
        return {}
    return {
        name[len(prefix) :]: int(info["size"])
        for name, info in found.items()
        if name.startswith(prefix) and info.get("type") != "directory"
    }


def walk_files(directory: str | os.PathLike) -> list[str]:
    """Relative ('/'-separated) paths of every file below ``directory``, sorted; ``[]`` if it is absent."""
    if is_url(directory):
        return sorted(file_sizes(directory))
    root = os.fspath(directory)
    found = []
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            found.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return sorted(found)


def open_read(path: str | os.PathLike) -> IO[bytes]:
    """A seekable binary stream (``FileNotFoundError`` when missing); the caller closes it."""
    if not is_url(path):
        return open(path, "rb")
    fs, key = _fs(path)
    return fs.open(key, "rb")


def read_bytes(path: str | os.PathLike) -> bytes:
    if not is_url(path):
        with open(path, "rb") as stream:
            return stream.read()
    fs, key = _fs(path)
    return fs.cat_file(key)


def sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file, read in 1 MiB chunks (never whole into memory)."""
    digest = hashlib.sha256()
    with open_read(path) as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


#: Files hashed at once by :func:`sha256_many`. SHA-256 and file reads release the GIL, so threads
#: hash in parallel: a rank's checkpoint is one file per DCP writer thread (four on CUDA), and one
#: thread hashes ~1-2 GB/s, i.e. ~10 s for a 1B model's 15 GB of state.
HASH_THREADS = 8


def sha256_many(paths: list[str]) -> list[str]:
    """:func:`sha256` of each path, in order, several local files at a time (object-store reads stay on
    the caller's thread: fsspec's sync calls from many threads onto one event loop gain nothing here)."""
    if len(paths) <= 1 or any(is_url(path) for path in paths):
        return [sha256(path) for path in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(paths)), thread_name_prefix="sha256") as pool:
        return list(pool.map(sha256, paths))


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a whole file (not atomic on a local disk: use :func:`atomic_write_bytes` for that)."""
    if not is_url(path):
        with open(path, "wb") as stream:
            stream.write(data)
        return
    fs, key = _fs(path)
    fs.pipe_file(key, data)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` so that ``path`` is at every instant absent/old or complete/new.

    Local: ``<path>.tmp`` is written and fsynced, renamed over ``path`` (atomic on POSIX), then the
    directory is fsynced so the rename itself survives a power loss; a crash leaves at most a stale
    ``.tmp``, which nothing ever reads. URL: one PUT of the object, which an object store applies
    atomically (no ``.tmp`` object, no rename: S3 has none).
    """
    if is_url(path):
        fs, key = _fs(path)
        fs.pipe_file(key, data)
        return
    path = os.fspath(path)
    tmp = path + TMP_SUFFIX
    with open(tmp, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a directory's entries (renames, new files). A no-op where directories cannot be opened,
    and for URLs (an object store has no directory entries to persist)."""
    if is_url(path):
        return
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def makedirs(path: str | os.PathLike) -> None:
    """Create a folder and its parents (existing is fine); a no-op for URLs (prefixes need no creating)."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)


def remove(path: str | os.PathLike) -> None:
    """Delete one file; ``FileNotFoundError`` when missing."""
    if not is_url(path):
        os.remove(path)
        return
    fs, key = _fs(path)
    fs.rm_file(key)


def rmtree(path: str | os.PathLike) -> None:
    """Delete a folder (URL: every object under the prefix); absent is fine, errors are ignored."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, key = _fs(path)
    try:
        fs.rm(key.rstrip("/") + "/", recursive=True)
    except (FileNotFoundError, OSError):
        pass


def replace(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Move a file or folder to ``target`` (local: ``os.replace``; URL: copy every object, then delete
    the originals; not atomic, so never used to commit anything)."""
    if not is_url(source):
        os.replace(source, target)
        return
    if not is_url(target):
        raise ValueError(f"cannot move {source} to the local path {target}")
    fs, key = _fs(source)
    _, target_key = _fs(target)
    sizes = file_sizes(source)
    if not sizes:  # a single object
        fs.mv(key, target_key)
        return
    for rel in sorted(sizes):
        fs.copy(f"{key.rstrip('/')}/{rel}", f"{target_key.rstrip('/')}/{rel}")
    rmtree(source)


def upload(local_path: str | os.PathLike, url: str) -> None:
    """Copy a local file to ``url`` (one PUT, or a multipart upload for a large file)."""
    fs, key = _fs(url)
    fs.put_file(os.fspath(local_path), key)


def download(url: str, local_path: str | os.PathLike) -> None:
    """Copy the object at ``url`` to a local file (``FileNotFoundError`` when there is none)."""
    fs, key = _fs(url)
    fs.get_file(key, os.fspath(local_path))
