"""Keep the node's compile cache folder within its bound: the adapter around ``workers/protocol/cache_bound.py``.

A rank whose first step compiled something (the cache grew) starts one pass in a background thread
(:func:`bound_in_background`): training never waits for it. The node's ranks share the folder, so a pass
holds an exclusive lock on it (a rank that finds it held skips its own pass) and a stamp file records
when the last pass ran (none again within :data:`PASS_EVERY_S`): eight ranks compiling at once walk the
folder once.

What a pass never touches: links (a pass reads and removes regular files only, through ``lstat``, never
following a link out of the folder), lock files (``locks/`` folders, ``*.lock``: removing one held by
another process would let a second holder in), files whose names start with a dot (inductor's atomic
writes in progress, this module's own lock and stamp), and directories (an empty one is a few bytes; one
removed just as another process writes into it would fail that write). When a pass removed anything, the
markers of the sets this node holds (``workers/engine/compile_artifacts.py``) go too: a set may have lost
files, and its stage's next rank here loads it again instead of trusting the marker.
"""

from __future__ import annotations

import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable

from etrain.workers.protocol import cache_bound
from etrain.workers.protocol.cache_bound import CachedFile

__all__ = ["PASS_EVERY_S", "bound", "bound_in_background", "inductor_header_folder", "scan"]

#: One pass per node at most this often (the stamp's age), however many ranks compile.
PASS_EVERY_S = 600.0
_LOCK = ".etrain-cache-bound.lock"
_STAMP = ".etrain-cache-bound.stamp"


def _skipped(name: str) -> bool:
    return name.startswith(".") or name.endswith(".lock") or name == "locks"


def scan(folder: str) -> list[CachedFile]:
    """Every regular file under ``folder`` a pass may remove (see the module docstring for what it skips)."""
    from etrain.workers.engine.compile_artifacts import MARKERS

    found: list[CachedFile] = []
    pending = [folder]
    while pending:
        current = pending.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:  # removed meanwhile, or not readable: nothing of it is counted or removed
            continue
        for entry in entries:
            if _skipped(entry.name) or (current == folder and entry.name == MARKERS):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode):
                pending.append(entry.path)
            elif stat.S_ISREG(info.st_mode):
                found.append(CachedFile(entry.path, info.st_size, max(info.st_atime, info.st_mtime)))
    return found


def bound(
    folder: str,
    *,
    max_bytes: int | None,
    min_idle_s: float = cache_bound.MIN_IDLE_S,
    every_s: float = PASS_EVERY_S,
    now: float | None = None,
) -> str | None:
    """One pass over ``folder``; the rank log's line, or None when there is nothing to say (within the
    bound, another rank's pass under way or recent, no bound)."""
    if max_bytes is None:
        return None
    try:
        lock = os.open(os.path.join(folder, _LOCK), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        return f"compile cache bound not checked: {type(err).__name__}: {err}"
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another rank of this node is in a pass
            return None
        now = time.time() if now is None else now
        stamp = os.path.join(folder, _STAMP)
        try:
            if now - os.lstat(stamp).st_mtime < every_s:
                return None
        except FileNotFoundError:
            pass
        return _pass(folder, stamp, max_bytes=max_bytes, min_idle_s=min_idle_s, now=now)
    finally:
        os.close(lock)  # releases the lock


def _pass(folder: str, stamp: str, *, max_bytes: int, min_idle_s: float, now: float) -> str | None:
    from etrain.workers.engine.compile_artifacts import forget_node_sets

    started = time.monotonic()
    removal = cache_bound.files_to_remove(scan(folder), max_bytes=max_bytes, now=now, min_idle_s=min_idle_s)
    removed = freed = 0
    for path in removal.paths:
        try:
            size = os.lstat(path).st_size
            os.unlink(path)
        except FileNotFoundError:  # another process removed it (inductor replaces entries by renaming)
            continue
        except OSError:
            continue
        removed, freed = removed + 1, freed + size
    with open(os.open(stamp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "wb"):
        pass
    os.utime(stamp, (now, now))
    if removal.within_bound and not removal.paths:
        return None
    if removed:
        forget_node_sets(folder)
    left = removal.bytes_before - freed
    idle_days = min_idle_s / 86400
    line = (
        f"compile cache over its bound ({_size(removal.bytes_before)} > {_size(max_bytes)}, {cache_bound.ENV}): "
        f"removed {removed} files ({_size(freed)}) unused for {idle_days:g} days or more, {_size(left)} left, "
        f"in {time.monotonic() - started:.2f}s"
    )
    if left > max_bytes:
        line += f"; the rest was used within {idle_days:g} days, so the cache stays over its bound for now"
    return line


def _size(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def inductor_header_folder() -> str:
    """Where inductor keeps its precompiled C++ headers (CPU kernels, ~150 MB each): under its *default*
    cache folder whatever ``TORCHINDUCTOR_CACHE_DIR`` says (torch 2.13, ``codecache._HEADER_DIR``, global on
    purpose: a fresh cache must not rebuild them). One header per compiler, flags and include paths, so a node
    gathers one per install and torch version (eight on this machine's clean clones in a day, 1.2 GB)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.join(default_cache_dir(), "precompiled_headers")


def bound_in_background(folders: list[str], write: Callable[[str], None]) -> threading.Thread:
    """Start one pass over each of ``folders`` (those that exist) with the node's bound
    (``ETRAIN_COMPILE_CACHE_MAX_GB``, each folder within it), in one daemon thread; ``write`` gets the rank
    log's lines (a bad setting's complaint, each pass's line)."""
    max_bytes, complaint = cache_bound.max_bytes_from_env(os.environ.get(cache_bound.ENV))
    if complaint is not None:
        write(complaint)

    def run() -> None:
        for index, folder in enumerate(folders):
            try:
                line = bound(folder, max_bytes=max_bytes) if os.path.isdir(folder) else None
            except Exception as err:  # a cache's bound is housekeeping: never a failed attempt
                line = f"compile cache bound not kept: {type(err).__name__}: {err}"
            if line is not None:
                write(line if index == 0 else f"{line} (in {folder})")

    thread = threading.Thread(target=run, name="compile-cache-bound", daemon=True)
    thread.start()
    return thread
