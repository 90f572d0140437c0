"""The node compile cache's bound (``workers/protocol/cache_bound.py``): which files a pass removes, and the
operator's setting. Pure: lists of (path, size, last use) in, paths out."""

from __future__ import annotations

import itertools

import pytest

from etrain.workers.protocol.cache_bound import (
    DEFAULT_MAX_GIB,
    ENV,
    MIN_IDLE_S,
    CachedFile,
    files_to_remove,
    max_bytes_from_env,
)

NOW = 1_000_000_000.0
DAY = 86400.0
GIB = 1 << 30


def _file(name: str, size: int, days_ago: float) -> CachedFile:
    return CachedFile(path=f"/cache/{name}", size=size, last_used=NOW - days_ago * DAY)


def test_within_the_bound_nothing_goes_however_old():
    files = [_file("a", 40, 300), _file("b", 60, 200)]
    for max_bytes in (100, 101, None):
        removal = files_to_remove(files, max_bytes=max_bytes, now=NOW)
        assert removal.paths == () and removal.bytes_before == removal.bytes_after == 100 and removal.within_bound


def test_over_the_bound_the_least_recently_used_go_first_down_to_the_low_water_mark():
    files = [_file("new", 30, 3), _file("oldest", 30, 30), _file("older", 30, 10), _file("old", 30, 5)]
    removal = files_to_remove(files, max_bytes=100, now=NOW)  # 120 > 100; low water 80
    assert removal.paths == ("/cache/oldest", "/cache/older")  # 120 → 90 is still over 80: one more
    assert (removal.bytes_before, removal.bytes_after) == (120, 60)
    assert removal.within_bound


def test_a_file_used_within_the_idle_time_stays_even_over_the_bound():
    files = [_file("hot", 500, 0.5), _file("warm", 500, 1.9), _file("cold", 100, 2.1)]
    removal = files_to_remove(files, max_bytes=400, now=NOW)
    assert removal.paths == ("/cache/cold",) and removal.bytes_after == 1000
    assert not removal.within_bound
    # exactly the idle time is idle enough; a second less is not
    edge = [CachedFile("/cache/x", 10, NOW - MIN_IDLE_S), CachedFile("/cache/y", 10, NOW - MIN_IDLE_S + 1)]
    assert files_to_remove(edge, max_bytes=5, now=NOW).paths == ("/cache/x",)


def test_ties_in_last_use_go_in_path_order_so_two_ranks_agree():
    files = [_file(name, 10, 9) for name in "dbca"]
    for order in itertools.permutations(files):
        assert files_to_remove(order, max_bytes=25, now=NOW).paths == ("/cache/a", "/cache/b")


def test_every_listing_ends_within_the_bound_or_with_only_recent_files_left():
    """Exhaustive over small caches: a pass never removes a recent file, removes oldest-first, stops as
    soon as it is at the low-water mark, and is over the bound only where every file left is recent."""
    sizes, ages = (0, 1, 7, 20), (0.0, 1.0, 2.0, 9.0)
    for count in range(4):
        for picks in itertools.product(itertools.product(sizes, ages), repeat=count):
            files = [_file(f"f{i}", size, age) for i, (size, age) in enumerate(picks)]
            for max_bytes in (0, 5, 10, 30, None):
                removal = files_to_remove(files, max_bytes=max_bytes, now=NOW)
                by_path = {f.path: f for f in files}
                removed = [by_path[path] for path in removal.paths]  # in the order removed
                kept = [f for f in files if f.path not in removal.paths]
                assert removal.bytes_after == sum(f.size for f in kept)
                assert all(NOW - f.last_used >= MIN_IDLE_S for f in removed)
                if removed:
                    newest_removed = max(f.last_used for f in removed)
                    assert all(f.last_used >= newest_removed for f in kept)
                    # stopped at the low-water mark: the last removal was still needed
                    assert removal.bytes_after + removed[-1].size > 0.8 * max_bytes or max_bytes == 0
                if max_bytes is None or sum(f.size for f in files) <= max_bytes:
                    assert not removed
                elif not removal.within_bound:
                    assert all(NOW - f.last_used < MIN_IDLE_S for f in kept if f.size)


def test_arguments_out_of_range_are_refused():
    with pytest.raises(ValueError, match="low_water"):
        files_to_remove([], max_bytes=1, now=NOW, low_water=0)
    with pytest.raises(ValueError, match="max_bytes"):
        files_to_remove([], max_bytes=-1, now=NOW)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, int(DEFAULT_MAX_GIB * GIB)),
        ("", int(DEFAULT_MAX_GIB * GIB)),
        (" 4 ", 4 * GIB),
        ("0.5", GIB // 2),
        ("none", None),
        ("None", None),
    ],
)
def test_the_operators_setting_in_gib(value, expected):
    assert max_bytes_from_env(value) == (expected, None)


@pytest.mark.parametrize("value", ["0", "-2", "ten", "nan", "inf", "1e400"])
def test_a_bad_setting_keeps_the_default_and_says_why(value):
    max_bytes, complaint = max_bytes_from_env(value)
    assert max_bytes == int(DEFAULT_MAX_GIB * GIB)
    assert complaint.startswith(f"{ENV}={value!r} is not a positive number of GiB")
