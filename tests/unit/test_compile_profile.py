"""The rank log's line of where a compile went (``CompileProfile``, ``workers/engine/compile.py``): spans and
cache counters since a moment, from dynamo's accounting (pure arithmetic on two snapshots)."""

from __future__ import annotations

from etrain.workers.engine.compile import CompileProfile


def test_a_profile_says_the_longest_spans_and_the_cache_counts_since_an_earlier_one():
    earlier = CompileProfile(
        spans={"compile_inner": 2.0, "bytecode_tracing": 0.5, "torch_key": 0.85},
        counters={"FX graph cache hits": 1, "AOTAutograd cache hits": 1},
    )
    now = CompileProfile(
        spans={
            "compile_inner": 7.6,
            "bytecode_tracing": 1.7,
            "torch_key": 0.85,  # spent before: not this attempt's
            "PyCodeCache.load_by_key_path": 3.0,
            "build_guards": 0.04,  # under the 0.05 s floor
        },
        counters={"FX graph cache hits": 5, "FX graph cache misses": 0, "AOTAutograd cache hits": 3},
    )
    assert now.counts_since(earlier) == {
        "FX graph cache hits": 4,
        "FX graph cache misses": 0,
        "AOTAutograd cache hits": 2,
        "AOTAutograd cache misses": 0,
    }
    assert now.since(earlier) == (
        "compile_inner 5.60s, PyCodeCache.load_by_key_path 3.00s, bytecode_tracing 1.20s; "
        "FX graph cache hits 4, FX graph cache misses 0, AOTAutograd cache hits 2, AOTAutograd cache misses 0"
    )
    assert now.since(earlier, top=1).startswith("compile_inner 5.60s; ")
    assert CompileProfile(spans={}, counters={}).since(earlier).startswith("no span over 0.05s; ")
