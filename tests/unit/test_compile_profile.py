"""The node's compile cache folder (``use_node_cache``) and the rank log's line of where a compile went
(``CompileProfile``: spans and cache counters since a moment, from dynamo's accounting; pure arithmetic on
two snapshots), both in ``workers/engine/compile.py``."""

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


def test_the_node_cache_defaults_to_a_folder_per_user_and_keeps_an_operators_choice(tmp_path, monkeypatch):
    import getpass
    import os
    import tempfile

    from etrain.workers.engine.compile import use_node_cache

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("ETRAIN_COMPILE_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    default = str(tmp_path / f"etrain-compile-cache-{getpass.getuser()}")
    assert use_node_cache() == default and os.environ["TORCHINDUCTOR_CACHE_DIR"] == default
    assert os.stat(default).st_mode & 0o777 == 0o700 and os.environ["TRITON_CACHE_DIR"] == f"{default}/triton"

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("ETRAIN_COMPILE_CACHE_DIR", str(tmp_path / "operators"))
    assert use_node_cache() == str(tmp_path / "operators")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductors"))  # inductor's own variable wins
    assert use_node_cache() == str(tmp_path / "inductors")
