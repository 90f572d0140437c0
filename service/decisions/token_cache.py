"""Which tokenized corpora the service's token cache lets go of (pure): least recently used first, down to its bound.

The token cache (``ETRAIN_TOKEN_CACHE_DIR``, ``workers/engine/tokenized.py``) is the service's own folder, one
``<sha256>.bin`` per corpus and tokenizer, so the service bounds it (``ETRAIN_TOKEN_CACHE_MAX_GB``). After a
submit writes a new cache, the folder is brought back under the bound by removing, in order:

* the least recently used first (a cache's last use is the last time a submit or a rank's start found it);
* never a cache an unfinished job uses: its ranks memory-map it, and a replacement rank or the next attempt
  reads it again (removed, it would tokenize the whole corpus once more, in every rank that starts);
* never one used within ``min_idle_s``: a submit that has just found a cache has not yet recorded its job;
* never one ``etrain prepare-data`` wrote (``pinned``): the operator prepared it for jobs not yet submitted, and
  only the operator removes it (it counts toward the bound all the same);
* never the one just written (it is in use by the job being submitted).

What stays over the bound is said (``over_bytes``), never forced: running jobs come first. The rules are tests in
tests/unit/test_token_cache_prune.py.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

__all__ = ["CachedCorpus", "Pruning", "to_prune"]


@dataclass(frozen=True)
class CachedCorpus:
    """One cache in the folder: its content hash, its bytes on disk (ids and sidecar), when it was last used."""

    sha256: str
    size_bytes: int
    last_used: float  # seconds since the epoch
    pinned: bool = False  # written by etrain prepare-data: never removed by the bound


@dataclass(frozen=True)
class Pruning:
    """The caches to remove (least recently used first), the bytes they free, and what stays over the bound."""

    remove: tuple[str, ...]
    freed_bytes: int
    over_bytes: int  # > 0: the folder stays this far over its bound (every cache left is in use, just used or pinned)


def to_prune(
    caches: Iterable[CachedCorpus],
    *,
    max_bytes: int,
    in_use: Collection[str],
    now: float,
    min_idle_s: float,
) -> Pruning:
    """The caches to remove so the folder holds at most ``max_bytes``, by the rules above."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes={max_bytes} must be 0 or more")
    listed = list(caches)
    total = sum(cache.size_bytes for cache in listed)
    removable = sorted(
        (
            cache
            for cache in listed
            if not cache.pinned and cache.sha256 not in in_use and now - cache.last_used >= min_idle_s
        ),
        key=lambda cache: (cache.last_used, cache.sha256),  # the hash breaks ties: the same answer every time
    )
    remove: list[str] = []
    freed = 0
    for cache in removable:
        if total - freed <= max_bytes:
            break
        remove.append(cache.sha256)
        freed += cache.size_bytes
    return Pruning(remove=tuple(remove), freed_bytes=freed, over_bytes=max(0, total - freed - max_bytes))
