"""The token cache's bound (service/decisions/token_cache.py): least recently used first, never a cache in use or
just used or over what the bound needs; every rule checked against a brute force over small folders."""

from __future__ import annotations

import random

import pytest

from etrain.service.decisions.token_cache import CachedCorpus, to_prune

GB = 10**9


def corpus(name: str, size: int, last_used: float) -> CachedCorpus:
    return CachedCorpus(sha256=name, size_bytes=size, last_used=last_used)


def test_least_recently_used_go_first_and_only_as_many_as_the_bound_needs():
    caches = [corpus("a", 4 * GB, 100.0), corpus("b", 3 * GB, 50.0), corpus("c", 2 * GB, 300.0)]
    pruning = to_prune(caches, max_bytes=5 * GB, in_use=(), now=10_000.0, min_idle_s=600)
    assert pruning.remove == ("b", "a") and pruning.freed_bytes == 7 * GB and pruning.over_bytes == 0
    assert to_prune(caches, max_bytes=7 * GB, in_use=(), now=10_000.0, min_idle_s=600).remove == ("b",)
    assert to_prune(caches, max_bytes=9 * GB, in_use=(), now=10_000.0, min_idle_s=600).remove == ()
    assert to_prune([], max_bytes=0, in_use=(), now=0.0, min_idle_s=0).remove == ()


def test_a_cache_in_use_or_just_used_stays_and_what_is_left_over_is_said():
    caches = [corpus("old", 4 * GB, 100.0), corpus("used", 3 * GB, 50.0), corpus("fresh", 2 * GB, 9_900.0)]
    pruning = to_prune(caches, max_bytes=1 * GB, in_use={"used"}, now=10_000.0, min_idle_s=600)
    assert pruning.remove == ("old",)  # "used" is a running job's, "fresh" was found 100 s ago
    assert pruning.over_bytes == 4 * GB  # 5 GB left against a 1 GB bound
    with pytest.raises(ValueError, match="must be 0 or more"):
        to_prune(caches, max_bytes=-1, in_use=(), now=0.0, min_idle_s=0)


def test_a_prepared_cache_is_the_operators_to_remove():
    caches = [CachedCorpus("prepared", 9 * GB, 0.0, pinned=True), corpus("b", 1 * GB, 10.0)]
    pruning = to_prune(caches, max_bytes=1 * GB, in_use=(), now=10_000.0, min_idle_s=600)
    assert pruning.remove == ("b",) and pruning.over_bytes == 8 * GB  # it counts toward the bound all the same


def test_every_small_folder_against_a_brute_force():
    """The answer is the shortest prefix of the removable caches, oldest first, that brings the folder under
    the bound (or all of them): checked over random folders against every prefix."""
    rng = random.Random(7)
    for _ in range(2000):
        count = rng.randint(0, 6)
        caches = [
            CachedCorpus(
                f"{index:02d}",
                rng.randint(0, 5) * GB,
                float(rng.choice([0, 10, 10, 20, 990, 1000])),
                pinned=rng.random() < 0.15,
            )
            for index in range(count)
        ]
        in_use = {cache.sha256 for cache in caches if rng.random() < 0.25}
        bound = rng.randint(0, 20) * GB
        now, idle = 1000.0, 100.0
        pruning = to_prune(caches, max_bytes=bound, in_use=in_use, now=now, min_idle_s=idle)

        removable = sorted(
            (c for c in caches if not c.pinned and c.sha256 not in in_use and now - c.last_used >= idle),
            key=lambda c: (c.last_used, c.sha256),
        )
        total = sum(c.size_bytes for c in caches)
        prefixes = [removable[:n] for n in range(len(removable) + 1)]
        fitting = [p for p in prefixes if total - sum(c.size_bytes for c in p) <= bound]
        expected = fitting[0] if fitting else removable
        assert pruning.remove == tuple(c.sha256 for c in expected), (caches, in_use, bound)
        left = total - pruning.freed_bytes
        assert pruning.freed_bytes == sum(c.size_bytes for c in expected)
        assert pruning.over_bytes == max(0, left - bound)
        assert not set(pruning.remove) & in_use
        # and it is a pure function of the folder, whatever order the listing gives
        shuffled = list(caches)
        rng.shuffle(shuffled)
        assert to_prune(shuffled, max_bytes=bound, in_use=in_use, now=now, min_idle_s=idle) == pruning
