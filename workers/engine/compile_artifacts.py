"""Carry a job's compiled code to other nodes through its checkpoint folder (``training.compile``).

The rules (who writes, who loads what, why a digest) are in ``workers/protocol/compile_sharing.py``;
this is the adapter around torch's portable cache artifacts (``torch.compiler.save_cache_artifacts``
and ``load_cache_artifacts``), which serialise and restore inductor's FX-graph entries (with their
Triton kernels on a GPU) and AOTAutograd's, the caches a node keeps on its disk. Loading fills the
node's cache folder, so the first step finds every graph there, as on a node that compiled before.

Neither function raises into training: a set that cannot be written or read costs a compile, never
a failed attempt; each returns the line the rank log shows. A node remembers the sets it already
holds (a marker file in its cache folder, also left by the writer), so a rank replaced on the same
node does not read the set again.
"""

from __future__ import annotations

import hashlib
import os
import time

from etrain.workers.checkpoints import storage
from etrain.workers.protocol import compile_sharing, safe_paths
from etrain.workers.protocol.compile_sharing import CompileArtifacts

__all__ = ["MARKERS", "forget_node_sets", "load", "open_folder", "save"]

MARKERS = "etrain-artifacts"  # under the node's compile cache folder: one empty file per set it holds


def _folder(checkpoint_path: str) -> str:
    return storage.join(checkpoint_path, compile_sharing.FOLDER)


def _mark_node(cache_dir: str | None, sha256: str) -> None:
    if not cache_dir:
        return
    try:
        os.makedirs(os.path.join(cache_dir, MARKERS), mode=0o700, exist_ok=True)
        with open(os.path.join(cache_dir, MARKERS, sha256), "wb"):
            pass
    except OSError:  # the next rank on this node reads the set again: slower, never wrong
        pass


def _node_holds(cache_dir: str | None, sha256: str) -> bool:
    return bool(cache_dir) and os.path.exists(os.path.join(cache_dir, MARKERS, sha256))


def forget_node_sets(cache_dir: str) -> None:
    """Remove every marker of a set this node holds (the cache's bound removed files, perhaps of a marked
    set: a rank that trusted the marker would skip loading the set and compile cold). The next rank loads its
    stage's set again, a few seconds at most."""
    folder = os.path.join(cache_dir, MARKERS)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:  # removed by another rank's pass meanwhile
            pass


def open_folder(checkpoint_path: str) -> tuple[int | str | None, str | None]:
    """The sets' folder opened for a write in the background: a descriptor of the local folder, opened now
    without links (made if missing), so the write never resolves the attempt's held folder by name after
    the attempt closed it; or the URL. ``(None, the rank log's line)`` when it cannot be opened."""
    folder = _folder(checkpoint_path)
    if storage.is_url(checkpoint_path):
        return folder, None
    try:
        return safe_paths.open_dir(folder, field="checkpoint.path", create=True), None
    except Exception as err:  # a link planted by the tenant, a read-only volume: the next node compiles
        shown = safe_paths.display(folder)
        return None, f"compile cache not shared: opening {shown} failed: {type(err).__name__}: {err}"


def save(folder: int | str, *, stage: int, cache_dir: str | None) -> tuple[CompileArtifacts | None, str]:
    """Serialise what this process has compiled and write it into ``folder`` (:func:`open_folder`'s; a
    descriptor is closed here); returns the set to report (None when there is nothing to share or the
    write failed) and the rank log's line."""
    try:
        return _save(folder, stage=stage, cache_dir=cache_dir)
    finally:
        if isinstance(folder, int):
            os.close(folder)


def _save(folder: int | str, *, stage: int, cache_dir: str | None) -> tuple[CompileArtifacts | None, str]:
    import torch

    started = time.monotonic()
    try:
        saved = torch.compiler.save_cache_artifacts()
    except Exception as err:  # torch's serialisation: a compile cache is an optimisation, never a failure
        return None, f"compile cache not shared: serialising failed: {type(err).__name__}: {err}"
    if saved is None or not saved[0]:
        return None, "compile cache not shared: nothing was compiled with a cacheable backend"
    data, info = saved
    if len(data) > compile_sharing.MAX_BYTES:
        return None, f"compile cache not shared: {len(data)} bytes is over {compile_sharing.MAX_BYTES}"
    digest = hashlib.sha256(data).hexdigest()
    name = compile_sharing.file_name(digest)
    try:
        if isinstance(folder, str):
            storage.atomic_write_bytes(storage.join(folder, name), data)
        else:
            _write_inside(folder, name, data)
    except Exception as err:  # a full or read-only volume: the next node compiles, training goes on
        return None, f"compile cache not shared: writing {name} failed: {type(err).__name__}: {err}"
    _mark_node(cache_dir, digest)
    entries = sum(len(keys) for keys in info.artifacts.values())
    return (
        CompileArtifacts(stage=stage, sha256=digest, size=len(data)),
        f"compile cache shared: stage {stage}, {entries} entries, {len(data) / 2**20:.1f} MiB "
        f"({digest[:12]}) in {time.monotonic() - started:.2f}s",
    )


def _write_inside(folder: int, name: str, data: bytes) -> None:
    """``name`` in the folder open as ``folder``, atomically (a temporary file renamed over it, both through
    the descriptor, never following a link), as ``storage.atomic_write_bytes`` writes a path."""
    temporary = name + storage.TMP_SUFFIX
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=folder)
    with os.fdopen(fd, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    os.rename(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
    os.fsync(folder)


def load(checkpoint_path: str, record: CompileArtifacts, *, cache_dir: str | None) -> str:
    """Load ``record``'s set into this node's compile cache unless the node holds it already; returns the
    rank log's line. The bytes are hashed as read and loaded only if they are the set the writer reported."""
    if _node_holds(cache_dir, record.sha256):
        return f"compile cache: stage {record.stage}'s set ({record.sha256[:12]}) is on this node already"
    import torch

    started = time.monotonic()
    path = storage.join(_folder(checkpoint_path), compile_sharing.file_name(record.sha256))
    shown = safe_paths.display(path)
    try:
        if storage.is_url(path):
            size = storage.getsize(path)
            if size > compile_sharing.MAX_BYTES:
                raise ValueError(f"{size} bytes is over {compile_sharing.MAX_BYTES}")
            data = storage.read_bytes(path)
        else:  # no link on the way or at the file (workers/protocol/safe_paths.py)
            data = safe_paths.read_file(path, field="checkpoint.path", limit=compile_sharing.MAX_BYTES)
    except Exception as err:
        return f"compile cache not loaded (compiling instead): reading {shown} failed: {type(err).__name__}: {err}"
    digest = hashlib.sha256(data).hexdigest()
    if digest != record.sha256:
        return (
            f"compile cache not loaded (compiling instead): {shown} is not the set its writer reported "
            f"(sha256 {digest[:12]}, expected {record.sha256[:12]}): it was changed after it was written"
        )
    try:
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as err:  # another torch's set, say: the cache keys would miss anyway
        return f"compile cache not loaded (compiling instead): {type(err).__name__}: {err}"
    entries = 0 if info is None else sum(len(keys) for keys in info.artifacts.values())
    if not entries:  # torch logs why (a corrupt payload, say) and loads nothing rather than raising
        return f"compile cache not loaded (compiling instead): torch read no entries from {shown}"
    _mark_node(cache_dir, record.sha256)
    return (
        f"compile cache loaded: stage {record.stage}'s set, {entries} entries, {len(data) / 2**20:.1f} MiB "
        f"({record.sha256[:12]}) in {time.monotonic() - started:.2f}s"
    )
