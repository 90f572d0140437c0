"""How big a node's compile cache may grow, and which files go when it is over (pure).

Why: inductor and Triton keep what they compile in the node's cache folder (``workers/engine/compile.py``)
and never remove anything, so a long-lived node (a Kubernetes pod's ``/tmp``, a GPU host) gathers every
distinct model, layout and torch version it ever compiled: a few to a few hundred MB each, unbounded.
The bound removes the least recently used files first, down to a low-water mark below the bound (so
the next job's compile does not start another pass at once), and never a file used recently: another
rank of the node may be reading it, and inductor rebuilds a removed entry the next time it is needed (a
compile, never a fault: its FX-graph loads tolerate a missing file, and the generated code is written
again on a hit).

"Used" is the later of a file's access and modification times. Linux's default ``relatime`` mount
updates the access time at most once a day, so a file read an hour ago may show an access up to a day
old: the idle time a file needs before it may go (:data:`MIN_IDLE_S`, two days) is that day more than
the day a file must really be unused. On a ``noatime`` mount a file counts as used when written only,
so an old entry still in use may go and be compiled again (the rank log then shows a cache miss).

Neither torch nor Ray: the adapter (``workers/engine/node_cache_bound.py``) walks the folder and removes
what :func:`files_to_remove` names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_GIB",
    "ENV",
    "LOW_WATER",
    "MIN_IDLE_S",
    "CachedFile",
    "Removal",
    "files_to_remove",
    "max_bytes_from_env",
]

#: The operator's bound, in GiB (a node's env, e.g. the Helm chart's worker env); ``none`` turns it off.
ENV = "ETRAIN_COMPILE_CACHE_MAX_GB"
#: The bound when ``ETRAIN_COMPILE_CACHE_MAX_GB`` is not set: room for dozens of jobs' compiled code
#: (a 1B model's stage is tens of MB with its Triton kernels), far less than a GPU node's disk.
DEFAULT_MAX_GIB = 10.0
#: A pass over the bound removes files until the cache is this fraction of the bound.
LOW_WATER = 0.8
#: A file unused for less than this stays, whatever the size (see the module docstring: two days).
MIN_IDLE_S = 2 * 24 * 3600.0

_GIB = 1 << 30


@dataclass(frozen=True)
class CachedFile:
    """One regular file of the cache: its path, size, and when it was last read or written (epoch s)."""

    path: str
    size: int
    last_used: float


@dataclass(frozen=True)
class Removal:
    """What a pass decided: the files to remove (least recently used first), the cache's bytes before and
    after removing them, and whether that is under the bound (False: every other file was used recently)."""

    paths: tuple[str, ...]
    bytes_before: int
    bytes_after: int
    within_bound: bool


def max_bytes_from_env(value: str | None) -> tuple[int | None, str | None]:
    """``(the bound in bytes or None for no bound, the rank log's complaint or None)`` from the env's
    value: unset or empty gives the default; ``none`` no bound; a positive number of GiB that many; anything
    else the default, with a line saying why (a node's setting must not fail a rank)."""
    default = int(DEFAULT_MAX_GIB * _GIB)
    if value is None or not value.strip():
        return default, None
    text = value.strip()
    if text.lower() == "none":
        return None, None
    try:
        gib = float(text)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        return default, (
            f"{ENV}={value!r} is not a positive number of GiB (or 'none'): the default {DEFAULT_MAX_GIB:g} GiB applies"
        )
    return int(gib * _GIB), None


def files_to_remove(
    files: Iterable[CachedFile],
    *,
    max_bytes: int | None,
    now: float,
    min_idle_s: float = MIN_IDLE_S,
    low_water: float = LOW_WATER,
) -> Removal:
    """Nothing while the cache is within ``max_bytes`` (or unbounded: None); over it, the least recently
    used files idle for at least ``min_idle_s``, oldest first (ties by path, so two ranks agree), until
    the rest is within ``low_water · max_bytes``, or no idle file is left."""
    if not 0 < low_water <= 1:
        raise ValueError(f"low_water must be in (0, 1], got {low_water}")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    files = list(files)
    total = sum(f.size for f in files)
    if max_bytes is None or total <= max_bytes:
        return Removal(paths=(), bytes_before=total, bytes_after=total, within_bound=True)
    target = int(low_water * max_bytes)
    left = total
    chosen: list[str] = []
    for cached in sorted(files, key=lambda f: (f.last_used, f.path)):
        if left <= target or now - cached.last_used < min_idle_s:
            break  # sorted by last use: every later file is newer still
        chosen.append(cached.path)
        left -= cached.size
    return Removal(paths=tuple(chosen), bytes_before=total, bytes_after=left, within_bound=left <= max_bytes)
